"""torch's ``register_sharding`` for axedist DTensors (``axedist.ops.register_sharding``).

A custom op (``torch.library.custom_op``, with a fake and an autograd formula) gets its shardings
from a function written as torch's documentation writes one; an aten op's own rule is replaced the
same way (softmax, the documentation's example). Checked on gloo ranks against one process (values
and gradients), with the sharding each call chose (the cheapest move of its inputs, over every
combination of the strategies on a 2x2 mesh) and the refusals, raised on every rank.
"""

import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute
from torch.distributed.tensor.experimental import register_sharding as torch_register_sharding

import axedist as ax
from axedist.ops import RULES, register_sharding
from axedist.runtime import count_collectives
from axedist.testing import run_on_ranks

TOL = dict(rtol=1e-12, atol=1e-12)


@torch.library.custom_op("axedist_test::row_scale", mutates_args=())
def row_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` times its entry of ``w``."""
    return x * w[:, None]


@row_scale.register_fake
def _(x, w):
    return torch.empty_like(x)


def _row_scale_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad * w[:, None], (grad * x).sum(1)


row_scale.register_autograd(_row_scale_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@torch_register_sharding(torch.ops.axedist_test.row_scale.default)  # the same function for torch's DTensor
@register_sharding(torch.ops.axedist_test.row_scale.default)
def row_scale_sharding(x, w):
    assert x.ndim == 2 and w.shape == (x.shape[0],)  # the arguments' global shapes (ArgSpecs)
    return [([Replicate()], [Replicate(), Replicate()]),
            ([Shard(0)], [Shard(0), Shard(0)]),
            ([Shard(1)], [Shard(1), Replicate()])]


def _drawn(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# (x's placements, w's placements) -> the output's: where x is, when w can follow without a collective
CASES = {
    (2,): [([Shard(0)], [Replicate()], (Shard(0),)), ([Shard(1)], [Replicate()], (Shard(1),)),
           ([Replicate()], [Shard(0)], (Shard(0),)), ([Replicate()], [Replicate()], (Replicate(),))],
    (2, 2): [([Shard(0), Shard(1)], [Replicate(), Replicate()], (Shard(0), Shard(1))),
             ([Shard(1), Shard(0)], [Replicate(), Shard(0)], (Shard(1), Shard(0))),
             ([Replicate(), Replicate()], [Replicate(), Replicate()], (Replicate(), Replicate()))],
}


def _custom_op(rank, world, seed, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    mesh, tmesh = ax.DeviceMesh("cpu", mesh_shape), init_device_mesh("cpu", mesh_shape)
    x, w, g = _drawn(seed, 8, 6), _drawn(seed + 1, 8), _drawn(seed + 2, 8, 6)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (row_scale(xr, wr) * g).sum().backward()
    for px, pw, expected in CASES[mesh_shape]:
        xd = ax.distribute_tensor(x, mesh, px).requires_grad_()
        wd = ax.distribute_tensor(w, mesh, pw).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no gather fallback
            with count_collectives() as counts:
                out = torch.ops.axedist_test.row_scale(xd, wd)
        assert out.placements == expected, (px, pw, out.placements)
        theirs = torch.ops.axedist_test.row_scale(torch_distribute(x, tmesh, px), torch_distribute(w, tmesh, pw))
        assert theirs.placements == expected, (px, pw, theirs.placements)  # torch's DTensor chooses the same
        assert counts.calls == 0, (px, pw, counts.by_kind)  # the chosen sharding moves nothing here
        torch.testing.assert_close(out.full_tensor(), x * w[:, None], **TOL)
        (out * ax.distribute_tensor(g, mesh, list(out.placements))).sum().backward()
        torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, **TOL)
        torch.testing.assert_close(wd.grad.full_tensor(), wr.grad, **TOL)
    return True


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_custom_op_sharded_by_its_registered_strategies(seed, mesh_shape):
    """Values and gradients of a custom op under ``register_sharding`` equal one process's, on a line
    of 2 and a 2x2 mesh (the strategies combined over both axes); each call takes the sharding that
    moves nothing (the output where ``x`` is), never the gather fallback, as torch's DTensor chooses
    with the same function registered by torch's ``register_sharding``."""
    world = 2 if mesh_shape == (2,) else 4
    assert run_on_ranks(_custom_op, world, args=(seed, mesh_shape)) == [True] * world


def _softmax_rule(rank, world, seed):
    aten = torch.ops.aten
    saved = RULES[aten._softmax.default]
    try:
        @register_sharding(aten._softmax.default)
        def softmax_sharding(x, dim, half_to_float):  # torch's documentation's example
            softmax_dim = dim if dim >= 0 else dim + x.ndim
            shardings = [([Replicate()], [Replicate(), None, None])]
            for d in range(x.ndim):
                if d != softmax_dim:
                    shardings.append(([Shard(d)], [Shard(d), None, None]))
            return shardings

        mesh = ax.DeviceMesh("cpu", (world,))
        x, g = _drawn(seed, 8, 6), _drawn(seed + 1, 8, 6)
        xr = x.clone().requires_grad_()
        (torch.softmax(xr, -1) * g).sum().backward()
        chosen = {}
        for px in ([Shard(0)], [Shard(1)], [Replicate()]):
            xd = ax.distribute_tensor(x, mesh, px).requires_grad_()
            out = torch.softmax(xd, -1)
            chosen[px[0]] = out.placements
            torch.testing.assert_close(out.full_tensor(), torch.softmax(x, -1), **TOL)
            (out * ax.distribute_tensor(g, mesh, list(out.placements))).sum().backward()
            torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, **TOL)
        # sharded along the softmax dim: the rule has no such sharding; moving to Shard(0) (an
        # all-to-all, half the tensor a rank) costs less than gathering it (all of it)
        assert chosen == {Shard(0): (Shard(0),), Shard(1): (Shard(0),), Replicate(): (Replicate(),)}, chosen

        # the refusals, on every rank alike
        @register_sharding(aten._softmax.default)
        def too_few(x, dim, half_to_float):
            return [([Replicate()], [None, None, None])]

        with pytest.raises(ValueError, match="placements for 0 tensor arguments; the call has 1"):
            torch.softmax(ax.distribute_tensor(x, mesh, [Shard(0)]), -1)

        @register_sharding(aten._softmax.default)
        def unfit(x, dim, half_to_float):
            return [([Shard(0)], [Shard(0), None, None])]

        small = ax.distribute_tensor(_drawn(seed, 1, 6), mesh, [Replicate()])
        with pytest.raises(ValueError, match="none of unfit's shardings fits"):
            torch.softmax(small, -1)

        @register_sharding(aten._softmax.default)
        def not_pairs(x, dim, half_to_float):
            return [[Replicate()]]

        with pytest.raises(ValueError, match="each is a pair"):
            torch.softmax(small, -1)
    finally:
        RULES[aten._softmax.default] = saved
        ax.reset()
    return True


def test_an_aten_rule_replaced_as_torch_documents(seed):
    """torch's documentation's softmax strategies replace axedist's softmax rule: values and gradients
    equal one process's for inputs sharded off and along the softmax dim (the latter moved to the
    cheaper of the rule's shardings); a rule giving the wrong number of input placements, none that
    fits, or no pairs is a ValueError on every rank. axedist's own rule is put back after."""
    assert run_on_ranks(_softmax_rule, 2, args=(seed,)) == [True] * 2


def test_register_sharding_refuses_what_is_no_op():
    with pytest.raises(TypeError, match="takes ops"):
        register_sharding("aten::softmax")
    with pytest.raises(TypeError, match="decorates a function"):
        register_sharding(torch.ops.aten._softmax.default)(3)
