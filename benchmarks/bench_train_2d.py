"""2-D training step: axedist fully_shard x parallelize vs torch's fully_shard x parallelize_module.

    torchrun --nproc-per-node 4 benchmarks/bench_train_2d.py --steps 3 --warmup 1        # CPU, gloo, small
    torchrun --nproc-per-node 4 benchmarks/bench_train_2d.py --cuda --preset llama8b --profile \\
        --out benchmarks/results                                 # the GPU-bound run of issue 27 (~1.5 min)

Both sides build the same ``Llama`` from the same seed on the mesh ``(dp, tp)`` (default
``(2, 2)``): tensor + sequence parallel on ``tp`` (axedist: ``llama_tp_plan``; torch: the equal
plan of torch styles), every block and then the root fully sharded over ``dp``, AdamW, each dp
rank training on its slice of the same batches. On CUDA parameters are fp32 and blocks compute
in bf16 (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on both sides).
A step is forward + backward + optimizer step; its time is the slowest rank's.

Sizes: ``--preset default`` (CUDA: dim 2048, 4 layers, 8 x 1024 tokens over the dp ranks) or
``--preset llama8b`` (Llama-3-8B layers, 4 of them, vocab 16384, 8 x 4096 tokens per dp rank:
``training_steps.py``); ``--dim/--layers/--seq/--batch/--vocab/--ffn`` override either
(``--batch``: sequences per step over all dp ranks).

Both sides are built, warmed up alone, then timed interleaved (step i of both before step
i + 1; ``--steps``, default 20): median, spread, MFU against the card's bf16 peak, peak memory.
Before that an fp32 loss check (a small model of the same structure, fp32 parameters and
compute, ``--check-steps`` steps, losses within ``--check-tol`` of torch's). After it one more
step per side counts the bytes each rank sends (axedist: its routes' ``count_collectives``;
torch: ``CommDebugMode``) and the collective calls, and each side's parameter + gradient +
optimizer bytes per rank (the sharded pieces) and axedist's peak of gathered parameter bytes;
``--profile``: one step per side under torch.profiler. ``--compile [BACKEND]`` (default
Inductor) adds two compiled sides: axedist's model under ``fully_shard(traced=True)`` compiled
whole with ``fullgraph=True`` (one graph: gathers and reduce-scatters inside it), and torch's
``fully_shard`` + ``parallelize_module`` model with each block compiled (torchtitan's way; FSDP2's
hooks run eagerly around the blocks). ``--compile-scope blocks`` compiles axedist's traced model
block by block instead (side ``axedist compiled blocks``: one graph serves every block, so the
first step compiles one block, not the whole model; each block's gathers inside its own graph);
``both`` adds that side beside the whole model's. ``--eager-backends nccl p2p``: more eager
axedist sides with collectives pinned (``nccl``: the planned collectives, FSDP's gathers and
reduce-scatters among them, on NCCL; ``p2p`` / ``symm`` / ``torch``: the fused GEMM calls), in
the same interleaved run.
Writes ``bench_train_2d_<device>_w<W>[_<preset>]`` ``.json``, ``.md``, ``.png`` to ``--out`` and a
line to its history.
"""

from __future__ import annotations

import argparse
import os
import sys

from axedist.env import keep_multicast_off

keep_multicast_off()  # before torch: NCCL and symmetric memory read the switches when they start

import torch
import torch.distributed as dist

import axedist as ax
from axedist.nn import MixedPrecisionPolicy, fsdp_units, fully_shard, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.runtime import count_collectives
from axedist.testing import torch_comm_bytes, torch_fully_shard_llama, torch_llama_loss

# beside this script
from history import run_meta
from training_steps import (FLOPS_FORMULA, PRESETS, GraphCounter, Side, add_diagnosis_arguments, add_pinned_argument,
                            allow_compiled_sides, check_config, describe_estimate, diagnose, goals, markdown_tables,
                            memory_estimate, model_flops, peak_flops, pinned, preset_config, ratio_rows,
                            run_interleaved, run_loss_check, side_stats, warm_libraries, write_results)

DEFAULT_SIZES = {  # --preset default, per device; batch: sequences over all dp ranks
    "cpu": dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_hidden=64 * -(-8 * 128 // 3 // 64),
                max_seq_len=64, batch=8),
    "cuda": dict(vocab_size=8192, dim=2048, n_layers=4, n_heads=16, ffn_hidden=64 * -(-8 * 2048 // 3 // 64),
                 max_seq_len=1024, batch=8),
}
CHECK_BATCH = 4  # per dp rank
COMPILE_SCOPES = ("model", "blocks")  # what axedist's compiled side compiles: the model whole, or each block


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def state_bytes(model, optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (their sharded pieces)."""
    total = 0
    for p in model.parameters():
        for t in [p, p.grad, *optimizer.state.get(p, {}).values()]:
            if isinstance(t, torch.Tensor) and t.dim():
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total


class Trainer:
    """One side's model (built from ``seed``, then parallelized and fully sharded) and AdamW;
    ``trainer(tokens) -> loss`` is a training step on this dp rank's rows of ``tokens`` (its
    collectives pinned to ``pin`` where given: ``training_steps.pinned``)."""

    def __init__(self, kind: str, cfg: LlamaConfig, mesh: ax.DeviceMesh, policy, seed: int,
                 backend: GraphCounter | None = None, pin: str | None = None, scope: str = "model"):
        if scope not in COMPILE_SCOPES:
            raise ValueError(f"compile scope {scope!r}: one of {COMPILE_SCOPES}")
        self.kind, self.mesh, self.compiled = kind, mesh, backend is not None
        if pin is not None:
            self.forward_backward = pinned(pin, self.forward_backward)
        torch.manual_seed(seed)
        with torch.device(mesh.device):  # initialised where it runs: fast for large models
            model = Llama(cfg)
        self.forward = model
        if kind == "axedist":
            parallelize(model, mesh["tp"], llama_tp_plan(cfg, sequence_parallel=True))
            if backend is not None:  # traced FSDP: the gathers are redistributes inside the compiled code
                fully_shard(model, mesh, mp_policy=policy, traced=True)
                if scope == "model":  # one graph: the model whole
                    self.forward = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
                else:  # each block, one backend object: one graph serves every block (as torch's side)
                    for layer in model.layers:
                        layer.compile(backend=backend, fullgraph=True, dynamic=False)
            else:
                for layer in model.layers:
                    fully_shard(layer, mesh, mp_policy=policy)
                fully_shard(model, mesh, mp_policy=policy)
        else:
            torch_fully_shard_llama(model, mesh.to_torch(), policy)
            if backend is not None:  # torchtitan's way: each block compiled, FSDP2's hooks around them
                for layer in model.layers:
                    layer.compile(backend=backend, dynamic=False)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def rows(self, tokens):
        dp, at = self.mesh.size("dp"), self.mesh.coordinates()["dp"]
        per = tokens.shape[0] // dp
        return tokens[at * per:(at + 1) * per].to(self.mesh.device)

    def forward_backward(self, tokens):
        tokens = self.rows(tokens)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = self.forward(inputs)
        if self.kind == "axedist":
            loss = next_token_loss(logits, replicate(targets, self.mesh["tp"]))
            loss.backward()
            return loss
        return torch_llama_loss(logits, targets, self.mesh.to_torch()["tp"])  # backward inside loss_parallel

    def __call__(self, tokens):
        loss = self.forward_backward(tokens)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def loss_value(self, loss) -> float:
        """The step's loss over the whole batch (the mean of the dp ranks' losses)."""
        value = loss.detach().full_tensor().float()
        dist.all_reduce(value, group=self.mesh.group("dp"))
        return float(value) / self.mesh.size("dp")

    def communication(self, tokens) -> dict:
        """One forward + backward counted: bytes this rank sends, collective calls (axedist),
        then the sharded state's bytes and axedist's peak of gathered parameters."""
        if self.kind == "axedist" and not self.compiled:
            with count_collectives() as seen:
                self.forward_backward(tokens)
            sent, calls = seen.bytes_sent, seen.calls
            peak = max(u.schedule.peak_bytes for u in fsdp_units(self.model))
        elif self.compiled:  # the collectives run inside compiled graphs, which neither count sees
            self.forward_backward(tokens)
            sent, calls, peak = None, None, None
        else:
            _, sent = torch_comm_bytes(lambda: self.forward_backward(tokens))
            calls, peak = None, None
        memory = state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return {"bytes_per_step": sent, "calls": calls, "state_bytes": memory, "peak_gathered_bytes": peak}


def _count(value) -> str:
    """A byte count with thousands separators, "-" where none was counted (compiled sides)."""
    return "-" if value is None else f"{value:,}"


def make_sides(cfg: LlamaConfig, mesh: ax.DeviceMesh, policy, seed: int = 0,
               compile_backend: str | None = None, pins: tuple = (), scopes: tuple = ("model",)) -> list[Side]:
    """axedist and torch eager, their compiled sides with ``compile_backend`` (axedist's per
    scope in ``scopes``: ``axedist compiled``, the model whole; ``axedist compiled blocks``), and
    per name in ``pins`` axedist eager with collectives pinned (``training_steps.pinned``)."""
    def side(kind, backend=None, pin=None, scope="model"):
        made = {}

        def make():
            made["trainer"] = Trainer(kind, cfg, mesh, policy, seed, backend, pin, scope)
            return made["trainer"]

        # the loss of the whole batch: the dp ranks' mean (the trainer exists once a step ran)
        name = kind + (" compiled" if backend is not None else f" {pin}" if pin else "") + \
            (" blocks" if scope == "blocks" else "")
        return Side(name, make, backend, loss_value=lambda loss: made["trainer"].loss_value(loss))
    sides = [side("axedist"), side("torch")] + [side("axedist", pin=pin) for pin in pins]
    if compile_backend:
        allow_compiled_sides()
        sides += [side("axedist", GraphCounter(compile_backend), scope=scope) for scope in scopes]
        sides += [side("torch", GraphCounter(compile_backend))]
    return sides


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--preset", choices=PRESETS, default="default")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps per side (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    for name in ("batch", "seq", "dim", "layers", "vocab", "ffn"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset's")
    p.add_argument("--out", default=None, help="write bench_train_2d_<device>_w<W>[_<preset>].json/.md/.png here")
    add_diagnosis_arguments(p)
    p.add_argument("--check-steps", type=int, default=3, help="steps of the fp32 loss check (0: none)")
    p.add_argument("--check-tol", type=float, default=1e-4, help="relative tolerance of the fp32 loss check")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's bf16 peak, if not in the table")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="add the compiled sides (default backend: inductor)")
    p.add_argument("--compile-scope", choices=COMPILE_SCOPES + ("both",), default="model",
                   help="axedist's compiled side: the traced model compiled whole (default; the best "
                        "steady-state step so far), each block (blocks: the first step compiles one block), or both")
    add_pinned_argument(p)
    args = p.parse_args(argv)
    scopes = COMPILE_SCOPES if args.compile_scope == "both" else (args.compile_scope,)
    argv = sys.argv[1:] if argv is None else argv
    cuda = args.cuda
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = world // args.dp
    mesh = ax.init_mesh((args.dp, tp), ("dp", "tp"), device_type="cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    cfg, batch = preset_config(args.preset, DEFAULT_SIZES["cuda" if cuda else "cpu"],
                               {k: getattr(args, k) for k in ("batch", "seq", "dim", "layers", "vocab", "ffn")})
    if args.preset == "llama8b" and args.batch is None:
        batch *= args.dp  # the preset's batch is per TP group, i.e. per dp rank
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
        MixedPrecisionPolicy()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    flops = model_flops(cfg, batch, cfg.max_seq_len)
    peak = peak_flops(device, args.peak_tflops) if cuda else None
    estimate = memory_estimate(cfg, batch // args.dp, tp, shards=args.dp, param_bytes=4, sides=2) if cuda else None
    say(f"mesh {mesh}; preset {args.preset}: {cfg}; batch {batch} x seq {cfg.max_seq_len}; "
        f"{'bf16 compute, fp32 parameters' if cuda else 'fp32'}")
    say(f"model FLOPs per step {flops:.3e}" + (f", {flops / world / peak * 1e3:.1f} ms per GPU at peak" if peak else ""))
    if estimate:
        say(describe_estimate(estimate))

    check = None
    if args.check_steps:
        small = check_config(cfg, tp)
        g = torch.Generator().manual_seed(99)
        check_data = [torch.randint(0, small.vocab_size, (CHECK_BATCH * args.dp, small.max_seq_len + 1), generator=g)
                      for _ in range(args.check_steps)]
        say(f"fp32 loss check: {args.check_steps} steps of both sides, {small}, batch {CHECK_BATCH * args.dp}")
        check = run_loss_check(make_sides(small, mesh, MixedPrecisionPolicy(), compile_backend=args.compile,
                                          pins=tuple(args.eager_backends), scopes=scopes),
                               check_data, args.check_steps, cuda, args.check_tol, "torch", say)
        check.update(steps=args.check_steps, config=str(small), batch=CHECK_BATCH * args.dp)

    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), generator=g)
            for _ in range(args.warmup + args.steps + 1)]
    failed = {}
    warmed = warm_libraries(cfg, tp, batch // args.dp, mesh.device, policy.param_dtype or torch.float32, say)
    sides, order = run_interleaved(make_sides(cfg, mesh, policy, compile_backend=args.compile,
                                              pins=tuple(args.eager_backends), scopes=scopes), data, args.warmup,
                                   args.steps, cuda, say, failed, first_step_profile=args.first_step)
    profile, memory = diagnose(args, sides, data[-1], cuda, say)
    stats = {s.name: side_stats(s, flops, world, peak) for s in sides}
    for s in sides:  # one counted step each, after the timing
        stats[s.name].update(s.step.communication(data[0]))
    compiled = "axedist compiled" if "axedist compiled" in stats else "axedist compiled blocks"
    ratio_rows(stats, lambda name: compiled if " compiled" in name else "axedist")
    for name, s in stats.items():
        say(f"{name:8s} median {s['median_ms']:8.2f} ms  [{s['min_ms']:.2f} - {s['max_ms']:.2f}]  host "
            f"{s['host_median_ms']:.1f} ms  MFU "
            + (f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a") + "  peak "
            + (f"{s['peak_bytes'] / 2**30:.2f} GiB" if s["peak_bytes"] is not None else "n/a")
            + f"  bytes/step {_count(s['bytes_per_step']):>12}  state {s['state_bytes']:>12,} B  first losses "
            f"{[round(v, 4) for v in s['losses'][:3]]}")
    met = goals(stats)
    for g_ in met:
        say(f"goal {g_['goal']}: {g_['value']:.2f} (target {g_['target']}) {'met' if g_['met'] else 'NOT met'}")
    bytes_ratio = None
    if "axedist" in stats and "torch" in stats and stats["torch"]["bytes_per_step"]:  # (one rank: none sent)
        bytes_ratio = stats["axedist"]["bytes_per_step"] / stats["torch"]["bytes_per_step"]
        say(f"axedist / torch bytes: {bytes_ratio:.3f}")

    if args.out and dist.get_rank() == 0:
        command = f"torchrun --nproc-per-node {world} benchmarks/bench_train_2d.py " + " ".join(argv)
        meta = run_meta(world, command, device=device)
        record = {"meta": meta, **{k: meta[k] for k in ("date", "commit", "machine", "command")},
                  "preset": args.preset, "world": world, "mesh": {"dp": args.dp, "tp": tp}, "batch": batch,
                  "seq": cfg.max_seq_len, "config": cfg.__dict__, "mixed_precision": cuda, "warmup": args.warmup,
                  "steps": args.steps, "model_flops_per_step": flops, "flops_formula": FLOPS_FORMULA,
                  "peak_flops_per_gpu": peak, "memory_estimate": estimate, "order": order,
                  "library_warmup_s": warmed, "sides": stats,
                  "failed": failed, "goals": met, "axedist_over_torch_bytes": bytes_ratio, "loss_check": check,
                  "profile": profile, "memory": memory}
        stem = f"bench_train_2d_{'cuda' if cuda else 'cpu'}_w{world}" + \
            ("" if args.preset == "default" else f"_{args.preset}")
        title = (f"dp{args.dp} x tp{tp} training step, {device}, dim {cfg.dim}, {cfg.n_layers} layers, "
                 f"{batch} x {cfg.max_seq_len} tokens")
        comm = "".join(f"| {n} | {_count(s['bytes_per_step'])} | {s['calls'] if s['calls'] is not None else '-'} | "
                       f"{s['state_bytes']:,} | {s['peak_gathered_bytes'] or '-'} |\n" for n, s in stats.items())
        markdown = (f"# 2-D training step (FSDP x TP): axedist vs torch fully_shard + parallelize_module\n\n"
                    f"{meta['date']}, commit {meta['commit']}, {meta['machine']}, torch {meta['torch']}, mesh (dp, tp) "
                    f"= ({args.dp}, {tp}), {'bf16 compute / fp32 parameters' if cuda else 'fp32'}, preset "
                    f"{args.preset}: batch {batch} x seq {cfg.max_seq_len} over the dp ranks, dim {cfg.dim}, "
                    f"{cfg.n_layers} layers, {cfg.n_heads} heads, {cfg.kv_heads} KV heads, FFN {cfg.ffn_hidden}, "
                    f"vocab {cfg.vocab_size}, TP + SP, AdamW. Both sides built, warmed up alone ({args.warmup} "
                    f"steps), then {args.steps} steps interleaved; a step's time is the slowest rank's.\n\n"
                    f"`{command}`\n\n" + markdown_tables(record) +
                    "One forward + backward counted per side, after the timing:\n\n| side | bytes sent per rank | "
                    "collective calls | param + grad + optimizer B per rank | peak gathered parameter B |\n"
                    f"|---|---|---|---|---|\n{comm}\n" +
                    (f"axedist / torch bytes: {bytes_ratio:.3f}\n" if bytes_ratio else ""))
        write_results(args.out, stem, record, markdown, title, say)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
