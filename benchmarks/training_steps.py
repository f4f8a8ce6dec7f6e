"""What the training-step benchmarks (``bench_tp.py``, ``bench_train_2d.py``) share: model presets,
model FLOPs and MFU, a memory estimate, per-side compile backends, interleaved timing with peak
memory, the fp32 loss check, profiler summaries and the results files.

A *side* is one implementation of the same training step (``axedist``, ``torch``,
``axedist compiled``, ...). Every side is built first, then warmed up alone (compiled sides
compile here, each under its own backend object), then timed round-robin: step i of every side,
then step i + 1 of every side, so clock, thermal and neighbour drift hit every side alike:

    sides = [Side("axedist", make_ours), Side("torch", make_theirs)]
    order = run_interleaved(sides, data, warmup=3, steps=20, cuda=True, say=print)
    stats = side_stats(sides[0], flops_per_step=1.19e14, world=2, peak_flops=989e12)
    # {"median_ms": 251.0, "min_ms": 249.8, "max_ms": 254.1, "mfu": 0.239, "peak_bytes": ...}

Imported beside the scripts (``from training_steps import ...``), like ``history.py``.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import gc
import json
import math
import os
import pstats
import re
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from axedist.nn.llama import LlamaConfig, TransformerBlock, rope_tables
from axedist.runtime import pinned_backends

GIB = 2**30

# The GPU-bound size (issue 27): Llama-3-8B's layers (dim 4096, 32 heads, 8 KV heads, FFN 14336) at
# seq 4096, batch 8 (sequences per TP group; bench_train_2d trains dp x 8), 4 layers. vocab 16384,
# not 128256: the output projection then takes 7% of the matmul FLOPs, as in the 32-layer
# model; the full vocabulary would take 38% of 4 layers' work, and its logits (32768 x 64128
# per rank at TP=2) 4 GiB per loss tensor. Work per step: 1.98e14 model FLOPs,
# 100 ms per GPU at TP=2 at 989 TFLOP/s (50 ms at TP=4): GPU-bound.
# Memory per rank at TP=2 (bench_tp, bf16 parameters, AdamW; ``memory_estimate``, which gives
# 12.3 GiB for issue 27's anchor where torch measured 12.2): per side 3.8 GiB of parameters,
# gradients and AdamW state; one step of torch's side adds 12.5 GiB of saved activations, 3.5
# GiB of logits and loss, 1.2 GiB of backward working set: 21.0 GiB for one side alone, 36.0 GiB
# for the run (5 sides resident with --compile, one stepping). axedist at 1.5x torch's step
# memory (issue 27: 17.9 vs 12.2 GiB) makes it about 45 GiB, plus symmetric-memory workspaces,
# NCCL and cuBLAS buffers and allocator fragmentation: fits an 80 GB H100. 6 layers would be
# about 65 GiB before those: too close. At TP=4 the run needs about 25 GiB.
LLAMA8B = dict(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=16384,
               max_seq_len=4096, batch=8)
PRESETS = ("default", "llama8b")

# bf16 dense peak FLOP/s per GPU (no sparsity), by a substring of torch.cuda.get_device_name();
# the first match wins, so the PCIe / NVL parts come before their SXM names
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12),
                   ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))

FLOPS_FORMULA = ("6 x (matmul parameters: every Linear weight of the blocks and the output projection; "
                 "not the embedding table or norms) x tokens + 6 x layers x batch x seq^2 x dim "
                 "(causal attention: QK^T and AV at 2 x seq^2 x dim each per sequence, half of them "
                 "masked, backward twice forward)")


def preset_config(preset: str, defaults: dict, overrides: dict) -> tuple[LlamaConfig, int]:
    """The model and batch of ``preset`` (``defaults``: the script's own default size), with
    every ``overrides`` value that is not None on top: ``preset_config("llama8b", {}, {"layers": 2})``
    gives Llama-3-8B layers, 2 of them, batch 8."""
    sizes = dict(LLAMA8B if preset == "llama8b" else defaults)
    names = {"dim": "dim", "layers": "n_layers", "seq": "max_seq_len", "vocab": "vocab_size", "ffn": "ffn_hidden",
             "heads": "n_heads", "kv_heads": "n_kv_heads", "batch": "batch"}
    for key, value in overrides.items():
        if value is not None:
            sizes[names[key]] = value
    batch = sizes.pop("batch")
    return LlamaConfig(**sizes), batch


def check_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """The small model of the fp32 loss check: ``cfg``'s structure (grouped-query attention or
    not) at dim 256, 2 layers, seq 64, kv heads still divisible by the TP size."""
    heads = 16
    kv = None
    if cfg.n_kv_heads and cfg.n_kv_heads != cfg.n_heads:
        kv = max(heads * cfg.n_kv_heads // cfg.n_heads, world)
    return LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=heads, n_kv_heads=kv, ffn_hidden=512,
                       max_seq_len=64)


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that multiply activations: the blocks' Linear weights and the output projection."""
    attention = cfg.dim * (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * cfg.dim
    feed_forward = 3 * cfg.dim * cfg.ffn_hidden
    return cfg.n_layers * (attention + feed_forward) + cfg.dim * cfg.vocab_size


def model_flops(cfg: LlamaConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (``FLOPS_FORMULA``); no recomputation counted. The
    issue-27 anchor (dim 4096, 2 layers, ffn 16384, vocab 8192, 16 x 4096 tokens): 2.37e14, i.e.
    60 ms per GPU at TP=4 at 989 TFLOP/s."""
    tokens = batch * seq
    return 6.0 * matmul_params(cfg) * tokens + 6.0 * cfg.n_layers * batch * seq * seq * cfg.dim


def peak_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """The card's bf16 dense peak in FLOP/s, None when unknown (MFU is then printed as n/a)."""
    if override_tflops:
        return override_tflops * 1e12
    for key, value in PEAK_BF16_FLOPS:
        if key in device_name:
            return value
    return None


def memory_estimate(cfg: LlamaConfig, batch: int, tp: int, shards: int = 1, param_bytes: int = 2,
                    compute_bytes: int = 2, sides: int = 1) -> dict:
    """Bytes per rank of one training step with TP + SP, AdamW, state sharded ``shards`` ways
    beyond TP (FSDP's dp), ``batch`` sequences per TP group.

    state per side = parameters x (param + grad + 2 AdamW moments, all ``param_bytes``) / (tp x shards);
    saved activations per token per layer = 2 x dim (the all-gathered inputs of attention and MLP)
    + 7 x dim / tp (the two norms' inputs; q, k, v after the GQA repeat, attention's output and
    wo's input) + 4 x ffn / tp (w1 and w3 outputs, silu, their product), at ``compute_bytes``;
    logits and loss per token = vocab / tp x (compute_bytes + 3 x 4) (logits, fp32 log-softmax,
    its gradient, a temporary); backward working set per token = dim + dim / tp + 2 x ffn / tp
    (the gradients alive at once in an MLP's backward: of its gathered input, of its input
    shard, of w1's and w3's outputs); with FSDP two blocks' gathered parameters. Issue 27's
    anchor (torch, TP=4, dim 4096, 2 layers, 16 x 4096 tokens): 12.3 GiB estimated, 12.2 GiB
    measured; it is the one measurement so far, and the working-set term was written after
    seeing it (counting a whole layer there gave 14.5 GiB), so treat the estimate as +-20%."""
    params = matmul_params(cfg) + cfg.vocab_size * cfg.dim + (2 * cfg.n_layers + 1) * cfg.dim
    state = params * 4 * param_bytes / (tp * shards)
    tokens = batch * cfg.max_seq_len
    per_layer = tokens * (2 * cfg.dim + 7 * cfg.dim / tp + 4 * cfg.ffn_hidden / tp) * compute_bytes
    activations = cfg.n_layers * per_layer
    working = tokens * (cfg.dim + cfg.dim / tp + 2 * cfg.ffn_hidden / tp) * compute_bytes
    logits = tokens * cfg.vocab_size / tp * (compute_bytes + 12)
    gathered = 0.0
    if shards > 1:
        gathered = 2 * (matmul_params(cfg) - cfg.dim * cfg.vocab_size) / cfg.n_layers / tp * compute_bytes
    step = activations + logits + working + gathered
    return {"state_per_side": state, "activations": activations, "logits_and_loss": logits,
            "backward_working_set": working, "gathered_parameters": gathered, "one_side": state + step,
            "all_sides": sides * state + step, "sides": sides}


def describe_estimate(estimate: dict) -> str:
    g = {k: v / GIB for k, v in estimate.items() if k != "sides"}
    return (f"memory estimate per rank: state {g['state_per_side']:.1f} GiB per side, activations "
            f"{g['activations']:.1f}, logits + loss {g['logits_and_loss']:.1f}, backward working set "
            f"{g['backward_working_set']:.1f}" + (f", gathered parameters {g['gathered_parameters']:.1f}"
                                                  if estimate['gathered_parameters'] else "")
            + f" GiB: one side {g['one_side']:.1f} GiB, all {estimate['sides']} sides {g['all_sides']:.1f} GiB")


class GraphCounter:
    """One side's ``torch.compile`` backend: the registered backend ``name`` (Inductor with this
    side's config patches), counting the graphs Dynamo hands it. One object per side keeps each
    side's compiled code its own: Dynamo reuses a cached graph only under the backend object that
    compiled it, so no side runs another's graphs and no ``torch._dynamo.reset()`` is needed;
    ``graphs`` growing during the timed steps is a recompile."""

    def __init__(self, name: str = "inductor", config_patches: dict | None = None):
        self.name, self.config_patches, self.graphs = name, dict(config_patches or {}), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.name == "inductor":
            from torch._inductor.compile_fx import compile_fx

            # compile_fx applies the patches to the backward graph too (compiled later, lazily)
            return compile_fx(gm, example_inputs, config_patches=self.config_patches)
        if self.config_patches:
            raise ValueError(f"config patches are Inductor's; backend {self.name!r} takes none")
        return torch._dynamo.lookup_backend(self.name)(gm, example_inputs)

    def __repr__(self) -> str:
        return f"GraphCounter({self.name!r}, {self.config_patches}, graphs={self.graphs})"


def allow_compiled_sides() -> None:
    """Room in Dynamo's cache for every side's graphs: the blocks of all sides share one code
    object (``Module._call_impl``), and a frame over the recompile limit silently runs eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


# An extra eager axedist side, named "axedist <backend>", pins its collectives while it steps:
# p2p / symm / torch pin the fused GEMM calls (torch: never fused, cuBLAS + NCCL); nccl pins the
# planned collectives (redistributes, FSDP's gathers and reduce-scatters) to torch.distributed.
PINNED_BACKENDS = ("p2p", "symm", "torch", "nccl")


def add_pinned_argument(parser) -> None:
    """The training benchmarks' ``--eager-backends``: the extra pinned sides (:func:`pinned`)."""
    parser.add_argument("--eager-backends", nargs="+", default=(), choices=PINNED_BACKENDS, metavar="BACKEND",
                        help="also axedist eager with collectives pinned to each (fused calls: p2p, symm, torch: "
                             "never fused; nccl: the planned collectives, FSDP's among them, on NCCL)")


def pinned(backend: str, step: Callable) -> Callable:
    """``step`` with the collectives ``backend`` names (``PINNED_BACKENDS``) pinned while it runs."""
    pins = dict(plan="torch") if backend == "nccl" else dict(fused=backend)

    def run(*args):
        with pinned_backends(**pins):
            return step(*args)
    return run


@dataclasses.dataclass
class Side:
    """One implementation of the training step. ``make()`` builds its model and optimizer and
    returns ``step(tokens) -> loss``; ``compiler`` is its backend when compiled."""

    name: str
    make: Callable[[], Callable] | None
    compiler: GraphCounter | None = None
    loss_value: Callable = lambda loss: float(loss.detach().full_tensor().float())
    step: Callable | None = None
    resident_bytes: int = 0             # this rank's bytes that stay between steps (state, caches)
    warmup_ms: list = dataclasses.field(default_factory=list)
    times_ms: list = dataclasses.field(default_factory=list)
    host_ms: list = dataclasses.field(default_factory=list)    # until step() returned, max over ranks
    peaks: list = dataclasses.field(default_factory=list)      # resident + the step's peak, max over ranks
    raw_peaks: list = dataclasses.field(default_factory=list)  # max_memory_allocated as read, max over ranks
    losses: list = dataclasses.field(default_factory=list)
    graphs_after_warmup: int | None = None
    first_step: dict | None = None      # rank 0's cProfile of the first warm-up step (first_step_profile)


def allocated(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else 0


@dataclasses.dataclass
class Measured:
    """One measured step: its result, the slowest rank's wall milliseconds, the slowest rank's
    host milliseconds (until ``step`` returned, before waiting for the device: near ``ms``, the
    step is bound by its host code, not the GPU), and two peaks, max over ranks (None on CPU)."""

    out: object
    ms: float
    host_ms: float
    peak: int | None
    raw_peak: int | None


def measured_step(step: Callable, tokens, cuda: bool, resident: int = 0, around=contextlib.nullcontext) -> Measured:
    """``step(tokens)`` between synchronised starts (all ranks, the device), measured. The peaks:
    the side's own, ``resident`` + the rise of allocated bytes during the step over those before
    it, and the process's ``torch.cuda.max_memory_allocated`` as read (every resident side's
    bytes). ``around()``: a context entered around the step alone (a profiler: the all-reduce of
    the measurements, which waits for the slowest rank, stays out of what it sees)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = allocated(cuda)
    dist.barrier()
    begin = time.perf_counter()
    with around():
        out = step(tokens)
        host = time.perf_counter() - begin
        if cuda:
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - begin
    raw = torch.cuda.max_memory_allocated() if cuda else 0
    measured = torch.tensor([elapsed, host, float(resident + raw - before), float(raw)], dtype=torch.float64,
                            device="cuda" if cuda else "cpu")
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    ms, host_ms = float(measured[0]) * 1e3, float(measured[1]) * 1e3
    if not cuda:
        return Measured(out, ms, host_ms, None, None)
    return Measured(out, ms, host_ms, int(measured[2]), int(measured[3]))


def agree(ok: bool, cuda: bool) -> bool:
    """True when every rank says ``ok``."""
    flag = torch.tensor([1 if ok else 0], device="cuda" if cuda else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def drop(side: Side, error: str, failed: dict, cuda: bool, say: Callable) -> None:
    """Give up on a side that failed on some rank (the others go on): its error is recorded."""
    failed[side.name] = error or "failed on another rank"
    side.step = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    say(f"  {side.name} FAILED and is left out: {failed[side.name][:400]}")


def build_sides(sides: list[Side], cuda: bool, say: Callable, failed: dict) -> list[Side]:
    """Build every side's model and optimizer (before any step), noting the bytes each keeps;
    the sides that built on every rank."""
    built = []
    for side in sides:
        gc.collect()
        before = allocated(cuda)
        error = ""
        try:
            side.step = side.make()
        except Exception as e:  # noqa: BLE001 - one side failing leaves the others' numbers
            error = f"building: {type(e).__name__}: {e}"
        if not agree(not error, cuda):
            drop(side, error, failed, cuda, say)
            continue
        side.make = None  # what it was built from (a full copy of the model) can go
        gc.collect()
        side.resident_bytes = allocated(cuda) - before
        built.append(side)
        say(f"built {side.name}" + (f": {side.resident_bytes / GIB:.2f} GiB on rank 0" if cuda else ""))
    return built


def warm_libraries(cfg: LlamaConfig, tp: int, rows: int, device, dtype, say: Callable) -> float:
    """Before any side runs, pay the libraries' first-use costs at one rank's shapes, which
    otherwise the side that runs first pays in its first step: cuBLAS's choices, cuDNN's attention
    kernels (compiled at run time per problem shape), the NCCL communicator. One forward and
    backward of a plain one-GPU Llama block with this rank's share of the heads, KV heads and FFN
    columns (``tp``-th of each) over the whole sequence (as attention sees it under sequence
    parallelism) for ``rows`` sequences, the output projection's vocabulary slice, and an
    all-reduce. Nothing of either framework runs. Says and returns the seconds it took (on this
    rank)."""
    start = time.perf_counter()
    local = SimpleNamespace(dim=cfg.dim, n_heads=cfg.n_heads // tp, kv_heads=cfg.kv_heads // tp,
                            head_dim=cfg.head_dim, ffn_hidden=cfg.ffn_hidden // tp, norm_eps=cfg.norm_eps)
    block = TransformerBlock(local).to(device=device, dtype=dtype)
    head = torch.nn.Linear(cfg.dim, cfg.vocab_size // tp, bias=False).to(device=device, dtype=dtype)
    cos, sin = (t.to(device) for t in rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta))
    x = torch.randn(cfg.max_seq_len, rows, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    head(block(x, cos, sin)).float().square().mean().backward()
    if dist.is_initialized():
        dist.all_reduce(torch.ones(1, device=device))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    say(f"libraries warmed at one rank's shapes in {seconds:.1f} s (no side's first step pays them)")
    return seconds


def warm_up(sides: list[Side], data, warmup: int, cuda: bool, say: Callable, failed: dict,
            first_step_profile: bool = False) -> list[Side]:
    """Each side alone for ``warmup`` steps (compiled sides compile in their first): optimizer
    state is created, caches filled; what stays allocated counts as the side's resident bytes.
    With ``first_step_profile``, every eager side's first step runs under cProfile on rank 0
    (``Side.first_step``: where its seconds go). The sides that warmed up on every rank."""
    warm = []
    for side in sides:
        gc.collect()
        before = allocated(cuda)
        error = ""
        try:
            for i in range(warmup):
                profiler = cProfile.Profile() if (first_step_profile and i == 0 and side.compiler is None
                                                  and dist.get_rank() == 0) else None
                m = measured_step(side.step, data[i], cuda, side.resident_bytes,
                                  around=(lambda: profiler) if profiler else contextlib.nullcontext)
                if profiler:
                    side.first_step = functions_by_time(profiler)
                side.losses.append(side.loss_value(m.out))
                side.warmup_ms.append(m.ms)
                say(f"  warm-up {side.name} {i + 1}/{warmup}: {m.ms:.1f} ms" +
                    (f", {side.compiler.graphs} graphs compiled" if side.compiler else ""))
        except Exception as e:  # noqa: BLE001 - e.g. a compile error or out of memory on every rank
            error = f"warming up: {type(e).__name__}: {e}"
        if not agree(not error, cuda):
            drop(side, error, failed, cuda, say)
            continue
        gc.collect()
        side.resident_bytes += allocated(cuda) - before
        side.graphs_after_warmup = side.compiler.graphs if side.compiler else None
        warm.append(side)
    return warm


def run_interleaved(sides: list[Side], data, warmup: int, steps: int, cuda: bool, say: Callable,
                    failed: dict | None = None, first_step_profile: bool = False) -> tuple[list[Side], list]:
    """Build, warm up (:func:`warm_up`), then time round-robin: step i of every side, then step
    i + 1 of every side, on batch ``data[warmup + i]`` for all of them. Returns the sides timed (a
    side that failed to build or warm up is left out, its error in ``failed``) and the order the
    steps ran in, ``[[0, "axedist"], [0, "torch"], [1, "axedist"], ...]``."""
    failed = {} if failed is None else failed
    sides = warm_up(build_sides(sides, cuda, say, failed), data, warmup, cuda, say, failed, first_step_profile)
    order = []
    for i in range(steps):
        for side in sides:
            m = measured_step(side.step, data[warmup + i], cuda, side.resident_bytes)
            side.losses.append(side.loss_value(m.out))
            side.times_ms.append(m.ms)
            side.host_ms.append(m.host_ms)
            side.peaks.append(m.peak)
            side.raw_peaks.append(m.raw_peak)
            order.append([i, side.name])
        if (i + 1) % 5 == 0 or i + 1 == steps:
            say(f"  timed step {i + 1}/{steps}: medians so far " +
                ", ".join(f"{s.name} {statistics.median(s.times_ms):.1f}" for s in sides) + " ms")
    for side in sides:
        if side.compiler and side.compiler.graphs != side.graphs_after_warmup:
            say(f"WARNING: {side.name} recompiled during the timed steps "
                f"({side.compiler.graphs - side.graphs_after_warmup} graphs): its times include compiles")
    return sides, order


def percentile(values: list, q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low, high = math.floor(at), math.ceil(at)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def side_stats(side: Side, flops_per_step: float, world: int, peak: float | None) -> dict:
    """Median, spread, MFU and peak memory of a timed side."""
    median = statistics.median(side.times_ms)
    mfu = flops_per_step / (median * 1e-3 * world * peak) if peak else None
    peaks = [p for p in side.peaks if p is not None]
    return {"median_ms": median, "min_ms": min(side.times_ms), "max_ms": max(side.times_ms),
            "p10_ms": percentile(side.times_ms, 10), "p90_ms": percentile(side.times_ms, 90),
            "times_ms": side.times_ms, "warmup_ms": side.warmup_ms, "mfu": mfu,
            "host_median_ms": statistics.median(side.host_ms), "host_ms": side.host_ms,
            "peak_bytes": max(peaks) if peaks else None, "resident_bytes": side.resident_bytes if peaks else None,
            "process_peak_bytes": max(side.raw_peaks) if peaks else None,
            "losses": side.losses,
            "graphs_compiled": side.compiler.graphs if side.compiler else None,
            "recompiles_in_timed_steps": (side.compiler.graphs - side.graphs_after_warmup) if side.compiler else None,
            "first_step_profile": side.first_step}


def functions_by_time(profiler: cProfile.Profile, top: int = 25) -> dict:
    """A cProfile run's functions with the most own time, and with the most time under them
    (cumulative; the step's own frames left out), in seconds."""
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own, cumulative, callers)}
    total = sum(own for _, _, own, _, _ in stats.values())

    def name(key):
        file, line, function = key
        parts = file.replace("\\", "/").split("/")
        where = "/".join(parts[-2:]) if file not in ("~", "") else ""
        return f"{where}:{line} {function}" if where else function

    def rows(order):
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][order])
        return [{"function": name(k), "calls": v[1], "own_s": v[2], "cumulative_s": v[3]} for k, v in ranked[:top]]

    return {"profiled_s": total, "by_own_time": rows(2), "by_cumulative_time": rows(3)}


def compare_losses(losses: dict, reference: str, tol: float) -> dict:
    """Every side's losses against ``reference``'s: the largest relative difference and whether
    it is within ``tol``."""
    ref = losses[reference]
    result = {"reference": reference, "tolerance": tol, "losses": losses, "max_rel_diff": {}, "passed": True}
    for name, values in losses.items():
        if name == reference:
            continue
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(values, ref))
        result["max_rel_diff"][name] = diff
        result["passed"] = result["passed"] and diff <= tol and len(values) == len(ref)
    return result


def run_loss_check(sides: list[Side], data, steps: int, cuda: bool, tol: float, reference: str, say: Callable) -> dict:
    """The fp32 check: each side (built from the same seed) trains ``steps`` steps on the same
    batches; its losses must agree with ``reference``'s within ``tol`` (relative). bf16 losses
    that agree say little (a few bits), fp32 ones say the same model computes the same numbers.
    A side that fails (on any rank) fails the check and is recorded with its error."""
    losses, errors = {}, {}
    for side in sides:
        error, begin = "", time.perf_counter()
        try:
            step = side.make()
            values = [side.loss_value(step(data[i])) for i in range(steps)]
            del step
        except Exception as e:  # noqa: BLE001 - recorded, the timing still runs
            error = f"{type(e).__name__}: {e}"
        gc.collect()
        if agree(not error, cuda):
            losses[side.name] = values
            say(f"  fp32 check {side.name}: {steps} steps in {time.perf_counter() - begin:.1f} s")
        else:
            errors[side.name] = error or "failed on another rank"
            say(f"  fp32 check of {side.name} FAILED: {errors[side.name][:400]}")
    if reference not in losses:
        result = {"reference": reference, "tolerance": tol, "losses": losses, "max_rel_diff": {}, "passed": False}
    else:
        result = compare_losses(losses, reference, tol)
    result["errors"] = errors
    result["passed"] = result["passed"] and not errors
    for name, diff in result["max_rel_diff"].items():
        say(f"  fp32 losses {name} vs {reference}: max relative difference {diff:.2e} "
            f"({'ok' if diff <= tol else 'ABOVE'} tolerance {tol:g})")
    say(f"fp32 loss check {'passed' if result['passed'] else 'FAILED'}: " +
        "; ".join(f"{n} {[round(v, 6) for v in vs]}" for n, vs in losses.items()))
    if cuda:
        torch.cuda.empty_cache()
    return result


def add_diagnosis_arguments(parser) -> None:
    """The training benchmarks' ``--profile``, ``--trace`` and ``--memory`` (:func:`diagnose`)."""
    parser.add_argument("--profile", action="store_true", help="one more step per side under torch.profiler")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile: every rank's Chrome trace of that step under OUT/traces/")
    parser.add_argument("--memory", action="store_true",
                        help="one more step per side with its allocations recorded (CUDA: the allocator's history; "
                             "CPU: the profiler's): what is live at its peak")
    parser.add_argument("--first-step", action="store_true",
                        help="every eager side's first step under cProfile on rank 0: where its seconds go")


def diagnose(args, sides: list[Side], tokens, cuda: bool, say: Callable) -> tuple[dict | None, dict | None]:
    """``(profile, memory)`` of the timed sides as ``args`` asks (:func:`add_diagnosis_arguments`),
    None where not asked."""
    traces = os.path.join(args.out, "traces") if args.trace else None
    profile = profile_sides(sides, tokens, cuda, say, trace_dir=traces) if args.profile else None
    memory = memory_peaks(sides, tokens, say, cuda) if args.memory else None
    return profile, memory


def profile_sides(sides: list[Side], tokens, cuda: bool, say: Callable, top: int = 15,
                  trace_dir: str | None = None) -> dict:
    """One more step of every side under ``torch.profiler`` (CUDA activity on CUDA); rank 0's
    summary per side: total device busy time (the union of kernel intervals over all streams),
    the sum of kernel times (above busy time where kernels overlap, e.g. NCCL beside GEMMs), and
    the top kernels by time. On CPU: the operators' self times and the busy time of the top-level
    operators. With ``trace_dir`` every rank also writes its Chrome trace there,
    ``trace_<side>_rank<r>.json.gz`` (for a timeline: where a side's GPU waits on its host or on
    another rank)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def one(side):
        prof = profile(activities=activities)
        ms = measured_step(side.step, tokens, cuda, around=lambda: prof).ms
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(
                trace_dir, f"trace_{side.name.replace(' ', '_')}_rank{dist.get_rank()}.json.gz"))
        if dist.get_rank() != 0:
            return None
        found = dict(profile_summary(prof.events(), cuda, top), step_ms=ms)
        say(f"  profiled {side.name}: step {ms:.1f} ms, busy {found['busy_ms']:.1f} ms")
        return found

    return each_side(sides, cuda, one)


def memory_peaks(sides: list[Side], tokens, say: Callable, cuda: bool = True, top: int = 12) -> dict:
    """One more step of every side with its allocations recorded (Python frames): rank 0's live
    blocks allocated during the step at the moment their sum peaked, grouped by where they were
    allocated (the innermost frame outside torch's own files, and the innermost frame), largest
    first. Blocks from before the step (parameters, optimizer state) are not in it: the peak here
    is the step's own rise. CUDA: the caching allocator's history; CPU: torch.profiler's
    allocation events (``cpu_allocation_trace``)."""
    def one(side):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            try:
                measured_step(side.step, tokens, True)
                trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        else:
            trace = cpu_allocation_trace(lambda around: measured_step(side.step, tokens, False, around=around))
        if dist.get_rank() != 0:
            return None
        found = live_at_peak(trace, top)
        unit, scale = memory_unit(found["peak_bytes"])
        say(f"  memory of {side.name}: step peak rise {found['peak_bytes'] / scale:.2f} {unit}, "
            f"{found['blocks']} blocks live")
        return found

    return each_side(sides, cuda, one)


def memory_unit(nbytes: int) -> tuple[str, int]:
    """("GiB", 2**30) for a GPU-sized peak, ("MiB", 2**20) below a GiB (CPU runs)."""
    return ("GiB", GIB) if nbytes >= GIB else ("MiB", 2**20)


def cpu_allocation_trace(run: Callable) -> list:
    """The CPU allocations and frees ``run(around)`` made inside ``around()`` (a context it enters
    around what to see), as an allocator trace for ``live_at_peak``: torch.profiler's allocation
    events in time order, each with the Python functions it ran in, innermost first (a frame's
    line is its function's first line: the profiler records calls, not lines). Frees that another
    thread makes (a gloo worker's) may be missing: their blocks count as live to the end."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    recorder = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)
    run(lambda: recorder)
    events = []
    pending = [(root, ()) for root in recorder.profiler.kineto_results.experimental_event_tree()]
    while pending:
        node, frames = pending.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr, frames))
            continue
        if node.tag == _EventType.PyCall:
            frame = _python_frame(node)
            frames = frames if frame is None else (frame, *frames)
        pending.extend((child, frames) for child in node.children)
    events.sort(key=lambda e: e[0])
    return [{"action": "alloc" if size > 0 else "free_completed", "addr": ptr, "size": abs(size),
             "frames": list(frames)} for _, size, ptr, frames in events]


def _python_frame(node) -> dict | None:
    """``{"filename", "line", "name"}`` of a profiler Python-call event (named ``file(line): name``)."""
    try:
        name = node.name
    except UnicodeDecodeError:  # (the profiler's name of some C-extension callables)
        return None
    match = re.match(r"^(.*)\((\d+)\): (.*)$", name)
    return {"filename": match[1], "line": int(match[2]), "name": match[3]} if match else None


def each_side(sides: list[Side], cuda: bool, one: Callable) -> dict:
    """``{side name: one(side)}`` for the sides where ``one`` returned something (rank 0's
    summaries); a side that failed on some rank is ``"<name> (failed)": {"error": ...}`` on every
    rank, and the others go on."""
    out = {}
    for side in sides:
        error = ""
        try:
            found = one(side)
            if found is not None:
                out[side.name] = found
        except Exception as e:  # noqa: BLE001 - a diagnosis failing must not lose the timings
            error = f"{type(e).__name__}: {e}"
        if not agree(not error, cuda):
            out.pop(side.name, None)
            out[side.name + " (failed)"] = {"error": error or "failed on another rank"}
    return out


def live_at_peak(trace: list, top: int = 12) -> dict:
    """Replays an allocator trace (``alloc`` / ``free_completed`` events): the bytes live at the
    peak of their sum, grouped by allocation site, ``top`` sites largest first."""
    live, current, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    sites: dict[str, list] = {}
    for event in at_peak.values():
        entry = sites.setdefault(allocation_site(event.get("frames") or []), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_bytes": peak, "blocks": len(at_peak),
            "top": [{"site": site, "bytes": size, "blocks": n} for site, (size, n) in ranked]}


def allocation_site(frames: list) -> str:
    """Where a block was allocated, from its Python frames (innermost first): the innermost
    frame outside torch's files, then the innermost one."""
    def place(f):
        return f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"
    if not frames:
        return "(no Python frame)"
    own = next((f for f in frames if "/torch/" not in f["filename"]), None)
    return place(own) + ("" if own is frames[0] else f" < {place(frames[0])}") if own else place(frames[0])


def covered(spans) -> float:
    """The length of the union of ``(start, stop)`` intervals: a device's busy time from its
    kernels' intervals, overlapping ones (several streams) counted once."""
    busy, end = 0.0, -math.inf
    for start, stop in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def profile_summary(events, cuda: bool, top: int = 15) -> dict:
    """Busy time, summed time and the ``top`` names by time (microseconds in, milliseconds out)
    of profiler events: kernels on CUDA, operators (self time) on CPU."""
    from torch.autograd import DeviceType

    if cuda:
        chosen = [e for e in events if e.device_type == DeviceType.CUDA]
        spans = [(e.time_range.start, e.time_range.end) for e in chosen]
        own = {id(e): e.time_range.end - e.time_range.start for e in chosen}
    else:
        chosen = [e for e in events if e.device_type == DeviceType.CPU]
        spans = [(e.time_range.start, e.time_range.end) for e in chosen if e.cpu_parent is None]
        own = {id(e): e.self_cpu_time_total for e in chosen}
    by_name: dict[str, list] = {}
    for e in chosen:
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += own[id(e)]
        entry[1] += 1
    busy = covered(spans)
    total = sum(v[0] for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"what": "CUDA kernels" if cuda else "CPU operators (self time)", "busy_ms": busy / 1e3,
            "summed_ms": total / 1e3,
            "top": [{"name": name[:200], "ms": t / 1e3, "calls": n, "share_of_summed": t / total if total else 0.0}
                    for name, (t, n) in ranked]}


def ratio_rows(stats: dict, reference_of: Callable[[str], str]) -> None:
    """Adds ``time_over_axedist`` to each side: its median over the median of the axedist side
    of the same mode (above 1: axedist is faster)."""
    for name, s in stats.items():
        ref = stats.get(reference_of(name))
        s["time_over_axedist"] = s["median_ms"] / ref["median_ms"] if ref else None


def goals(stats: dict) -> list[dict]:
    """Issue 27's goals, each with its measured value and whether it is met."""
    out = []

    def add(what, value, target, higher_is_better):
        if value is not None:
            out.append({"goal": what, "value": value, "target": target,
                        "met": value >= target if higher_is_better else value <= target})

    get = lambda name, key: stats.get(name, {}).get(key)  # noqa: E731
    if get("torch", "median_ms") and get("axedist", "median_ms"):
        add("eager step: torch eager / axedist eager", get("torch", "median_ms") / get("axedist", "median_ms"), 1.15, True)
    if get("torch compiled async-TP", "median_ms") and get("axedist compiled", "median_ms"):
        add("compiled step: torch compiled + async-TP / axedist compiled",
            get("torch compiled async-TP", "median_ms") / get("axedist compiled", "median_ms"), 1.10, True)
    if get("torch", "peak_bytes") and get("axedist", "peak_bytes"):
        add("peak memory eager: axedist / torch", get("axedist", "peak_bytes") / get("torch", "peak_bytes"), 1.05, False)
    for ours, theirs in (("axedist compiled", "torch compiled"), ("axedist compiled", "torch compiled async-TP")):
        if get(theirs, "peak_bytes") and get(ours, "peak_bytes"):
            add(f"peak memory compiled: {ours} / {theirs}", get(ours, "peak_bytes") / get(theirs, "peak_bytes"),
                1.05, False)
    return out


def markdown_tables(record: dict) -> str:
    """The per-side table, goals, the fp32 loss check and the profile summary, as markdown."""
    gib = lambda b: f"{b / GIB:.2f}" if b is not None else "n/a"  # noqa: E731
    pct = lambda v: f"{100 * v:.1f}%" if v is not None else "n/a"  # noqa: E731
    rows = []
    for name, s in record["sides"].items():
        ratio = f"{s['time_over_axedist']:.2f}x" if s.get("time_over_axedist") else "-"
        recompiles = "" if s["recompiles_in_timed_steps"] in (None, 0) else f" ({s['recompiles_in_timed_steps']} recompiles!)"
        first = f"{s['warmup_ms'][0] / 1000:.1f}" if s.get("warmup_ms") else "-"
        host = f"{s['host_median_ms']:.1f}" if s.get("host_median_ms") is not None else "-"
        rows.append(f"| {name} | {s['median_ms']:.2f}{recompiles} | {s['min_ms']:.2f} - {s['max_ms']:.2f} | "
                    f"{s['p10_ms']:.2f} - {s['p90_ms']:.2f} | {host} | {pct(s['mfu'])} | {gib(s['peak_bytes'])} | "
                    f"{gib(s['resident_bytes'])} | {ratio} | {first} | {s['losses'][0]:.4f} |")
    text = ("| side | median step (ms) | min - max | p10 - p90 | host (ms) | MFU | peak GiB | resident GiB | "
            "time / axedist's | first step (s) | first loss |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n\n")
    text += (f"Model FLOPs per step {record['model_flops_per_step']:.3e} ({record['flops_formula']}); MFU = model "
             f"FLOPs / (median step x {record['world']} GPUs x peak), peak "
             + (f"{record['peak_flops_per_gpu'] / 1e12:.0f} TFLOP/s bf16 dense per GPU" if record["peak_flops_per_gpu"]
                else "unknown for this device (n/a)") + ". Peak GiB: the side's resident bytes (its parameters, "
             "gradients, optimizer state and caches, measured when it was built and warmed up) plus the largest "
             "rise of `torch.cuda.max_memory_allocated` over one step, max over steps and ranks (the JSON's "
             "`process_peak_bytes`: the value as read, with every side's resident bytes); symmetric-memory "
             "workspaces are outside the caching allocator and not counted. time / axedist's: the side's median "
             "over axedist's of the same mode (above 1: axedist is faster). First step: the side's first warm-up "
             "step (its planning, Triton's compiling of the kernels it launches, torch.compile's tracing)"
             + (f", all of them after `warm_libraries` ({record['library_warmup_s']:.1f} s: cuBLAS, cuDNN's "
                "attention kernels and NCCL warmed at one rank's shapes, so that no side's first step pays them "
                "for the others)" if record.get("library_warmup_s") is not None else "") + ". Host: "
             "the median over steps of the slowest rank's time until the step's Python returned, before waiting "
             "for the GPU; near the step's time, the host, not the GPU, bounds the step.\n\n")
    for name, error in (record.get("failed") or {}).items():
        text += f"**{name} failed and is not in the table**: {error[:600]}\n\n"
    if record.get("goals"):
        text += "Goals (issue 27):\n\n" + "".join(
            f"- {g['goal']}: {g['value']:.2f} (target {'>=' if 'step' in g['goal'] else '<='} {g['target']}) "
            f"{'met' if g['met'] else 'NOT met'}\n" for g in record["goals"]) + "\n"
    if record.get("memory_estimate"):
        text += describe_estimate(record["memory_estimate"]) + " (before the run).\n\n"
    check = record.get("loss_check")
    if check:
        text += (f"fp32 loss check ({check['steps']} steps, {check['config']}, batch {check['batch']}, same init and "
                 f"data): **{'passed' if check['passed'] else 'FAILED'}**, tolerance {check['tolerance']:g} relative "
                 f"to {check['reference']}:\n\n| side | losses | max relative difference |\n|---|---|---|\n" +
                 "".join(f"| {n} | {', '.join(f'{v:.6f}' for v in vs)} | "
                         f"{check['max_rel_diff'][n]:.2e} |\n" if n in check["max_rel_diff"] else
                         f"| {n} | {', '.join(f'{v:.6f}' for v in vs)} | (reference) |\n"
                         for n, vs in check["losses"].items()) +
                 "".join(f"| {n} | failed: {e[:300]} | - |\n" for n, e in check.get("errors", {}).items()) + "\n")
    for name, s in record["sides"].items():
        if s.get("first_step_profile"):
            text += _first_step_section(name, s["first_step_profile"])
    for kind, render in (("Memory", _memory_section), ("Profile", _profile_section)):
        for name, found in (record.get(kind.lower()) or {}).items():
            text += f"{kind} of {name}: {found['error'][:400]}\n\n" if "error" in found else render(name, found)
    return text


def _memory_section(name: str, m: dict) -> str:
    unit, scale = memory_unit(m["peak_bytes"])
    return (f"Memory of one step, {name} (rank 0): the step's allocations peaked at {m['peak_bytes'] / scale:.2f} {unit} "
            f"over what it started with, {m['blocks']} blocks live then; by where they were allocated:\n\n"
            + _table(("site", unit, "blocks"),
                     [(f"`{t['site'][:120]}`", f"{t['bytes'] / scale:.3f}", t["blocks"]) for t in m["top"]]))


def _first_step_section(name: str, p: dict) -> str:
    cells = lambda r: (f"`{r['function'][:100]}`", r["calls"], f"{r['own_s']:.3f}", f"{r['cumulative_s']:.3f}")  # noqa: E731
    return (f"First step of {name} under cProfile (rank 0; {p['profiled_s']:.2f} s of Python and the C calls "
            f"it made), by own time:\n\n" + _table(("function", "calls", "own s", "cumulative s"),
                                                 [cells(r) for r in p["by_own_time"][:15]])
            + "by cumulative time:\n\n" + _table(("function", "calls", "own s", "cumulative s"),
                                                  [cells(r) for r in p["by_cumulative_time"]]))


def _profile_section(name: str, p: dict) -> str:
    return (f"Profile of one step, {name} (rank 0, {p['what']}): busy {p['busy_ms']:.2f} ms, summed "
            f"{p['summed_ms']:.2f} ms, step {p['step_ms']:.2f} ms\n\n"
            + _table(("name", "ms", "calls", "share"),
                     [(f"`{t['name'][:90]}`", f"{t['ms']:.3f}", t["calls"], f"{100 * t['share_of_summed']:.1f}%")
                      for t in p["top"]]))


def _table(columns: tuple, rows: list) -> str:
    """A markdown table of ``rows`` (cells as they print) under ``columns``, then a blank line."""
    return ("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            + "".join("| " + " | ".join(str(cell) for cell in row) + " |\n" for row in rows) + "\n")


def plot(path: str, record: dict, title: str) -> bool:
    """A bar chart of each side's median step time, min - max as error bars; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(record["sides"])
    med = [record["sides"][n]["median_ms"] for n in names]
    low = [m - record["sides"][n]["min_ms"] for n, m in zip(names, med)]
    high = [record["sides"][n]["max_ms"] - m for n, m in zip(names, med)]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    bars = ax.bar(range(len(names)), med, yerr=[low, high], capsize=4,
                  color=["tab:blue" if n.startswith("axedist") else "tab:gray" for n in names])
    for bar, n in zip(bars, names):
        mfu = record["sides"][n]["mfu"]
        ax.annotate(f"{bar.get_height():.1f}" + (f"\n{100 * mfu:.0f}% MFU" if mfu else ""),
                    (bar.get_x() + bar.get_width() / 2, record["sides"][n]["max_ms"]), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.margins(y=0.15)  # room for the labels above the tallest bar
    ax.set_ylabel("step time (ms), median; bars: min - max")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_results(out_dir: str, stem: str, record: dict, markdown: str, title: str, say: Callable) -> None:
    """``<stem>.json``, ``.md`` and ``.png`` in ``out_dir``, and a line in its history."""
    import os

    from history import append_history  # benchmarks/history.py, beside this script

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem)
    with open(path + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(markdown)
    drew = plot(path + ".png", record, title)
    append_history(out_dir, stem, record["meta"], {k: v for k, v in record.items() if k != "meta"})
    say(f"wrote {path}.json, .md" + (", .png" if drew else ""))
