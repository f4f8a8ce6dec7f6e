"""Where a fused call's host time goes: cProfile of the fused all-gather + GEMM and GEMM +
reduce-scatter calls at a small shape (where eager calls are host-bound), through the public
calls (ax.all_gather_gemm / ax.gemm_reduce_scatter, backend "p2p"), with cuBLAS for scale.

    torchrun --nproc-per-node 2 benchmarks/probe_host_fused.py --out benchmarks/results

Per call: host us (``timing.host_time_us``: median of 5 batches of 20 calls issued behind a
sleep kernel, as bench_ag_gemm's; batches of 200 filled one rank's launch queue), then the
top functions by own time and by cumulative time of --calls profiled calls. Writes
probe_host_fused.md (rank 0) with the commit, machine and command.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from history import require_multicast_off, run_meta  # noqa: E402

import axedist as ax  # noqa: E402
from axedist.collectives.timing import host_time_us  # noqa: E402


def profile(fn, calls: int, top: int) -> str:
    """The top functions of `calls` calls by own time, then by cumulative time."""
    torch.cuda.synchronize()
    dist.barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    require_multicast_off()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(rank)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    ag_a, ag_b = torch.randn(2048 // world, 8192, **bf16), torch.randn(8192, 2048, **bf16)
    rs_a, rs_b = torch.randn(2048, 8192 // world, **bf16), torch.randn(8192 // world, 2048, **bf16)
    ag_out = torch.empty(2048, 2048, **bf16)
    rs_out = torch.empty(2048 // world, 2048, **bf16)
    cases = {
        "all_gather_gemm 2048x2048x8192": lambda: ax.all_gather_gemm(ag_a, ag_b, backend="p2p", out=ag_out),
        "gemm_reduce_scatter 2048x2048x8192": lambda: ax.gemm_reduce_scatter(rs_a, rs_b, backend="p2p", out=rs_out),
        "cuBLAS mm 2048x2048x8192 (reference)": lambda: torch.mm(rs_a, rs_b),
    }
    lines = []
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        us = host_time_us(fn, calls=20)
        print(f"[{rank}] {name}: {us:.1f} us of host per call", flush=True)
        report = profile(fn, args.calls, args.top)
        lines += [f"## {name}: {us:.1f} us of host per call (rank {rank})", "", "```", report.strip(), "```", ""]
    if rank == 0:
        meta = run_meta(world, "torchrun --nproc-per-node %d benchmarks/probe_host_fused.py %s"
                        % (world, " ".join(sys.argv[1:])))
        os.makedirs(args.out, exist_ok=True)
        head = [f"# Host cost of the fused calls ({meta['date']})", "",
                f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
                f"command: `{meta['command']}`", ""]
        with open(os.path.join(args.out, "probe_host_fused.md"), "w") as handle:
            handle.write("\n".join(head + lines) + "\n")
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
