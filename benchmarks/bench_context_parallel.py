"""Context-parallel causal attention (``axedist.nn.context_parallel``), forward + backward, against
one GPU attending the whole sequence.

    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py --out benchmarks/results
    torchrun --nproc_per_node=1 benchmarks/bench_context_parallel.py --out benchmarks/results

Per global sequence length L (bf16, batch 1, 32 query heads, 8 key/value heads, head dim 128), ms
per forward + backward (median of --reps, the two sides interleaved; max over ranks):
  whole   F.scaled_dot_product_attention(is_causal=True) of the whole sequence on each GPU (the
          one-GPU work that context parallelism splits)
  cp      the same attention inside context_parallel: each rank its L / W positions (head-tail
          order), keys and values gathered over the ranks, gradients reduce-scattered back
speedup = whole / cp (W would be perfect), and each side's peak memory. The output and the
gradients of the rank's positions are checked against the whole sequence's (relative error).
Writes context_parallel_w{W}.json / .md / .png and a history line. Multicast stays off.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import axedist as ax
from axedist.collectives.timing import time_interleaved
from axedist.nn import SequenceShards, context_parallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py, beside this script
from history import append_history, require_multicast_off, run_meta  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def measure(length: int, mesh, reps: int) -> dict:
    world, rank = mesh.size(), dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(length)
    q, k, v, g = (torch.randn(1, heads, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]

    def run_whole():
        for t in whole:
            t.grad = None
        out = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
        out.backward(g)
        return out

    reference = run_whole()
    grads = [t.grad.clone() for t in whole]
    here = SequenceShards.of(length, world).positions(mesh.position(), "cuda")
    pieces = [t.clone() for t in (q, k, v, g)]
    with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2] * 4, no_restore_buffers=set(pieces)):
        leaves = [t.requires_grad_() for t in pieces[:3]]

        def run_cp():
            for t in leaves:
                t.grad = None
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(pieces[3])
            return out

        out = run_cp()
        errors = dict(out=rel_err(out, reference[:, :, here]),
                      **{f"grad_{name}": rel_err(t.grad, grad[:, :, here])
                         for name, t, grad in zip("qkv", leaves, grads)})
        peaks = {}
        for name, fn in (("whole", run_whole), ("cp", run_cp)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**20
        times = time_interleaved({"whole": run_whole, "cp": run_cp}, reps=reps)
    if rank == 0:
        print(f"L={length}: whole {times['whole']:.3f} ms, cp {times['cp']:.3f} ms "
              f"({times['whole'] / times['cp']:.2f}x on {world}), errors {errors}", flush=True)
    return dict(length=length, times=times, speedup=times["whole"] / times["cp"], peak_mib=peaks, rel_err=errors)


def write(out_dir: str, meta: dict, rows: list) -> None:
    world = meta["world"]
    name = f"context_parallel_w{world}"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as handle:
        json.dump(dict(meta=meta, rows=rows), handle, indent=1)
    lines = [f"# Context-parallel causal attention, W = {world} ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
             f"command: `{meta['command']}`; bf16, batch 1, {HEADS} query / {KV_HEADS} kv heads, head dim {HEAD_DIM}",
             "", "ms per forward + backward (median, sides interleaved, max over ranks); peak MiB on rank 0", "",
             "| L | whole sequence, one GPU | context_parallel | speedup | peak whole | peak cp | max rel err |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['length']} | {row['times']['whole']:.3f} | {row['times']['cp']:.3f} | "
                     f"{row['speedup']:.2f}x | {row['peak_mib']['whole']:.0f} | {row['peak_mib']['cp']:.0f} | "
                     f"{max(row['rel_err'].values()):.1e} |")
    with open(os.path.join(out_dir, f"{name}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax_ = plt.subplots(figsize=(6, 3.5))
    labels = [str(row["length"]) for row in rows]
    x = range(len(rows))
    ax_.bar([i - 0.2 for i in x], [row["times"]["whole"] for row in rows], 0.4, label="whole sequence, one GPU")
    ax_.bar([i + 0.2 for i in x], [row["times"]["cp"] for row in rows], 0.4, label=f"context_parallel, W={world}")
    ax_.set_xticks(list(x), labels)
    ax_.set_xlabel("sequence length")
    ax_.set_ylabel("ms, forward + backward")
    ax_.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=120)
    append_history(out_dir, name, meta, dict(rows=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_multicast_off()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    mesh = ax.DeviceMesh("cuda", (world,))
    rows = [measure(int(length), mesh, args.reps) for length in args.lengths.split(",")]
    if dist.get_rank() == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        write(args.out, run_meta(world, "torchrun --nproc_per_node=%d benchmarks/bench_context_parallel.py %s"
                                 % (world, " ".join(sys.argv[1:]))), rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
