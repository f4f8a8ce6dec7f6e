"""``DTensor.to_local()`` of a pending reduction (torch's ``Partial``) in torch's shape.

A pending reduction keeps a leading summand dim in its local tensor; ``to_local()`` returns what
this rank contributes, as torch's does: its summand (a view), or, where a layout puts several
summands on each rank, their reduction here. Checked against torch's DTensor on the same gloo
ranks (from_local round trips, row-parallel matmuls, reductions over sharded dims; values,
gradients, ``grad_placements``) on a 1-D mesh and a 2x2 mesh, and against one-process references
where torch has no such layout (summands in memory). Shapes and values come from the ``seed``
fixture.
"""

import random

import pytest
import torch
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import axedist as ax
from axedist.dtensor import DTensor, distribute
from axedist.layout import Layout, LayoutError
from axedist.mesh import DeviceMesh
from axedist.spec import make_spec, spec_from_placements, without_summands
from axedist.testing import run_on_ranks

P, R, S = Partial, Replicate, Shard
# placements of from_local per mesh shape: Partial of every op, alone and beside Shard / Replicate
FROM_LOCAL = {
    (2,): [[P()], [P("avg")], [P("max")], [P("min")]],
    (2, 2): [[P(), S(0)], [S(1), P()], [P(), P()], [P("avg"), R()], [R(), P("max")], [P("min"), S(1)],
             [S(0), P("avg")]],
}
# (b's placements, w's placements) of b @ w giving a pending sum (a row-parallel matmul)
MATMULS = {
    (2,): [([S(1)], [S(0)])],
    (2, 2): [([R(), S(1)], [R(), S(0)]), ([S(0), S(1)], [R(), S(0)]), ([S(1), S(1)], [S(0), S(0)])],
}
# (x's placements, dim) of x.sum(dim) over a sharded dim
REDUCTIONS = {
    (2,): [([S(0)], 0), ([S(1)], 1)],
    (2, 2): [([S(0), S(1)], 0), ([S(1), R()], 1), ([S(0), S(0)], 0)],
}
TOL = dict(rtol=1e-12, atol=1e-12)


def _drawn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _own_seed(mesh: DeviceMesh, placements, seed: int) -> int:
    """A seed per piece: ranks differ along Partial and Shard axes and agree along Replicate ones
    (torch assumes replicas equal)."""
    coordinates = mesh.coordinates()
    key = [0 if isinstance(p, Replicate) else coordinates[a] for a, p in zip(mesh.axis_names, placements)]
    return seed + 1 + sum(c * 10 ** i for i, c in enumerate(key))


def _from_local_against_torch(mesh, tmesh, placements, seed):
    """from_local -> to_local by axedist and torch: the piece, the whole tensor, the gradient of the
    caller's local tensor (with and without grad_placements) and of a leaf DTensor."""
    rng = random.Random(seed)
    local = _drawn((rng.randint(1, 4), rng.randint(1, 5)), _own_seed(mesh, placements, seed))
    grad = _drawn(local.shape, seed + 1000 + mesh.position())  # each rank's own gradient of its piece
    ours, theirs = DTensor.from_local(local, mesh, placements), TorchDTensor.from_local(local, tmesh, placements)
    piece = ours.to_local()
    assert piece.shape == local.shape == theirs.to_local().shape, (placements, piece.shape)
    assert torch.equal(piece, theirs.to_local()) and piece.data_ptr() == local.data_ptr()  # a view
    torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), **TOL)
    as_sum = [P() if isinstance(p, (Partial, Replicate)) else p for p in placements]
    for grad_placements in (None, placements, as_sum):
        got, want = local.clone().requires_grad_(), local.clone().requires_grad_()
        DTensor.from_local(got, mesh, placements).to_local(grad_placements=grad_placements).backward(grad)
        TorchDTensor.from_local(want, tmesh, placements).to_local(grad_placements=grad_placements).backward(grad)
        torch.testing.assert_close(got.grad, want.grad, **TOL)
        if grad_placements is None:  # each rank's summand gets its own piece's gradient (torch's: replicated)
            assert torch.equal(got.grad, grad)
    leaf, torch_leaf = ours.detach().requires_grad_(), theirs.detach().requires_grad_()
    leaf.to_local().backward(grad)
    torch_leaf.to_local().backward(grad)
    assert tuple(leaf.grad.placements) == tuple(torch_leaf.grad.placements)
    assert torch.equal(leaf.grad.to_local(), torch_leaf.grad.to_local())
    if any(isinstance(p, Shard) for p in placements):  # a gradient piece of another shape: refused
        wrong = [R() if isinstance(p, Shard) else p for p in placements]
        with pytest.raises(LayoutError, match="piece of shape"):
            ours.detach().requires_grad_().to_local(grad_placements=wrong)


def _matmul_against_torch(mesh, tmesh, b_placements, w_placements, seed):
    """(b @ w).to_local() of a pending sum, and its backward, by axedist and torch; b's and w's
    gradients also against each rank's own chain rule (its summand is its b columns @ its w rows)."""
    rng = random.Random(seed)
    # (rows even on 2: torch's cost model keeps rows of b sharded only then)
    m, k, n = 2 * rng.randint(1, 3), 4 * rng.randint(1, 2), rng.randint(1, 5)
    whole_b, whole_w = _drawn((m, k), seed + 1), _drawn((k, n), seed + 2)
    b = ax.distribute_tensor(whole_b, mesh, b_placements).requires_grad_()
    w = ax.distribute_tensor(whole_w, mesh, w_placements).requires_grad_()
    tb = distribute_tensor(whole_b, tmesh, b_placements).requires_grad_()
    tw = distribute_tensor(whole_w, tmesh, w_placements).requires_grad_()
    y, ty = b @ w, tb @ tw
    assert tuple(y.placements) == tuple(ty.placements) and y.reduce_op == "sum", (y.placements, ty.placements)
    piece = y.to_local()
    assert piece.shape == ty.to_local().shape
    torch.testing.assert_close(piece, ty.to_local(), **TOL)
    torch.testing.assert_close(piece, b.to_local() @ w.to_local(), **TOL)  # this rank's summand
    grad = _drawn(piece.shape, seed + 1000 + mesh.position())
    piece.backward(grad)
    ty.to_local().backward(grad)
    torch.testing.assert_close(b.grad.full_tensor(), tb.grad.full_tensor(), **TOL)
    torch.testing.assert_close(w.grad.full_tensor(), tw.grad.full_tensor(), **TOL)
    local_b = b.to_local().detach().requires_grad_()
    local_w = w.to_local().detach().requires_grad_()
    (local_b @ local_w).backward(grad)
    # the ranks along an axis that replicates a piece of b (or w) but deals out y's rows used it
    # for different rows: their gradients add up (along an axis replicating y too, they computed
    # the same rows, and torch's replicated gradient is any one rank's)
    for dt, own in ((b, local_b.grad), (w, local_w.grad)):
        replicas = [a for a, p, q in zip(mesh.axis_names, dt.placements, y.placements)
                    if isinstance(p, Replicate) and not isinstance(q, Replicate)]
        total = own.clone()
        for axis in replicas:
            torch.distributed.all_reduce(total, group=mesh.group(axis))
        # (a gradient may come back pending, as torch's may: read in the tensor's own placements)
        torch.testing.assert_close(dt.grad.redistribute(dt.placements).to_local(), total, **TOL)


def _reduction_against_torch(mesh, tmesh, placements, dim, seed):
    """x.sum(dim) over a sharded dim is a pending sum: its to_local and backward as torch's."""
    rng = random.Random(seed)
    whole = _drawn((4 * rng.randint(1, 2), 4 * rng.randint(1, 2)), seed + 3)
    x = ax.distribute_tensor(whole, mesh, placements).requires_grad_()
    tx = distribute_tensor(whole, tmesh, placements).requires_grad_()
    y, ty = x.sum(dim), tx.sum(dim)
    assert tuple(y.placements) == tuple(ty.placements) and y.reduce_op == "sum", (y.placements, ty.placements)
    piece = y.to_local()
    torch.testing.assert_close(piece, ty.to_local(), **TOL)
    torch.testing.assert_close(piece, x.to_local().sum(dim), **TOL)
    grad = _drawn(piece.shape, seed + 2000 + mesh.position())
    piece.backward(grad)
    ty.to_local().backward(grad)
    torch.testing.assert_close(x.grad.full_tensor(), tx.grad.full_tensor(), **TOL)


def _against_torch(rank, world, mesh_shape, seed):
    from torch.distributed.device_mesh import init_device_mesh

    mesh, tmesh = DeviceMesh("cpu", mesh_shape), init_device_mesh("cpu", mesh_shape)
    for i, placements in enumerate(FROM_LOCAL[mesh_shape]):
        _from_local_against_torch(mesh, tmesh, placements, seed + 100 * i)
    for i, (b_placements, w_placements) in enumerate(MATMULS[mesh_shape]):
        _matmul_against_torch(mesh, tmesh, b_placements, w_placements, seed + 7 + 100 * i)
    for i, (placements, dim) in enumerate(REDUCTIONS[mesh_shape]):
        _reduction_against_torch(mesh, tmesh, placements, dim, seed + 13 + 100 * i)
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_to_local_of_partial_matches_torch(mesh_shape, seed):
    world = 1
    for k in mesh_shape:
        world *= k
    assert run_on_ranks(_against_torch, world, args=(mesh_shape, seed)) == [True] * world


# -- several summands on each rank: no torch form, a one-process reference --------------------------

REDUCE = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0), "max": lambda t: t.amax(0),
          "min": lambda t: t.amin(0)}


def _summands_here(mesh, layout, shape, held, op, seed):
    """``from_local`` of the summands ``held`` of a random ``shape`` (summand dim first) in
    ``layout``: to_local is their reduction here, the op over every rank's is the value, and its
    gradient is the reduction's (sum: each summand the piece's gradient; avg: its share)."""
    full = _drawn(shape, seed)
    local = full[held]
    d = DTensor.from_local(local, mesh, layout, shape, reduce_op=op)
    piece = d.to_local()
    torch.testing.assert_close(piece, REDUCE[op](local), **TOL)
    torch.testing.assert_close(d.full_tensor(), REDUCE[op](full), **TOL)
    grad = _drawn(piece.shape, seed + 1000 + mesh.position())
    got = local.clone().requires_grad_()
    if op in ("max", "min"):  # its gradient would go to one summand of each element: refused
        with pytest.raises(NotImplementedError, match=f"pending {op} with 2 summands on each rank"):
            DTensor.from_local(got, mesh, layout, shape, reduce_op=op).to_local()
        with torch.no_grad():
            torch.testing.assert_close(DTensor.from_local(got, mesh, layout, shape, reduce_op=op).to_local(), piece)
        return piece
    DTensor.from_local(got, mesh, layout, shape, reduce_op=op).to_local().backward(grad)
    want = local.clone().requires_grad_()
    REDUCE[op](want).backward(grad)
    torch.testing.assert_close(got.grad, want.grad, **TOL)
    return piece


def _in_memory(rank, world, seed):
    rng = random.Random(seed)
    rows, cols = rng.randint(1, 4), rng.randint(1, 5)
    # 1-D, 2 ranks: 4 summands, 2 a rank (outer ones on the mesh: rank r holds 2r, 2r + 1;
    # inner ones on the mesh: rank r holds r, r + 2)
    line = DeviceMesh("cpu", (2,)) if world == 2 else None
    square = DeviceMesh("cpu", (2, 2), ("dp", "tp")) if world == 4 else None
    cases = []
    if line is not None:
        r = rank
        cases += [(line, f"S[(2,2,{rows},{cols}):(1@gpuid,{rows * cols},{cols},1)]", (4, rows, cols), [2 * r, 2 * r + 1]),
                  (line, f"S[(2,2,{rows},{cols}):({rows * cols},1@gpuid,{cols},1)]", (4, rows, cols), [r, r + 2])]
    else:
        dp, tp = square.coordinates()["dp"], square.coordinates()["tp"]
        # summands on dp and in memory, rows sharded on tp
        layout = f"S[(2,2,2,{rows},{cols}):(1@dp,{rows * cols},1@tp,{cols},1)]"
        held = (slice(2 * dp, 2 * dp + 2), slice(tp * rows, (tp + 1) * rows))
        cases += [(square, layout, (4, 2 * rows, cols), held)]
    for i, (mesh, layout, shape, held) in enumerate(cases):
        # the gradient's spec: the summands' mesh axes replicated, their memory part gone
        spec = make_spec(mesh, Layout.parse(layout), shape[1:], reduce_op="sum", summands=4)
        kept = [R()] + ([S(0)] if world == 4 else [])
        assert without_summands(spec) == spec_from_placements(shape[1:], mesh, kept), without_summands(spec)
        pending = spec_from_placements(shape[1:], mesh, [P()] + kept[1:])
        assert without_summands(pending) == spec_from_placements(shape[1:], mesh, kept)
        if world == 4:  # only some axes' summands (FSDP's gradient of its own batch): the rest stay pending
            both = spec_from_placements(shape[1:], mesh, [P(), P()])
            assert without_summands(both, ("dp",)) == spec_from_placements(shape[1:], mesh, [R(), P()])
            assert without_summands(both, ("tp",)) == spec_from_placements(shape[1:], mesh, [P(), R()])
            assert without_summands(both, ("dp", "tp")) == without_summands(both) == \
                spec_from_placements(shape[1:], mesh, [R(), R()])
            assert without_summands(pending, ("tp",)) == pending
        for j, op in enumerate(REDUCE):
            piece = _summands_here(mesh, Layout.parse(layout), shape, held, op, seed + 10 * i + j)
            # the op over the ranks' pieces is the value
            pieces = [torch.empty_like(piece) for _ in range(world)]
            torch.distributed.all_gather(pieces, piece.contiguous())
            full = REDUCE[op](_drawn(shape, seed + 10 * i + j))
            if world == 2:
                torch.testing.assert_close(REDUCE[op](torch.stack(pieces)), full, **TOL)
            else:  # ranks (dp, tp) in row-major order: reduce over dp, rows concatenated over tp
                per_tp = [REDUCE[op](torch.stack([pieces[0 * 2 + t], pieces[1 * 2 + t]])) for t in range(2)]
                torch.testing.assert_close(torch.cat(per_tp), full, **TOL)
    # an integer avg over 2 summands a rank rounds twice: refused on every rank; a sum keeps its dtype
    mesh, layout, shape, held = cases[0]
    whole = torch.randint(-9, 9, shape, generator=torch.Generator().manual_seed(seed))
    with pytest.raises(LayoutError, match="pending integer avg"):
        DTensor.from_local(whole[held], mesh, Layout.parse(layout), shape, reduce_op="avg").to_local()
    summed = DTensor.from_local(whole[held].int(), mesh, Layout.parse(layout), shape, reduce_op="sum").to_local()
    assert summed.dtype == torch.int32 and torch.equal(summed, whole[held].sum(0).int())
    return True


def _replicated_summands(rank, world, seed):
    """to_partial of a replicated tensor: every rank holds all 4 summands, so its piece is the
    whole value; its gradient comes back replicated (each summand's: the piece's, or its share)."""
    mesh = DeviceMesh("cpu", (world,))
    rng = random.Random(seed)
    whole = _drawn((4, rng.randint(1, 4), rng.randint(1, 5)), seed)
    for op in REDUCE:
        pending = distribute(whole, mesh, [Replicate()]).requires_grad_().to_partial(op)
        grad = _drawn(whole.shape[1:], seed + 1)  # the same on every rank, as a replicated gradient is
        if op in ("max", "min"):  # not differentiable (see _summands_here)
            with torch.no_grad():
                piece = pending.to_local()
        else:
            piece = pending.to_local()
            piece.backward(grad)
            assert tuple(pending.grad.placements) == (Replicate(),)
            want = whole.clone().requires_grad_()
            REDUCE[op](want).backward(grad)
            # (the gradient of the value: what each summand's gradient is, by the pending op)
            torch.testing.assert_close(pending.grad.to_local(), want.grad[0], **TOL)
        torch.testing.assert_close(piece, REDUCE[op](whole), **TOL)
        torch.testing.assert_close(piece, pending.full_tensor(), **TOL)
    return True


def _part_of_mesh(rank, world, seed):
    """A pending sum on ranks 0 and 1 of 4 (a layout offset-free on part of the mesh): ranks 2 and 3
    hold nothing, so their piece is empty; the sum over the ranks' pieces is still the value."""
    mesh = DeviceMesh("cpu", (world,))
    rng = random.Random(seed)
    rows, cols = rng.randint(1, 4), rng.randint(1, 5)
    full = _drawn((2, rows, cols), seed)
    local = full[rank:rank + 1] if rank < 2 else torch.zeros(0, 0, 0, dtype=torch.float64)
    got = local.clone().requires_grad_()
    d = DTensor.from_local(got, mesh, Layout.parse(f"S[(2,{rows},{cols}):(1@gpuid,{cols},1)]"), (2, rows, cols),
                           reduce_op="sum")
    piece = d.to_local()
    assert piece.shape == ((rows, cols) if rank < 2 else (0, 0))
    torch.testing.assert_close(d.full_tensor(), full.sum(0), **TOL)
    grad = _drawn(piece.shape, seed + 1 + rank)
    piece.backward(grad)
    assert got.grad.shape == local.shape
    torch.testing.assert_close(got.grad, grad.unsqueeze(0) if rank < 2 else torch.zeros_like(local), **TOL)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_to_local_reduces_the_summands_each_rank_holds(world, seed):
    assert run_on_ranks(_in_memory, world, args=(seed,)) == [True] * world


def test_to_local_of_replicated_summands_is_the_value(seed):
    assert run_on_ranks(_replicated_summands, 2, args=(seed,)) == [True] * 2


def test_to_local_on_part_of_the_mesh(seed):
    assert run_on_ranks(_part_of_mesh, 4, args=(seed,)) == [True] * 4


def _block_cyclic_pending(rank, world, seed):
    """The gradient of a pending sum in a layout placements cannot spell (summands on dp, rows
    block-cyclic on tp) goes back where its summands lie (``without_summands``: the rows stay
    block-cyclic, dp replicated), through redistribute's backward and to_local's alike: each
    summand's gradient is the value's gradient at the rows its rank holds."""
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    rng = random.Random(seed)
    r, c = rng.randint(1, 3), rng.randint(1, 4)
    dp, tp = mesh.coordinates()["dp"], mesh.coordinates()["tp"]
    layout = Layout.parse(f"S[(2,2,2,{r},{c}):(1@dp,{r * c},1@tp,{c},1)]")
    shape = (2, 4 * r, c)
    rows = torch.cat([torch.arange(o * 2 * r + tp * r, o * 2 * r + tp * r + r) for o in range(2)])
    whole = _drawn(shape, seed)
    g = _drawn(shape[1:], seed + 1)  # the value's gradient (the same on every rank)
    for how in ("redistribute", "to_local"):
        local = whole[dp:dp + 1, rows].clone().requires_grad_()
        x = DTensor.from_local(local, mesh, layout, shape, reduce_op="sum")
        if how == "redistribute":
            y = x.redistribute(mesh, [R(), R()])
            torch.testing.assert_close(y.to_local(), whole.sum(0), **TOL)
            (y.to_local() * g).sum().backward()
        else:  # this rank's summand at its rows (torch's Partial to_local)
            piece = x.to_local()
            torch.testing.assert_close(piece, whole[dp, rows], **TOL)
            (piece * g[rows]).sum().backward()
        torch.testing.assert_close(local.grad, g[rows].unsqueeze(0), **TOL, msg=how)
    return True


def test_gradient_of_a_pending_layout_without_placements(seed):
    assert run_on_ranks(_block_cyclic_pending, 4, args=(seed,)) == [True] * 4
