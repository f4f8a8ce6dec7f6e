"""Tile probe of the fused all-gather + GEMM at W = 1 (its GEMM half) against cuBLAS, one GPU.

    OUT=<dir> python3 benchmarks/device/probe_ag_tiles.py 128x256x64/g8/s4/w8/c32x512/p4/gl,...

Per shape of bench_ag_gemm.py (TP = 4 N_local): device time of cuBLAS and of every config given
(AllGatherGemmConfig strings), each output checked against cuBLAS (relative error < 1e-2), and the
names of the kernels cuBLAS ran (torch.profiler). Writes $OUT/probe_ag_tiles.json.
"""
import json, math, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from axedist.collectives.timing import device_time
from axedist.kernels.ag_gemm import AllGatherGemmConfig
from axedist.testing import VirtualRanks
from bench_ag_gemm import shapes

os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29517")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.manual_seed(1)
vr = VirtualRanks(1, data_bytes=1 << 30)
configs = sys.argv[1].split(",")
rows = []
for label, m, n, k in shapes(4):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)).t()
    ref = torch.mm(a, b)
    outs = {c: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for c in configs}
    cols = {"cublas": lambda: torch.mm(a, b, out=ref)}
    for c in configs:
        cfg = AllGatherGemmConfig.parse(c)
        cols[c] = (lambda cfg=cfg, o=outs[c]: vr.all_gather_gemm([a], [b], [o], config=cfg))
    t = device_time(cols, calls=10, batches=5)
    errs = {}
    for c in configs:
        outs[c].fill_(float("nan")); cols[c](); torch.cuda.synchronize()
        errs[c] = float((outs[c].float() - ref.float()).norm() / ref.float().norm())
    vr.check()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.mm(a, b, out=ref); torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    row = dict(label=label, M=m, N=n, K=k, ms=t, err=errs, cublas_kernels=names)
    rows.append(row)
    best = max(configs, key=lambda c: -t[c])
    print(f"{m}x{n}x{k} cublas {t['cublas']:.4f} " + " ".join(f"{c.split('/c')[0]}{'/gl' if c.endswith('gl') else ''}={t['cublas']/t[c]:.3f}" for c in configs)
          + f" | best {best} | {names}", flush=True)
    assert all(e < 1e-2 for e in errs.values()), errs
os.makedirs(os.environ["OUT"], exist_ok=True)
json.dump(rows, open(os.path.join(os.environ["OUT"], "probe_ag_tiles.json"), "w"), indent=1)
dist.destroy_process_group()
