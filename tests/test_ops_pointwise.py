"""Elementwise ops on DTensors vs the same ops on full tensors (fp64, uneven shapes, 1-D and 2x2 meshes),
in-place ops on pending values (Partial sum/avg/max/min) included."""

import random

import pytest
import torch
import torch.nn.functional as F
from tests.ops_cases import MESHES, WORLD, check, close, make, mesh_of, rand, randint, sample_sets
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks


def _mesh(world, two_d):
    return DeviceMesh("cpu", (2, world // 2), ("x", "y")) if two_d else DeviceMesh("cpu", (world,))


def _pointwise(rank, world, two_d, seed):
    mesh = _mesh(world, two_d)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    cases = [[S0], [S1], [R]] if not two_d else [[S0, S1], [S1, S0], [S0, S0], [R, S1]]
    for px in cases:
        for pb in ([R] * mesh.ndim, [Shard(0)] + [R] * (mesh.ndim - 1)):
            dx, db = distribute(x, mesh, px), distribute(b, mesh, pb)
            outs = {
                "gelu(x+b)*x": (F.gelu(dx + db) * dx, F.gelu(x + b) * x),
                "where": (torch.where(dx > 0, dx, db), torch.where(x > 0, x, b)),
                "clamp/silu/sigmoid": (torch.clamp(F.silu(dx), -0.3, 0.5) + torch.sigmoid(db), 
                                       torch.clamp(F.silu(x), -0.3, 0.5) + torch.sigmoid(b)),
                "relu/tanh/div": (torch.relu(dx) / (2 + torch.tanh(db)), torch.relu(x) / (2 + torch.tanh(b))),
                "cast": (dx.to(torch.float32) * 2, x.to(torch.float32) * 2),
                "compare": ((dx >= db).to(torch.float64), (x >= b).to(torch.float64)),
            }
            for name, (got, want) in outs.items():
                full = got.full_tensor()
                assert full.dtype == want.dtype and torch.allclose(full, want, atol=1e-6), (name, px, pb)
                # the output keeps every shard of x, and b's where x has none (no needless gather)
                expected = tuple(p if isinstance(p, Shard) else (Shard(1) if isinstance(q, Shard) else R)
                                 for p, q in zip(px, pb)) if name != "cast" else tuple(px)
                assert got.placements == expected, (name, got.placements, px, pb)
            # gradients through the ops (backward ops: gelu_backward, tanh_backward, ...)
            loss_d = (F.gelu(dx + db) * torch.tanh(dx)).full_tensor().sum()
            gx, gb = torch.autograd.grad(loss_d, (x, b))
            wx, wb = torch.autograd.grad((F.gelu(x + b) * torch.tanh(x)).sum(), (x, b))
            assert torch.allclose(gx, wx) and torch.allclose(gb, wb), (px, pb)
    # like factories, fill_/zero_/copy_
    dx = distribute(x.detach(), mesh, cases[0])
    assert torch.ones_like(dx).placements == tuple(cases[0]) and torch.equal(torch.zeros_like(dx).full_tensor(),
                                                                             torch.zeros(5, 7, dtype=torch.float64))
    y = dx.clone().fill_(3.0)
    assert torch.equal(y.full_tensor(), torch.full((5, 7), 3.0, dtype=torch.float64))
    y.copy_(distribute(x.detach(), mesh, [R] * mesh.ndim))
    assert y.placements == tuple(cases[0]) and torch.equal(y.full_tensor(), x.detach())
    return True


@pytest.mark.parametrize("world,two_d", [(2, False), (4, False), (4, True)])
def test_pointwise_matches_full(world, two_d):
    run_on_ranks(_pointwise, world, args=(two_d, random.randrange(10**6)))


# ---------------------------------------------------------------------------
# In-place ops on pending values (Partial sum/avg/max/min)
# ---------------------------------------------------------------------------

EVERY_OP = ("sum", "avg", "max", "min")

# name, the in-place op (x, r: a replicated row, m: a mask, s: a tensor like x), the pending ops
# it keeps exactly (any other is applied first, in x's own buffer: x turns Replicate there)
INPLACE_CASES = [
    ("add_ number", lambda x, r, m, s: x.add_(1.25), EVERY_OP),
    ("sub_ row, alpha", lambda x, r, m, s: x.sub_(r, alpha=0.5), EVERY_OP),
    ("add_ 0-dim tensor", lambda x, r, m, s: x.add_(torch.tensor(-0.75, dtype=torch.float64)), EVERY_OP),
    ("masked_fill_ 0", lambda x, r, m, s: x.masked_fill_(m, 0.0), EVERY_OP),
    ("masked_fill_ v", lambda x, r, m, s: x.masked_fill_(m, -1.5), EVERY_OP),
    ("fill_", lambda x, r, m, s: x.fill_(2.0), EVERY_OP),
    ("copy_", lambda x, r, m, s: x.copy_(s), EVERY_OP),
    ("mul_ positive", lambda x, r, m, s: x.mul_(2.5), EVERY_OP),
    ("div_ positive", lambda x, r, m, s: x.div_(4.0), EVERY_OP),
    ("mul_ negative", lambda x, r, m, s: x.mul_(-2.0), ("sum", "avg")),
    ("mul_ row", lambda x, r, m, s: x.mul_(r), ("sum", "avg")),
    ("clamp_", lambda x, r, m, s: x.clamp_(-0.5, 0.75), ("max", "min")),
    ("exp_", lambda x, r, m, s: x.exp_(), ()),
    ("pow_", lambda x, r, m, s: x.pow_(2), ()),
]


def _pending(full, mesh, placements, seed, exact=False):
    """``full`` as a pending value in ``placements`` (ops_cases.make, plus avg: summands
    whose mean is ``full``). ``exact``: the avg summands add up exactly where ``full`` is 0
    (quarter-integer noise; ops_cases.make's sums already do)."""
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if ops != {"avg"}:
        return make(full, mesh, placements, seed)
    partial = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    k, mine = 1, 0
    for i in partial:
        k *= mesh.shape[i]
        mine = mine * mesh.shape[i] + mesh.coordinates()[mesh.axis_names[i]]
    noise = rand(torch.Generator().manual_seed(seed + 7), k, *full.shape)
    if exact:
        noise = (noise * 4).round() / 4
    local = full + (noise[mine] - noise.mean(0))
    base = [p if isinstance(p, Partial) else Replicate() for p in placements]
    return DTensor.from_local(local.contiguous(), mesh, base).redistribute(placements)


def _inplace_on_pending(rank, world, mesh_name, seed):
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    rows, cols = randint(g, 3, 8), randint(g, 2, 7)  # mostly uneven over 2 and 4
    X, R, S = rand(g, rows, cols), rand(g, cols), rand(g, rows, cols)
    M = rand(g, rows, cols) > 0
    checked = 0
    for op in EVERY_OP:
        options = [Partial(op), Shard(0), Shard(1), Replicate()]
        sets = [p for p in sample_sets(mesh, options, g, k=8) if any(isinstance(q, Partial) for q in p)]
        for xp in sets[:3]:
            whole = [Replicate() if isinstance(p, Partial) else p for p in xp]
            r = distribute(R, mesh, [Replicate()] * mesh.ndim)
            m, s = distribute(M, mesh, whole), distribute(S, mesh, whole)
            for name, fn, keeps in INPLACE_CASES:
                x = _pending(X, mesh, xp, seed)
                want = fn(X.clone(), R, M, S)
                got = fn(x, r, m, s)
                what = f"{name} on {xp}"
                assert got is x, what
                expected = tuple(xp) if op in keeps else tuple(whole)
                assert x.placements == expected, f"{what}: {x.placements}, expected {expected}"
                close(x, want, what)
                checked += 1
    return checked


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_inplace_on_pending_values(mesh_name, seed):
    """Each in-place op on a Partial sum/avg/max/min equals the op on the full tensor; it keeps
    the pending value where that is exact, and otherwise turns self Replicate on those axes."""
    counts = run_on_ranks(_inplace_on_pending, WORLD[mesh_name], args=(mesh_name, seed))
    assert counts[0] >= 4 * len(INPLACE_CASES), counts


def _inplace_pending_backward(rank, world, mesh_name, seed):
    """Gradients through in-place ops on a pending sum made inside the graph (the sum of squares
    over a sharded dim, as in RMS norm), against the same code on plain tensors."""
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    rows, cols = randint(g, 2, 7), randint(g, 3, 9)
    X, R = rand(g, rows, cols), rand(g, 1)
    mask = rand(g, rows, 1) > 0
    bodies = {
        "add_ eps then rsqrt": lambda y, r: y.add_(1e-3).rsqrt(),
        "masked_fill_ 0": lambda y, r: y.masked_fill_(_like(mask, y), 0.0) * 2,
        "masked_fill_ v": lambda y, r: y.masked_fill_(_like(mask, y), 3.0).sqrt(),
        "sub_ a replicated value, mul_": lambda y, r: y.sub_(r).mul_(0.5),
        "exp_": lambda y, r: y.div_(cols).exp_(),
    }
    layouts = [[Shard(1)]] if mesh.ndim == 1 else [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [Shard(1), Replicate()]]
    for xp in layouts:
        for name, body in bodies.items():
            def fn(x, r, body=body):
                y = (x * x).sum(-1, keepdim=True)  # a pending sum where x's columns are sharded
                return x * body(y, r) * r

            check(fn, [(X, xp), (R, [Replicate()] * mesh.ndim)], mesh, seed, g, f"{name} on {xp}")
    return True


def _like(mask, y):
    """The plain mask, or the same mask as a replicated DTensor when ``y`` is one."""
    if isinstance(y, DTensor):
        return distribute(mask, y.mesh, [Replicate()] * y.mesh.ndim)
    return mask


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_inplace_on_pending_sum_backward(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_inplace_pending_backward, world, args=(mesh_name, seed)) == [True] * world


def _inplace_on_pending_view(rank, world):
    mesh = DeviceMesh("cpu", (world,))
    p = DTensor.from_local(torch.randn(4, 3, dtype=torch.float64), mesh, [Partial()])
    v = p.view(12)
    with pytest.raises(RuntimeError, match=r"aten.exp_.default is in-place on a view of a pending sum"):
        v.exp_()
    return True


def test_nonaffine_inplace_on_a_view_of_a_pending_sum_is_a_clear_error():
    assert run_on_ranks(_inplace_on_pending_view, 2) == [True, True]


def _layout_with_replicated(rank, world, seed):
    """A tensor dealt round-robin (no placement form) with a replicated tensor of its shape: the
    replicated one is sliced to the layout (no collective), the output keeps the layout; values
    and gradients as torch on full tensors."""
    from axedist.layout import Layout
    from axedist.runtime import count_collectives

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4 * world, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4 * world, generator=g, dtype=torch.float64, requires_grad=True)
    dealt = Layout.parse(f"S[(3,2,{world},2):(4,2,1@gpuid,1)]")
    for op in (torch.add, torch.mul, lambda a, b: torch.where(a > b, a, b * 2)):
        for swap in (False, True):
            dx, dy = distribute(x, mesh, dealt), distribute(y, mesh, [Replicate()])
            with count_collectives() as seen:
                out = op(dy, dx) if swap else op(dx, dy)
            assert seen.calls == 0 and out.axe_layout == dealt, (str(seen), out.axe_layout)
            want = op(y, x) if swap else op(x, y)
            assert torch.allclose(out.full_tensor(), want)
            up = torch.randn(want.shape, generator=g, dtype=torch.float64)
            (out.full_tensor() * up).sum().backward()
            got = x.grad.clone(), y.grad.clone()
            x.grad = y.grad = None
            (want * up).sum().backward()
            assert torch.allclose(got[0], x.grad) and torch.allclose(got[1], y.grad)
            x.grad = y.grad = None
    return True


def test_a_replicated_operand_is_sliced_to_a_layout_without_placements():
    run_on_ranks(_layout_with_replicated, 2, args=(random.randrange(10**6),))


# ---------------------------------------------------------------------------
# Casts of pending values
# ---------------------------------------------------------------------------

# name, the cast (a tensor -> a tensor of another dtype)
INTEGER_CASTS = [
    ("to(int64)", lambda t: t.to(torch.int64)),
    ("int()", lambda t: t.int()),
    ("to(dtype=int16)", lambda t: t.to(dtype=torch.int16)),
    ("type_as an int32 tensor", lambda t: t.type_as(torch.zeros(1, dtype=torch.int32))),
    ("to(bool)", lambda t: t.to(torch.bool)),
    ("bool()", lambda t: t.bool()),
]


def _casts_of_pending(rank, world, mesh_name, seed):
    """A pending value cast to an integer or bool dtype (or copied into an integer tensor) equals
    the cast of the full tensor: a pending sum/avg is reduced first (1.2 held as 0.6 + 0.6 is
    int 1, not 0 + 0; 0 held as 1 - 1 is False, not True), as torch's DTensor does. A cast
    between floating dtypes keeps the sum pending."""
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    rows, cols = randint(g, 3, 8), randint(g, 2, 7)
    X = rand(g, rows, cols) * 4
    X[rand(g, rows, cols) > 0.5] = 0.0  # zeros held as summands that are not (bool)
    checked = 0
    for op in EVERY_OP:
        options = [Partial(op), Shard(0), Shard(1), Replicate()]
        sets = [p for p in sample_sets(mesh, options, g, k=8) if any(isinstance(q, Partial) for q in p)]
        for xp in sets[:3]:
            whole = tuple(Replicate() if isinstance(p, Partial) else p for p in xp)
            for name, cast in INTEGER_CASTS:
                what = f"{name} of {xp}"
                got = cast(_pending(X, mesh, xp, seed, exact=True))
                want = cast(X)
                assert got.dtype == want.dtype and torch.equal(got.full_tensor(), want), what
                if op in ("sum", "avg"):
                    assert got.placements == whole, f"{what}: {got.placements}"
                checked += 1
            # copy_ into an integer tensor: a laid-out one, and (sum, max, min) a pending one
            targets = [distribute(torch.zeros(rows, cols, dtype=torch.int64), mesh, list(whole))]
            if op != "avg":
                targets.append(make(torch.zeros(rows, cols, dtype=torch.int64), mesh, xp, seed))
            for target in targets:
                target.copy_(_pending(X, mesh, xp, seed, exact=True))
                assert torch.equal(target.full_tensor(), X.to(torch.int64)), f"copy_ of {xp}"
                checked += 1
            if op in ("sum", "avg"):
                kept = _pending(X, mesh, xp, seed, exact=True).to(torch.float32)
                assert kept.placements == tuple(xp), (xp, kept.placements)
                torch.testing.assert_close(kept.full_tensor(), X.to(torch.float32))
    return checked


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_casts_of_pending_values_to_integer_and_bool(mesh_name, seed):
    counts = run_on_ranks(_casts_of_pending, WORLD[mesh_name], args=(mesh_name, seed))
    assert counts[0] >= 4 * len(INTEGER_CASTS), counts
