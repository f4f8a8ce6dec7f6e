"""Batch norm on DTensors whose batch (or spatial) dims are split: torch's values on the whole batch.

Each case runs ``F.batch_norm`` on a DTensor and torch's on the whole tensor, from fresh random
float64 inputs: the output, the input / weight / bias gradients and the running statistics after
the step must be torch's; the input is not moved (no route runs in the forward: the statistics'
all-reduces are in the local step) and the output keeps the input's placements or layout.
The CUDA ops (``cudnn_batch_norm`` and its backward) share the rules; they are called directly
here on CPU tensors (their local step is the same formula) and compared with torch's native ones.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import distribute
from axedist.layout import Layout
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

C = 3


def _inputs(world):
    """(label, mesh, placements or layout, shape) of each way the batch is split."""
    mesh = DeviceMesh("cpu", (world,))
    out = [("batch sharded", mesh, [Shard(0)], (2 * world, C, 5)),
           ("batch sharded unevenly", mesh, [Shard(0)], (world + 1, C, 4)),
           ("spatial dim sharded", mesh, [Shard(2)], (3, C, 2 * world, 3)),
           ("samples dealt round-robin in pairs",
            mesh, Layout.parse(f"S[(2,{world},2,{C},4):({8 * C},1@gpuid,{4 * C},4,1)]"), (4 * world, C, 4))]
    if world == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
        out += [("batch over dp, replicated over tp", grid, [Shard(0), Replicate()], (6, C, 5)),
                ("batch over dp, spatial over tp", grid, [Shard(0), Shard(2)], (4, C, 6)),
                ("channels sharded (gathered)", grid, [Shard(1), Replicate()], (4, 4, 5))]
    return out


def _batch_norm_cases(rank, world, seed):
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, laid, shape in _inputs(world):
        replicated = [Replicate()] * mesh.ndim
        channels = shape[1]
        for mode, training, stats, affine in (("train", True, True, True), ("train, no running stats", True, False, True),
                                              ("train, no affine", True, True, False), ("eval", False, True, True)):
            what = f"{label}, {mode}"
            x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).requires_grad_()
            w = torch.randn(channels, generator=g, dtype=torch.float64).requires_grad_() if affine else None
            b = torch.randn(channels, generator=g, dtype=torch.float64).requires_grad_() if affine else None
            rm = torch.randn(channels, generator=g, dtype=torch.float64) if stats else None
            rv = torch.rand(channels, generator=g, dtype=torch.float64) + 0.5 if stats else None
            dx = distribute(x.detach(), mesh, laid).requires_grad_()
            dw, db = ((distribute(t.detach(), mesh, replicated).requires_grad_() if t is not None else None) for t in (w, b))
            drm, drv = ((distribute(t.clone(), mesh, replicated) if t is not None else None) for t in (rm, rv))
            with count_collectives() as seen:
                out = F.batch_norm(dx, drm, drv, dw, db, training=training, momentum=0.3, eps=1e-4)
            want = F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.3, eps=1e-4)
            if seen.calls and "gathered" not in label:
                failures.append(f"{what}: {seen.calls} moves in the forward")
            if out._spec.layout != dx._spec.layout and "gathered" not in label:
                failures.append(f"{what}: output laid out as {out._spec.layout}, not as the input")
            if not torch.allclose(out.full_tensor(), want):
                failures.append(f"{what}: values differ from torch's")
                continue
            for name, mine, theirs in (("running mean", drm, rm), ("running var", drv, rv)):
                if theirs is not None and not torch.allclose(mine.full_tensor(), theirs):
                    failures.append(f"{what}: the {name} differs from torch's")
            up = torch.randn(shape, generator=g, dtype=torch.float64)
            (out * distribute(up, mesh, replicated)).sum().backward()
            (want * up).sum().backward()
            for name, mine, theirs in (("x", dx, x), ("weight", dw, w), ("bias", db, b)):
                if theirs is not None and (mine.grad is None or not torch.allclose(mine.grad.full_tensor(), theirs.grad)):
                    failures.append(f"{what}: the {name} gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_batch_norm_of_a_split_batch_matches_torch(world):
    seed = random.randrange(10**6)
    results = run_on_ranks(_batch_norm_cases, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, (seed, results[0])


def _cudnn_ops_by_their_rules(rank, world, seed):
    """``cudnn_batch_norm`` and its backward on a batch-sharded DTensor give torch's native values."""
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(seed)
    mesh = DeviceMesh("cpu", (world,))
    replicated = [Replicate()]
    x = torch.randn(2 * world, C, 5, generator=g, dtype=torch.float64)
    w, b, rm = (torch.randn(C, generator=g, dtype=torch.float64) for _ in range(3))
    rv = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    dx = distribute(x, mesh, [Shard(0)])
    dw, db, drm, drv = (distribute(t.clone(), mesh, replicated) for t in (w, b, rm, rv))
    out, mean, invstd, _reserve = aten.cudnn_batch_norm(dx, dw, db, drm, drv, True, 0.1, 1e-5)
    want, want_mean, want_invstd = aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
    failures = []
    for name, mine, theirs in (("output", out, want), ("mean", mean, want_mean), ("invstd", invstd, want_invstd),
                               ("running mean", drm, rm), ("running var", drv, rv)):
        if not torch.allclose(mine.full_tensor(), theirs):
            failures.append(f"cudnn_batch_norm: the {name} differs from torch's native op")
    grad = torch.randn(x.shape, generator=g, dtype=torch.float64)
    mine = aten.cudnn_batch_norm_backward(dx, distribute(grad, mesh, [Shard(0)]), dw, drm, drv, mean, invstd, 1e-5,
                                          _reserve)
    theirs = aten.native_batch_norm_backward(grad, x, w, rm, rv, want_mean, want_invstd, True, 1e-5, [True] * 3)
    for name, m, t in zip(("input", "weight", "bias"), mine, theirs):
        if not torch.allclose(m.full_tensor(), t):
            failures.append(f"cudnn_batch_norm_backward: the {name} gradient differs from torch's native op")
    # eval: the output by the running statistics; the saved ones empty, as cudnn's meta kernel says
    out, mean, invstd, _ = aten.cudnn_batch_norm(dx, dw, db, drm, drv, False, 0.1, 1e-5)
    want = aten.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5)[0]
    if not torch.allclose(out.full_tensor(), want) or mean.shape != (0,) or invstd.shape != (0,):
        failures.append(f"cudnn_batch_norm in eval: values differ or statistics {tuple(mean.shape)}, not empty")
    return failures


def test_the_cuda_batch_norm_ops_share_the_rules():
    results = run_on_ranks(_cudnn_ops_by_their_rules, 2, args=(random.randrange(10**6),), timeout_s=300)
    assert results == [[]] * 2, results[0]


def _batch_norm_module_steps(rank, world, seed):
    """``nn.BatchNorm1d`` made replicated by ``distribute_module`` on a batch-sharded input, three
    training steps with SGD then one eval: outputs, parameters and running buffers (the step count
    too) track torch's module on the whole batch."""
    from axedist import distribute_module

    torch.manual_seed(seed)
    mesh = DeviceMesh("cpu", (world,))
    theirs = torch.nn.BatchNorm1d(C, momentum=0.2).double()
    mine = distribute_module(torch.nn.BatchNorm1d(C, momentum=0.2).double(), mesh)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    failures = []
    for step in range(4):
        if step == 3:
            mine.eval(), theirs.eval()
        x = torch.randn(2 * world, C, 6, dtype=torch.float64)
        out, want = mine(distribute(x, mesh, [Shard(0)])), theirs(x)
        if not torch.allclose(out.full_tensor(), want):
            failures.append(f"step {step}: values differ from torch's")
        if step < 3:
            out.square().mean().backward(), want.square().mean().backward()
            opt_mine.step(), opt_theirs.step()
            opt_mine.zero_grad(), opt_theirs.zero_grad()
        for name, value in theirs.state_dict().items():
            got = mine.state_dict()[name]
            if not torch.equal(got.full_tensor(), value) and not torch.allclose(got.full_tensor().double(), value.double()):
                failures.append(f"step {step}: {name} differs from torch's")
    return failures


def test_a_batch_norm_module_trains_on_a_sharded_batch():
    results = run_on_ranks(_batch_norm_module_steps, 2, args=(random.randrange(10**6),), timeout_s=300)
    assert results == [[]] * 2, results[0]
