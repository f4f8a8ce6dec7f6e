"""Elementwise ops on DTensors vs the same ops on full tensors (fp64, uneven shapes, 1-D and 2x2 meshes)."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import distribute
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
