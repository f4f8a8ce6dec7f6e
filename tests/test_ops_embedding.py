"""Embedding over DTensors (ops/embedding.py) against F.embedding on whole tensors.

Every placement of the weight (vocab-sharded, dim-sharded, replicated) with every
placement of the indices, on 2 and 4 ranks and a 2x2 mesh, uneven vocabularies included:
the output and the weight grad must equal the single-device ones, and a vocab-sharded
weight must give a partial-sum output (the masked lookup, not a gather) and a vocab-sharded
grad.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import distribute
from axedist.layout import Layout
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks
from tests.ops_cases import MESHES


def _pairs(mesh, weight_options, index_options, generator, most=8):
    """Placement pairs to try: all of them on a 1-D mesh, a random ``most`` of them on 2-D."""
    pairs = [(list(w), list(i)) for w in itertools.product(weight_options, repeat=mesh.ndim)
             for i in itertools.product(index_options, repeat=mesh.ndim)]
    if len(pairs) > most:
        pairs = [pairs[j] for j in torch.randperm(len(pairs), generator=generator)[:most].tolist()]
    return pairs


def _embedding_case(rank, world_size, mesh_name, seed):
    mesh = DeviceMesh("cpu", *MESHES[mesh_name])
    g = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(2, 12, (1,), generator=g))          # often not divisible by the mesh
    dim = int(torch.randint(1, 6, (1,), generator=g))
    batch, seq = (int(v) for v in torch.randint(1, 6, (2,), generator=g))
    weight = torch.randn(vocab, dim, dtype=torch.float64, generator=g)
    indices = torch.randint(0, vocab, (batch, seq), generator=g)
    grad = torch.randn(batch, seq, dim, dtype=torch.float64, generator=g)
    padding_idx = int(torch.randint(-1, vocab, (1,), generator=g))  # -1: none
    scale = bool(torch.randint(0, 2, (1,), generator=g))
    pad = None if padding_idx < 0 else padding_idx

    reference = weight.clone().requires_grad_()
    want = F.embedding(indices, reference, padding_idx=pad, scale_grad_by_freq=scale)
    want.backward(grad)

    checked = 0
    for wp, ip in _pairs(mesh, [Shard(0), Shard(1), Replicate()], [Replicate(), Shard(0), Shard(1)], g):
        w = distribute(weight, mesh, wp).requires_grad_()
        i = distribute(indices, mesh, ip)
        out = F.embedding(i, w, padding_idx=pad, scale_grad_by_freq=scale)
        what = f"seed {seed}, vocab {vocab}, weight {wp}, indices {ip}"
        torch.testing.assert_close(out.full_tensor(), want, msg=what)
        for axis, p in enumerate(wp):
            if p == Shard(0):
                assert out.placements[axis] == Partial("sum"), f"{what}: {out.placements}"
            if p == Shard(1):
                assert out.placements[axis] == Shard(2), f"{what}: {out.placements}"
        out.backward(distribute(grad, mesh, [Replicate()] * mesh.ndim))
        torch.testing.assert_close(w.grad.full_tensor(), reference.grad, msg=what)
        if not scale and all(p == Replicate() for p in ip):
            # whole grads and indices: each rank builds only its vocab rows (no gather, no partial)
            assert all(p == Shard(0) for p in w.grad.placements), f"{what}: {w.grad.placements}"
        checked += 1
    return checked


@pytest.mark.parametrize("mesh_name,world_size", [("2", 2), ("4", 4), ("2x2", 4)])
@settings(max_examples=3)
@given(seed=st.integers(0, 2**31 - 1))
def test_embedding_forward_backward(mesh_name, world_size, seed):
    counts = run_on_ranks(_embedding_case, world_size, args=(mesh_name, seed))
    assert counts[0] == 8


def _sharded_grad_case(rank, world_size, seed):
    """A grad sharded on its last dim gives a dim-sharded weight grad; a batch-sharded one a partial sum."""
    mesh = DeviceMesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(9, 6, dtype=torch.float64, generator=g)
    indices = torch.randint(0, 9, (3, 5), generator=g)
    grad = torch.randn(3, 5, 6, dtype=torch.float64, generator=g)
    reference = weight.clone().requires_grad_()
    F.embedding(indices, reference).backward(grad)
    out = {}
    for name, gp, ip in (("last", Shard(2), Replicate()), ("batch", Shard(0), Shard(0)), ("partial", None, Replicate())):
        w = distribute(weight, mesh, [Replicate()]).requires_grad_()
        i = distribute(indices, mesh, [ip])
        if gp is None:  # a partial-sum grad: rank r holds grad * (r + 1) / sum
            share = grad * (rank + 1) / sum(range(1, world_size + 1))
            from axedist.dtensor import DTensor
            dgrad = DTensor.from_local(share, mesh, [Partial("sum")])
        else:
            dgrad = distribute(grad, mesh, [gp])
        F.embedding(i, w).backward(dgrad)
        torch.testing.assert_close(w.grad.full_tensor(), reference.grad)
        out[name] = w.grad.placements
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_embedding_backward_sharded_grads(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    got = run_on_ranks(_sharded_grad_case, world_size, args=(seed,))[0]
    assert got == {"last": (Shard(1),), "batch": (Partial("sum"),), "partial": (Partial("sum"),)}


def _bad_index_case(rank, world_size):
    mesh = DeviceMesh("cpu", (world_size,))
    w = distribute(torch.randn(5, 2), mesh, [Shard(0)])
    i = distribute(torch.tensor([[1, 5]]), mesh, [Replicate()])
    try:
        F.embedding(i, w)
    except IndexError as e:
        return str(e)
    return "no error"


def test_embedding_index_out_of_range_is_a_clear_error():
    messages = run_on_ranks(_bad_index_case, 2)
    assert all("index 5 is out of range for a vocabulary of 5 rows" in m for m in messages), messages


def _dealt_vocab_layouts(world_size):
    """(label, mesh, layout of a (vocab, D) weight, vocab, D) whose rows no placement can say."""
    line = DeviceMesh("cpu", (world_size,))
    out = [("rows round-robin in pairs", line, Layout.parse(f"S[(3,{world_size},2,5):(10,1@gpuid,5,1)]"),
            3 * world_size * 2, 5),
           ("blocks of 3 in reverse device order", line,
            Layout.parse(f"S[({world_size},3,4):(-1@gpuid,4,1)] + {world_size - 1}@gpuid"), world_size * 3, 4)]
    if world_size == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
        out.append(("pairs round-robin over tp, replicated over dp", grid,
                    Layout.parse("S[(2,2,2,3):(6,1@tp,3,1)] + R[2:1@dp]"), 8, 3))
    return out


def _dealt_vocab_case(rank, world_size, seed):
    """Each rank looks its own rows up and the output is a pending sum: no collective in the
    forward; values and the weight gradient equal torch's (padding index and scaled grads too)."""
    from axedist.layout import LayoutError
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, layout, vocab, dim in _dealt_vocab_layouts(world_size):
        for pad, scale in ((None, False), (int(torch.randint(0, vocab, (1,), generator=g)), True)):
            weight = torch.randn(vocab, dim, dtype=torch.float64, generator=g)
            indices = torch.randint(0, vocab, (3, 7), generator=g)
            grad = torch.randn(3, 7, dim, dtype=torch.float64, generator=g)
            reference = weight.clone().requires_grad_()
            want = F.embedding(indices, reference, padding_idx=pad, scale_grad_by_freq=scale)
            want.backward(grad)
            w = distribute(weight, mesh, layout).requires_grad_()
            try:
                w.placements
                failures.append(f"{label}: the weight has a placement form")
            except LayoutError:
                pass
            i = distribute(indices, mesh, [Replicate()] * mesh.ndim)
            with count_collectives() as seen:
                out = F.embedding(i, w, padding_idx=pad, scale_grad_by_freq=scale)
            what = f"{label}, padding {pad}, scale {scale}"
            if seen.calls:
                failures.append(f"{what}: {seen.calls} collectives in the forward")
            dealt = {it.axis for it in layout.shard if it.axis != "m"}
            want_placements = tuple(Partial("sum") if a in dealt else Replicate() for a in mesh.axis_names)
            if out.placements != want_placements:
                failures.append(f"{what}: output {out.placements}, not {want_placements}")
            if not torch.allclose(out.full_tensor(), want.detach()):
                failures.append(f"{what}: values differ from torch")
            out.backward(distribute(grad, mesh, [Replicate()] * mesh.ndim))
            if not torch.allclose(w.grad.full_tensor(), reference.grad):
                failures.append(f"{what}: the weight gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_embedding_of_rows_dealt_by_a_layout_without_placements(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    results = run_on_ranks(_dealt_vocab_case, world_size, args=(seed,))
    assert results == [[]] * world_size, (seed, results[0])


def _compiled_dealt_case(rank, world_size):
    """The lookup over dealt vocabulary rows (its table of rows made outside the trace, a constant
    of the graph) and a log-softmax over the dealt classes of ``h @ W.t()``, under torch.compile:
    the same values and weight gradient as eager, twice (the second call reuses the graph)."""
    mesh = DeviceMesh("cpu", (world_size,))
    dim, vocab = 4, 3 * world_size * 2
    layout = Layout.parse(f"S[(3,{world_size},2,{dim}):({2 * dim},1@gpuid,{dim},1)]")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, dtype=torch.float64, generator=g)
    tokens = distribute(torch.randint(0, vocab, (6,), generator=g), mesh, [Replicate()])

    def f(w, t):
        return torch.log_softmax(F.embedding(t, w) @ w.t(), -1).sum()

    w = distribute(weight, mesh, layout).requires_grad_()
    eager = f(w, tokens)
    (want,) = torch.autograd.grad(eager, w, torch.ones_like(eager))
    compiled = torch.compile(f, backend="aot_eager")
    failures = []
    for call in range(2):
        out = compiled(w, tokens)
        (grad,) = torch.autograd.grad(out, w, torch.ones_like(out))
        if not torch.allclose(out.full_tensor(), eager.full_tensor()):
            failures.append(f"call {call}: value differs from eager")
        if not torch.allclose(grad.full_tensor(), want.full_tensor()):
            failures.append(f"call {call}: gradient differs from eager")
    return failures


def test_compiled_lookup_over_dealt_rows():
    results = run_on_ranks(_compiled_dealt_case, 2, timeout_s=600)
    assert results == [[], []], results[0]
