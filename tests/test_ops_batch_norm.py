"""Batch norm on DTensors whose batch (or spatial) dims are split: torch's values on the whole batch.

Each case runs ``F.batch_norm`` on a DTensor and torch's on the whole tensor, from fresh random
float64 inputs: the output, the input / weight / bias gradients and the running statistics after
the step must be torch's; the input is not moved (no route runs in the forward: the statistics'
all-reduces are in the local step) and the output keeps the input's placements or layout.
The CUDA ops (``cudnn_batch_norm`` and its backward) share the rules; they are called directly
here on CPU tensors (their local step is the same formula) and compared with torch's native ones.
Inputs whose layout deals the channels only run where they are, with no collective forward or
backward; the cases that way does not take (uneven channels, running statistics it would have to
move) take the placement way, with the running statistics updated where they lie.
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


def _channels_dealt(world):
    """(label, mesh, x's shape, x's layout, the channels' map) of layouts with no placement form
    that deal the channels only: round-robin, round-robin in pairs (a BatchNorm2d input), and
    round-robin over tp replicated over dp."""
    mesh = DeviceMesh("cpu", (world,))
    out = [("channels round-robin", mesh, (3, 2 * world, 5),
            Layout.parse(f"S[(3,2,{world},5):(10,5,1@gpuid,1)]"), Layout.parse(f"S[(2,{world}):(1,1@gpuid)]")),
           ("channels round-robin in pairs", mesh, (2, 4 * world, 3, 2),
            Layout.parse(f"S[(2,2,{world},2,3,2):(24,12,1@gpuid,6,2,1)]"),
            Layout.parse(f"S[(2,{world},2):(2,1@gpuid,1)]"))]
    if world == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
        out.append(("channels round-robin over tp, replicated over dp", grid, (4, 4, 3),
                    Layout.parse("S[(4,2,2,3):(6,3,1@tp,1)] + R[2:1@dp]"),
                    Layout.parse("S[(2,2):(1,1@tp)] + R[2:1@dp]")))
    return out


# mode -> (training, running statistics: "map" (in the channels' map), "replicated" or None, affine)
_CHANNEL_MODES = {"train": (True, "map", True), "train, no running stats": (True, None, True),
                  "train, no affine": (True, "map", False),
                  "eval, replicated running stats": (False, "replicated", True),
                  "eval, running stats in the map": (False, "map", False)}


def _batch_norm_of_dealt_channels(rank, world, seed):
    """``F.batch_norm`` of inputs whose layout deals the channels only: each device normalizes its
    own channels, no collective forward or backward (a replicated weight, bias or running
    statistic is cut where it is, the output gradient comes in the input's layout), the output
    and the input gradient keep the layout, the weight and bias gradients lie in the channels'
    map; values, running statistics and every gradient equal torch's on the whole tensor."""
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, shape, laid, channels in _channels_dealt(world):
        replicated = [Replicate()] * mesh.ndim
        c = shape[1]
        for mode, (training, stats, affine) in _CHANNEL_MODES.items():
            what = f"{label}, {mode}"
            x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).requires_grad_()
            w, b = (torch.randn(c, generator=g, dtype=torch.float64).requires_grad_() if affine else None
                    for _ in "wb")
            rm = torch.randn(c, generator=g, dtype=torch.float64) if stats else None
            rv = torch.rand(c, generator=g, dtype=torch.float64) + 0.5 if stats else None
            dx = distribute(x.detach(), mesh, laid).requires_grad_()
            dw, db = (distribute(t.detach(), mesh, replicated).requires_grad_() if t is not None else None
                      for t in (w, b))
            where = channels if stats == "map" else replicated
            drm, drv = ((distribute(t.clone(), mesh, where) if t is not None else None) for t in (rm, rv))
            with count_collectives() as seen:
                out = F.batch_norm(dx, drm, drv, dw, db, training=training, momentum=0.3, eps=1e-4)
            want = F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.3, eps=1e-4)
            if seen.calls:
                failures.append(f"{what}: {seen.calls} collectives in the forward ({seen})")
            if out._spec.layout != dx._spec.layout:
                failures.append(f"{what}: output laid out as {out._spec.layout}, not as the input")
            if not torch.allclose(out.full_tensor(), want):
                failures.append(f"{what}: values differ from torch's")
                continue
            for name, mine, theirs in (("running mean", drm, rm), ("running var", drv, rv)):
                if theirs is not None and not torch.allclose(mine.full_tensor(), theirs):
                    failures.append(f"{what}: the {name} differs from torch's")
            up = torch.randn(shape, generator=g, dtype=torch.float64)
            loss = (out * distribute(up, mesh, laid)).sum()
            with count_collectives() as seen:
                loss.backward()
            if seen.calls:
                failures.append(f"{what}: {seen.calls} collectives in the backward ({seen})")
            (want * up).sum().backward()
            for name, mine, theirs, layout in (("x", dx, x, laid), ("weight", dw, w, channels),
                                               ("bias", db, b, channels)):
                if theirs is None:
                    continue
                if mine.grad is None or not torch.allclose(mine.grad.full_tensor(), theirs.grad):
                    failures.append(f"{what}: the {name} gradient differs from torch's")
                elif mine.grad._spec.layout != layout:
                    failures.append(f"{what}: the {name} gradient laid out as {mine.grad._spec.layout}, not {layout}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_batch_norm_of_dealt_channels_runs_where_they_are(world, seed):
    results = run_on_ranks(_batch_norm_of_dealt_channels, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]


def _outside_the_channels_way(world):
    """(label, mesh, x's shape, x's layout or placements, padded shape, the running statistics'
    layout or placements, or (layout, padded shape)) of inputs the channels' way does not take."""
    mesh = DeviceMesh("cpu", (world,))
    replicated = [Replicate()]
    dealt = Layout.parse(f"S[(3,2,{world},5):(10,5,1@gpuid,1)]")
    channel_map = Layout.parse(f"S[(2,{world}):(1,1@gpuid)]")
    uneven = Layout.parse(f"S[(3,2,{world},4):(8,4,1@gpuid,1)]")
    out = [("uneven channels (padded)", mesh, (3, 2 * world - 1, 4), uneven, (3, 2 * world, 4), replicated),
           ("uneven channels, running stats dealt alike", mesh, (3, 2 * world - 1, 4), uneven, (3, 2 * world, 4),
            (channel_map, (2 * world,))),
           ("channels dealt, running stats replicated", mesh, (3, 2 * world, 5), dealt, None, replicated),
           ("channels dealt, running stats in blocks", mesh, (3, 2 * world, 5), dealt, None, [Shard(0)]),
           ("batch sharded, running stats in the channels' map", mesh, (2 * world, 2 * world, 3), [Shard(0)], None,
            channel_map)]
    if world == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
        out.append(("samples over dp, channels round-robin over tp", grid, (4, 4, 3),
                    Layout.parse("S[(2,2,2,2,3):(1@dp,6,3,1@tp,1)]"), None, [Replicate(), Replicate()]))
    return out


def _batch_norm_outside_the_channels_way(rank, world, seed):
    """Inputs the channels' way does not take (uneven channels, running statistics it would have
    to move, samples and channels both dealt) take the placement way: values, running statistics
    (updated where they lie, whatever their layout) and gradients equal torch's."""
    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, shape, laid, padded_shape, stats_laid in _outside_the_channels_way(world):
        replicated = [Replicate()] * mesh.ndim
        c = shape[1]
        for mode, training in (("train", True), ("eval", False)):
            what = f"{label}, {mode}"
            x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).requires_grad_()
            w, b = (torch.randn(c, generator=g, dtype=torch.float64).requires_grad_() for _ in "wb")
            rm = torch.randn(c, generator=g, dtype=torch.float64)
            rv = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
            dx = distribute(x.detach(), mesh, laid, padded_shape=padded_shape).requires_grad_()
            dw, db = (distribute(t.detach(), mesh, replicated).requires_grad_() for t in (w, b))
            stats_layout, stats_padded = stats_laid if isinstance(stats_laid, tuple) else (stats_laid, None)
            drm, drv = (distribute(t.clone(), mesh, stats_layout, padded_shape=stats_padded) for t in (rm, rv))
            out = F.batch_norm(dx, drm, drv, dw, db, training=training, momentum=0.3, eps=1e-4)
            want = F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.3, eps=1e-4)
            if not torch.allclose(out.full_tensor(), want):
                failures.append(f"{what}: values differ from torch's")
                continue
            for name, mine, theirs in (("running mean", drm, rm), ("running var", drv, rv)):
                if not torch.allclose(mine.full_tensor(), theirs):
                    failures.append(f"{what}: the {name} differs from torch's")
            up = torch.randn(shape, generator=g, dtype=torch.float64)
            (out * distribute(up, mesh, replicated)).sum().backward()
            (want * up).sum().backward()
            for name, mine, theirs in (("x", dx, x), ("weight", dw, w), ("bias", db, b)):
                if mine.grad is None or not torch.allclose(mine.grad.full_tensor(), theirs.grad):
                    failures.append(f"{what}: the {name} gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_batch_norm_outside_the_channels_way_takes_the_placement_way(world, seed):
    results = run_on_ranks(_batch_norm_outside_the_channels_way, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]


def _cudnn_ops_on_dealt_channels(rank, world, seed):
    """``cudnn_batch_norm`` and its backward (train), and the forward in eval (its saved statistics
    empty), on channels dealt round-robin: no collective, torch's native values."""
    from axedist.runtime import count_collectives

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(seed)
    (_, mesh, shape, laid, channels), = [case for case in _channels_dealt(world) if case[0] == "channels round-robin"]
    x, grad = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    w, b, rm = (torch.randn(shape[1], generator=g, dtype=torch.float64) for _ in range(3))
    rv = torch.rand(shape[1], generator=g, dtype=torch.float64) + 0.5
    dx, dgrad = distribute(x, mesh, laid), distribute(grad, mesh, laid)
    dw, db = (distribute(t, mesh, [Replicate()]) for t in (w, b))
    drm, drv = (distribute(t.clone(), mesh, channels) for t in (rm, rv))
    failures = []
    with count_collectives() as seen:
        out, mean, invstd, reserve = aten.cudnn_batch_norm(dx, dw, db, drm, drv, True, 0.1, 1e-5)
        mine = aten.cudnn_batch_norm_backward(dx, dgrad, dw, drm, drv, mean, invstd, 1e-5, reserve)
        evaluated, empty, _, _ = aten.cudnn_batch_norm(dx, dw, db, drm, drv, False, 0.1, 1e-5)
    if seen.calls:
        failures.append(f"cudnn ops on dealt channels: {seen.calls} collectives ({seen})")
    want, want_mean, want_invstd = aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
    theirs = aten.native_batch_norm_backward(grad, x, w, rm, rv, want_mean, want_invstd, True, 1e-5, [True] * 3)
    want_eval = aten.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5)[0]
    pairs = [("output", out, want), ("mean", mean, want_mean), ("invstd", invstd, want_invstd),
             ("running mean", drm, rm), ("running var", drv, rv), ("eval output", evaluated, want_eval)]
    pairs += [(f"{name} gradient", m, t) for name, m, t in zip(("input", "weight", "bias"), mine, theirs)]
    for name, m, t in pairs:
        if not torch.allclose(m.full_tensor(), t):
            failures.append(f"cudnn ops on dealt channels: the {name} differs from torch's native op")
    if empty.shape != (0,):
        failures.append(f"cudnn_batch_norm in eval on dealt channels: statistics {tuple(empty.shape)}, not empty")
    return failures


def test_the_cuda_batch_norm_ops_run_on_dealt_channels():
    results = run_on_ranks(_cudnn_ops_on_dealt_channels, 2, args=(random.randrange(10**6),), timeout_s=300)
    assert results == [[]] * 2, results[0]

def _batch_norm_module_on_dealt_channels(rank, world, seed):
    """``nn.BatchNorm2d`` whose weight, bias and running statistics lie in the map of channels dealt
    round-robin in pairs (``distribute_module``'s partition_fn; the step count replicated), on
    inputs laid out that way: three training steps with SGD then one eval run no collective
    forward or backward, and outputs, parameters and buffers track torch's module."""
    from axedist import distribute_module
    from axedist.runtime import count_collectives

    torch.manual_seed(seed)
    (_, mesh, shape, laid, channels), = [case for case in _channels_dealt(world) if "pairs" in case[0]]
    theirs = torch.nn.BatchNorm2d(shape[1], momentum=0.2).double()
    mine = torch.nn.BatchNorm2d(shape[1], momentum=0.2).double()

    def in_channels(name, module, mesh):
        for key in ("weight", "bias"):
            setattr(module, key, torch.nn.Parameter(distribute(getattr(module, key).detach(), mesh, channels)))
        for key in ("running_mean", "running_var"):
            setattr(module, key, distribute(getattr(module, key), mesh, channels))

    distribute_module(mine, mesh, in_channels)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    failures = []
    for step in range(4):
        if step == 3:
            mine.eval(), theirs.eval()
        x = torch.randn(shape, dtype=torch.float64) * 2 + 1
        dx = distribute(x, mesh, laid)
        with count_collectives() as seen:
            out = mine(dx)
        want = theirs(x)
        if seen.calls:
            failures.append(f"step {step}: {seen.calls} collectives in the forward ({seen})")
        if not torch.allclose(out.full_tensor(), want):
            failures.append(f"step {step}: values differ from torch's")
        if step < 3:
            loss = out.square().mean()
            with count_collectives() as seen:
                loss.backward()
            if seen.calls:
                failures.append(f"step {step}: {seen.calls} collectives in the backward ({seen})")
            want.square().mean().backward()
            opt_mine.step(), opt_theirs.step()
            opt_mine.zero_grad(), opt_theirs.zero_grad()
        for name, value in theirs.state_dict().items():
            got = mine.state_dict()[name].full_tensor()
            if not torch.allclose(got.to(value.dtype), value):
                failures.append(f"step {step}: {name} differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_a_batch_norm_module_trains_on_dealt_channels_where_they_are(world, seed):
    results = run_on_ranks(_batch_norm_module_on_dealt_channels, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]
