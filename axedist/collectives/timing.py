"""Timing of collective GPU operations for the benchmarks (launch/bench_*.py).

Each sample is one call between two CUDA events on the current stream; the result is the median
over samples on each rank, then the maximum over ranks (a collective is as slow as its slowest
rank). Warm-up calls come first so that compilation and handle creation stay out.

    >>> time_collective(lambda: dist.reduce_scatter_tensor(out, x), reps=30)   # ms
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def time_collective(fn, reps: int = 30, warmup: int = 5, group=None) -> float:
    """Median over `reps` calls of fn's device time in ms, max over the group's ranks."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    median = statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))
    value = torch.tensor([median], dtype=torch.float64, device="cuda")
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())

