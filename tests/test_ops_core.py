"""The op dispatcher (axedist/ops/dispatcher.py): errors, fallback, in-place, out=, foreach, AdamW.

Every check compares with the same op on the plain full tensors (fp64, fresh seeds).
"""

import random
import warnings

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _behaviours(rank, world, seed):
    dispatch = DTensor.dispatcher

    mesh = DeviceMesh("cpu", (world,))
    x, y = _rand((7, 5), seed), _rand((7, 5), seed + 1)
    dx, dy = distribute(x, mesh, [Shard(0)]), distribute(y, mesh, [Shard(1)])
    facts = {}
    # plain non-scalar tensor mixed in: a clear error naming the op and argument
    with pytest.raises(RuntimeError, match="aten.add.Tensor: argument 'other' is a plain torch.Tensor"):
        dx + y
    # a plain tensor holding one value, the same on every rank (autograd formulas make them): replicated
    c = dx + torch.full((7, 5), 2.5, dtype=torch.float64)
    assert c.placements == (Shard(0),) and torch.equal(c.full_tensor(), x + 2.5)
    with pytest.raises(RuntimeError, match="the same on every rank"):
        dx + torch.full((7, 5), float(rank), dtype=torch.float64)
    # a 0-dim plain tensor is a scalar
    assert torch.allclose((dx * torch.tensor(3.0, dtype=torch.float64)).full_tensor(), x * 3)
    # different meshes
    other = DeviceMesh("cpu", (world,), "other")
    with pytest.raises(RuntimeError, match="one mesh"):
        dx + distribute(y, other, [Shard(0)])
    # fallback: correct, replicated, one warning naming the op
    dispatch.forget_fallbacks()  # ranks are pooled across tests: aminmax may have warned before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c1 = torch.aminmax(dx, dim=1)
        c2 = torch.aminmax(dy, dim=1)
    named = [w for w in caught if "aten.aminmax.default" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]
    assert torch.allclose(c1.min.full_tensor(), x.aminmax(dim=1).min)
    assert torch.equal(c2.max.full_tensor(), y.aminmax(dim=1).max)
    assert c1.min.placements == (Replicate(),)
    # in-place keeps self's layout; others move to it
    z = dx.clone()
    z.add_(dy, alpha=2.0)
    assert z.placements == (Shard(0),) and torch.allclose(z.full_tensor(), x + 2 * y)
    # an in-place op through the fallback is written back in self's layout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = dy.clone()
        w.renorm_(2, 1, 1.0)
    assert w.placements == (Shard(1),) and torch.allclose(w.full_tensor(), y.clone().renorm_(2, 1, 1.0))
    # a non-affine in-place op on a pending sum applies the sum in self's buffer first
    p = DTensor.from_local(_rand((7, 5), seed + rank), mesh, [Partial()])
    full_p = sum(_rand((7, 5), seed + r) for r in range(world))
    assert p.exp_() is p and p.placements == (Replicate(),) and torch.allclose(p.full_tensor(), full_p.exp())
    # out=
    out = distribute(torch.zeros(7, 5, dtype=torch.float64), mesh, [Shard(1)])
    r = torch.add(dx, dy, out=out)
    assert r is out and out.placements == (Shard(1),) and torch.allclose(out.full_tensor(), x + y)
    # foreach, out-of-place and in-place, with scalar lists
    xs = [dx, dy]
    got = torch._foreach_mul(xs, [2.0, 3.0])
    assert torch.allclose(got[0].full_tensor(), 2 * x) and torch.allclose(got[1].full_tensor(), 3 * y)
    ys = [dx.clone(), dy.clone()]
    torch._foreach_add_(ys, xs, alpha=0.5)
    assert torch.allclose(ys[0].full_tensor(), 1.5 * x) and ys[1].placements == (Shard(1),)
    norms = torch._foreach_norm(xs, 2)
    assert torch.allclose(norms[0].full_tensor(), x.norm()) and torch.allclose(norms[1].full_tensor(), y.norm())
    # non-tensor outputs
    assert dx.sum().item() == pytest.approx(x.sum().item(), rel=1e-12)
    assert abs(distribute(x[0, 0].clone(), mesh, [Replicate()]).item() - x[0, 0].item()) < 1e-12
    # rules are cached: a second identical call is a hit
    before = dispatch.cache_info()["hits"]
    dx * dy
    dx * dy
    assert dispatch.cache_info()["hits"] >= before + 1
    # a partial sum survives linear ops and reduces before nonlinear ones
    q = DTensor.from_local(_rand((4, 3), seed + 10 + rank), mesh, [Partial()])
    full_q = sum(_rand((4, 3), seed + 10 + r) for r in range(world))
    assert (q * 2).placements == (Partial(),) and torch.allclose((q * 2 - q).full_tensor(), full_q)
    assert (q + 1).placements == (Replicate(),) and torch.allclose((q + 1).full_tensor(), full_q + 1)
    assert torch.allclose(torch.exp(q).full_tensor(), full_q.exp())
    facts["repr"] = repr(dx)
    return facts


@pytest.mark.parametrize("world", [2, 4])
def test_dispatcher_behaviours(world):
    run_on_ranks(_behaviours, world, args=(random.randrange(10**6),))


def _adamw(rank, world, seed, mode):
    """AdamW (for-loop, foreach or fused; or fused SGD with momentum) with clip_grad_norm_ on
    sharded and replicated parameters; one gradient is a pending sum (a replicated weight's
    gradient under sequence parallelism), which the step reads as its sum. No op is gathered."""
    dispatch = DTensor.dispatcher

    before = set(dispatch.fallback_ops())
    mesh = DeviceMesh("cpu", (2, world // 2), ("dp", "tp")) if world == 4 else DeviceMesh("cpu", (world,))
    tp = mesh.ndim - 1
    shapes = [(6, 5), (5,), (3, 7), (4,)]
    fulls = [_rand(s, seed + i) for i, s in enumerate(shapes)]
    grads = [_rand(s, seed + 10 + i) for i, s in enumerate(shapes)]
    pl = [[Replicate()] * mesh.ndim for _ in shapes]
    pl[0][tp] = Shard(0)
    pl[2][tp] = Shard(1)
    params = [distribute(f, mesh, p).requires_grad_() for f, p in zip(fulls, pl)]
    plain = [f.clone().requires_grad_() for f in fulls]
    for p, q in zip(plain, grads):
        p.grad = q.clone()
    if mode == "sgd fused":  # momentum buffers are made on the first step, in the parameters' layouts
        opt, ref = (torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, fused=True) for ps in (params, plain))
    else:
        flags = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[mode]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, **flags)
        ref = torch.optim.AdamW(plain, lr=0.1, weight_decay=0.1, **flags)
    for _ in range(3):
        for p, q in zip(params, grads):
            p.grad = distribute(q, mesh, p.placements)
        # the last gradient pending over the tp axis: summands that add up to it
        pending = [Partial() if i == tp else Replicate() for i in range(mesh.ndim)]
        piece = _rand(shapes[-1], seed + 20 + mesh.coordinates()[mesh.axis_names[tp]])
        total = sum(_rand(shapes[-1], seed + 20 + r) for r in range(mesh.shape[tp]))
        if mesh.coordinates()[mesh.axis_names[tp]] == 0:
            piece = piece + grads[-1] - total
        params[-1].grad = DTensor.from_local(piece, mesh, pending)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=mode != "loop")
        torch.nn.utils.clip_grad_norm_(plain, 1.0, foreach=mode != "loop")
        opt.step()
        ref.step()
        for p, q in zip(plain, grads):
            p.grad = q.clone()
    for p, q, places in zip(params, plain, pl):
        assert p.placements == tuple(places), p.placements
        assert torch.allclose(p.detach().full_tensor(), q.detach(), atol=1e-12), (p, q)
    return sorted(str(op) for op in set(dispatch.fallback_ops()) - before)  # ops gathered: none


@pytest.mark.parametrize("world,mode", [(2, "foreach"), (4, "loop"), (4, "foreach"), (2, "fused"), (4, "fused"),
                                        (2, "sgd fused")])
def test_adamw_step_matches_plain(world, mode):
    assert run_on_ranks(_adamw, world, args=(random.randrange(10**6), mode)) == [[]] * world


def _fused_with_grad_scale(rank, world, seed):
    """``_fused_adamw_`` with ``grad_scale`` (AMP) has no rule: the gather fallback runs it and
    writes every written list back in its own layout, a pending gradient as valid summands."""
    dispatch = DTensor.dispatcher

    mesh = DeviceMesh("cpu", (world,))
    shapes = [(6, 5), (5,)]
    fulls = [_rand(s, seed + i) for i, s in enumerate(shapes)]
    grads = [_rand(s, seed + 10 + i) for i, s in enumerate(shapes)]
    places = [[Shard(0)], [Replicate()]]
    params = [distribute(f, mesh, p) for f, p in zip(fulls, places)]
    pieces = [_rand(s, seed + 30 + rank) for s in shapes]
    totals = [sum(_rand(s, seed + 30 + r) for r in range(world)) for s in shapes]
    dgrads = [distribute(grads[0], mesh, [Shard(0)]),
              DTensor.from_local(pieces[1] + (grads[1] - totals[1] if rank == 0 else 0), mesh, [Partial()])]
    states = [[distribute(torch.zeros(s, dtype=torch.float64), mesh, p) for s, p in zip(shapes, places)]
              for _ in range(2)]
    plain_states = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(2)]
    steps, plain_steps = [[torch.tensor(1.0) for _ in shapes] for _ in range(2)]
    plain_params, plain_grads = [f.clone() for f in fulls], [g.clone() for g in grads]
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    scale, found = torch.tensor(4.0), torch.tensor(0.0)
    before = dispatch.cache_info()["fallbacks"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._fused_adamw_(params, dgrads, *states, [], steps, **hyper, grad_scale=scale, found_inf=found)
    assert dispatch.cache_info()["fallbacks"] == before + 1
    torch._fused_adamw_(plain_params, plain_grads, *plain_states, [], plain_steps, **hyper,
                        grad_scale=scale.clone(), found_inf=found.clone())
    assert dgrads[1].placements == (Partial(),)
    for got, want in zip(params + dgrads + states[0] + states[1],
                         plain_params + plain_grads + plain_states[0] + plain_states[1]):
        assert torch.allclose(got.full_tensor(), want, atol=1e-12), (got.full_tensor(), want)
    return True


def test_fused_optimizer_fallback_writes_back():
    run_on_ranks(_fused_with_grad_scale, 2, args=(random.randrange(10**6),))
