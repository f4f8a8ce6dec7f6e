"""Context-parallel causal attention (``axedist.nn.context_parallel``), forward + backward, against
one GPU attending the whole sequence.

    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py --out benchmarks/results
    torchrun --nproc_per_node=1 benchmarks/bench_context_parallel.py --out benchmarks/results

Per global sequence length L (bf16, batch 1, 32 query heads, 8 key/value heads, head dim 128), ms
per forward + backward (median of --reps, the two sides interleaved; max over ranks):
  whole   F.scaled_dot_product_attention(is_causal=True) of the whole sequence on each GPU (the
          one-GPU work that context parallelism splits)
  cp        the same attention inside axedist's context_parallel: each rank its L / W positions
            (head-tail order), keys and values gathered over the ranks, gradients reduce-scattered back
  torch_cp  the same inside torch's context_parallel (its default rotate method, all-gather)
Each timed call of the two cp sides opens its context (on a position vector; the pieces are cut
once), so each pays its own entry. speedup = whole / cp (W would be perfect), torch_cp / cp, and
each side's peak memory. Each side's output and gradients of the rank's positions are checked
against the whole sequence's (relative error); a side that raises is recorded, not timed.
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
from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py, beside this script
from history import append_history, require_multicast_off, run_meta  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def measure(length: int, mesh, torch_mesh, reps: int) -> dict:
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
    # the pieces cut once (the same as torch's cut: tests/test_context_parallel.py); each timed call
    # opens its side's context on a position vector, so both sides pay their own context's entry
    pieces = [t[:, :, here].contiguous() for t in (q, k, v, g)]
    positions = torch.arange(length, device="cuda")
    sides = {"cp": (context_parallel, mesh), "torch_cp": (torch_context_parallel, torch_mesh)}
    leaves = {name: [t.clone().requires_grad_() for t in pieces[:3]] for name in sides}

    def side(name):
        enter, on = sides[name]

        def call():
            for t in leaves[name]:
                t.grad = None
            with enter(on, buffers=[positions.clone()], buffer_seq_dims=[0]):
                out = F.scaled_dot_product_attention(*leaves[name], is_causal=True, enable_gqa=True)
                out.backward(pieces[3])
            return out
        return call

    fns, errors, peaks = {"whole": run_whole}, {}, {}
    for name in sides:
        try:
            out = side(name)()
        except Exception as error:  # torch's side may not run this case: recorded, not timed
            errors[name] = f"{type(error).__name__}: {str(error)[:200]}"
            continue
        fns[name] = side(name)
        errors[name] = dict(out=rel_err(out, reference[:, :, here]),
                            **{f"grad_{n}": rel_err(t.grad, grad[:, :, here])
                               for n, t, grad in zip("qkv", leaves[name], grads)})
    for name, fn in fns.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() / 2**20
    times = time_interleaved(fns, reps=reps)
    if rank == 0:
        print(f"L={length}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items())
              + f"; errors {errors}", flush=True)
    return dict(length=length, times=times, speedup=times["whole"] / times["cp"],
                vs_torch=times["torch_cp"] / times["cp"] if "torch_cp" in times else None, peak_mib=peaks,
                rel_err=errors)


def write(out_dir: str, meta: dict, rows: list) -> None:
    world = meta["world"]
    name = f"context_parallel_w{world}"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as handle:
        json.dump(dict(meta=meta, rows=rows), handle, indent=1)
    lines = [f"# Context-parallel causal attention, W = {world} ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
             f"command: `{meta['command']}`; bf16, batch 1, {HEADS} query / {KV_HEADS} kv heads, head dim {HEAD_DIM}",
             "", "ms per forward + backward (median, sides interleaved, max over ranks); peak MiB on rank 0", "",
             "| L | whole sequence, one GPU | axedist context_parallel | torch context_parallel | whole / axedist | "
             "torch / axedist | peak MiB whole / axedist / torch | max rel err axedist / torch |",
             "|---|---|---|---|---|---|---|---|"]

    def worst(errors) -> str:
        return f"{max(errors.values()):.1e}" if isinstance(errors, dict) else str(errors)

    for row in rows:
        t, peak = row["times"], row["peak_mib"]
        theirs = f"{t['torch_cp']:.3f}" if "torch_cp" in t else "did not run"
        ratio = f"{row['vs_torch']:.2f}x" if row["vs_torch"] else "-"
        lines.append(f"| {row['length']} | {t['whole']:.3f} | {t['cp']:.3f} | {theirs} | {row['speedup']:.2f}x | "
                     f"{ratio} | {peak['whole']:.0f} / {peak['cp']:.0f} / {peak.get('torch_cp', float('nan')):.0f} | "
                     f"{worst(row['rel_err']['cp'])} / {worst(row['rel_err'].get('torch_cp', '-'))} |")
    with open(os.path.join(out_dir, f"{name}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax_ = plt.subplots(figsize=(6, 3.5))
    labels = [str(row["length"]) for row in rows]
    x = range(len(rows))
    ax_.bar([i - 0.27 for i in x], [row["times"]["whole"] for row in rows], 0.27, label="whole sequence, one GPU")
    ax_.bar(list(x), [row["times"]["cp"] for row in rows], 0.27, label=f"axedist context_parallel, W={world}")
    ax_.bar([i + 0.27 for i in x], [row["times"].get("torch_cp", 0) for row in rows], 0.27,
            label=f"torch context_parallel, W={world}")
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
    from torch.distributed.device_mesh import init_device_mesh

    torch_mesh = init_device_mesh("cuda", (world,))
    rows = [measure(int(length), mesh, torch_mesh, args.reps) for length in args.lengths.split(",")]
    if dist.get_rank() == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        write(args.out, run_meta(world, "torchrun --nproc_per_node=%d benchmarks/bench_context_parallel.py %s"
                                 % (world, " ".join(sys.argv[1:]))), rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
