"""Time the first ``DTensor.redistribute`` of an uneven tensor: planning (once per spec pair) vs a cached call.

    torchrun --nproc-per-node 4 benchmarks/bench_first_plan.py                 # CPU, gloo
    torchrun --nproc-per-node 4 benchmarks/bench_first_plan.py --sizes 1023x1025 4095x4098 --profile

An uneven shape pads its dims (``torch.chunk``), and the first redistribute of a spec pair
works out which buffer slots are real, each rank's true local shape, and the plan that
leaves the padding out; later calls find all of it cached. Rank 0 prints one row per
(mesh, transition, shape): the first call and a cached call (slowest rank, wall clock), and
with ``--profile`` where rank 0's first call spends its time (cProfile, cumulative seconds of
the planning functions). Only public names are used, except the function names profiled.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import axedist as ax
from axedist.dtensor import distribute

P = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
TRANSITIONS = [((2, 2), "S1 S1", "S1 S0"), ((2, 2), "S1 S1", "R S0"), ((4,), "S0", "S1"), ((4,), "S1", "R")]
# the functions of axedist/planning and axedist/runtime whose cumulative time is shown
PARTS = ["plan_redistribute", "true_boxes", "real_slots", "holdings_of", "held_rows", "drop_padding",
         "plan_alternatives", "plan_direct", "execute_plan"]


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _parts(profile: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds per function name in ``PARTS`` (summed over same-named functions)."""
    stats = pstats.Stats(profile).stats
    out = dict.fromkeys(PARTS, 0.0)
    for (_, _, name), (_, _, _, cumulative, _) in stats.items():
        if name in out:
            out[name] += cumulative
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1023x1025", "2047x2049", "4095x4098"])
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0's first call")
    args = parser.parse_args()
    mesh4 = ax.init_mesh((4,), device_type="cpu")
    assert dist.get_world_size() == 4, "run with 4 ranks"
    mesh22 = ax.DeviceMesh("cpu", (2, 2), ("x", "y"))
    rank = dist.get_rank()
    header = "| mesh | transition | shape | first call s | cached call ms |"
    if args.profile:
        header += " " + " | ".join(PARTS) + " |"
    if rank == 0:
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
    for size in args.sizes:
        shape = tuple(int(s) for s in size.split("x"))
        for mesh_shape, src, dst in TRANSITIONS:
            mesh = mesh4 if mesh_shape == (4,) else mesh22
            full = torch.randn(shape)
            dist.broadcast(full, src=0)
            x = distribute(full, mesh, [P[p] for p in src.split()])
            target = [P[p] for p in dst.split()]
            dist.barrier()
            profile = cProfile.Profile() if args.profile and rank == 0 else None
            begin = time.perf_counter()
            if profile:
                profile.enable()
            y = x.redistribute(target)
            if profile:
                profile.disable()
            first = _slowest(time.perf_counter() - begin)
            assert torch.equal(y.full_tensor(), full), (mesh_shape, src, dst, shape)
            dist.barrier()
            begin = time.perf_counter()
            x.redistribute(target)
            cached = _slowest(time.perf_counter() - begin)
            if rank == 0:
                row = f"| {'x'.join(map(str, mesh_shape))} | {src} -> {dst} | {shape[0]}x{shape[1]} | " \
                      f"{first:.3f} | {cached * 1e3:.2f} |"
                if profile:
                    row += " " + " | ".join(f"{v:.3f}" for v in _parts(profile).values()) + " |"
                print(row, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
