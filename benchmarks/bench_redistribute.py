"""Redistribute: axedist DTensor (layout-inference plans) vs torch DTensor, bytes and time.

    torchrun --nproc-per-node 4 benchmarks/bench_redistribute.py            # CPU, gloo
    torchrun --nproc-per-node 4 benchmarks/bench_redistribute.py --cuda     # 4 GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/bench_redistribute.py --cuda     # 2 GPUs: the 1-D rows only

Rank 0 prints a markdown table and writes ``<out>/redistribute_w{2,4}[_cpu].{json,md,png}``
(date, machine, commit, command): per transition, the bytes one rank sends at most
(axedist: from the plans it ran, collected with ``axedist.runtime.record``; torch DTensor:
from the collectives it issues, counted under ``CommDebugMode``), the median time of one
call from an idle GPU (max over ranks; CUDA events on GPUs, wall clock on CPU) of
``DTensor.redistribute`` on both sides with its host part (until the call returns), and on
GPUs the time per call of calls queued back to back behind a sleep kernel (the device's cost);
then the CPU overhead of one call with a cached plan on a transition that
moves no data (``Replicate -> Shard(0)``: slicing only), where the time is all framework.
Only public names are used. The last rows are uneven, ``(rows - 1, rows + 2)``. torch's bytes
are those of its NCCL path also on CPU (``torch_comm_bytes``: its CPU shard-dim all-to-all
all-gathers instead), while its CPU times are those of what it runs there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import axedist as ax
from axedist.collectives.timing import device_time
from axedist.runtime import execution_bytes, explain_execution, record
from axedist.testing import torch_comm_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py, beside this script
from history import append_history, run_meta  # noqa: E402

P = {"R": Replicate(), "P": Partial(), "S0": Shard(0), "S1": Shard(1)}
TRANSITIONS = [
    # (mesh shape, src, dst)
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
    ((2, 2), "P P", "S1 R"),
    # uneven: (rows - 1, rows + 2), dim 1 chunked by x then by y (torch's nested chunks, padded
    # differently from the target's): true elements only (plan_direct), or axis by axis
    ((2, 2), "S1 S1", "S1 S0", "uneven"),
    ((2, 2), "S1 S1", "R S0", "uneven"),
]


def _timed(fn, device, iters: int) -> tuple[float, float]:
    """Medians over ``iters`` of the slowest rank's time (ms: CUDA events on GPUs, wall clock on
    CPU) and of the host time of the call alone (us: until ``fn`` returns, the GPU not waited for)."""
    times, host = [], []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            fn()
            issued = time.perf_counter() - begin
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            fn()
            elapsed = issued = time.perf_counter() - begin
        value = torch.tensor([elapsed, issued], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        times.append(float(value[0]) * 1e3)
        host.append(float(value[1]) * 1e6)
    return statistics.median(times), statistics.median(host)


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _pair(mesh, shape, src_text, dst_text, dtype):
    """(axedist source DTensor, torch source DTensor, torch mesh, dst placements) for one transition."""
    src_pl = [P[p] for p in src_text.split()]
    dst_pl = [P[p] for p in dst_text.split()]
    torch_mesh = mesh.to_torch()
    full = torch.randn(shape, dtype=dtype, device=mesh.device)
    dist.broadcast(full, src=0)
    if any(isinstance(p, Partial) for p in src_pl):
        start = [p if isinstance(p, Partial) else Replicate() for p in src_pl]
        torch_src = TorchDTensor.from_local(full, torch_mesh, start, run_check=False)
        if start != src_pl:
            torch_src = torch_src.redistribute(torch_mesh, src_pl)
    else:
        torch_src = distribute_tensor(full, torch_mesh, src_pl)
    return ax.from_torch(torch_src), torch_src, torch_mesh, dst_pl


def _write(rows, overhead, meta, path_stem):
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    with open(path_stem + ".json", "w") as handle:
        json.dump(dict(meta=meta, rows=rows, cpu_overhead_us=overhead), handle, indent=1)
    append_history(os.path.dirname(path_stem) or ".", os.path.basename(path_stem), meta,
                   dict(rows=rows, cpu_overhead_us=overhead))
    lines = [f"# Redistribute, axedist vs torch DTensor, W={meta['world']} ({meta['date']})", "",
             f"machine: {meta['machine']}; backend {meta['backend']}; commit {meta['commit']}; "
             f"torch {meta['torch']}; multicast off", f"command: `{meta['command']}`", "",
             f"Tensor {meta['shape']} {meta['dtype']}. Bytes: what one rank sends at most (axedist: its plans; "
             f"torch: the collectives it issues, under CommDebugMode). Time: median of {meta['iters']} calls of "
             f"`DTensor.redistribute`, slowest rank ({meta['timer']}); host: until the call returns (median, "
             f"slowest rank), the GPU not waited for; queued (GPUs): ms per call of {meta['iters']} calls queued back to "
             f"back behind a sleep kernel (`collectives.timing.device_time`: the device's cost of a call).", "",
             "| mesh | transition | axedist steps | bytes/rank axedist | bytes/rank DTensor | ms axedist | ms DTensor "
             "| host us axedist | host us DTensor | queued ms axedist | queued ms DTensor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        host = (f"{r['host_us_axedist']:.0f} | {r['host_us_torch']:.0f}" if "host_us_axedist" in r else "- | -")
        queued = (f"{r['queued_ms_axedist']:.3f} | {r['queued_ms_torch']:.3f}" if r.get("queued_ms_axedist") else "- | -")
        lines.append(f"| {r['mesh']} | {r['transition']} | {r['steps']} | {r['bytes_axedist']:,} | "
                     f"{r['bytes_torch']:,} | {r['ms_axedist']:.3f} | {r['ms_torch']:.3f} | {host} | {queued} |")
    lines += ["", f"CPU overhead per call with a cached plan, `Replicate -> Shard(0)` of {overhead['shape']} "
                  f"(no communication): axedist {overhead['axedist']:.1f} us, torch DTensor {overhead['torch']:.1f} us."]
    with open(path_stem + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    labels = [f"{r['mesh']}: {r['transition']}" for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.5))
    ys = range(len(rows))
    for axis, key, title in ((left, "bytes", "MB sent per rank (max)"), (right, "ms", "median ms (slowest rank)")):
        ours = [r[f"{key}_axedist"] / (1e6 if key == "bytes" else 1) for r in rows]
        theirs = [r[f"{key}_torch"] / (1e6 if key == "bytes" else 1) for r in rows]
        axis.barh([y + 0.2 for y in ys], ours, height=0.4, label="axedist")
        axis.barh([y - 0.2 for y in ys], theirs, height=0.4, label="torch DTensor")
        axis.set_yticks(list(ys))
        axis.set_yticklabels(labels if axis is left else [""] * len(rows))
        axis.invert_yaxis()
        axis.set_title(title)
        axis.legend(loc="best")
    figure.suptitle(f"redistribute {meta['shape']} {meta['dtype']}, {meta['backend']}, W={meta['world']}")
    figure.tight_layout()
    figure.savefig(path_stem + ".png", dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cuda", action="store_true", help="NCCL on GPUs (default: gloo on CPU)")
    parser.add_argument("--rows", type=int, default=None, help="rows = cols of the tensor (default 1024 CPU, 8192 CUDA)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results", help="folder for the json/md/png")
    parser.add_argument("--explain", action="store_true", help="print each plan and how it ran")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world not in (2, 4):
        raise SystemExit(f"run with 2 or 4 ranks (2: the 1-D rows only), not {world}")
    line = ax.init_mesh((world,), device_type="cuda" if args.cuda else "cpu")
    device = line.device
    square = ax.DeviceMesh(line.device_type, (2, 2), ("x", "y")) if world == 4 else None
    rows_count = args.rows or (8192 if args.cuda else 1024)
    iters = args.iters or (20 if args.cuda else 10)
    shape = (rows_count, rows_count)
    dtype = torch.bfloat16 if args.cuda else torch.float32
    rows = []
    for mesh_shape, src_text, dst_text, *uneven in TRANSITIONS:
        if len(mesh_shape) > 1 and square is None:
            continue
        mesh_shape = (world,) if len(mesh_shape) == 1 else mesh_shape
        mesh = line if len(mesh_shape) == 1 else square
        here = (rows_count - 1, rows_count + 2) if uneven else shape
        ours, torch_src, torch_mesh, dst_pl = _pair(mesh, here, src_text, dst_text, dtype)
        with record() as ran:  # to_local inside: a move deferred on CUDA (a row all-gather) runs there
            out = ours.redistribute(dst_pl)  # plans, compiles, warms up
            out.to_local()
        want, torch_bytes = torch_comm_bytes(lambda: torch_src.redistribute(torch_mesh, dst_pl).to_local())
        got = out.to_local()
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), (src_text, dst_text)
        route = ran[0] if ran else None
        ours_bytes = execution_bytes(route, mesh) if route else 0
        # both sides' local tensors are read, so a deferred move is timed, not only its deferral
        t_ours, host_ours = _timed(lambda: ours.redistribute(dst_pl).to_local(), device, iters)
        t_torch, host_torch = _timed(lambda: torch_src.redistribute(torch_mesh, dst_pl).to_local(), device, iters)
        queued = dict(axedist=None, torch=None)
        if device.type == "cuda":  # calls queued back to back behind a sleep kernel: the device's cost of a call
            queued = device_time(dict(axedist=lambda: ours.redistribute(dst_pl).to_local(),
                                      torch=lambda: torch_src.redistribute(torch_mesh, dst_pl).to_local()), calls=iters)
            queued = {side: _max_over_ranks(ms, device) for side, ms in queued.items()}
        if args.explain and route and dist.get_rank() == 0:
            print(explain_execution(route, mesh), flush=True)
        steps = " + ".join(route.kinds) if route else "none"
        shape_text = f" ({here[0]}x{here[1]})" if uneven else ""
        rows.append(dict(mesh="x".join(map(str, mesh_shape)), transition=f"{src_text} -> {dst_text}{shape_text}",
                         steps=steps or "local",
                         bytes_axedist=int(_max_over_ranks(ours_bytes, device)),
                         bytes_torch=int(_max_over_ranks(torch_bytes, device)),
                         ms_axedist=t_ours, ms_torch=t_torch, host_us_axedist=host_ours, host_us_torch=host_torch,
                         queued_ms_axedist=queued["axedist"], queued_ms_torch=queued["torch"]))
    # CPU overhead of a cached call that moves nothing: Replicate -> Shard(0)
    small = (64, 64)
    ours, torch_src, torch_mesh, dst_pl = _pair(line, small, "R", "S0", torch.float32)
    ours.redistribute(dst_pl)
    torch_src.redistribute(torch_mesh, dst_pl)
    calls = 2000

    def per_call(fn) -> float:
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - begin) / calls * 1e6

    us_ours = statistics.median(per_call(lambda: ours.redistribute(dst_pl)) for _ in range(3))
    us_torch = statistics.median(per_call(lambda: torch_src.redistribute(torch_mesh, dst_pl)) for _ in range(3))
    overhead = dict(shape=list(small), axedist=_max_over_ranks(us_ours, device), torch=_max_over_ranks(us_torch, device))
    if dist.get_rank() == 0:
        backend = "NCCL" if args.cuda else "gloo"
        gpu = torch.cuda.get_device_name() if args.cuda else platform.processor() or platform.machine()
        meta = run_meta(world, f"torchrun --nproc-per-node {world} benchmarks/bench_redistribute.py " + " ".join(sys.argv[1:]),
                        device=gpu, backend=backend, shape=list(shape), dtype=str(dtype).replace("torch.", ""),
                        iters=iters, timer="CUDA events" if args.cuda else "wall clock")
        stem = os.path.join(args.out, f"redistribute_w{world}" + ("" if args.cuda else "_cpu"))
        _write(rows, overhead, meta, stem)
        print(open(stem + ".md").read(), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
