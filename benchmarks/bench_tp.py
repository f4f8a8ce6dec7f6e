"""Training-step time: the axedist-parallelized Llama vs the same model under torch's TP.

    torchrun --nproc-per-node 4 benchmarks/bench_tp.py                            # CPU, gloo
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --cuda --out benchmarks/results   # 4 GPUs, NCCL, bf16
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --cuda --compile   # + both sides torch.compile'd

Both sides build the same ``Llama`` from the same seed and train on the same batches with
AdamW: axedist with ``parallelize(model, mesh, llama_tp_plan(cfg))`` (axedist DTensors, fused
GEMM + reduce-scatter on CUDA), torch with ``parallelize_module`` and the equal plan of torch
styles (torch DTensors, ``loss_parallel``). Both use sequence parallelism unless
``--no-sequence-parallel``. A step is forward + backward + optimizer step; the time of a step
is the slowest rank's; the table gives the median of ``--steps`` steps after ``--warmup``. The
first losses of both sides are printed side by side (they must agree: same model, same data).
With ``--compile`` (backend Inductor by default) the same models also run with every
transformer block ``torch.compile``'d: axedist's (whole graphs: functional collectives, its
fused kernels as custom ops), torch's, and on CUDA torch's with its async-TP pass
(``torch._inductor.config._micro_pipeline_tp``: its fused all-gather / reduce-scatter matmuls).
Compilation happens in the warm-up steps. Writes ``bench_tp_<device>_w<W>[_compiled].json``
and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import statistics
import subprocess

from axedist.env import keep_multicast_off

keep_multicast_off()  # before torch: NCCL and symmetric memory read the switches when they start

import torch
import torch.distributed as dist

import axedist as ax
from axedist.nn import parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.testing import torch_llama_loss, torch_parallelize_llama

from history import timed_step  # benchmarks/history.py, beside this script


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def torch_parallelize(model: Llama, mesh: ax.DeviceMesh, sequence_parallel: bool) -> Llama:
    return torch_parallelize_llama(model, mesh.to_torch(), sequence_parallel)


def compile_blocks(model: Llama, backend: str, fullgraph: bool) -> Llama:
    for block in model.layers:
        block.compile(backend=backend, fullgraph=fullgraph)
    return model


def async_tp(mesh: ax.DeviceMesh):
    """torch's async TP for the next compiles: its micro-pipeline pass on, symmetric memory on the group."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mesh.to_torch().get_group().group_name)
    return torch._inductor.config.patch(_micro_pipeline_tp=True)


def batches(n: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def run(kind: str, model: Llama, mesh: ax.DeviceMesh, data, warmup: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    cuda = mesh.device_type == "cuda"
    times, losses = [], []
    for i, tokens in enumerate(data):
        tokens = tokens.to(mesh.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        def step():
            logits = model(inputs)
            if kind == "axedist":
                loss = next_token_loss(logits, replicate(targets, mesh))
                loss.backward()
            else:
                loss = torch_llama_loss(logits, targets, mesh.to_torch())  # backward inside loss_parallel
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        loss, ms = timed_step(step, mesh.device, cuda)
        losses.append(float(loss.detach().full_tensor().float()))
        if i >= warmup:
            times.append(ms)
    return statistics.median(times), losses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=None, help="default: 8 CPU, 8 CUDA")
    p.add_argument("--seq", type=int, default=None, help="default: 64 CPU, 1024 CUDA")
    p.add_argument("--dim", type=int, default=None, help="default: 128 CPU, 2048 CUDA")
    p.add_argument("--layers", type=int, default=None, help="default: 2 CPU, 4 CUDA")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--out", default="runs/bench_tp")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time both sides with each block torch.compile'd (default backend inductor)")
    args = p.parse_args(argv)

    mesh = ax.init_mesh(device_type="cuda" if args.cuda else "cpu")
    cuda, world = args.cuda, mesh.size
    if not cuda:
        torch.set_num_threads(1)
    pick = lambda v, cpu, gpu: v if v is not None else (gpu if cuda else cpu)  # noqa: E731
    dim = pick(args.dim, 128, 2048)
    cfg = LlamaConfig(vocab_size=pick(None, 512, 8192), dim=dim, n_layers=pick(args.layers, 2, 4),
                      n_heads=pick(None, 8, 16), ffn_hidden=pick(None, 4 * dim, 4 * dim),
                      max_seq_len=pick(args.seq, 64, 1024))
    batch = pick(args.batch, 8, 8)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    base = Llama(cfg).to(device=mesh.device, dtype=dtype)
    data = batches(args.warmup + args.steps, batch, cfg.max_seq_len, cfg.vocab_size)
    say(f"{world} ranks on {mesh.device_type}, {dtype}, batch {batch} x seq {cfg.max_seq_len}, {cfg}")

    def ours():
        return parallelize(copy.deepcopy(base), mesh, llama_tp_plan(cfg, sequence_parallel=args.sequence_parallel))

    def theirs():
        return torch_parallelize(copy.deepcopy(base), mesh, args.sequence_parallel)

    variants = [("axedist", ours, None), ("torch", theirs, None)]
    if args.compile:
        backend = args.compile
        variants += [("axedist compiled", lambda: compile_blocks(ours(), backend, True), None),
                     ("torch compiled", lambda: compile_blocks(theirs(), backend, False), None)]
        if cuda and backend == "inductor":
            variants.append(("torch compiled async-TP", lambda: compile_blocks(theirs(), backend, False), async_tp))
    results = {}
    for kind, make, context in variants:
        torch._dynamo.reset()  # each variant compiles its own graphs
        with context(mesh) if context else contextlib.nullcontext():
            median, losses = run(kind.split()[0], make(), mesh, data, args.warmup)
        results[kind] = {"median_ms": median, "losses": losses}
        say(f"{kind:24s} median step {median:9.2f} ms   first losses {[round(v, 4) for v in losses[:3]]}")
    ratio = results["torch"]["median_ms"] / results["axedist"]["median_ms"]
    say(f"speed-up of axedist over torch (torch step time / axedist step time): {ratio:.2f}x")
    ratios = {"torch_over_axedist": ratio}
    for kind in ("torch compiled", "torch compiled async-TP"):
        if kind in results:
            ratios[f"{kind} over axedist compiled"] = results[kind]["median_ms"] / results["axedist compiled"]["median_ms"]
            say(f"speed-up of compiled axedist over {kind}: {ratios[kind + ' over axedist compiled']:.2f}x")

    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        # a device call runs a tree without git history: the caller names the commit
        commit = os.environ.get("AXEDIST_COMMIT", "")
        if not commit:
            try:
                commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
            except OSError:
                commit = ""
        device = torch.cuda.get_device_name() if cuda else "cpu"
        record = {"date": datetime.date.today().isoformat(), "commit": commit, "device": device, "world": world,
                  "dtype": str(dtype), "batch": batch, "seq": cfg.max_seq_len, "config": cfg.__dict__,
                  "sequence_parallel": args.sequence_parallel, "warmup": args.warmup, "steps": args.steps,
                  "command": f"torchrun --nproc-per-node {world} benchmarks/bench_tp.py" + (" --cuda" if cuda else "")
                  + (f" --compile {args.compile}" if args.compile else ""),
                  "results": results, **ratios}
        stem = os.path.join(args.out, f"bench_tp_{'cuda' if cuda else 'cpu'}_w{world}" + ("_compiled" if args.compile else ""))
        with open(stem + ".json", "w") as f:
            json.dump(record, f, indent=1)
        meta = dict(record, machine=f"{world}x {device}", command=record["command"])
        from history import append_history  # benchmarks/history.py, beside this script
        append_history(args.out, os.path.basename(stem), meta, dict(results=results, **ratios))
        names = {"axedist": "axedist", "torch": "torch parallelize_module"}
        rows = "".join(f"| {names.get(kind, kind)} | {r['median_ms']:.2f} | {r['losses'][0]:.4f} |\n"
                       for kind, r in results.items())
        speedups = "".join(f"- {name.replace('_', ' ')}: {value:.2f}x\n" for name, value in ratios.items())
        with open(stem + ".md", "w") as f:
            f.write(f"# TP training step: axedist vs torch parallelize_module\n\n"
                    f"{record['date']}, commit {commit}, {device} x {world}, {dtype}, batch {batch} x seq "
                    f"{cfg.max_seq_len}, dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
                    f"{'TP + SP' if args.sequence_parallel else 'TP'}; median of {args.steps} steps after "
                    f"{args.warmup} warm-up, slowest rank. `{record['command']}`\n\n"
                    f"| implementation | median step (ms) | first loss |\n|---|---|---|\n{rows}\n"
                    f"speed-ups (step time of the other / step time of axedist):\n\n{speedups}")
        say(f"wrote {stem}.json and {stem}.md")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
