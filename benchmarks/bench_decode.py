"""Decode steps of a Llama layer stack at batch 1..64, TP = W: ms per token of axedist (eager and
CUDA graphs) and of torch's parallelize_module (eager and CUDA graphs); and the row-parallel
GEMMs of the stack alone: fused GEMM + all-reduce vs cuBLAS + NCCL / + axedist's p2p all-reduce.

    torchrun --nproc_per_node=4 benchmarks/bench_decode.py --out benchmarks/results
    torchrun --nproc_per_node=1 benchmarks/bench_decode.py --out benchmarks/results   # one GPU

A decode step runs the stack on one new position of each of B sequences (h [1, B, dim], no KV
cache: the attention sees that position only), so every row-parallel linear (wo, w2) ends in an
all-reduce of B rows, which is latency, not bandwidth. Per batch size, ms per step (median of
--reps steps, axedist's and torch's steps interleaved; max over ranks):
  axedist_eager / axedist_graph   the stack parallelized with axedist's llama_tp_plan (no sequence
                                  parallelism), run eagerly / captured once and replayed; each
                                  layer's all-reduce + residual add + RMSNorm fused into one kernel
                                  (defer_tails("auto"); --no-fused-tail: unfused)
  torch_eager / torch_graph       the same stack with torch's ColwiseParallel / RowwiseParallel
Layer-tail rows (device time, W > 1): per batch, h = residual + all_reduce(x), y = rms_norm(h) on
[B, dim]: seq_nccl (NCCL all-reduce, add, rms_norm), seq_p2p (p2p all-reduce, add, rms_norm) and
fused (collectives/layer_tail.py: one kernel).
GEMM rows (device time): per batch and row-parallel shape [B, K/W] @ [K/W, dim]:
  cublas, seq_nccl (cuBLAS + NCCL all-reduce), seq_p2p (cuBLAS + p2p all-reduce), fused
  (axedist.gemm_all_reduce, p2p), and at W = 1 the fused kernel's GEMM half (one virtual rank).
--profile: the kernels of 20 CUDA-graph steps per side at the first batch size (names, launches and
device us per step). Writes decode_w{W}.json / .md / .png and a history line; --tables-from writes
axedist/kernels/gemm_ar_auto.json (the shapes where the fused kernel lost).
Multicast stays off: this script refuses to run with AXEDIST_ENABLE_MULTICAST=1 set.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import axedist as ax
from axedist.collectives import p2p, plan_gemm_all_reduce
from axedist.collectives.layer_tail import all_reduce_rms_norm
from axedist.runtime.tails import defer_tails
from axedist.collectives.timing import time_interleaved
from axedist.nn import parallelize, to_inference
from axedist.nn.llama import LlamaConfig, TransformerBlock, llama_tp_plan, rope_tables
from axedist.testing import VirtualRanks, capture

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py, beside this script
from history import append_history, require_multicast_off, run_meta, table_source  # noqa: E402


class LayerStack(nn.Module):
    """The transformer blocks of a Llama (no embedding, no output head): h [S, B, dim] -> same."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = h.shape[0]
        for layer in self.layers:
            h = layer(h, self.rope_cos[:s], self.rope_sin[:s])
        return h


def torch_parallel(stack: LayerStack, cfg, world: int, torch_mesh) -> LayerStack:
    """The stack as torch's tensor parallelism runs it: ColwiseParallel / RowwiseParallel with
    local outputs between the layers, and each attention's head counts made per rank (as
    torchtitan does; torch's plain tensors cannot view the local [.., heads / W * d] as the
    global head count)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {}
    for i in range(cfg.n_layers):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(stack, torch_mesh, plan)
    for layer in stack.layers:
        layer.attention.n_heads //= world
        layer.attention.kv_heads //= world
    return stack


def kernel_profile(replay, steps: int) -> list[dict]:
    """The kernels of `steps` replays of a CUDA graph under torch.profiler (per_step_kernels of
    them). The replays queue behind a 20 ms sleep kernel begun after a barrier, so that the ranks
    start them together (the barrier and the sleep are left out)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dist.barrier()
        torch.cuda._sleep(40_000_000)  # cycles: about 20 ms
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    events = [event for event in prof.events() if event.device_type == DeviceType.CUDA]
    replays_start = max((event.time_range.end for event in events if "spin_kernel" in event.name), default=0)
    return per_step_kernels([(event.name, event.device_time) for event in events
                             if event.time_range.start >= replays_start], steps)


def per_step_kernels(launches, steps: int) -> list[dict]:
    """Per kernel name of ``launches`` ((name, device us) of `steps` replays): launches per step
    and device us per step as the **median** launch's time x launches per step, largest first.
    The median, not the sum: a collective that waits for a rank the profiler delayed takes tens
    of us in a few launches (the ranks drift apart at the profile's start), which a sum would
    charge to the kernel.

    >>> per_step_kernels([("tail", 8.0), ("tail", 60.0), ("tail", 8.0), ("gemm", 17.0)], 1)
    [{'name': 'tail', 'count': 3.0, 'us': 24.0}, {'name': 'gemm', 'count': 1.0, 'us': 17.0}]
    """
    durations: dict[str, list[float]] = {}
    for name, us in launches:
        durations.setdefault(name, []).append(us)
    rows = [dict(name=name, count=len(times) / steps, us=statistics.median(times) * len(times) / steps)
            for name, times in durations.items()]
    return sorted(rows, key=lambda row: -row["us"])


def _local(x):
    return x.to_local() if hasattr(x, "to_local") else x


def stack_rows(args, cfg, world, rank, mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    torch.manual_seed(0)  # the same weights on every rank
    base = LayerStack(cfg).to(device="cuda", dtype=torch.bfloat16)
    base.eval()
    ours = copy.deepcopy(base)
    parallelize(ours, mesh, {k: v for k, v in llama_tp_plan(cfg, sequence_parallel=False).items()
                             if k.startswith("layers.")}, src_rank=None)
    to_inference(ours)
    theirs = torch_parallel(copy.deepcopy(base), cfg, world, init_device_mesh("cuda", (world,)))
    rows, profiles = [], {}
    for batch in args.batches:
        torch.manual_seed(10 + batch)
        h = torch.randn(1, batch, cfg.dim, device="cuda", dtype=torch.bfloat16)
        row = dict(batch=batch, world=world)
        with torch.inference_mode():
            reference = base(h)
            ours_in = ax.DTensor.from_local(h, mesh, [Replicate()])
            theirs_in = h                                  # torch's TP takes the local tensor
            eager, graphs = {}, {}
            for name, model, x in (("axedist", ours, ours_in), ("torch", theirs, theirs_in)):
                out = _local(model(x))
                row[f"{name}_rel_err"] = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                eager[name] = (lambda m, i: lambda: m(i))(model, x)
                try:
                    graph, graph_out = capture(lambda: model(x))  # two warm-ups on a side stream, then captured
                    replay = graph.replay
                    replay()
                    torch.cuda.synchronize()
                    got = _local(graph_out)
                    row[f"{name}_graph_rel_err"] = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
                    graphs[name] = replay
                except Exception as error:  # say why in the table, keep the run going
                    row[f"{name}_graph"] = None
                    row[f"{name}_graph_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    torch.cuda.synchronize()
            # the sides' steps interleaved, events around each, the slowest rank's median
            row.update({f"{name}_eager": ms for name, ms in time_interleaved(eager, args.reps).items()})
            for name, step in eager.items():  # a call after the timed ones: the cached routes' result
                out = _local(step())
                row[f"{name}_cached_rel_err"] = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            row.update({f"{name}_graph": ms for name, ms in time_interleaved(graphs, args.reps).items()})
            if args.profile and batch == args.batches[0] and len(graphs) == 2:
                profiles.update(batch=batch, steps=20)
                profiles.update({name: kernel_profile(replay, 20) for name, replay in graphs.items()})
        rows.append(row)
        if rank == 0:
            print(f"B={batch}: axedist eager {row['axedist_eager']:.3f} graph {row['axedist_graph']} | torch "
                  f"eager {row['torch_eager']:.3f} graph {row['torch_graph']} ms/step | errors "
                  f"{row['axedist_rel_err']:.1e} {row['torch_rel_err']:.1e} (cached calls: "
                  f"{row['axedist_cached_rel_err']:.1e} {row['torch_cached_rel_err']:.1e})"
                  + "".join(f" | {k}: {v}" for k, v in row.items() if k.endswith("_error")), flush=True)
    return rows, (profiles if "torch" in profiles and "axedist" in profiles else None)


def gemm_rows(args, cfg, world, rank):
    """The stack's row-parallel GEMMs alone at each batch size: fused vs the unfused pairs."""
    one_rank = VirtualRanks(1, data_bytes=256 << 20) if world == 1 else None
    rows = []
    for batch in args.batches:
        for name, k_full in (("wo", cfg.dim), ("w2", cfg.ffn_hidden)):
            k, n = k_full // world, cfg.dim
            a = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
            b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
            product = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
            reduced = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
            fused_out = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
            columns = {"cublas": lambda: torch.mm(a, b, out=product)}
            if world > 1:
                columns["seq_nccl"] = lambda: dist.all_reduce(torch.mm(a, b, out=product))
                columns["seq_p2p"] = lambda: p2p.all_reduce(torch.mm(a, b, out=product), out=reduced)
                columns["fused"] = lambda: ax.gemm_all_reduce(a, b, backend="p2p", out=fused_out)
            else:
                columns["kernel_w1"] = lambda: one_rank.gemm_all_reduce([a], [b], [fused_out])
            times = time_interleaved(columns, args.reps, queued=True)
            check = fused_out.fill_(float("nan"))
            (columns.get("fused") or columns["kernel_w1"])()
            torch.mm(a, b, out=product)
            if world > 1:
                dist.all_reduce(product)
            torch.cuda.synchronize()
            row = dict(batch=batch, name=name, M=batch, N=n, K_local=k, world=world, queued=times,
                       rel_err=((check.float() - product.float()).norm() / product.float().norm()).item())
            if world > 1:
                row["plan"] = str(plan_gemm_all_reduce(a, b))
                row["speedup_vs_seq"] = times["seq_nccl"] / times["fused"]
            rows.append(row)
            if rank == 0:
                print(f"  GEMM {name} [{batch}x{k}]@[{k}x{n}]: " + " ".join(f"{c} {t:.4f}" for c, t in times.items())
                      + f" ms, err {row['rel_err']:.1e}", flush=True)
    return rows


def tail_rows(args, cfg, world, rank):
    """The layer tail alone at each batch size: the fused kernel vs the unfused sequences."""
    rows = []
    if world == 1:
        return rows
    hidden, eps = cfg.dim, cfg.norm_eps
    for batch in args.batches:
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        reduced = torch.empty_like(x)

        def seq(all_reduce):
            h = residual + all_reduce(x)
            return h, torch.nn.functional.rms_norm(h, (hidden,), weight, eps)

        columns = {"seq_nccl": lambda: seq(lambda t: (reduced.copy_(t), dist.all_reduce(reduced))[0]),
                   "seq_p2p": lambda: seq(lambda t: p2p.all_reduce(t, out=reduced)),
                   "fused": lambda: all_reduce_rms_norm(x, residual, weight, eps, backend="p2p")}
        times = time_interleaved(columns, args.reps, queued=True)
        h, y = columns["fused"]()
        h_ref, y_ref = columns["seq_nccl"]()
        torch.cuda.synchronize()
        row = dict(batch=batch, hidden=hidden, world=world, queued=times,
                   rel_err=max(((a.float() - b.float()).norm() / b.float().norm()).item()
                               for a, b in ((h, h_ref), (y, y_ref))),
                   speedup_vs_seq_p2p=times["seq_p2p"] / times["fused"],
                   speedup_vs_seq_nccl=times["seq_nccl"] / times["fused"])
        rows.append(row)
        if rank == 0:
            print(f"  tail [{batch}x{hidden}]: " + " ".join(f"{c} {t:.4f}" for c, t in times.items())
                  + f" ms, err {row['rel_err']:.1e}", flush=True)
    return rows


def write_outputs(stack, gemms, world, cfg, out_dir, tails=(), profiles=None):
    os.makedirs(out_dir, exist_ok=True)
    meta = run_meta(world, f"torchrun --nproc_per_node={world} benchmarks/bench_decode.py " + " ".join(sys.argv[1:]),
                    config=dict(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                ffn_hidden=cfg.ffn_hidden, dtype="bf16", decode_tails=defer_tails()))
    name = f"decode_w{world}"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as handle:
        json.dump(dict(meta=meta, stack=stack, gemms=gemms, tails=list(tails), profiles=profiles), handle, indent=1)
    append_history(out_dir, name, meta, dict(stack=stack, gemms=gemms, tails=list(tails)))

    def cell(value):
        return f"{value:.3f}" if isinstance(value, float) else "failed"
    lines = [f"# Decode steps, TP = {world} ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
             f"command: `{meta['command']}`; stack {meta['config']}", "",
             "## ms per decode step (one position of each of B sequences through the stack)", "",
             "| B | axedist eager | axedist CUDA graph | torch eager | torch CUDA graph | rel err axedist / torch "
             "(first call; a cached one) |",
             "|---|---|---|---|---|---|"]
    for r in stack:
        cached = (f"; {r['axedist_cached_rel_err']:.1e} / {r['torch_cached_rel_err']:.1e}"
                  if "axedist_cached_rel_err" in r else "")
        lines.append(f"| {r['batch']} | {cell(r['axedist_eager'])} | {cell(r['axedist_graph'])} | "
                     f"{cell(r['torch_eager'])} | {cell(r['torch_graph'])} | "
                     f"{r['axedist_rel_err']:.1e} / {r['torch_rel_err']:.1e}{cached} |")
    errors = [f"- B={r['batch']} {k}: {v}" for r in stack for k, v in r.items() if k.endswith("_error")]
    lines += ([""] + errors if errors else []) + ["", "## Row-parallel GEMMs alone, device time (ms)", ""]
    columns = list(gemms[0]["queued"]) if gemms else []
    lines += ["| GEMM | B | K/W | N | " + " | ".join(columns) + " | rel err |",
              "|" + "---|" * (len(columns) + 5)]
    for r in gemms:
        lines.append(f"| {r['name']} | {r['M']} | {r['K_local']} | {r['N']} | "
                     + " | ".join(f"{r['queued'][c]:.4f}" for c in columns) + f" | {r['rel_err']:.1e} |")
    if tails:
        lines += ["", "## Layer tail alone (all-reduce + residual add + RMSNorm), device time (ms)", "",
                  "| B | hidden | seq_nccl | seq_p2p | fused | fused vs seq_p2p | rel err |", "|---|---|---|---|---|---|---|"]
        for r in tails:
            q = r["queued"]
            lines.append(f"| {r['batch']} | {r['hidden']} | {q['seq_nccl']:.4f} | {q['seq_p2p']:.4f} | {q['fused']:.4f} "
                         f"| {r['speedup_vs_seq_p2p']:.2f}x | {r['rel_err']:.1e} |")
    if profiles:
        lines += ["", f"## Where a CUDA-graph step's device time goes (B = {profiles['batch']}, rank 0, "
                      f"{profiles['steps']} replays)", "",
                  "Kernels per step and device us per step (the median launch's time x launches per step); "
                  "the step's time is in the first table.", ""]
        for side in ("axedist", "torch"):
            kernels = profiles[side]
            total = sum(k["us"] for k in kernels)
            lines += [f"**{side}**: {sum(k['count'] for k in kernels):.0f} kernels, {total:.1f} us of kernel time "
                      "per step", "", "| kernel | per step | us per step |", "|---|---|---|"]
            lines += [f"| `{k['name'][:90]}` | {k['count']:.0f} | {k['us']:.1f} |" for k in kernels[:14]]
            lines.append("")
    with open(os.path.join(out_dir, f"{name}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for column in ("axedist_eager", "axedist_graph", "torch_eager", "torch_graph"):
            points = [(r["batch"], r[column]) for r in stack if isinstance(r.get(column), float)]
            if points:
                axis.plot(*zip(*points), marker="o", label=column)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch (sequences decoded at once)")
        axis.set_ylabel("ms per decode step")
        axis.set_title(f"Llama layer stack decode, TP={world} ({meta['machine']})", fontsize=9)
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG")


def auto_table(results: list[dict]) -> dict:
    loses, sources = [], []
    for result in results:
        meta = result["meta"]
        sources.append(table_source(meta))
        for row in result["gemms"]:
            if row["world"] > 1 and row["speedup_vs_seq"] < 1.0:
                loses.append([row["M"], row["N"], row["K_local"], row["world"]])
    return dict(source=sources, fused_loses=sorted(loses))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--skip-stack", action="store_true", help="only the GEMM rows")
    parser.add_argument("--profile", action="store_true",
                        help="profile 20 CUDA-graph steps of each side at the first batch size (kernels per step)")
    parser.add_argument("--no-fused-tail", action="store_true",
                        help="the stack without deferred decode tails (defer_tails('never'))")
    parser.add_argument("--tables-from", nargs="+", default=None, metavar="RESULTS_JSON",
                        help="no benchmark: write axedist/kernels/gemm_ar_auto.json from these result files")
    args = parser.parse_args()
    if args.tables_from:
        from axedist.collectives.fused_tp import AR_AUTO_TABLE_PATH
        with open(AR_AUTO_TABLE_PATH, "w") as handle:
            json.dump(auto_table([json.load(open(path)) for path in args.tables_from]), handle, indent=1)
        return
    require_multicast_off()
    # the layers' all-reduce + residual add + RMSNorm as one kernel (the default), or not
    defer_tails("never" if args.no_fused_tail else "auto")
    started = time.time()
    mesh = ax.init_mesh(device_type="cuda")
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_hidden=args.ffn, max_seq_len=16)
    stack, profiles = ([], None) if args.skip_stack else stack_rows(args, cfg, world, rank, mesh)
    gemms = gemm_rows(args, cfg, world, rank)
    tails = tail_rows(args, cfg, world, rank)
    if rank == 0:
        write_outputs(stack, gemms, world, cfg, args.out, tails, profiles)
        print(f"done in {time.time() - started:.0f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
