"""Tensors with an empty dim (an empty batch, more ranks than rows, efficient attention's unused
logsumexp): DTensors of them behave as torch's do.

A layout has no extent 0, so an empty dim is laid out padded to one row per chunk that holds
no true element (``[0, 6]`` as ``Shard(0)`` on 4 ranks: padded ``[4, 6]``, every local tensor
``(0, 6)``). Checked on a 2x2 gloo mesh against torch's DTensor (local shapes of every placement
and every redistribute between them) and against the plain ops (values, gradients).
"""

import itertools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

import axedist as ax
from axedist.dtensor import distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

PLACEMENTS = [Shard(0), Shard(1), Replicate()]


def _moves_case(rank, world_size):
    mesh = DeviceMesh("cpu", (2, 2), ("x", "y"))
    theirs = init_device_mesh("cpu", (2, 2))
    checked = 0
    for shape in [(0, 6), (4, 0), (0, 0), (3, 0)]:
        whole = torch.randn(shape)
        for placements in itertools.product(PLACEMENTS, PLACEMENTS):
            ours = distribute(whole, mesh, list(placements))
            torch_dt = distribute_tensor(whole, theirs, list(placements))
            what = f"{shape} {placements}"
            assert ours.to_local().shape == torch_dt.to_local().shape, what
            assert ours.full_tensor().shape == whole.shape, what
            for target in itertools.product(PLACEMENTS, PLACEMENTS):
                moved = ours.redistribute(mesh, list(target))
                assert moved.to_local().shape == torch_dt.redistribute(theirs, list(target)).to_local().shape, \
                    f"{what} -> {target}"
                assert moved.full_tensor().shape == whole.shape, f"{what} -> {target}"
                checked += 1
    return checked


def test_empty_dims_lay_out_and_move_as_torch_does():
    assert run_on_ranks(_moves_case, 4) == [4 * 9 * 9] * 4


def _ops_case(rank, world_size, seed):
    mesh = DeviceMesh("cpu", (2, 2), ("x", "y"))
    g = torch.Generator().manual_seed(seed)
    s0, s1, r = Shard(0), Shard(1), Replicate()

    def randn(*shape):
        return torch.randn(shape, dtype=torch.float64, generator=g)

    cases = [
        ("mm, empty contraction", torch.mm, [(randn(4, 0), (s0, r)), (randn(0, 6), (r, r))]),
        ("mm, no rows", torch.mm, [(randn(0, 3), (s0, r)), (randn(3, 6), (r, s1))]),
        ("mm, empty contraction sharded", torch.mm, [(randn(4, 0), (r, s1)), (randn(0, 6), (r, s0))]),
        ("addmm", torch.addmm, [(randn(6), (r, r)), (randn(0, 3), (s0, r)), (randn(3, 6), (r, r))]),
        ("linear", F.linear, [(randn(0, 3), (s0, r)), (randn(5, 3), (r, s0))]),
        ("cat", lambda a, b: torch.cat([a, b]), [(randn(0, 3), (s0, r)), (randn(4, 3), (s0, r))]),
        ("sum", torch.sum, [(randn(0, 3), (s0, r))]),
        ("sum over the empty dim", lambda a: a.sum(0), [(randn(0, 3), (s0, s1))]),
        ("add", torch.add, [(randn(0, 3), (s0, r)), (randn(0, 3), (r, s1))]),
        ("softmax", lambda a: a.softmax(-1), [(randn(0, 3), (s0, r))]),
        ("view", lambda a: a.view(-1, 3), [(randn(3, 0, 3), (s0, r))]),
        ("reshape", lambda a: a.reshape(3, 0), [(randn(0, 3), (s0, r))]),
    ]
    for what, op, inputs in cases:
        plain = [t.clone().requires_grad_() for t, _ in inputs]
        dts = [distribute(t, mesh, list(p)).requires_grad_() for t, p in inputs]
        want, got = op(*plain), op(*dts)
        assert got.shape == want.shape, f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}"
        torch.testing.assert_close(got.full_tensor(), want, msg=what)
        if want.numel():
            grad = randn(*want.shape)
            (want * grad).sum().backward()
            (got * distribute(grad, mesh, [r, r])).sum().backward()
            for d, p in zip(dts, plain):
                assert d.grad.shape == p.grad.shape, what
                torch.testing.assert_close(d.grad.full_tensor(), p.grad, msg=f"{what}: grad")
    return len(cases)


def test_ops_on_empty_dims_match_the_plain_ops(seed):
    assert run_on_ranks(_ops_case, 4, args=(seed,)) == [12] * 4
