"""mm/bmm/addmm/baddbmm on DTensors vs torch on full tensors, with gradients and output placements."""

import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

R, P = Replicate(), Partial()


def _matmul(rank, world, two_d, seed):
    mesh = DeviceMesh("cpu", (2, world // 2), ("x", "y")) if two_d else DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(7, 9, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    # (a placements, b placements, expected output placements): no needless gather
    one = [([Shard(1)], [Shard(0)], (P,)), ([Shard(0)], [R], (Shard(0),)), ([R], [Shard(1)], (Shard(1),)),
           ([Shard(1)], [R], (P,)), ([R], [R], (R,)), ([Shard(0)], [Shard(1)], None), ([Shard(0)], [Shard(0)], None)]
    two = [([Shard(0), Shard(1)], [R, Shard(0)], (Shard(0), P)), ([R, Shard(1)], [Shard(1), Shard(0)], (Shard(1), P)),
           ([Shard(1), Shard(1)], [Shard(0), Shard(0)], (P, P)), ([Shard(0), R], [R, Shard(1)], (Shard(0), Shard(1)))]
    for pa, pb, expected in (two if two_d else one):
        da, db, dbias = distribute(a, mesh, pa), distribute(b, mesh, pb), distribute(bias, mesh, [R] * mesh.ndim)
        c = torch.mm(da, db)
        if expected is not None:
            assert c.placements == expected, (pa, pb, c.placements)
        assert torch.allclose(c.full_tensor(), a @ b)
        c2 = torch.addmm(dbias, da, db, beta=0.5, alpha=2.0)
        loss = (torch.relu(c2) * c2).full_tensor().sum()
        got = torch.autograd.grad(loss, (a, b, bias))
        want_c2 = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
        want = torch.autograd.grad((torch.relu(want_c2) * want_c2).sum(), (a, b, bias))
        assert torch.allclose(c2.full_tensor(), want_c2), (pa, pb)
        for x, y in zip(got, want):
            assert torch.allclose(x, y), (pa, pb)
    # batched: batch sharded stays sharded; contraction sharded gives a partial sum
    x = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    y = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    inp = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    rest = [R] * (mesh.ndim - 1)
    for px, py, expected in [([Shard(0)] + rest, [Shard(0)] + rest, Shard(0)), ([Shard(2)] + rest, [Shard(1)] + rest, P),
                             ([Shard(1)] + rest, [R] + rest, Shard(1))]:
        dx, dy = distribute(x, mesh, px), distribute(y, mesh, py)
        out = torch.bmm(dx, dy)
        assert out.placements[0] == expected and torch.allclose(out.full_tensor(), torch.bmm(x, y))
        out2 = torch.baddbmm(distribute(inp, mesh, [R] * mesh.ndim), dx, dy, alpha=0.5)
        assert torch.allclose(out2.full_tensor(), torch.baddbmm(inp, x, y, alpha=0.5))
    return True


@pytest.mark.parametrize("world,two_d", [(2, False), (4, False), (4, True)])
def test_matmul_matches_full(world, two_d):
    run_on_ranks(_matmul, world, args=(two_d, random.randrange(10**6)))


def _rows_layout_way(rank, world, seed):
    """Rows of a sequence-sharded [B, S, H] flattened to [B*S, H] (no placement form) times a
    replicated weight: the output keeps the row map, no data moves; values and grads as torch."""
    from axedist.runtime import record

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    bsz, seq, h, n = 3, 2 * world, 5, 4
    x = torch.randn(bsz, seq, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(h, n, generator=g, dtype=torch.float64, requires_grad=True)
    dx, dw = distribute(x, mesh, [Shard(1)]), distribute(w, mesh, [R])
    flat = dx.view(bsz * seq, h)
    with record() as ran:
        out = torch.mm(flat, dw)
    assert not ran, ran  # no redistribute at all: each rank multiplied its own rows
    from axedist.layout import LayoutError
    with pytest.raises(LayoutError):
        flat.placements  # the flattened rows have no placement form
    assert out.axe_layout.replica == flat.axe_layout.replica
    assert torch.allclose(out.full_tensor(), x.reshape(-1, h) @ w)
    back = out.view(bsz, seq, n)
    assert back.placements == (Shard(1),)  # the row map is the sequence sharding again
    up = torch.randn(bsz, seq, n, generator=g, dtype=torch.float64)
    (back.full_tensor() * up).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ((x.reshape(-1, h) @ w).view(bsz, seq, n) * up).sum().backward()
    assert torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_mm_keeps_a_row_layout_without_placements(world):
    run_on_ranks(_rows_layout_way, world, args=(random.randrange(10**6),))


def _columns_layout_way(rank, world, seed):
    """A replicated input times the transpose of a weight whose rows (output features) go
    round-robin in pairs to the ranks (no placement form): the product keeps the weight's column
    map and adds a bias laid out the same way, with no data moved; values and grads as torch.
    A bias laid out otherwise (Shard(0)) falls back to moving operands, with the same values."""
    from axedist.layout import Layout, LayoutError
    from axedist.runtime import record

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    m, k, n = 3, 5, 4 * world
    x = torch.randn(m, k, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, k, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(n, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(m, n, generator=g, dtype=torch.float64)
    dealt = Layout.parse(f"S[(2,{world},2,{k}):({2 * k},1@gpuid,{k},1)]")
    dx, dw = distribute(x, mesh, [R]), distribute(w, mesh, dealt)
    with pytest.raises(LayoutError):
        dw.t().placements  # the columns have no placement form
    for bias_where, moves in ((Layout.parse(f"S[(2,{world},2):(2,1@gpuid,1)]"), False), ([Shard(0)], True)):
        dbias = distribute(bias, mesh, bias_where)
        with record() as ran:
            product = torch.mm(dx, dw.t())
            out = torch.addmm(dbias, dx, dw.t())
        assert bool(ran) == moves, ran
        assert torch.allclose(product.full_tensor(), x @ w.t())
        if not moves:
            assert product.axe_layout == out.axe_layout and product.axe_layout.replica == dw.axe_layout.replica
        (out.full_tensor() * up).sum().backward()
        got = [t.grad.clone() for t in (x, w, bias)]
        for t in (x, w, bias):
            t.grad = None
        want_out = torch.addmm(bias, x, w.t())
        (want_out * up).sum().backward()
        assert torch.allclose(out.full_tensor(), want_out)
        for name, a, b in zip("x w bias".split(), got, (x.grad, w.grad, bias.grad)):
            assert torch.allclose(a, b), name
        for t in (x, w, bias):
            t.grad = None
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_mm_keeps_a_column_layout_without_placements(world):
    run_on_ranks(_columns_layout_way, world, args=(random.randrange(10**6),))


def _contraction_layout_way(rank, world, seed):
    """``g [M, N] @ w [N, K]`` with N dealt round-robin in pairs (no placement form) in both (the
    input gradient of a dealt column-parallel weight), or dealt in one and replicated in the
    other: a pending sum with no collective (a replicated operand is sliced locally); values and
    grads as torch. Dealt differently in the two operands, the product moves them, same values."""
    from axedist.layout import Layout
    from axedist.runtime import count_collectives

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    m, n, k = 3, 4 * world, 5
    a = torch.randn(m, n, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, k, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(m, k, generator=g, dtype=torch.float64)
    cols = Layout.parse(f"S[({m},2,{world},2):(4,2,1@gpuid,1)]")
    rows = Layout.parse(f"S[(2,{world},2,{k}):({2 * k},1@gpuid,{k},1)]")
    blocks = Layout.parse(f"S[({world},2,2,{k}):(1@gpuid,{2 * k},{k},1)]")  # Shard(0): dealt otherwise
    for where_a, where_w, moves in ((cols, rows, False), ([R], rows, False), (cols, [R], False), (cols, blocks, True)):
        da, dw = distribute(a, mesh, where_a), distribute(w, mesh, where_w)
        with count_collectives() as seen:
            out = torch.mm(da, dw)
        assert bool(seen.calls) == moves, (where_a, where_w, str(seen))
        if not moves:
            assert out.placements == (P,), out.placements
        assert torch.allclose(out.full_tensor(), a @ w)
        (out.full_tensor() * up).sum().backward()
        got = a.grad.clone(), w.grad.clone()
        a.grad = w.grad = None
        ((a @ w) * up).sum().backward()
        assert torch.allclose(got[0], a.grad) and torch.allclose(got[1], w.grad), (where_a, where_w)
        a.grad = w.grad = None
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_mm_over_a_contraction_dealt_alike_is_a_pending_sum(world):
    run_on_ranks(_contraction_layout_way, world, args=(random.randrange(10**6),))


def _pending(full, mesh, op, g):
    """Local summands of ``full`` pending ``op`` ("sum" or "avg") over every mesh axis: fresh
    random values on all ranks but the last, which holds what makes the sum (or average) ``full``."""
    k = math.prod(mesh.shape)
    noise = torch.randn((k - 1,) + tuple(full.shape), generator=g, dtype=full.dtype)
    last = (full if op == "sum" else k * full) - noise.sum(0)
    summands = torch.cat([noise, last.unsqueeze(0)])
    coords = mesh.coordinates()
    mine = 0
    for name, n in zip(mesh.axis_names, mesh.shape):
        mine = mine * n + coords[name]
    return summands[mine].contiguous()


def _bias_on_a_pending_product(rank, world, two_d, seed):
    """addmm / F.linear (2-D and 3-D input) / baddbmm with one product operand pending a sum or
    an average (kept pending: output Partial of the same op): the bias counts once in the value
    (avg(x_i + b) = avg(x_i) + b, so an average adds it on every rank, a sum on one); values and
    gradients as torch on the full tensors, values as torch's DTensor."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor as TorchDTensor, init_device_mesh

    shape, names = ((2, world // 2), ("x", "y")) if two_d else ((world,), ("gpuid",))
    mesh, theirs = DeviceMesh("cpu", shape, names), init_device_mesh("cpu", shape)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(s, generator=g, dtype=torch.float64)
    cases = {  # name: (fn, full inputs, index of the pending input)
        "addmm, pending mat2": (lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0), (rand(4), rand(5, 3), rand(3, 4)), 2),
        "addmm, pending mat1": (lambda b, x, w: torch.addmm(b, x, w), (rand(5, 4), rand(5, 3), rand(3, 4)), 1),
        "linear 2-D, pending weight": (lambda x, w, b: F.linear(x, w, b), (rand(5, 3), rand(4, 3), rand(4)), 1),
        "linear 3-D, pending input": (lambda x, w, b: F.linear(x, w, b), (rand(2, 5, 3), rand(4, 3), rand(4)), 0),
        "baddbmm, pending batch1": (lambda b, x, y: torch.baddbmm(b, x, y, alpha=0.5), (rand(1, 5, 4), rand(2, 5, 3), rand(2, 3, 4)), 1),
        "baddbmm, pending batch2": (lambda b, x, y: torch.baddbmm(b, x, y), (rand(2, 5, 4), rand(2, 5, 3), rand(2, 3, 4)), 2),
    }
    for op in ("sum", "avg"):
        pending = [Partial(op)] * mesh.ndim
        for what, (fn, fulls, at) in cases.items():
            what = f"{what} ({op})"
            locals_ = [_pending(t, mesh, op, g) if i == at else t for i, t in enumerate(fulls)]
            places = [pending if i == at else [R] * mesh.ndim for i in range(len(fulls))]
            ours = [DTensor.from_local(t, mesh, p).detach().requires_grad_() for t, p in zip(locals_, places)]
            refs = [t.clone().requires_grad_() for t in fulls]
            out, ref = fn(*ours), fn(*refs)
            assert out.placements == tuple(pending), (what, out.placements)
            torch.testing.assert_close(out.full_tensor(), ref, msg=lambda m: f"{what}: {m}")
            torch_out = fn(*[TorchDTensor.from_local(t, theirs, p) for t, p in zip(locals_, places)])
            torch.testing.assert_close(out.full_tensor(), torch_out.full_tensor(), msg=lambda m: f"{what} vs torch's DTensor: {m}")
            grad = rand(*ref.shape)
            torch.autograd.backward(out, distribute(grad, mesh, [R] * mesh.ndim))
            torch.autograd.backward(ref, grad)
            for i, (d, r) in enumerate(zip(ours, refs)):
                torch.testing.assert_close(d.grad.full_tensor(), r.grad, msg=lambda m: f"{what}: gradient {i}: {m}")
    return True


@pytest.mark.parametrize("world,two_d", [(2, False), (4, False), (4, True)])
def test_bias_counts_once_on_a_pending_sum_or_average_product(world, two_d):
    run_on_ranks(_bias_on_a_pending_product, world, args=(two_d, random.randrange(10**6)))
