"""The Gluon GEMM core (kernels/gemm_gluon.py) against cuBLAS and the Triton core on one GPU.

    python3 benchmarks/probe_gemm_gluon.py --out DIR

Checks every config on shapes with ragged edges (both B orientations) against torch.mm, then
times cuBLAS, the Triton core (gemm.gemm, shipped config) and each Gluon config at the
per-rank GEMM shapes of the Llama-3-8B TP = 4 step at batch 16 (M = 65536) and four design
shapes (device time: timing.device_time, 20 queued calls, median of 7 interleaved batches).
Writes probe_gemm_gluon.json into --out.
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = (  # name, M, N, K, B given as nn.Linear's [N, K] weight
    ("wo fwd", 65536, 4096, 1024, True), ("w2 fwd", 65536, 4096, 3584, True),
    ("qkv fwd", 65536, 1536, 4096, True), ("w1 fwd", 65536, 3584, 4096, True),
    ("qkv dgrad", 65536, 4096, 1536, False), ("w1w3 dgrad", 65536, 4096, 7168, False),
    ("out dgrad", 65536, 4096, 4096, False), ("wo dgrad", 65536, 1024, 4096, False),
    ("design", 8192, 8192, 7168, False), ("design", 8192, 8192, 2048, False),
    ("design", 2048, 8192, 2048, False), ("design", 16384, 8192, 2048, False),
)
CHECK = ((1000, 1000, 1000), (300, 520, 136), (4096, 4096, 1024), (129, 8192, 7168))


def kernel_ms(fn, calls=10):
    """Mean device time of the kernels one call of fn launches, from the profiler's records."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(event.self_device_time_total for event in prof.key_averages()
                   if event.self_device_time_total > 0)
    return total_us / calls / 1e3


def host_us(fn, calls=50):
    """CPU microseconds per launch of fn (no sync inside)."""
    import time

    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--batches", type=int, default=7)
    args = parser.parse_args()
    import faulthandler

    import torch

    from axedist.collectives.timing import device_time
    from axedist.kernels import gemm as core
    from axedist.kernels.gemm_gluon import PipelinedConfig, launch_pipelined

    faulthandler.dump_traceback_later(400, exit=True)
    configs = {"gl_s3e1": PipelinedConfig(stages=3, epilogue_split=1),
               "gl_s4e2": PipelinedConfig(stages=4, epilogue_split=2),
               "gl_s3e2": PipelinedConfig(stages=3, epilogue_split=2)}
    torch.manual_seed(0)
    checks = []
    for name, config in configs.items():
        for m, n, k in CHECK:
            for transposed in (True, False):
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn((n, k) if transposed else (k, n), device="cuda",
                                dtype=torch.bfloat16)
                c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                launch_pipelined(a, b, c, transposed, config)
                want = a.float() @ (b.float().t() if transposed else b.float())
                error = ((c.float() - want).norm() / want.norm()).item()
                ok = bool(error < 1e-2)
                checks.append(dict(config=name, m=m, n=n, k=k, transposed=transposed,
                                   error=error, ok=ok))
                print(f"check {name} {m}x{n}x{k} t={transposed}: rel error {error:.2e} "
                      f"{'ok' if ok else 'FAIL'}", flush=True)
    bad = {row["config"] for row in checks if not row["ok"]}
    rows = []
    for label, m, n, k, transposed in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn((n, k) if transposed else (k, n), device="cuda", dtype=torch.bfloat16)
        b_view = b.t() if transposed else b
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fns = {"cublas": lambda: torch.mm(a, b_view, out=c),
               "core": lambda: core.gemm(a, b_view, out=c)}
        for name, config in configs.items():
            if name not in bad:
                fns[name] = (lambda config=config: launch_pipelined(a, b, c, transposed, config))
        times = device_time(fns, calls=args.calls, batches=args.batches)
        kernels = {key: kernel_ms(fn) for key, fn in fns.items()}
        host = {key: host_us(fn) for key, fn in fns.items()}
        flops = 2 * m * n * k
        row = dict(shape=label, m=m, n=n, k=k, transposed=transposed,
                   ms={key: round(value, 4) for key, value in times.items()},
                   tflops={key: round(flops / value / 1e9, 1) for key, value in times.items()},
                   kernel_ms={key: round(value, 4) for key, value in kernels.items()},
                   host_us={key: round(value, 1) for key, value in host.items()})
        rows.append(row)
        ratios = " ".join(f"{key} {times['cublas'] / value:.3f}" for key, value in times.items())
        print(f"{label} {m}x{n}x{k} t={transposed}: cublas {times['cublas']:.3f} ms; "
              f"vs cublas: {ratios}", flush=True)
        print("   kernel ms (profiler): " + " ".join(f"{key} {value:.3f}" for key, value in kernels.items())
              + "; host us: " + " ".join(f"{key} {value:.0f}" for key, value in host.items()), flush=True)
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  commit=os.environ.get("AXEDIST_COMMIT", "?"), torch=torch.__version__,
                  device=torch.cuda.get_device_name(), checks=checks, rows=rows,
                  configs={name: str(config) for name, config in configs.items()})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_gemm_gluon.json"), "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
