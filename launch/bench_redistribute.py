"""Redistribute: axedist's plans (executed by plan_executor) vs torch DTensor, bytes and time.

    torchrun --nproc-per-node 4 launch/bench_redistribute.py            # CPU, gloo
    torchrun --nproc-per-node 4 launch/bench_redistribute.py --cuda     # GPUs, NCCL

Prints a markdown table (rank 0): per transition, the bytes a rank sends at most
(axedist plan vs torch DTensor, counted from the collectives torch issues under
``CommDebugMode``) and the median wall time (max over ranks) of both; then the CPU
overhead of one call with a cached plan on a transition that moves no data
(``Replicate -> Shard``: slicing only), where the time is all framework.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import distribute_tensor

import axedist as ax
from axedist.collectives.plan_executor import _route, explain_execution, redistribute_local, torch_comm_bytes
from axedist.dtensor import _target_spec

P = {"R": Replicate(), "P": Partial(), "S0": Shard(0), "S1": Shard(1)}
TRANSITIONS = [
    # (mesh shape, src, dst, shape scale: rows, cols per unit)
    ((4,), "S0", "R"),
    ((4,), "P", "S0"),
    ((4,), "P", "R"),
    ((4,), "S0", "S1"),
    ((4,), "R", "S0"),
    ((2, 2), "S0 S1", "S1 S0"),
    ((2, 2), "S0 S1", "R R"),
    ((2, 2), "P P", "S0 S1"),
    ((2, 2), "S0 R", "R S0"),
    ((2, 2), "P R", "S0 S1"),
]


def _timed(fn, device, iters: int) -> float:
    """Median over ``iters`` of the slowest rank's wall time (ms)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed) * 1e3)
    return statistics.median(times)


def _max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _pair(mesh, shape, src_text, dst_text, dtype):
    """(axedist local + specs, torch source DTensor, dst placements) for one transition."""
    src_pl = [P[p] for p in src_text.split()]
    dst_pl = [P[p] for p in dst_text.split()]
    torch_mesh = mesh.to_torch()
    full = torch.randn(shape, dtype=dtype, device=mesh.device, generator=None)
    dist.broadcast(full, src=0)
    if any(isinstance(p, Partial) for p in src_pl):
        start = [p if isinstance(p, Partial) else Replicate() for p in src_pl]
        torch_src = TorchDTensor.from_local(full, torch_mesh, start, run_check=False).redistribute(torch_mesh, src_pl) \
            if start != src_pl else TorchDTensor.from_local(full, torch_mesh, src_pl, run_check=False)
    else:
        torch_src = distribute_tensor(full, torch_mesh, src_pl)
    ours = ax.from_torch(torch_src)
    dst_spec = _target_spec(ours._spec, dst_pl, None, None)
    return ours, dst_spec, torch_src, torch_mesh, dst_pl


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cuda", action="store_true", help="NCCL on GPUs (default: gloo on CPU)")
    parser.add_argument("--rows", type=int, default=None, help="rows of the tensor (default 1024 CPU, 8192 CUDA)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--explain", action="store_true", help="print each plan and how it runs")
    args = parser.parse_args()
    mesh4 = ax.init_mesh((4,), device_type="cuda" if args.cuda else "cpu")
    device = mesh4.device
    world = dist.get_world_size()
    assert world == 4, "run with 4 ranks"
    mesh22 = ax.DeviceMesh(mesh4.device_type, (2, 2), ("x", "y"))
    rows = args.rows or (8192 if args.cuda else 1024)
    iters = args.iters or (20 if args.cuda else 10)
    shape = (rows, rows)
    dtype = torch.bfloat16 if args.cuda else torch.float32
    lines = ["| mesh | transition | axedist steps | bytes/rank axedist | bytes/rank DTensor | ms axedist | ms DTensor |",
             "|---|---|---|---|---|---|---|"]
    for mesh_shape, src_text, dst_text in TRANSITIONS:
        mesh = mesh4 if mesh_shape == (4,) else mesh22
        ours, dst_spec, torch_src, torch_mesh, dst_pl = _pair(mesh, shape, src_text, dst_text, dtype)
        local, src_spec = ours.to_local(), ours._spec
        out = redistribute_local(local, src_spec, dst_spec)  # plans, compiles, warms up
        want, torch_bytes = torch_comm_bytes(lambda: torch_src.redistribute(torch_mesh, dst_pl).to_local())
        assert torch.allclose(out.float(), want.float(), rtol=1e-2, atol=1e-2), (src_text, dst_text)
        route = _route(src_spec, dst_spec, local.element_size())
        me = tuple(mesh.coordinates()[a] for a in mesh.axis_names)
        ours_bytes = sum(p.bytes_sent.get(me, 0) for p in route.plans)
        if args.explain and dist.get_rank() == 0:
            print(explain_execution(route.plans[0], mesh), flush=True)
        t_ours = _timed(lambda: redistribute_local(local, src_spec, dst_spec), device, iters)
        t_torch = _timed(lambda: torch_src.redistribute(torch_mesh, dst_pl).to_local(), device, iters)
        kinds = " + ".join(k for p in route.plans for k in p.kinds) or "none"
        lines.append(f"| {'x'.join(map(str, mesh_shape))} | {src_text} -> {dst_text} | {kinds} | "
                     f"{_max_over_ranks(ours_bytes):,} | {_max_over_ranks(torch_bytes):,} | {t_ours:.2f} | {t_torch:.2f} |")
    # CPU overhead of a cached call that moves nothing: Replicate -> Shard(0)
    small = (64, 64)
    ours, dst_spec, torch_src, torch_mesh, dst_pl = _pair(mesh4, small, "R", "S0", torch.float32)
    local, src_spec = ours.to_local(), ours._spec
    redistribute_local(local, src_spec, dst_spec)
    torch_src.redistribute(torch_mesh, dst_pl)
    calls = 2000

    def per_call(fn) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    us_ours = statistics.median(per_call(lambda: redistribute_local(local, src_spec, dst_spec)) for _ in range(3))
    us_torch = statistics.median(per_call(lambda: torch_src.redistribute(torch_mesh, dst_pl)) for _ in range(3))
    if dist.get_rank() == 0:
        backend = "NCCL" if args.cuda else "gloo"
        print(f"shape {shape} {str(dtype).replace('torch.', '')}, {world} ranks, {backend}, median of {iters} "
              f"(max over ranks)\n")
        print("\n".join(lines))
        print(f"\nCPU overhead per call, cached plan, Replicate -> Shard(0) of {small} (no communication): "
              f"axedist redistribute_local {us_ours:.1f} us, torch DTensor.redistribute {us_torch:.1f} us")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
