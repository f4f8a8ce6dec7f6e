"""The p2p collectives with W = 2, 4, 8 virtual ranks on one GPU, against an fp32 reference.

Real call path (p2p.CallPlan: epochs, alternating halves, barrier words, timeouts) on workspaces
carved from this GPU's memory; outputs poisoned with NaN beforehand; fresh random inputs (the
seed is in every failure message); odd sizes and tails; calls back to back with no host sync;
a rank that never arrives.
"""
import time

import pytest
import torch

from axedist.testing import VirtualRanks
from axedist.testing.virtual_ranks import precompile_collectives

# elements per rank: odd (masked tails, no 16-divisibility) and a multiple of 16 spanning
# several grid strides; W = 2 and 8 take one each, W = 4 both
SIZES = {2: (1001,), 4: (1001, 49152), 8: (49152,)}
OPS = ("reduce_scatter", "all_gather", "all_reduce_one_shot", "all_reduce_two_shot")
VARIANTS = ("push", "pull")
ROUNDS = 4


def _input_shape(op, world, count):
    return (world * count,) if op == "reduce_scatter" else (count,)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Every kernel these tests launch, compiled in parallel processes up front."""
    if not torch.cuda.is_available():
        return
    for world, sizes in SIZES.items():
        cases = [(op, _input_shape(op, world, count), torch.bfloat16, variant, None, True)
                 for op in OPS for variant in VARIANTS for count in sizes]
        if world == 4:
            cases += [("reduce_scatter", (4 * 1001,), torch.float32, v, None, True) for v in VARIANTS]
            cases += [(op, _input_shape(op, 4, 49152), torch.bfloat16, v, ROUNDS, True)
                      for op in ("reduce_scatter", "all_gather") for v in VARIANTS]
        precompile_collectives(world, cases, processes=16)


def _reference(op, xs, world):
    stacked = torch.stack([x.double() for x in xs])
    if op == "all_gather":
        return [stacked.reshape(-1, *xs[0].shape[1:])] * world
    total = stacked.sum(0)
    if op == "reduce_scatter":
        return list(total.chunk(world))
    return [total] * world


def _run(ranks, op, xs, variant, rounds=None, outs=None):
    if op == "reduce_scatter":
        return ranks.reduce_scatter(xs, outs, variant=variant, rounds=rounds)
    if op == "all_gather":
        return ranks.all_gather(xs, outs, variant=variant, rounds=rounds)
    return ranks.all_reduce(xs, outs, algorithm=op.replace("all_reduce_", ""), variant=variant)


def _poisoned(op, x, world):
    shape = {"reduce_scatter": (x.shape[0] // world,), "all_gather": (world * x.shape[0],)}
    return [torch.full(shape.get(op, x.shape), float("nan"), dtype=x.dtype, device=x.device)
            for _ in range(world)]


def _failures(op, xs, outs, world, label):
    failures = []
    tolerance = 0.0 if op == "all_gather" else (1e-2 if xs[0].dtype == torch.bfloat16 else 1e-6)
    for rank, (out, ref) in enumerate(zip(outs, _reference(op, xs, world))):
        if torch.isnan(out).any():
            failures.append(f"{label} rank {rank}: NaN left (unwritten output)")
            continue
        error = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if error > tolerance:
            failures.append(f"{label} rank {rank}: rel error {error:.2e}")
    if op == "all_reduce_two_shot" and not failures and not all(torch.equal(outs[0], o) for o in outs):
        failures.append(f"{label}: ranks differ (two-shot results must be bit-identical)")
    return failures


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("world", sorted(SIZES))
def test_every_collective_matches_an_fp32_reference(world, variant, seed):
    ranks = VirtualRanks(world, 4 << 20)
    failures = []
    for op in OPS:
        for count in SIZES[world]:
            xs = [torch.randn(_input_shape(op, world, count), device="cuda").to(torch.bfloat16)
                  for _ in range(world)]
            outs = _run(ranks, op, xs, variant, outs=_poisoned(op, xs[0], world))
            ranks.check()
            failures += _failures(op, xs, outs, world, f"{op} {variant} W={world} n={count} seed={seed}")
    assert not failures, failures


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_reduce_scatter(variant, seed):
    ranks = VirtualRanks(4, 4 << 20)
    xs = [torch.randn(4 * 1001, device="cuda") for _ in range(4)]
    outs = ranks.reduce_scatter(xs, _poisoned("reduce_scatter", xs[0], 4), variant=variant)
    ranks.check()
    assert not _failures("reduce_scatter", xs, outs, 4, f"fp32 {variant} seed={seed}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_pipelined_rounds(op, variant, seed):
    """The place / combine phases pipelined over 4 ranges (one barrier slot per range)."""
    ranks = VirtualRanks(4, 4 << 20)
    xs = [torch.randn(_input_shape(op, 4, 49152), device="cuda").to(torch.bfloat16) for _ in range(4)]
    outs = _run(ranks, op, xs, variant, rounds=ROUNDS, outs=_poisoned(op, xs[0], 4))
    ranks.check()
    assert all(plan.rounds == ROUNDS for plan in ranks.last_plans), ranks.last_plans
    assert not _failures(op, xs, outs, 4, f"{op} {variant} rounds={ROUNDS} seed={seed}")


def test_back_to_back_calls_without_sync(seed):
    """Twenty calls of alternating ops, variants and sizes queued with no host sync: epochs
    advance, halves alternate, barrier regions alternate by parity; every result is checked
    after the last call."""
    world = 4
    ranks = VirtualRanks(world, 4 << 20)
    pending = []
    for call in range(20):
        op = OPS[call % len(OPS)]
        variant = VARIANTS[(call // len(OPS)) % 2]
        count = SIZES[world][call % 2]
        xs = [torch.randn(_input_shape(op, world, count), device="cuda").to(torch.bfloat16)
              for _ in range(world)]
        outs = _run(ranks, op, xs, variant, outs=_poisoned(op, xs[0], world))
        pending.append((op, xs, outs, f"call {call} {op} {variant} n={count} seed={seed}"))
    ranks.check()
    assert [w.device_epoch() for w in ranks.workspaces] == [20] * world
    failures = [f for op, xs, outs, label in pending for f in _failures(op, xs, outs, world, label)]
    assert not failures, failures


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_rank_that_never_arrives_is_named_by_the_others(variant):
    world, missing, timeout_s = 4, 2, 1.0
    ranks = VirtualRanks(world, 4 << 20)
    xs = [torch.randn(world * 1001, device="cuda").to(torch.bfloat16) for _ in range(world)]
    ranks.reduce_scatter(xs, variant=variant)  # a good call first: epochs 1 everywhere
    ranks.check()
    start = time.perf_counter()
    ranks.reduce_scatter(xs, variant=variant, absent=(missing,), timeout_s=timeout_s)
    messages = ranks.errors()
    elapsed = time.perf_counter() - start
    assert messages[missing] == ""
    for rank in range(world):
        if rank != missing:
            assert f"of rank {missing} " in messages[rank] and "gave up" in messages[rank], messages
    assert elapsed < timeout_s + 5.0, elapsed


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("world", [2, 4])
def test_layer_tail_matches_float64_on_virtual_ranks(world, variant):
    """The fused decode tail (all-reduce + residual add + RMSNorm) against float64, the same bits
    on every rank, five calls back to back without a host sync (epochs and halves alternate)."""
    ranks = VirtualRanks(world, data_bytes=8 << 20)
    seed = int(time.time()) % 10_000
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for call, (rows, hidden) in enumerate([(1, 4096), (8, 4096), (64, 8192), (5, 1000), (3, 16384)]):
        dtype = torch.bfloat16 if call % 2 == 0 else torch.float32
        xs = [torch.randn(rows, hidden, device="cuda", generator=generator).to(dtype) for _ in range(world)]
        residual = torch.randn(rows, hidden, device="cuda", generator=generator).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=generator)).to(dtype)
        outs = ranks.all_reduce_rms_norm(xs, residual, weight, 1e-5, variant=variant)
        h_ref = residual.double() + torch.stack([x.double() for x in xs]).sum(0)
        hr = h_ref.to(dtype).double()
        y_ref = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        for rank, (h, y) in enumerate(outs):
            for label, got, ref in (("h", h, h_ref), ("y", y, y_ref)):
                error = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                assert error <= tolerance, f"seed {seed} call {call} rank {rank} {label}: error {error:.2e}"
            assert torch.equal(h, outs[0][0]) and torch.equal(y, outs[0][1]), f"seed {seed}: ranks differ"
    ranks.check()
