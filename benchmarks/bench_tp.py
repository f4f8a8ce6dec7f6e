"""Training-step time: the axedist-parallelized Llama vs the same model under torch's TP.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --steps 3 --warmup 1          # CPU, gloo, small
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --cuda --preset llama8b --compile --profile \\
        --out benchmarks/results                                 # the GPU-bound run of issue 27 (~4 min)

Both sides build the same ``Llama`` from the same seed and train on the same batches with
AdamW: axedist with ``parallelize(model, mesh, llama_tp_plan(cfg))`` (axedist DTensors, fused
GEMM + reduce-scatter on CUDA), torch with ``parallelize_module`` and the equal plan of torch
styles (torch DTensors, ``loss_parallel``). TP + SP unless ``--no-sequence-parallel``; bf16 on
CUDA, fp32 on CPU. A step is forward + backward + optimizer step; its time is the slowest rank's.

Sizes: ``--preset default`` (CUDA: dim 2048, 4 layers, 8 x 1024 tokens, host-bound on H100/H200)
or ``--preset llama8b`` (Llama-3-8B layers: dim 4096, 32 heads, 8 KV heads, FFN 14336; 4 layers,
vocab 16384, 8 x 4096 tokens; GPU-bound; its memory estimate is in ``training_steps.py``);
``--dim/--layers/--seq/--batch/--vocab/--ffn`` override either.

With ``--compile`` (Inductor by default) three more sides run every transformer block
``torch.compile``'d: axedist (whole graphs), torch, and on CUDA torch with its async-TP pass
(``_micro_pipeline_tp``, symmetric memory on the TP group). Each compiled side has its own
backend object, so each compiles under its own settings and keeps its graphs (no
``torch._dynamo.reset()``); a recompile during the timed steps is reported.

Every side is built first, warmed up alone (``--warmup`` steps; compiles happen there), then
timed round-robin, step i of every side before step i + 1 of any (``--steps``, default 20):
median, min - max, p10 - p90, MFU against the card's bf16 peak, peak memory (max over steps and
ranks). Before that an fp32 loss check: every side trains ``--check-steps`` steps of a small
model of the same structure from the same init on the same data; losses must agree with torch
eager's within ``--check-tol`` (relative). ``--profile``: one more step per side under
torch.profiler, its top kernels and device busy time in the results (``--trace``: every rank's
Chrome trace of it under OUT/traces/, summed per category by ``trace_summary.py``). ``--memory``
(CUDA): one more step per side with the allocator's history, what is live at its peak.
``--first-step``: every eager side's first warm-up step under cProfile on rank 0 (where its
seconds go: planning, Triton loading kernels, symmetric-memory rendezvous, NCCL setup).
``--eager-backends p2p torch nccl``: more eager axedist sides with collectives pinned (``axedist
p2p``: the p2p fused kernels; ``axedist torch``: cuBLAS + NCCL, nothing fused; ``axedist nccl``:
the planned collectives on NCCL, the fused calls left to ``auto``), against the ``auto`` choice
of the plain ``axedist`` side, in the same interleaved run.
Writes ``bench_tp_<device>_w<W>[_<preset>].json``, ``.md``, ``.png`` to ``--out`` and a line
to ``history/``.
"""

from __future__ import annotations

import argparse
import copy
import sys

from axedist.env import keep_multicast_off

keep_multicast_off()  # before torch: NCCL and symmetric memory read the switches when they start

import torch
import torch.distributed as dist

import axedist as ax
from axedist.nn import parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.testing import torch_llama_loss, torch_parallelize_llama

# beside this script
from history import run_meta
from training_steps import (FLOPS_FORMULA, PRESETS, GraphCounter, Side, add_diagnosis_arguments, add_pinned_argument,
                            allow_compiled_sides, check_config, describe_estimate, diagnose, goals, markdown_tables,
                            memory_estimate, model_flops, peak_flops, pinned, preset_config, ratio_rows,
                            run_interleaved, run_loss_check, side_stats, warm_libraries, write_results)

DEFAULT_SIZES = {  # --preset default, per device
    "cpu": dict(vocab_size=512, dim=128, n_layers=2, n_heads=8, ffn_hidden=512, max_seq_len=64, batch=8),
    "cuda": dict(vocab_size=8192, dim=2048, n_layers=4, n_heads=16, ffn_hidden=8192, max_seq_len=1024, batch=8),
}
CHECK_BATCH = 4


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def compile_blocks(model: Llama, backend: GraphCounter, fullgraph: bool) -> Llama:
    for block in model.layers:
        block.compile(backend=backend, fullgraph=fullgraph, dynamic=False)
    return model


def enable_async_tp(mesh: ax.DeviceMesh) -> None:
    """Symmetric memory on the TP group, which torch's async-TP pass needs when it compiles."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mesh.to_torch().get_group().group_name)


def trainer(kind: str, model: Llama, mesh: ax.DeviceMesh):
    """``step(tokens) -> loss``: forward, backward, AdamW step of ``model`` on ``tokens`` [B, S + 1]."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step(tokens):
        tokens = tokens.to(mesh.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        if kind == "axedist":
            loss = next_token_loss(logits, replicate(targets, mesh))
            loss.backward()
        else:
            loss = torch_llama_loss(logits, targets, mesh.to_torch())  # backward inside loss_parallel
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def make_sides(base: Llama, mesh: ax.DeviceMesh, sequence_parallel: bool, compile_backend: str | None,
               backends: tuple = ()) -> list[Side]:
    """The sides of a run, each training its own deep copy of ``base``: axedist, torch, and with
    ``compile_backend`` their compiled blocks (plus torch's async-TP pass with Inductor on CUDA);
    per name in ``backends``, axedist eager with collectives pinned to that backend
    (``training_steps.pinned``)."""
    cfg = base.cfg

    def ours():
        return parallelize(copy.deepcopy(base), mesh, llama_tp_plan(cfg, sequence_parallel=sequence_parallel))

    def theirs():
        return torch_parallelize_llama(copy.deepcopy(base), mesh.to_torch(), sequence_parallel)

    def compiled(kind, build, counter, fullgraph, before=None):
        def make():
            if before:
                before(mesh)
            return trainer(kind, compile_blocks(build(), counter, fullgraph), mesh)
        return Side(f"{kind} compiled" + (" async-TP" if counter.config_patches else ""), make, counter)

    sides = [Side("axedist", lambda: trainer("axedist", ours(), mesh)),
             Side("torch", lambda: trainer("torch", theirs(), mesh))]
    sides += [Side(f"axedist {b}", lambda b=b: pinned(b, trainer("axedist", ours(), mesh))) for b in backends]
    if compile_backend:
        allow_compiled_sides()
        sides += [compiled("axedist", ours, GraphCounter(compile_backend), fullgraph=True),
                  compiled("torch", theirs, GraphCounter(compile_backend), fullgraph=False)]
        if mesh.device_type == "cuda" and compile_backend == "inductor":
            sides.append(compiled("torch", theirs, GraphCounter("inductor", {"_micro_pipeline_tp": True}),
                                  fullgraph=False, before=enable_async_tp))
    return sides


def batches(n: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def base_model(cfg: LlamaConfig, mesh: ax.DeviceMesh, dtype) -> Llama:
    torch.manual_seed(0)
    with torch.device(mesh.device):  # initialised where it runs: 1e9 parameters initialise slowly on a CPU
        return Llama(cfg).to(dtype=dtype)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--preset", choices=PRESETS, default="default")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first, alone (compiles here)")
    for name in ("batch", "seq", "dim", "layers", "vocab", "ffn"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset's")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--out", default="runs/bench_tp")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time every side with each block torch.compile'd (default backend inductor)")
    add_diagnosis_arguments(p)
    add_pinned_argument(p)
    p.add_argument("--check-steps", type=int, default=3, help="steps of the fp32 loss check (0: none)")
    p.add_argument("--check-tol", type=float, default=1e-4, help="relative tolerance of the fp32 loss check")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's bf16 peak, if not in the table")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    cuda = args.cuda
    mesh = ax.init_mesh(device_type="cuda" if cuda else "cpu")
    world = mesh.size()
    if not cuda:
        torch.set_num_threads(1)
    cfg, batch = preset_config(args.preset, DEFAULT_SIZES["cuda" if cuda else "cpu"],
                               {k: getattr(args, k) for k in ("batch", "seq", "dim", "layers", "vocab", "ffn")})
    dtype = torch.bfloat16 if cuda else torch.float32
    device = torch.cuda.get_device_name() if cuda else "cpu"
    flops = model_flops(cfg, batch, cfg.max_seq_len)
    peak = peak_flops(device, args.peak_tflops) if cuda else None
    n_sides = 2 + len(args.eager_backends) + (0 if not args.compile else 3 if args.compile == "inductor" else 2)
    estimate = memory_estimate(cfg, batch, world, sides=n_sides) if cuda else None
    say(f"{world} ranks on {device}, {dtype}, preset {args.preset}: batch {batch} x seq {cfg.max_seq_len}, {cfg}")
    say(f"model FLOPs per step {flops:.3e}" + (f", {flops / world / peak * 1e3:.1f} ms per GPU at peak" if peak else ""))
    if estimate:
        say(describe_estimate(estimate))

    check = None
    if args.check_steps:
        small = check_config(cfg, world)
        say(f"fp32 loss check: {args.check_steps} steps of every side, {small}, batch {CHECK_BATCH}")
        check = run_loss_check(make_sides(base_model(small, mesh, torch.float32), mesh, args.sequence_parallel,
                                          args.compile, tuple(args.eager_backends)),
                               batches(args.check_steps, CHECK_BATCH, small.max_seq_len, small.vocab_size),
                               args.check_steps, cuda, args.check_tol, "torch", say)
        check.update(steps=args.check_steps, config=str(small), batch=CHECK_BATCH)

    sides = make_sides(base_model(cfg, mesh, dtype), mesh, args.sequence_parallel, args.compile,
                       tuple(args.eager_backends))
    data = batches(args.warmup + args.steps + 1, batch, cfg.max_seq_len, cfg.vocab_size)
    say(f"sides: {', '.join(s.name for s in sides)}; {args.warmup} warm-up steps each, then {args.steps} "
        "interleaved timed steps")
    failed = {}
    warmed = warm_libraries(cfg, world, batch, mesh.device, dtype, say)
    sides, order = run_interleaved(sides, data, args.warmup, args.steps, cuda, say, failed,
                                   first_step_profile=args.first_step)
    profile, memory = diagnose(args, sides, data[-1], cuda, say)

    stats = {s.name: side_stats(s, flops, world, peak) for s in sides}
    ratio_rows(stats, lambda name: "axedist compiled" if "compiled" in name else "axedist")
    for name, s in stats.items():
        say(f"{name:24s} median {s['median_ms']:9.2f} ms  [{s['min_ms']:.2f} - {s['max_ms']:.2f}]  host "
            f"{s['host_median_ms']:.1f} ms  MFU "
            + (f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a") + "  peak "
            + (f"{s['peak_bytes'] / 2**30:.2f} GiB" if s["peak_bytes"] is not None else "n/a")
            + f"  losses first {s['losses'][0]:.4f} last {s['losses'][-1]:.4f}")
    met = goals(stats)
    for g in met:
        say(f"goal {g['goal']}: {g['value']:.2f} (target {g['target']}) {'met' if g['met'] else 'NOT met'}")

    if dist.get_rank() == 0:
        command = f"torchrun --nproc-per-node {world} benchmarks/bench_tp.py " + " ".join(argv)
        meta = run_meta(world, command, device=device)
        record = {"meta": meta, **{k: meta[k] for k in ("date", "commit", "machine", "command")},
                  "preset": args.preset, "dtype": str(dtype), "world": world, "batch": batch, "seq": cfg.max_seq_len,
                  "config": cfg.__dict__, "sequence_parallel": args.sequence_parallel, "warmup": args.warmup,
                  "steps": args.steps, "compile": args.compile, "model_flops_per_step": flops,
                  "flops_formula": FLOPS_FORMULA, "peak_flops_per_gpu": peak, "memory_estimate": estimate,
                  "order": order, "library_warmup_s": warmed, "sides": stats, "failed": failed, "goals": met,
                  "loss_check": check, "profile": profile,
                  "memory": memory}
        stem = f"bench_tp_{'cuda' if cuda else 'cpu'}_w{world}" + ("" if args.preset == "default" else f"_{args.preset}")
        title = (f"TP={world} training step, {device}, dim {cfg.dim}, {cfg.n_layers} layers, "
                 f"{batch} x {cfg.max_seq_len} tokens, {'TP + SP' if args.sequence_parallel else 'TP'}")
        header = (f"# TP training step: axedist vs torch parallelize_module\n\n{meta['date']}, commit "
                  f"{meta['commit']}, {meta['machine']}, torch {meta['torch']}, {dtype}, preset {args.preset}: batch "
                  f"{batch} x seq {cfg.max_seq_len}, dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
                  f"{cfg.kv_heads} KV heads, FFN {cfg.ffn_hidden}, vocab {cfg.vocab_size}, "
                  f"{'TP + SP' if args.sequence_parallel else 'TP'}, AdamW. Every side built, warmed up alone "
                  f"({args.warmup} steps), then {args.steps} steps interleaved (step i of every side before step "
                  f"i + 1); a step's time is the slowest rank's.\n\n`{command}`\n\n")
        write_results(args.out, stem, record, header + markdown_tables(record), title, say)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
