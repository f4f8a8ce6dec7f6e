"""Ranks that must agree, on 4 pooled gloo ranks: every rank raises one clear error, none hangs,
and the checks cost one exchange per new plan (none on the cached path).

The faults that break a job (a rank that raises, exits or stalls) run on fresh ranks in
tests/test_faults.py; here the job survives every error, so the pool is reused.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import axedist.runtime.executor as executor
from axedist import peers
from axedist.dtensor import DTensor, distribute
from axedist.layout import Layout, LayoutError
from axedist.mesh import DeviceMesh
from axedist.ops.call_plan import DispatchError
from axedist.peers import PeerError, RankDisagreementError
from axedist.testing import run_on_ranks
from axedist.testing.ranks import run_fresh_ranks


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _disagreements(rank, world):
    mesh = DeviceMesh("cpu", (world,))
    full = torch.arange(48.0).reshape(8, 6)
    x = distribute(full, mesh, [Shard(0)])
    out = {}
    # a layout invalid on rank 2 only (two elements in one slot): rank 2 raises it, the others say so
    bad = "S[(4,2,6):(1@gpuid,6,2)]" if rank == 2 else "S[(8,6):(6,1)] + R[4:1@gpuid]"
    out["invalid_here"] = _error(lambda: x.redistribute(Layout.parse(bad)))
    # from_local with the default run_check=False: rank 1's local tensor has another dtype
    local = torch.ones(2, 6, dtype=torch.float32 if rank == 1 else torch.float64)
    out["from_local_dtype"] = _error(lambda: DTensor.from_local(local, mesh, [Shard(0)]))
    # rank 3 asks for another move than the others (both move data)
    out["other_move_here"] = _error(lambda: x.redistribute([Shard(1)] if rank == 3 else [Replicate()]))
    # plain integer constants that differ beyond float64's 53 bits: not adopted as one replicated value
    ints = distribute(torch.zeros(8, 6, dtype=torch.int64), mesh, [Shard(0)])
    constant = torch.full((8, 6), 2**53 + (rank == 1), dtype=torch.int64)
    out["constant"] = _error(lambda: ints + constant)
    same = torch.full((8, 6), 2**53 + 1, dtype=torch.int64)
    out["constant_same"] = int((ints + same).full_tensor()[0, 0])
    # the job still works after every error: the same move on every rank
    out["after"] = float(x.redistribute([Replicate()]).to_local().sum())
    dist.barrier()
    return out


def test_disagreeing_ranks_all_raise():
    results = run_on_ranks(_disagreements, 4)
    for rank, out in enumerate(results):
        if rank == 2:
            assert out["invalid_here"].startswith("LayoutError") and "two elements" in out["invalid_here"]
        else:
            assert out["invalid_here"].startswith("RankDisagreementError"), out["invalid_here"]
            assert "rank 2: raised LayoutError" in out["invalid_here"] and "two elements" in out["invalid_here"]
        assert out["from_local_dtype"].startswith("RankDisagreementError"), out["from_local_dtype"]
        assert "rank 1: local (2, 6) torch.float32 -> [8, 6]" in out["from_local_dtype"]
        assert "ranks 0, 2, 3: local (2, 6) torch.float64 -> [8, 6]" in out["from_local_dtype"]
        assert out["other_move_here"].startswith("RankDisagreementError"), out["other_move_here"]
        assert "rank 3: [8, 6] S[(4,12):(1@gpuid,1)] -> [8, 6] (padded [8, 8]) S[(8,4,2):(2,1@gpuid,1)]" \
            in out["other_move_here"]
        assert "ranks 0, 1, 2: [8, 6] S[(4,12):(1@gpuid,1)] -> [8, 6] S[48:1] + R[4:1@gpuid]" in out["other_move_here"]
        assert out["constant"].startswith("DispatchError") and "same on every rank" in out["constant"], out["constant"]
        assert out["constant_same"] == 2**53 + 1
        assert out["after"] == 48 * 47 / 2


class _NoHostReads:
    """Within: reading a tensor's value on the host raises, as it would under CUDA-graph capture."""

    NAMES = ("tolist", "item", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def refuse(*args, **kwargs):
            raise AssertionError("a host read while 'capturing'")

        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse)

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


def _captured_agreement(rank, world):
    """Plain tensors among DTensors while a CUDA graph is 'captured' (checks.capturing patched on, as
    it reads on a capturing CUDA stream): their agreement is asserted on the device, with no host
    read (torch._assert_async raises at once on CPU, with the message)."""
    from axedist.runtime import checks

    mesh = DeviceMesh("cpu", (world,))
    torch.manual_seed(0)
    table = torch.randn(10, 4)
    weight = distribute(table, mesh, [Shard(0)])
    same = torch.randint(0, 10, (3, 5))
    ints = distribute(torch.arange(48).reshape(8, 6), mesh, [Shard(0)])
    out = {}
    torch.nn.functional.embedding(same, weight), ints + torch.full((8, 6), 7)  # warm-up: the plans, as before a capture
    checks.capturing = lambda values: True
    try:
        with _NoHostReads():
            looked_up = torch.nn.functional.embedding(same, weight)
            added = ints + torch.full((8, 6), 7)
        out["lookup"] = torch.equal(looked_up.full_tensor(), table[same])
        out["constant"] = torch.equal(added.full_tensor(), torch.arange(48).reshape(8, 6) + 7)
        differs = same + (rank == 1)
        out["differs"] = _error(lambda: torch.nn.functional.embedding(differs % 10, weight))
        out["not_constant"] = _error(lambda: ints + torch.arange(6))
    finally:
        checks.capturing = lambda values: values.is_cuda and torch.cuda.is_current_stream_capturing()
    dist.barrier()
    return out


def test_plain_tensors_agreement_is_asserted_on_the_device_while_captured():
    for out in run_on_ranks(_captured_agreement, 2):
        assert out["lookup"] and out["constant"], out
        assert out["differs"].startswith("RuntimeError") and "differs between the ranks" in out["differs"], out
        assert out["not_constant"].startswith("RuntimeError") and "more than one value" in out["not_constant"], out
        assert all(len(out[key]) <= len("RuntimeError: ") + 254 for key in ("differs", "not_constant")), out


def _moves_on_rank_0_only(rank, world):
    """Rank 0 alone makes moves that send nothing, as a script that logs on rank 0 does: a
    replicated tensor's ``full_tensor()``, its local chunk (``Replicate -> Shard``), a move to
    its own placements; then every rank makes one that communicates, agreeing or not."""
    mesh = DeviceMesh("cpu", (world,))
    x = distribute(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()])
    out = {}
    if rank == 0:
        out["full"] = _error(lambda: x.full_tensor().sum().item()) or x.full_tensor().sum().item()
        out["chunk"] = _error(lambda: x.redistribute([Shard(0)])) or x.redistribute([Shard(0)]).to_local().tolist()
        out["stay"] = _error(lambda: x.redistribute([Replicate()])) or x.redistribute(mesh, None).to_local().tolist()
    y = distribute(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)])
    out["gather"] = _error(lambda: y.redistribute([Replicate()])) or float(y.redistribute([Replicate()]).to_local().sum())
    # a new move that communicates is still checked: rank 1 asks for another one than rank 0
    z = distribute(torch.arange(40.0).reshape(8, 5), mesh, [Shard(0)])
    out["differ"] = _error(lambda: z.redistribute([Shard(1)] if rank == 1 else [Replicate()]))
    return out


def _train_step_logged_on_rank_0(rank, world, log):
    """One TP step of a 2-layer MLP; with ``log``, rank 0 alone prints the replicated loss's
    ``full_tensor()`` before the backward. The first layer's full weight gradient."""
    from torch import nn

    from axedist.nn import ColwiseParallel, RowwiseParallel, parallelize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)).double()
    mesh = DeviceMesh("cpu", (world,))
    model = parallelize(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    batch = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss = model(batch).pow(2).mean()
    if log and rank == 0:
        print("loss", float(loss.full_tensor()))
    loss.backward()
    return model[0].weight.grad.full_tensor()


def _one_process_gradient():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)).double()
    model(torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    return model[0].weight.grad


def test_a_move_that_sends_nothing_may_run_on_one_rank():
    """torch returns at once from a rank-0-only ``full_tensor()`` of a replicated tensor: so does
    axedist (no check to wait in), and the next moves' checks still line up on every rank."""
    outcomes = run_fresh_ranks(_moves_on_rank_0_only, 2, collective_timeout_s=5.0)
    for o in outcomes:
        assert o.status == "ok", f"{o}\n{o.message}"
        assert o.value["gather"] == 48 * 47 / 2, o.value
        assert o.value["differ"].startswith("RankDisagreementError"), o.value["differ"]
        assert "rank 0: [8, 5] S[(2,20):(1@gpuid,1)] -> [8, 5] S[40:1] + R[2:1@gpuid]" in o.value["differ"], o.value
        assert "rank 1: [8, 5] S[(2,20):(1@gpuid,1)] -> [8, 5] (padded [8, 6]) S[" in o.value["differ"], o.value
    assert outcomes[0].value["full"] == 15.0
    assert outcomes[0].value["chunk"] == [[0.0, 1.0, 2.0]]
    assert outcomes[0].value["stay"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_logging_on_rank_0_leaves_the_training_step_alone():
    """``if rank == 0: print(loss.full_tensor())`` in a TP step: the gradients are the one-process
    model's on every rank (it once shifted rank 0's checks: a false disagreement in the backward)."""
    expected = _one_process_gradient()
    for o in run_fresh_ranks(_train_step_logged_on_rank_0, 2, args=(True,), collective_timeout_s=5.0):
        assert o.status == "ok", f"{o}\n{o.message}"
        torch.testing.assert_close(o.value, expected)


def _argument_error_on_rank_0(rank, world, case):
    """Rank 0 alone passes an argument that axedist refuses before its agreement check; the
    other ranks make the call with good arguments, then the move that follows."""
    from torch.distributed.tensor import Partial

    mesh = DeviceMesh("cpu", (world,))
    x = distribute(torch.arange(24.0).reshape(4, 6), mesh, [Shard(0)])
    here = rank == 0
    if case == "unplannable target":
        return x.redistribute([Partial()] if here else [Replicate()]).to_local().tolist()
    if case == "another mesh":
        other = DeviceMesh("cpu", (world,), ("tp",))
        return x.redistribute(other if here else mesh, [Replicate()]).to_local().tolist()
    local = torch.ones(2, 6, device="meta" if here and case == "device" else "cpu")
    if case == "stride":
        y = DTensor.from_local(local, mesh, [Shard(0)], shape=(4, 6), stride=(1, 4) if here else (6, 1))
    elif case == "grad_placements":
        y = DTensor.from_local(local, mesh, [Shard(0)], grad_placements=[Partial()] if here else None)
    else:
        y = DTensor.from_local(local, mesh, [Shard(0)])
    return y.full_tensor().tolist()


@pytest.mark.parametrize("case, error", [
    ("unplannable target", "LayoutError: cannot redistribute to a pending sum"),
    ("another mesh", "MeshError: redistribute moves a tensor within its mesh"),
    ("stride", "LayoutError: from_local: stride (1, 4) is not the contiguous stride"),
    ("grad_placements", "LayoutError: from_local(grad_placements=[Partial(sum)]): a gradient cannot"),
    ("device", "LayoutError: local tensor is on meta"),
])
def test_an_argument_error_on_one_rank_is_posted(case, error):
    """docs/dtensor.md: a rank whose own arguments are invalid posts its error, so its peers raise
    at once naming it (they once waited out the collective timeout, told the rank 'did not arrive')."""
    outcomes = run_fresh_ranks(_argument_error_on_rank_0, 2, args=(case,), collective_timeout_s=5.0)
    assert outcomes[0].status == "raised" and error in outcomes[0].message, outcomes[0]
    peer = outcomes[1]
    assert peer.error == "RankDisagreementError" and "rank 0: " in peer.message, f"{peer}\n{peer.message}"
    assert error.split(": ", 1)[1] in peer.message and "raised " + error.split(":")[0] in peer.message, peer.message
    assert peer.seconds < 4.0, peer


def _mesh_in_another_order(rank, world):
    import axedist as ax

    mesh = ax.DeviceMesh("cpu", (world,), ranks=[0, 1] if rank == 0 else [1, 0])
    return ax.DTensor.from_local(torch.full((2, 2), float(rank)), mesh, [Shard(0)]).full_tensor().tolist()


def test_a_mesh_listed_in_another_order_on_one_rank_is_a_disagreement():
    """The same rank set in another order on one rank: every rank raises at once, naming the order,
    instead of each waiting out the timeout in a check no peer joins."""
    outcomes = run_fresh_ranks(_mesh_in_another_order, 2, collective_timeout_s=5.0)
    for o in outcomes:
        assert o.status == "raised" and o.error == "RankDisagreementError", f"{o}\n{o.message}"
        assert "[ranks in the order [1, 0]]" in o.message and o.seconds < 4.0, f"{o}\n{o.message}"


class _SlowReader:
    """The job's store, but reading every member's text late (a rank slow between its wait and its read)."""

    def __init__(self, store):
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def multi_get(self, keys):
        time.sleep(1.5)
        return self.store.multi_get(keys)


def _failures_while_a_peer_reads(rank, world):
    ranks = list(range(world))
    if rank == world - 1:
        store = dist.distributed_c10d._get_default_store()
        dist.distributed_c10d._get_default_store = lambda: _SlowReader(store)
    peers.agree(ranks, "check", "the same")
    for _ in range(3):  # the same mistake on every rank: posted, not read
        peers.agree(ranks, "check", "", failed=ValueError("refused everywhere"))
    peers.agree(ranks, "check", "the same again")
    return True


def test_failures_posted_while_a_peer_still_reads_leave_its_texts():
    """Ranks that post failures in quick succession (each raising the same argument error) while
    a peer still reads the check before: the peer's read finds every text (a failing rank used to
    delete its text two checks back, and the slow reader waited on a deleted key for good)."""
    for o in run_fresh_ranks(_failures_while_a_peer_reads, 4, collective_timeout_s=5.0, deadline_s=60):
        assert o.status == "ok" and o.value is True, f"{o}\n{o.message}"


def _check_costs(rank, world):
    """Agreement exchanges: one per new move, none for a move this rank already checked."""
    mesh = DeviceMesh("cpu", (world,))
    x = distribute(torch.arange(40.0).reshape(8, 5), mesh, [Shard(0)])
    calls = []
    original = executor.agree
    executor.agree = lambda *args, **kwargs: (calls.append(args[1]), original(*args, **kwargs))[1]
    try:
        for _ in range(5):
            x.redistribute([Shard(1)])
        first = len(calls)
        for _ in range(20):
            x.redistribute([Shard(1)]).redistribute([Replicate()])
    finally:
        executor.agree = original
    return first, len(calls)


def test_agreement_runs_once_per_plan():
    for first, total in run_on_ranks(_check_costs, 2):
        assert (first, total) == (1, 2)  # S0 -> S1 once; then only the new S1 -> R, once


def _gemm_rows(rank, world, same):
    from axedist.collectives import gemm_reduce_scatter

    rows = 8 if same or rank else 12
    a = torch.ones(rows, 4, dtype=torch.bfloat16)
    b = torch.ones(4, 6, dtype=torch.bfloat16)
    return _error(lambda: gemm_reduce_scatter(a, b))


def test_gemm_reduce_scatter_rows_must_agree():
    for message in run_on_ranks(_gemm_rows, 2, args=(False,)):
        assert message.startswith("RankDisagreementError"), message
        assert "rank 0: a [12] x K @ b [K, 6] torch.bfloat16" in message and "rank 1: a [8] x K" in message
    assert run_on_ranks(_gemm_rows, 2, args=(True,)) == [None, None]


def test_rank_listing_groups_equal_texts():
    assert peers.rank_listing({0: "a", 2: "b", 1: "a"}) == "  ranks 0, 1: a\n  rank 2: b"


@pytest.mark.parametrize("text, expected", [
    ("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete", True),
    ("Connection closed by peer [127.0.0.1]:1234", True),
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)", False),
])
def test_is_peer_failure(text, expected):
    assert peers.is_peer_failure(RuntimeError(text)) is expected
    assert not peers.is_peer_failure(ValueError(text))


@pytest.mark.parametrize("seconds", [0, -5, float("inf"), float("nan"), True, "10"])
def test_timeout_argument_is_checked(seconds):
    with pytest.raises(ValueError, match="timeout_s must be seconds > 0"):
        peers.choose_timeout(seconds)


def test_error_classes():
    assert issubclass(RankDisagreementError, LayoutError) and issubclass(PeerError, RuntimeError)
    assert issubclass(DispatchError, RuntimeError)


def _copy_engines_on_one_rank(rank, world):
    """Rank 1 alone can issue copy-engine copies (cuda-python): a fused call whose kernels would
    then move data two ways raises on every rank before any kernel runs, and the job goes on."""
    import axedist.collectives.fused as fused
    import axedist.collectives.fused_tp as fused_tp
    from axedist.collectives import all_gather_gemm, gemm_reduce_scatter
    for module in (fused, fused_tp):
        module.copy_engines_usable = lambda: rank == 1
    a = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(rank)).bfloat16()
    b = torch.randn(8, 5, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = {"ag": _error(lambda: all_gather_gemm(a[:4], b)),
           "rs": _error(lambda: gemm_reduce_scatter(a, b))}
    for module in (fused, fused_tp):
        module.copy_engines_usable = lambda: False
    out["after"] = list(gemm_reduce_scatter(a, b).shape)
    dist.barrier()
    return out


def test_ranks_that_differ_in_copy_engines_raise_before_a_fused_kernel():
    for rank, out in enumerate(run_on_ranks(_copy_engines_on_one_rank, 2)):
        for op in ("ag", "rs"):
            assert out[op].startswith("RankDisagreementError"), (rank, out[op])
            assert "copy engines True" in out[op] and "copy engines False" in out[op], out[op]
        assert out["after"] == [4, 5]
