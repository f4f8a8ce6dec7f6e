"""Host cost (us per call) of the pieces of a /ce all-gather + GEMM launch's copy issue, on one GPU:

    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/probe_ce_host.py     # -> results/probe_ce_host.md (by hand)
"""
import ctypes
import glob
import os
import time

import torch
from cuda.bindings import runtime as rt

s = torch.cuda.Stream(); e = torch.cuda.Event(); x = torch.empty(1 << 20, device="cuda"); y = torch.empty_like(x)
def t(name, f, n=3000):
    for _ in range(100): f()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:34s} {dt:6.2f} us", flush=True)
cs = torch.cuda.current_stream()
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
t("Event.record(stream)", lambda: e.record(cs))
t("Stream.wait_event", lambda: s.wait_event(e))
h = s.cuda_stream; K = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice; xp, yp = x.data_ptr(), y.data_ptr()
t("s.cuda_stream", lambda: s.cuda_stream)
t("enum lookup", lambda: rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice)
t("cudaMemcpy2DAsync (cuda-python)", lambda: rt.cudaMemcpy2DAsync(yp, 64, xp, 64, 64, 4, K, h))
t("cudaMemcpyAsync (cuda-python)", lambda: rt.cudaMemcpyAsync(yp, xp, 256, K, h))
cands = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*")) + ["libcudart.so"]
print("cudart candidates", cands[:4])
try:
    lib = ctypes.CDLL(cands[0])
    f2 = lib.cudaMemcpy2DAsync; f2.restype = ctypes.c_int
    f2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    t("cudaMemcpy2DAsync (ctypes)", lambda: f2(yp, 64, xp, 64, 64, 4, 3, h))
except Exception as err:
    print("ctypes failed", err)
t("torch copy_ slice", lambda: y[:64].copy_(x[:64], non_blocking=True))
def ctx():
    with torch.cuda.stream(s):
        pass
t("with torch.cuda.stream(s)", ctx)
