"""Host cost of the cuBLAS + NCCL path that ``gemm_reduce_scatter``'s ``auto`` runs at the
inference shapes (issue 28: at W = 4, M = 128 / 512, eager ``auto`` took 0.249 / 0.251 ms against
0.128 / 0.129 for the same pair called directly, ``results/gemm_rs_w4.md``), taken apart, on one
GPU with a one-rank NCCL group or on the machine's GPUs:

    torchrun --nproc-per-node 1 benchmarks/device/probe_auto_host.py [--out DIR]
    torchrun --nproc-per-node 4 benchmarks/device/probe_auto_host.py [--out DIR]

At W = 1 the call itself runs a plain matmul, so the probe also times the torch path's pieces as that
path calls them (``fallback.reduce_scatter`` and ``fallback.copy_out``, the functions the W >= 2
branch of ``run_gemm_reduce_scatter`` uses) beside the pair on preallocated tensors (the
benchmark's ``seq``) and with fresh ones:

    seq         torch.mm(a, b, out=partial); reduce_scatter_into(rs_out, partial)
    seq_fresh   the same, product and output allocated each call
    torch_path  torch.matmul, fallback.reduce_scatter (contiguous, empty, NCCL), copy_out: the
                W >= 2 path until 6a93dc5 (kept here as the "before")
    lean        fallback.matmul_reduce_scatter: what that path runs since (one mm of a's rows,
                NCCL straight into the result)
    auto        gemm_reduce_scatter(a, b): at W = 1 the dispatch and a plain matmul only; at W >= 2
                what a user's call runs (the inference shapes are in the table's fused_loses)

Per column: host us per call issued behind a sleep kernel (timing.host_time_us: a call that waits
for the GPU shows as hundreds of us), host us per call from an idle GPU (bench_gemm_rs's way),
eager ms (blocks of three calls, the last timed) and the CUDA runtime calls one call makes
(profiler), so a hidden synchronisation or allocation is named. Times and errors are the max over
ranks (host times too: every rank times its own calls), runtime calls rank 0's. Every rank holds
the same operands, so each rank's share of the sum is W x its rows of a @ b. Writes
DIR/probe_auto_host_w<W>.json.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from axedist.collectives import fallback, gemm_reduce_scatter, reduce_scatter_into
from axedist.collectives.timing import host_time_us, profiled_counts, time_interleaved

SHAPES = ((128, 8192, 7168), (512, 8192, 7168), (2048, 8192, 2048))


def idle_host_us(fn, calls: int = 20) -> float:
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same operands on every rank
    results = []

    def most(values: dict) -> dict:  # per name, the max over ranks
        maxima = torch.tensor(list(values.values()), dtype=torch.float64, device="cuda")
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        return dict(zip(values, maxima.tolist()))

    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # nn.Linear's weight.t()
        partial = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        rs_out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)

        def seq():
            torch.mm(a, b, out=partial)
            reduce_scatter_into(rs_out, partial)

        def seq_fresh():
            product = torch.mm(a, b)
            out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
            reduce_scatter_into(out, product)

        def torch_path():
            product = torch.matmul(a, b)
            result = fallback.reduce_scatter(product.movedim(0, 0).contiguous(), None).movedim(0, 0)
            return fallback.copy_out("gemm_reduce_scatter", result.contiguous(), None)

        columns = dict(seq=seq, seq_fresh=seq_fresh, torch_path=torch_path,
                       lean=lambda: fallback.matmul_reduce_scatter("gemm_reduce_scatter", a, b, None, 0, None),
                       auto=lambda: gemm_reduce_scatter(a, b))
        rows = slice(rank * m // world, (rank + 1) * m // world)
        reference = world * (a.float() @ b.float())[rows]
        errors = {name: ((fn().float() - reference).abs().max() / reference.abs().max()).item()
                  for name, fn in (("torch_path", torch_path), ("lean", columns["lean"]),
                                   ("auto", columns["auto"]))}
        row = dict(M=m, N=n, K=k, world=world, rel_err=most(errors),
                   eager_ms=time_interleaved(columns, reps=30, block=3),
                   host_us_queued=most({name: host_time_us(fn, calls=50, repeats=5) for name, fn in columns.items()}),
                   host_us_idle=most({name: idle_host_us(fn) for name, fn in columns.items()}),
                   runtime_calls={name: profiled_counts(fn, calls=10, gpu=False) for name, fn in columns.items()})
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    meta = dict(commit=os.environ.get("AXEDIST_COMMIT", "unknown"), torch=torch.__version__,
                gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if rank == 0:
        with open(os.path.join(args.out, f"probe_auto_host_w{world}.json"), "w") as handle:
            json.dump(dict(meta=meta, rows=results), handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
