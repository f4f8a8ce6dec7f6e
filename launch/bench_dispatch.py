"""CPU cost of one op call on DTensors: axedist (cached rules/plans) vs PyTorch DTensor.

    torchrun --nproc-per-node 4 launch/bench_dispatch.py             # gloo, 4 CPU ranks
    torchrun --nproc-per-node 4 launch/bench_dispatch.py --profile   # + cProfile of axedist's calls

Same ops, same placements, same (small) tensors on both sides, so the time is framework
overhead: per op, the median over ``--repeats`` batches of ``--calls`` calls (after a warm-up
that fills every cache) of the time per call, batches of the three sides interleaved and
ranks timed in turn (the others wait in a barrier); the same op on the plain local tensors is timed
too and subtracted, giving each framework's *overhead* per call. Rank 0 prints a table with
the ratio (axedist overhead / DTensor overhead; the goal is <= 0.5), from the medians and
from each side's fastest batch (less sensitive to a loaded machine). No op here communicates
(every placement is kept), so ranks never wait on each other inside a timed loop.

Ops: ``x + y`` (Shard(0) + Shard(0)), ``x * 2.0``, ``a @ b`` giving a pending sum (Shard(1) @
Shard(0) -> Partial; the local product is read with ``to_local()`` on both sides, since axedist
defers it), ``x.view(...)`` merging the two leading dims of a dim-0-sharded tensor,
``x.sum(1)`` (over an unsharded dim), and ``F.linear`` column-parallel (input Replicate, weight
Shard(0) -> output Shard(1), no redistribute).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import axedist as ax
from axedist.dtensor import distribute


def _cases(mesh, torch_mesh):
    """(name, axedist fn, torch DTensor fn, plain-local fn) per op; each fn takes no arguments."""
    g = torch.Generator().manual_seed(0)

    def both(shape, placements):
        t = torch.randn(shape, generator=g)
        ours = distribute(t, mesh, placements)
        theirs = distribute_tensor(t, torch_mesh, placements)
        return ours, theirs, ours.to_local()

    x, tx, lx = both((64, 32), [Shard(0)])
    y, ty, ly = both((64, 32), [Shard(0)])
    a, ta, la = both((16, 64), [Shard(1)])
    b, tb, lb = both((64, 16), [Shard(0)])
    v, tv, lv = both((8, 4, 16), [Shard(0)])
    inp, tinp, linp = both((16, 32), [Replicate()])
    w, tw, lw = both((64, 32), [Shard(0)])
    vshape, lvshape = (32, 16), (lv.shape[0] * 4, 16)
    return [
        ("add  S0 + S0", lambda: x + y, lambda: tx + ty, lambda: lx + ly),
        ("mul  S0 * 2.0", lambda: x * 2.0, lambda: tx * 2.0, lambda: lx * 2.0),
        ("mm   S1 @ S0 -> P", lambda: torch.mm(a, b).to_local(), lambda: torch.mm(ta, tb).to_local(),
         lambda: torch.mm(la, lb)),
        ("view S0 (8,4,16)->(32,16)", lambda: v.view(vshape), lambda: tv.view(vshape), lambda: lv.view(lvshape)),
        ("sum  S0 over dim 1", lambda: x.sum(1), lambda: tx.sum(1), lambda: lx.sum(1)),
        ("linear R x S0 -> S1", lambda: F.linear(inp, w), lambda: F.linear(tinp, tw), lambda: F.linear(linp, lw)),
    ]


def _batch_us(fn, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def _measure(fns, calls: int, repeats: int) -> list[float]:
    """Median time per call (us) of each fn; batches interleaved so load changes hit all alike."""
    for fn in fns:
        for _ in range(50):  # warm-up: rules, plans, meta shapes, torch's sharding-prop cache
            fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            out.append(_batch_us(fn, calls))
    return [statistics.median(s) for s in samples] + [min(s) for s in samples]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=25, help="timed batches (the median is reported)")
    parser.add_argument("--profile", action="store_true", help="cProfile axedist's calls (rank 0 prints the top)")
    args = parser.parse_args()
    mesh = ax.init_mesh((int(os.environ.get("WORLD_SIZE", "4")),), device_type="cpu")
    world = dist.get_world_size()
    torch_mesh = mesh.to_torch()
    torch.set_num_threads(1)
    cases = _cases(mesh, torch_mesh)
    rows = torch.zeros(len(cases), 6, dtype=torch.float64)
    # ranks take turns (the others wait in a barrier), so the timed rank has the cores to itself
    for turn in range(world):
        dist.barrier()
        if dist.get_rank() == turn:
            for i, (name, ours, theirs, plain) in enumerate(cases):
                rows[i] = torch.tensor(_measure([plain, ours, theirs], args.calls, args.repeats))
        dist.barrier()
    gathered = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(gathered, rows)
    table = torch.stack(gathered).median(dim=0).values  # the median rank
    rows = [(name, None, None, None) for name, _, _, _ in cases]
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            for _, ours, _, _ in cases:
                ours()
        profiler.disable()
    if dist.get_rank() == 0:
        print(f"\nCPU cost per op call, {world} gloo ranks, torch {torch.__version__}; median of {args.repeats} "
              f"batches x {args.calls} calls; overhead = call - same op on the local tensors (us)\n")
        print("| op | local op | axedist | torch DTensor | axedist overhead | DTensor overhead | ratio "
              "| ratio (best batch) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        ratios, best = [], []
        for (name, _, _, _), (p, o, t, bp, bo, bt) in zip(rows, table.tolist()):
            ours_over, theirs_over = o - p, t - p
            ratio = ours_over / theirs_over if theirs_over > 0 else float("nan")
            ratios.append(ratio)
            best.append((bo - bp) / (bt - bp) if bt > bp else float("nan"))
            print(f"| {name} | {p:.1f} | {o:.1f} | {t:.1f} | {ours_over:.1f} | {theirs_over:.1f} | {ratio:.2f} "
                  f"| {best[-1]:.2f} |")
        print(f"\ngeomean ratio {statistics.geometric_mean(ratios):.2f} (best batches: "
              f"{statistics.geometric_mean(best):.2f}; goal <= 0.50); worst {max(ratios):.2f}")
        if args.profile:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
