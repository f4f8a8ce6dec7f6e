"""p2p collectives vs torch.distributed (NCCL) on W = torch.cuda.device_count() GPUs.

Fresh random inputs every time (never zeros), outputs poisoned with NaN beforehand, odd sizes,
all three dtypes, many calls back to back without resets, and a peer that never signals.
"""

import pytest
import torch
import torch.distributed as dist

from axedist.testing import run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# elements per rank chunk: tiny, odd, not a multiple of 16, block-sized, multi-block, large
SIZES = (1, 7, 33, 1000, 4096, 4097, 65_537, 1 << 20, 3_000_001)


def _tolerance(dtype, world):
    # the reference sums in fp32 and rounds once; NCCL may round per step: bf16 differs by ulps
    return {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


def _rel_error(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(rank, shape, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32).to(dtype)


def _reference_sum(x, world):
    """fp32 sum over ranks of x (gathered through NCCL)."""
    gathered = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, x.contiguous())
    return gathered.float().sum(0)


def body_reduce_scatter(rank, world, sizes, dtypes, repeats):
    from axedist.collectives import p2p
    failures = []
    for dtype in dtypes:
        for chunk in sizes:
            for repeat in range(repeats):
                x = _inputs(rank, (world * chunk,), dtype, seed=chunk + repeat + 7 * DTYPES.index(dtype))
                out = torch.full((chunk,), float("nan"), dtype=dtype, device="cuda")
                p2p.reduce_scatter(x, out=out)
                ref = _reference_sum(x, world)[rank * chunk:(rank + 1) * chunk]
                nccl = torch.empty(chunk, dtype=dtype, device="cuda")
                dist.reduce_scatter_tensor(nccl, x)
                if torch.isnan(out).any():
                    failures.append(f"{dtype} chunk {chunk} repeat {repeat}: NaN left (unwritten)")
                error = _rel_error(out, ref)
                if error > _tolerance(dtype, world) / 4:
                    failures.append(f"{dtype} chunk {chunk}: rel error {error:.2e} vs fp32 ref")
                if _rel_error(out, nccl) > _tolerance(dtype, world):
                    failures.append(f"{dtype} chunk {chunk}: differs from NCCL")
    # 2-D input, dim 0 scattered
    x = _inputs(rank, (world * 3, 129), torch.bfloat16, seed=99)
    out = p2p.reduce_scatter(x)
    ref = _reference_sum(x, world)[rank * 3:(rank + 1) * 3]
    if out.shape != (3, 129) or _rel_error(out, ref) > 5e-3:
        failures.append(f"2-D reduce-scatter: shape {tuple(out.shape)}, error {_rel_error(out, ref)}")
    torch.cuda.synchronize()
    from axedist.collectives import check
    check()
    return failures


def body_all_gather(rank, world, sizes, dtypes):
    from axedist.collectives import p2p
    failures = []
    for dtype in dtypes:
        for chunk in sizes:
            x = _inputs(rank, (chunk,), dtype, seed=chunk + 3)
            out = torch.full((world * chunk,), float("nan"), dtype=dtype, device="cuda")
            p2p.all_gather(x, out=out)
            ref = torch.empty(world * chunk, dtype=dtype, device="cuda")
            dist.all_gather_into_tensor(ref, x)
            if not torch.equal(out, ref):
                failures.append(f"{dtype} chunk {chunk}: all_gather differs from NCCL "
                                f"(NaN left: {bool(torch.isnan(out).any())})")
    torch.cuda.synchronize()
    return failures


def body_all_reduce(rank, world, sizes, dtypes, algorithm):
    from axedist.collectives import p2p
    failures = []
    for dtype in dtypes:
        for numel in sizes:
            x = _inputs(rank, (numel,), dtype, seed=numel + 11)
            out = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
            p2p.all_reduce(x, out=out, algorithm=algorithm)
            ref = _reference_sum(x, world)
            if torch.isnan(out).any():
                failures.append(f"{algorithm} {dtype} n {numel}: NaN left")
            error = _rel_error(out, ref)
            if error > _tolerance(dtype, world) / 4:
                failures.append(f"{algorithm} {dtype} n {numel}: rel error {error:.2e}")
            # every rank must hold bit-identical results (two-shot gathers one reduced copy)
            if algorithm == "two_shot":
                gathered = torch.empty((world, numel), dtype=dtype, device="cuda")
                dist.all_gather_into_tensor(gathered, out)
                if not all(torch.equal(gathered[0], gathered[r]) for r in range(world)):
                    failures.append(f"two_shot {dtype} n {numel}: ranks disagree")
    torch.cuda.synchronize()
    return failures


def body_back_to_back(rank, world, calls):
    """Many calls of mixed ops and sizes with no host sync: epochs and halves alternate."""
    from axedist.collectives import p2p
    inputs, outputs = [], []
    for call in range(calls):
        chunk = 1000 + 4096 * (call % 5)
        x = _inputs(rank, (world * chunk,), torch.bfloat16, seed=500 + call)
        inputs.append(x)
        kind = call % 3
        if kind == 0:
            outputs.append(p2p.reduce_scatter(x))
        elif kind == 1:
            outputs.append(p2p.all_reduce(x, algorithm="two_shot"))
        else:
            outputs.append(p2p.all_gather(x))
    failures = []
    for call, (x, out) in enumerate(zip(inputs, outputs)):
        chunk = x.numel() // world
        kind = call % 3
        if kind == 0:
            ref = _reference_sum(x, world)[rank * chunk:(rank + 1) * chunk]
            error = _rel_error(out, ref)
        elif kind == 1:
            error = _rel_error(out, _reference_sum(x, world))
        else:
            ref = torch.empty(world * x.numel(), dtype=x.dtype, device="cuda")
            dist.all_gather_into_tensor(ref, x)
            error = 0.0 if torch.equal(out, ref) else 1.0
        if error > 5e-3:
            failures.append(f"call {call} kind {kind}: error {error:.2e}")
    return failures


def body_timeout(rank, world):
    """Rank 0 never launches; the other ranks' kernels must give up and raise, naming rank 0."""
    from axedist.collectives import CollectiveTimeoutError, p2p
    from axedist.collectives.symmetric import get_workspace
    x = _inputs(rank, (world * 4096,), torch.bfloat16, seed=1)
    workspace = get_workspace(None, x.numel() * 2 * 64, fresh=True)  # collective allocation
    message = ""
    if rank != 0:
        p2p.reduce_scatter(x, timeout_s=0.5)
        try:
            workspace.check(synchronize=True)
        except CollectiveTimeoutError as error:
            message = str(error)
    dist.barrier()
    from axedist.collectives import reset
    reset()
    # the group works again afterwards (fresh workspace)
    out = p2p.reduce_scatter(x)
    ref = _reference_sum(x, world)[rank * 4096:(rank + 1) * 4096]
    return message, _rel_error(out, ref)


def body_errors(rank, world):
    from axedist.collectives import p2p, reduce_scatter
    messages = []
    for bad in (lambda: p2p.reduce_scatter(torch.randn(world * 2 + 1, device="cuda")),
                lambda: p2p.reduce_scatter(torch.randn(8)),
                lambda: p2p.all_reduce(torch.ones(8, dtype=torch.int32, device="cuda")),
                lambda: reduce_scatter(torch.randn(8, device="cuda"), backend="nccl")):
        try:
            bad()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_reduce_scatter_matches_nccl():
    results = run_on_ranks(body_reduce_scatter, WORLD, "nccl", args=(SIZES, DTYPES, 2), timeout_s=600)
    assert results == [[]] * WORLD, results


def test_all_gather_matches_nccl():
    results = run_on_ranks(body_all_gather, WORLD, "nccl", args=(SIZES, DTYPES), timeout_s=600)
    assert results == [[]] * WORLD, results


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_all_reduce_matches_reference(algorithm):
    sizes = (1, 7, 4097, 65_537, 1 << 20, 3_000_001)
    results = run_on_ranks(body_all_reduce, WORLD, "nccl", args=(sizes, DTYPES, algorithm), timeout_s=600)
    assert results == [[]] * WORLD, results


def test_back_to_back_calls_without_resets():
    results = run_on_ranks(body_back_to_back, WORLD, "nccl", args=(60,), timeout_s=600)
    assert results == [[]] * WORLD, results


def test_peer_that_never_signals_raises_timeout():
    results = run_on_ranks(body_timeout, WORLD, "nccl", timeout_s=300)
    assert results[0][0] == ""
    for rank in range(1, WORLD):
        message, error = results[rank]
        assert "rank 0" in message and "gave up" in message, message
    assert all(error < 5e-3 for _, error in results), results


def test_bad_input_raises_clear_errors():
    messages = run_on_ranks(body_errors, WORLD, "nccl", timeout_s=300)[0]
    assert messages[0] and "not divisible by the group size" in messages[0]
    assert messages[1] and "CUDA" in messages[1]
    assert messages[2] and "dtype" in messages[2]
    assert messages[3] and "backend must be one of" in messages[3]
