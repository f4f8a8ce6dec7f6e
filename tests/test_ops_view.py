"""View ops on DTensors: values, gradients, and that a view moves no data where the layout allows."""

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks


def _views(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4 * world, 6, generator=g, dtype=torch.float64, requires_grad=True)
    dx = distribute(x, mesh, [Shard(1)])
    flat = dx.view(-1, 6)                 # (B*S, 6) of a sequence-sharded tensor: a layout, no data moved
    assert flat.to_local().data_ptr() == dx.to_local().data_ptr() and flat.to_local().shape == (8, 6)
    assert str(flat.axe_layout) == f"S[(2,{world},4,6):(24,1@gpuid,6,1)]", flat.axe_layout
    moved = torch.tanh(flat) * 2          # elementwise keeps the layout
    assert moved.axe_layout == flat.axe_layout
    back = moved.view(2, 4 * world, 6)
    assert back.placements == (Shard(1),)
    assert torch.allclose(back.full_tensor(), torch.tanh(x) * 2)
    gx, = torch.autograd.grad(back.full_tensor().pow(2).sum(), (x,))
    wx, = torch.autograd.grad((torch.tanh(x) * 2).pow(2).sum(), (x,))
    assert torch.allclose(gx, wx)
    # uneven dims, transposes, permutes, unsqueeze/squeeze, expand, flatten/unflatten
    y = torch.randn(5, 3, 7, generator=g, dtype=torch.float64)
    for p in ([Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]):
        dy = distribute(y, mesh, p)
        cases = {
            "t": (dy.transpose(0, 2), y.transpose(0, 2)), "permute": (dy.permute(2, 0, 1), y.permute(2, 0, 1)),
            "unsqueeze": (dy.unsqueeze(1).squeeze(1), y), "flatten": (dy.flatten(1), y.flatten(1)),
            "reshape": (dy.reshape(15, 7), y.reshape(15, 7)), "expand": (dy.unsqueeze(0).expand(2, 5, 3, 7), y.unsqueeze(0).expand(2, 5, 3, 7)),
            "expand-row": (dy[:1].expand(4, 3, 7), y[:1].expand(4, 3, 7)),
            "unflatten": (dy.flatten(1).unflatten(1, (3, 7)), y),
        }
        for name, (got, want) in cases.items():
            assert torch.equal(got.full_tensor(), want), (name, p)
        if p == [Shard(0)]:
            assert dy.permute(2, 0, 1).placements == (Shard(1),)
    # a partial sum stays pending through views
    q = DTensor.from_local(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + rank),
                                       dtype=torch.float64), mesh, [Partial()])
    full_q = sum(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + r), dtype=torch.float64)
                 for r in range(world))
    assert q.view(24).placements == (Partial(),) and torch.allclose(q.t().full_tensor(), full_q.t())
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_views(world):
    run_on_ranks(_views, world, args=(random.randrange(10**6),))
