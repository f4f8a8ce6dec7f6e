"""Where an eager decode step's host time goes: bench_decode.py's stack (TP over the ranks, no
sequence parallelism, ``to_inference``, ``torch.inference_mode``) after warm-up, one rank's view.

    torchrun --nproc-per-node 1 benchmarks/probe_decode_host.py --cuda [--out DIR]
    torchrun --nproc-per-node 2 benchmarks/probe_decode_host.py --dim 256 --ffn 512 --heads 8 --kv-heads 4

Prints (and writes to DIR/probe_decode_host.txt on rank 0): the step's wall and thread-CPU time
(median of 7 batches, each ended by a synchronize: a decode step's kernels take less time than
their launches, so the batch's time is the host's), the dispatcher's and the fast path's counts per step (an
uncached call or a recording per step is a cache that does not hold), the time spent inside each
torch function called on DTensors (outermost calls only) and a cProfile of the steps.
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

import axedist as ax
from axedist.dtensor import DTensor
from axedist.nn import parallelize, to_inference
from axedist.nn.llama import LlamaConfig, llama_tp_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import LayerStack  # noqa: E402


def _per_function(step, steps: int) -> list[tuple[str, float, float]]:
    """(torch function, calls per step, us per step) inside DTensor.__torch_function__, outermost calls."""
    installed = DTensor.__dict__["__torch_function__"]
    handler = installed.__func__
    spent = collections.defaultdict(lambda: [0, 0.0])
    depth = [0]

    def timed(cls, func, types, args=(), kwargs=None):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return handler(cls, func, types, args, kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                entry = spent[getattr(func, "__qualname__", str(func))]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

    DTensor.__torch_function__ = classmethod(timed)
    try:
        for _ in range(steps):
            step()
    finally:
        DTensor.__torch_function__ = installed
    return sorted(((name, n / steps, t / steps * 1e6) for name, (n, t) in spent.items()), key=lambda r: -r[2])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    mesh = ax.init_mesh(device_type=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_hidden=args.ffn, max_seq_len=16)
    dtype = torch.bfloat16 if args.cuda else torch.float32
    torch.manual_seed(0)
    stack = LayerStack(cfg).to(device=device, dtype=dtype).eval()
    parallelize(stack, mesh, {k: v for k, v in llama_tp_plan(cfg, sequence_parallel=False).items()
                              if k.startswith("layers.")}, src_rank=None)
    to_inference(stack)
    lines = [f"probe_decode_host: {world} rank(s), {device}, {args.layers} layers, dim {args.dim}, batch {args.batch}, "
             f"torch {torch.__version__}, commit {os.environ.get('AXEDIST_COMMIT', '?')}"]
    with torch.inference_mode():
        x = DTensor.from_local(torch.randn(1, args.batch, cfg.dim, device=device, dtype=dtype), mesh, [Replicate()])

        def step():
            return stack(x)

        for _ in range(5):
            step()
        sync = torch.cuda.synchronize if args.cuda else (lambda: None)
        sync()
        dist.barrier()
        walls, cpus = [], []
        for _ in range(7):
            # (no sleep kernel ahead: a batch's launches would fill CUDA's queue and the host spin
            # until the sleep ends. A decode step's kernels take less time than their launches, so
            # the GPU keeps up and the batch's wall time is the host's)
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                step()
            sync()
            walls.append((time.perf_counter() - wall) / args.steps * 1e3)
            cpus.append((time.thread_time() - cpu) / args.steps * 1e3)
        lines.append(f"host per step: wall {statistics.median(walls):.2f} ms (min {min(walls):.2f}), "
                     f"thread CPU {statistics.median(cpus):.2f} ms (min {min(cpus):.2f})")
        d = DTensor.dispatcher
        before, fast_before = dict(d.stats), dict(d.fastpath.counts)
        for _ in range(args.steps):
            step()
        sync()
        lines.append("dispatcher per step: " + ", ".join(
            f"{k} {(d.stats[k] - before[k]) / args.steps:g}" for k in before))
        lines.append("fast path per step: " + ", ".join(
            f"{k} {(d.fastpath.counts[k] - fast_before[k]) / args.steps:g}" for k in fast_before))
        lines += ["", "| torch function | calls / step | us / step |", "|---|---:|---:|"]
        lines += [f"| {name} | {n:g} | {us:.0f} |" for name, n, us in _per_function(step, args.steps)[:25]]
        sync()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            step()
        sync()
        profiler.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(30)
        lines += ["", f"cProfile of {args.steps} steps by {order}:", text.getvalue()]
    if rank == 0:
        report = "\n".join(lines)
        print(report, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "probe_decode_host.txt"), "w") as handle:
                handle.write(report + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
