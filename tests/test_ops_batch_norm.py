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


def _batch_norm_against_torch(what, g, mesh, shape, laid, stats_laid, training, affine=True, padded_shape=None,
                              up_laid=None):
    """F.batch_norm of an input (shape, mean 1, scale 2) laid out as ``laid`` (``padded_shape``: a
    padded layout), the weight and bias replicated (None without ``affine``), the running
    statistics as ``stats_laid`` (a layout or placements, or (layout, padded shape); None: no
    running statistics), against torch's on the whole tensors: output, running statistics, then
    the gradients of x, weight and bias after ``(out * up).sum()`` (``up`` laid out as
    ``up_laid``, default replicated). Returns (failures, facts): the output, the DTensor leaves
    by name, and the collectives of the forward and of the backward."""
    from axedist.runtime import count_collectives

    replicated = [Replicate()] * mesh.ndim
    c = shape[1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).requires_grad_()
    w, b = (torch.randn(c, generator=g, dtype=torch.float64).requires_grad_() if affine else None for _ in "wb")
    rm = torch.randn(c, generator=g, dtype=torch.float64) if stats_laid is not None else None
    rv = torch.rand(c, generator=g, dtype=torch.float64) + 0.5 if stats_laid is not None else None
    dx = distribute(x.detach(), mesh, laid, padded_shape=padded_shape).requires_grad_()
    dw, db = (distribute(t.detach(), mesh, replicated).requires_grad_() if t is not None else None for t in (w, b))
    stats_layout, stats_padded = stats_laid if isinstance(stats_laid, tuple) else (stats_laid, None)
    drm, drv = (distribute(t.clone(), mesh, stats_layout, padded_shape=stats_padded) if t is not None else None
                for t in (rm, rv))
    facts = {"leaves": {"x": dx, "weight": dw, "bias": db}}
    with count_collectives() as seen:
        out = F.batch_norm(dx, drm, drv, dw, db, training=training, momentum=0.3, eps=1e-4)
    facts.update(out=out, forward=seen.calls)
    want = F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.3, eps=1e-4)
    if not torch.allclose(out.full_tensor(), want):
        return [f"{what}: values differ from torch's"], facts
    failures = [f"{what}: the {name} differs from torch's" for name, mine, theirs in
                (("running mean", drm, rm), ("running var", drv, rv))
                if theirs is not None and not torch.allclose(mine.full_tensor(), theirs)]
    up = torch.randn(shape, generator=g, dtype=torch.float64)
    loss = (out * distribute(up, mesh, up_laid or replicated)).sum()
    with count_collectives() as seen:
        loss.backward()
    facts["backward"] = seen.calls
    (want * up).sum().backward()
    for name, mine, theirs in (("x", dx, x), ("weight", dw, w), ("bias", db, b)):
        if theirs is not None and (mine.grad is None or not torch.allclose(mine.grad.full_tensor(), theirs.grad)):
            failures.append(f"{what}: the {name} gradient differs from torch's")
    return failures, facts


def _batch_norm_cases(rank, world, seed):
    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, laid, shape in _inputs(world):
        replicated = [Replicate()] * mesh.ndim
        for mode, training, stats, affine in (("train", True, True, True), ("train, no running stats", True, False, True),
                                              ("train, no affine", True, True, False), ("eval", False, True, True)):
            what = f"{label}, {mode}"
            found, facts = _batch_norm_against_torch(what, g, mesh, shape, laid, replicated if stats else None,
                                                     training, affine)
            if facts["forward"] and "gathered" not in label:
                found.append(f"{what}: {facts['forward']} moves in the forward")
            if facts["out"]._spec.layout != facts["leaves"]["x"]._spec.layout and "gathered" not in label:
                found.append(f"{what}: output laid out as {facts['out']._spec.layout}, not as the input")
            failures += found
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_batch_norm_of_a_split_batch_matches_torch(world):
    seed = random.randrange(10**6)
    results = run_on_ranks(_batch_norm_cases, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, (seed, results[0])


def _cudnn_against_native(what, mesh, g, shape, laid, stats_laid):
    """``cudnn_batch_norm`` (train, then eval: its saved statistics empty) and its backward on an
    input and output gradient laid out as ``laid``, weight and bias replicated, the running
    statistics as ``stats_laid``, against torch's native ops on the whole tensors: (failures,
    collectives the three calls ran)."""
    from axedist.runtime import count_collectives

    aten = torch.ops.aten
    x, grad = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    w, b, rm = (torch.randn(shape[1], generator=g, dtype=torch.float64) for _ in range(3))
    rv = torch.rand(shape[1], generator=g, dtype=torch.float64) + 0.5
    dx, dgrad = distribute(x, mesh, laid), distribute(grad, mesh, laid)
    dw, db = (distribute(t, mesh, [Replicate()]) for t in (w, b))
    drm, drv = (distribute(t.clone(), mesh, stats_laid) for t in (rm, rv))
    with count_collectives() as seen:
        out, mean, invstd, reserve = aten.cudnn_batch_norm(dx, dw, db, drm, drv, True, 0.1, 1e-5)
        mine = aten.cudnn_batch_norm_backward(dx, dgrad, dw, drm, drv, mean, invstd, 1e-5, reserve)
        evaluated, empty, _, _ = aten.cudnn_batch_norm(dx, dw, db, drm, drv, False, 0.1, 1e-5)
    want, want_mean, want_invstd = aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
    theirs = aten.native_batch_norm_backward(grad, x, w, rm, rv, want_mean, want_invstd, True, 1e-5, [True] * 3)
    want_eval = aten.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5)[0]
    pairs = [("output", out, want), ("mean", mean, want_mean), ("invstd", invstd, want_invstd),
             ("running mean", drm, rm), ("running var", drv, rv), ("eval output", evaluated, want_eval)]
    pairs += [(f"{name} gradient", m, t) for name, m, t in zip(("input", "weight", "bias"), mine, theirs)]
    failures = [f"{what}: the {name} differs from torch's native op" for name, m, t in pairs
                if not torch.allclose(m.full_tensor(), t)]
    if empty.shape != (0,):
        failures.append(f"{what}, eval: statistics {tuple(empty.shape)}, not empty")
    return failures, seen.calls


def _cudnn_ops_by_their_rules(rank, world, seed):
    """``cudnn_batch_norm`` and its backward on a batch-sharded DTensor give torch's native values."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    return _cudnn_against_native("cudnn ops, batch sharded", mesh, g, (2 * world, C, 5), [Shard(0)], [Replicate()])[0]


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
    return _module_steps(mine, theirs, lambda: torch.randn(2 * world, C, 6, dtype=torch.float64),
                         lambda x: distribute(x, mesh, [Shard(0)]))


def _module_steps(mine, theirs, make, laid_out, collective_free=False):
    """Three training steps with SGD, then one in eval, of ``mine`` on ``laid_out(x)`` and
    ``theirs`` on fresh inputs ``x = make()``: outputs, then parameters and buffers (the step
    count too) after each step, against torch's; with ``collective_free``, no collective forward
    or backward. The failures."""
    from axedist.runtime import count_collectives

    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    failures = []
    for step in range(4):
        if step == 3:
            mine.eval(), theirs.eval()
        x = make()
        dx = laid_out(x)
        with count_collectives() as seen:
            out = mine(dx)
        want = theirs(x)
        if collective_free and seen.calls:
            failures.append(f"step {step}: {seen.calls} collectives in the forward ({seen})")
        if not torch.allclose(out.full_tensor(), want):
            failures.append(f"step {step}: values differ from torch's")
        if step < 3:
            loss = out.square().mean()
            with count_collectives() as seen:
                loss.backward()
            if collective_free and seen.calls:
                failures.append(f"step {step}: {seen.calls} collectives in the backward ({seen})")
            want.square().mean().backward()
            opt_mine.step(), opt_theirs.step()
            opt_mine.zero_grad(), opt_theirs.zero_grad()
        for name, value in theirs.state_dict().items():
            got = mine.state_dict()[name].full_tensor()
            if not torch.equal(got, value) and not torch.allclose(got.double(), value.double()):
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
    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, shape, laid, channels in _channels_dealt(world):
        replicated = [Replicate()] * mesh.ndim
        for mode, (training, stats, affine) in _CHANNEL_MODES.items():
            what = f"{label}, {mode}"
            where = {"map": channels, "replicated": replicated, None: None}[stats]
            found, facts = _batch_norm_against_torch(what, g, mesh, shape, laid, where, training, affine, up_laid=laid)
            for phase in ("forward", "backward"):
                if facts.get(phase):
                    found.append(f"{what}: {facts[phase]} collectives in the {phase}")
            if facts["out"]._spec.layout != facts["leaves"]["x"]._spec.layout:
                found.append(f"{what}: output laid out as {facts['out']._spec.layout}, not as the input")
            for name, layout in (("x", laid), ("weight", channels), ("bias", channels)):
                grad = facts["leaves"][name].grad if facts["leaves"][name] is not None else None
                if grad is not None and not found and grad._spec.layout != layout:
                    found.append(f"{what}: the {name} gradient laid out as {grad._spec.layout}, not {layout}")
            failures += found
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
        for mode, training in (("train", True), ("eval", False)):
            failures += _batch_norm_against_torch(f"{label}, {mode}", g, mesh, shape, laid, stats_laid, training,
                                                  padded_shape=padded_shape)[0]
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_batch_norm_outside_the_channels_way_takes_the_placement_way(world, seed):
    results = run_on_ranks(_batch_norm_outside_the_channels_way, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]


def _cudnn_ops_on_dealt_channels(rank, world, seed):
    """``cudnn_batch_norm`` and its backward (train), and the forward in eval (its saved statistics
    empty), on channels dealt round-robin: no collective, torch's native values."""
    g = torch.Generator().manual_seed(seed)
    (_, mesh, shape, laid, channels), = [case for case in _channels_dealt(world) if case[0] == "channels round-robin"]
    failures, collectives = _cudnn_against_native("cudnn ops on dealt channels", mesh, g, shape, laid, channels)
    if collectives:
        failures.append(f"cudnn ops on dealt channels: {collectives} collectives")
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
    return _module_steps(mine, theirs, lambda: torch.randn(shape, dtype=torch.float64) * 2 + 1,
                         lambda x: distribute(x, mesh, laid), collective_free=True)


@pytest.mark.parametrize("world", [2, 4])
def test_a_batch_norm_module_trains_on_dealt_channels_where_they_are(world, seed):
    results = run_on_ranks(_batch_norm_module_on_dealt_channels, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]
