"""torch's ``local_map`` on axedist DTensors (``axedist.local_map``).

A function written for plain tensors runs on the local pieces of DTensor arguments and its outputs
become DTensors by ``out_placements``. Checked on gloo ranks against one-process references (values
and gradients) and against torch's own ``local_map`` on torch DTensors with the same placements:
a row-parallel matmul whose output is a pending sum, a column-parallel one whose replicated input
needs ``in_grad_placements`` (and what both libraries give without it), nested arguments,
non-tensor arguments and outputs, keyword arguments, the decorator form, inputs redistributed on
request (to placements and to an axedist Layout), and the refusals, raised on every rank.
"""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute
from torch.distributed.tensor.experimental import local_map as torch_local_map

import axedist as ax
from axedist.layout import Layout
from axedist.peers import RankDisagreementError
from axedist.testing import run_on_ranks

TOL = dict(rtol=1e-12, atol=1e-12)


def _drawn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _both(mesh, tmesh, full: torch.Tensor, placements):
    """The same global tensor as an axedist and a torch DTensor leaf (every rank has ``full``)."""
    ours = ax.distribute_tensor(full, mesh, placements).requires_grad_()
    theirs = torch_distribute(full, tmesh, placements).requires_grad_()
    return ours, theirs


def _meshes(world):
    from torch.distributed.device_mesh import init_device_mesh

    return ax.DeviceMesh("cpu", (world,)), init_device_mesh("cpu", (world,))


def _matmuls(rank, world, seed):
    mesh, tmesh = _meshes(world)
    x, w, w2, g, g2 = (_drawn(seed + i, *shape) for i, shape in
                       enumerate([(4, 6), (6, 3), (6, 8), (4, 3), (4, 8)]))

    # row-parallel: x's columns and w's rows split alike; each rank's product is a summand
    row = dict(out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]))
    (xo, xt), (wo, wt) = _both(mesh, tmesh, x, [Shard(1)]), _both(mesh, tmesh, w, [Shard(0)])
    ours, theirs = ax.local_map(torch.mm, **row)(xo, wo), torch_local_map(torch.mm, **row)(xt, wt)
    assert isinstance(ours, ax.DTensor) and ours.placements == (Partial(),)
    torch.testing.assert_close(ours.to_local(), theirs.to_local(), **TOL)  # the same summand here
    torch.testing.assert_close(ours.full_tensor(), x @ w, **TOL)
    (ours.full_tensor() * g).sum().backward()
    (theirs.full_tensor() * g).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr * g).sum().backward()
    for leaf, twin, ref in ((xo, xt, xr), (wo, wt, wr)):
        assert leaf.grad.placements == twin.grad.placements
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, **TOL)
        torch.testing.assert_close(leaf.grad.to_local(), twin.grad.to_local(), **TOL)

    # column-parallel on a replicated input: its pieces' gradients differ (a pending sum), which
    # in_grad_placements says; without it both libraries read them as one replicated gradient
    for hint in (([Partial()], [Shard(1)]), None):
        col = dict(out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]), in_grad_placements=hint)
        (xo, xt), (wo, wt) = _both(mesh, tmesh, x, [Replicate()]), _both(mesh, tmesh, w2, [Shard(1)])
        ours, theirs = ax.local_map(torch.mm, **col)(xo, wo), torch_local_map(torch.mm, **col)(xt, wt)
        assert ours.placements == (Shard(1),)
        torch.testing.assert_close(ours.full_tensor(), x @ w2, **TOL)
        (ours.full_tensor() * g2).sum().backward()
        (theirs.full_tensor() * g2).sum().backward()
        xr, wr = x.clone().requires_grad_(), w2.clone().requires_grad_()
        (xr @ wr * g2).sum().backward()
        torch.testing.assert_close(wo.grad.full_tensor(), wr.grad, **TOL)
        torch.testing.assert_close(xo.grad.to_local(), xt.grad.to_local(), **TOL)
        if hint is not None:
            torch.testing.assert_close(xo.grad.full_tensor(), xr.grad, **TOL)
        else:  # this rank's part of the sum only (as torch's): the hint is what makes it right
            assert not torch.allclose(xo.grad.full_tensor(), xr.grad)
    return True


def test_matmuls_match_one_process_and_torch(seed):
    """A row-parallel matmul under ``local_map`` (output ``[Partial()]``) and a column-parallel one on a
    replicated input, with and without ``in_grad_placements=[Partial()]``: values and gradients equal
    one process's (with the hint) and torch's ``local_map`` on torch DTensors (always), on 2 ranks."""
    assert run_on_ranks(_matmuls, 2, args=(seed,)) == [True] * 2


def _arguments(rank, world, seed):
    mesh, tmesh = _meshes(world)
    x, y = _drawn(seed, 6, 3), _drawn(seed + 1, 6, 3)

    @ax.local_map(out_placements=([Shard(0)], None, [Shard(0)]), in_placements=([Shard(0)], [Shard(0)], None))
    def combine(a, pair, *, power):
        b, scale = pair
        assert type(a) is torch.Tensor and type(b) is torch.Tensor  # the pieces, not DTensors
        return a + scale * b, a.shape[0], a ** power

    (xo, _), (yo, _) = _both(mesh, tmesh, x, [Shard(0)]), _both(mesh, tmesh, y, [Shard(0)])
    added, rows, powered = combine(xo, (yo, 2.5), power=3)
    assert rows == 3 and combine.__name__ == "combine"
    assert added.placements == powered.placements == (Shard(0),)
    ((added.full_tensor() + powered.full_tensor()) ** 2).sum().backward()
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    ((xr + 2.5 * yr + xr ** 3) ** 2).sum().backward()
    torch.testing.assert_close(added.full_tensor(), (x + 2.5 * y), **TOL)
    torch.testing.assert_close(xo.grad.full_tensor(), xr.grad, **TOL)
    torch.testing.assert_close(yo.grad.full_tensor(), yr.grad, **TOL)

    # without DTensor arguments the function runs as it is, its outputs returned unchanged
    plain = combine(x, (y, 2.5), power=1)
    assert all(type(t) is torch.Tensor for t in (plain[0], plain[2])) and plain[1] == 6

    # in another layout: refused, or redistributed on request (to placements, or to an axedist layout:
    # rows dealt round-robin, which no placement says; the rank's rows sum to a summand)
    replicated = ax.distribute_tensor(x, mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"argument 0 is in \[Replicate\(\)\].*redistribute_inputs=True"):
        combine(replicated, (yo, 1.0), power=1)
    moved = ax.local_map(torch.neg, out_placements=[Shard(0)], in_placements=([Shard(0)],),
                         redistribute_inputs=True)(replicated)
    torch.testing.assert_close(moved.full_tensor(), -x, **TOL)
    cyclic = Layout.parse(f"S[(3,{world},3):(3,1@gpuid,1)]")
    total = ax.local_map(lambda a: a.sum(0), out_placements=[Partial()], in_placements=(cyclic,),
                         redistribute_inputs=True)(xo)
    torch.testing.assert_close(total.full_tensor(), x.sum(0), **TOL)
    mine = [r * world + rank for r in range(3)][: 6 // world]
    local_rows = ax.local_map(lambda a: a, out_placements=[Shard(0)], in_placements=(cyclic,),
                              redistribute_inputs=True)(xo).to_local()
    torch.testing.assert_close(local_rows, x[mine], **TOL)
    return True


def test_arguments_outputs_and_redistribution(seed):
    """Nested positional arguments with a non-tensor among them, a keyword argument, outputs with a
    non-tensor among them, the decorator form; no DTensor argument (the function as it is); an input in
    another layout refused, then redistributed with ``redistribute_inputs=True``, to placements and to
    an axedist Layout (rows dealt round-robin). Values and gradients equal one process's."""
    assert run_on_ranks(_arguments, 2, args=(seed,)) == [True] * 2


def _refusals(rank, world, seed):
    mesh, tmesh = _meshes(world)
    x = ax.distribute_tensor(_drawn(seed, 4, 2), mesh, [Shard(0)])
    cases = [
        (dict(out_placements=[Shard(0)], in_placements=([Shard(0)], None)), (x,), ValueError,
         "in_placements has 2 entries for 1 arguments"),
        (dict(out_placements=[Shard(0)], in_placements=(None,)), (x,), ValueError, "in_placements entry is None"),
        (dict(out_placements=[Shard(0)], in_placements=(Shard(0),)), (x,), TypeError, "one placement"),
        (dict(out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)])), (x, 2.0), ValueError,
         "argument 1 .float. is not a tensor"),
        (dict(out_placements=[Shard(0)], in_grad_placements=(None,)), (x,), ValueError, "in_grad_placements entry"),
        (dict(out_placements=([Shard(0)], [Shard(0)])), (x,), ValueError, "2 entries for the function's 1 outputs"),
        (dict(out_placements=(Shard(0),)), (x,), TypeError, "a tuple holds one entry per output"),
        (dict(out_placements=None), (x,), TypeError, "output 0 is a tensor"),
    ]
    for kwargs, args, error, text in cases:
        with pytest.raises(error, match=text):
            ax.local_map(torch.neg, **kwargs)(*args)
    with pytest.raises(TypeError, match="returned a DTensor"):
        ax.local_map(lambda a: x, out_placements=[Shard(0)])(x)
    with pytest.raises(ValueError, match=r"output 1 \(int\) is not a tensor"):
        ax.local_map(lambda a: (a, 1), out_placements=([Shard(0)], [Shard(0)]))(x)
    with pytest.raises(TypeError, match="takes a function"):
        ax.local_map(3)
    # an output's global shape is inferred as even (torch's from_local): uneven pieces disagree, on every rank
    # (a mesh of its own: a rank checks each local shape once per mesh, so no earlier call skips the check)
    own = ax.DeviceMesh("cpu", (world,), ("local_map_uneven",))
    uneven = ax.distribute_tensor(_drawn(seed, 2 * world + 1, 5), own, [Shard(0)])
    with pytest.raises(RankDisagreementError, match="ranks disagree on from_local"):
        ax.local_map(torch.neg, out_placements=[Shard(0)])(uneven)
    return True


def test_refusals_on_every_rank(seed):
    """Each mismatch of the placements given and the arguments or outputs is a clear error on every
    rank (torch asserts): entry counts, ``None`` for a DTensor, one bare placement, a placement for a
    non-tensor, a DTensor returned by the function; uneven output pieces (whose global shape torch
    would infer wrongly) are a ``RankDisagreementError``."""
    assert run_on_ranks(_refusals, 2, args=(seed,)) == [True] * 2


def _compiled(rank, world, seed):
    mesh, _ = _meshes(world)
    x, w = _drawn(seed, 4, 6), _drawn(seed + 1, 6, 3)
    mm = ax.local_map(torch.mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]))

    def loss(a, b):
        return mm(torch.relu(a), b).full_tensor().square().sum()

    xo, wo = (ax.distribute_tensor(t, mesh, p).requires_grad_() for t, p in ((x, [Shard(1)]), (w, [Shard(0)])))
    out = torch.compile(loss, backend="aot_eager")(xo, wo)
    out.backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = (torch.relu(xr) @ wr).square().sum()
    ref.backward()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(xo.grad.full_tensor(), xr.grad, **TOL)
    torch.testing.assert_close(wo.grad.full_tensor(), wr.grad, **TOL)
    return True


def test_under_torch_compile(seed):
    """A function calling a ``local_map``-wrapped matmul, compiled (``aot_eager``): its value and
    gradients equal one process's."""
    assert run_on_ranks(_compiled, 2, args=(seed,)) == [True] * 2
