"""Gradients through from_local / to_local / redistribute / distribute / full_tensor, and async redistribute."""

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute, plan
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks


def _grads(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, generator=g, dtype=torch.float64)
    # distribute -> redistribute -> full_tensor: the gradient is the plain one on every rank
    d = distribute(x, mesh, [Shard(0)]).redistribute([Shard(1)])
    (gx,) = torch.autograd.grad((d.full_tensor() * w).sum(), (x,))
    assert torch.allclose(gx, w)
    # from_local / to_local mirror each other: the local gradient is the local piece of the grad
    local = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64,
                        requires_grad=True)
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    (gl,) = torch.autograd.grad((dt.redistribute([Replicate()]).to_local() * 2).sum(), (local,))
    assert torch.allclose(gl, torch.full_like(local, 2.0))
    # a Partial source gets a Replicate grad; redistribute's backward goes back to the source layout
    p = DTensor.from_local(local, mesh, [Partial()])
    out = p.redistribute([Shard(0)])
    (gp,) = torch.autograd.grad(out.full_tensor().sum(), (local,))
    assert torch.allclose(gp, torch.ones_like(local))
    # async redistribute: returned at once, correct on first use
    y = distribute(x.detach(), mesh, [Shard(0)]).redistribute([Replicate()], async_op=True)
    assert torch.equal(y.to_local(), x.detach())
    # plan at the DTensor level
    text = str(plan(distribute(x.detach(), mesh, [Shard(0)]), [Replicate()]))
    assert text.startswith("plan S[") and "R[" in text and "per device at most" in text, text
    text2 = str(plan([Partial()], [Shard(0)], mesh=mesh, shape=(8, 4)))
    assert "reduce-scatter" in text2, text2
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_autograd_through_moves(world):
    run_on_ranks(_grads, world, args=(random.randrange(10**6),))
