"""The fast path's grad-mode hits (axedist/ops/fastpath.py) against the normal dispatch route.

With grad mode on and a DTensor argument that requires grad, a cached call still goes through
torch's dispatcher (autograd records it in C++), but ``__torch_dispatch__`` hands back the
output the fast path computed on the local tensors instead of running the dispatcher. Every
call here runs with the fast path off (the normal route), then three times with it on (a miss
that records, then hits), on fresh leaves each time; the outputs and the gradients must equal
the normal route's exactly (spec, dtype, strides, local tensor bit for bit) and the unsharded
op's on the full tensors. Fresh random inputs each run (hypothesis seeds), several placements.
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.ops.state import READY, RECORDING, ReadyOutput
from axedist.testing import run_on_ranks

fastpath = DTensor.dispatcher.fastpath


def _rand(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _facts(t):
    """What a caller can observe of a DTensor on this rank (None stays None)."""
    if t is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        return (t._spec, t.dtype, tuple(t.shape), t.stride(), t.requires_grad, t._local.detach().clone())


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a[:5] == b[:5], f"{what}: {a[:5]} != {b[:5]}"
    assert torch.equal(a[5], b[5]), what


# name -> (full tensor maker (seed), placements); every input is a leaf
INPUTS = {
    "x": (lambda s, w: _rand((4 * w, 6), s + 1), [Shard(0)]),
    "y": (lambda s, w: _rand((4 * w, 6), s + 2), [Shard(0)]),
    "c": (lambda s, w: _rand((4 * w, 6), s + 3), [Shard(1)]),
    "u": (lambda s, w: _rand((4 * w + 1, 5), s + 4), [Shard(0)]),       # uneven: torch.chunk shards
    "a": (lambda s, w: _rand((6, 4 * w), s + 5), [Shard(1)]),
    "b": (lambda s, w: _rand((4 * w, 3), s + 6), [Shard(0)]),
    "r": (lambda s, w: _rand((4 * w, 6), s + 7), [Replicate()]),
    "f": (lambda s, w: _rand((4 * w, 6), s + 8, torch.float32), [Shard(0)]),
}

# name, inputs that require grad, call on (DTensors or full tensors), served by the fast path
# once recorded (else: the normal route on every call)
CALLS = [
    ("add", "xy", lambda t: t["x"] + t["y"], True),
    ("add, only x requires grad", "x", lambda t: t["x"] + t["y"], True),
    ("add, only y requires grad", "y", lambda t: t["x"] + t["y"], True),
    ("add alpha kwarg", "xy", lambda t: torch.add(t["x"], t["y"], alpha=0.5), True),
    ("double use x * x", "x", lambda t: t["x"] * t["x"], True),
    ("mul float", "x", lambda t: t["x"] * 2.0, True),
    ("radd scalar", "x", lambda t: 2.5 + t["x"], True),
    ("sub replicated", "r", lambda t: t["r"] - 1.5, True),
    ("exp (saves its output)", "x", lambda t: torch.exp(t["x"]), True),
    ("uneven tanh", "u", lambda t: torch.tanh(t["u"]), True),
    ("sum dim", "x", lambda t: t["x"].sum(1), True),
    ("sum dim keepdim", "x", lambda t: t["x"].sum(dim=1, keepdim=True), True),
    ("softmax (autograd detaches its output)", "c", lambda t: torch.softmax(t["c"], dim=0), True),
    ("cast", "f", lambda t: t["f"].to(torch.float64), True),
    ("mm -> pending sum", "ab", lambda t: torch.mm(t["a"], t["b"]), True),
    ("mm, only b requires grad", "b", lambda t: torch.mm(t["a"], t["b"]), True),
    ("linear (t + mm: two aten ops)", "rx", lambda t: F.linear(t["r"], t["x"]), False),
    ("mean over a sharded dim (communicates)", "x", lambda t: t["x"].mean(0), False),
    ("needs a move", "xc", lambda t: t["x"] + t["c"], False),
    ("view", "x", lambda t: t["x"].view(2 * t["x"].shape[0], 3), False),
    ("transpose", "x", lambda t: t["x"].transpose(0, 1), False),
]


def _leaves(mesh, seed, needs):
    """Fresh DTensor leaves (and full tensors) for one run; ``needs`` names those requiring grad."""
    dts, full = {}, {}
    for name, (make, placements) in INPUTS.items():
        t = make(seed, mesh.size())
        full[name] = t.clone().requires_grad_(name in needs)
        dts[name] = distribute(t, mesh, placements).requires_grad_(name in needs)
    return dts, full


def _run(call, needs, mesh, seed):
    """Output facts, grads of the inputs that require grad (facts), the loss, the full output.

    The call runs twice on the same leaves: the first call enters the fast path's handler and
    marks the leaves (and its output) so that the second goes straight to the dispatcher
    when every DTensor argument requires grad; both must give the same output."""
    dts, _ = _leaves(mesh, seed, needs)
    first = _facts(call(dts))
    out = call(dts)
    _same(_facts(out), first, "the same call again on the same leaves")
    assert out.requires_grad and out.grad_fn is not None
    cot = _rand(tuple(out.shape), seed + 99)  # the same cotangent on every rank
    loss = (out.full_tensor() * cot).sum()
    grads = torch.autograd.grad(loss, [dts[n] for n in needs])
    return _facts(out), [_facts(g) for g in grads], out.full_tensor().detach(), [g.full_tensor() for g in grads]


def _check_calls(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    fastpath.clear()
    for name, needs, call, fast in CALLS:
        fastpath.enable(False)
        normal = _run(call, needs, mesh, seed)
        # the unsharded reference: the op and its gradients on the full tensors
        _, full = _leaves(mesh, seed, needs)
        expected = call(full)
        cot = _rand(tuple(expected.shape), seed + 99)
        expected_grads = torch.autograd.grad((expected * cot).sum(), [full[n] for n in needs])
        fastpath.enable(True)
        before = fastpath.stats()["grad hits"]
        for attempt in range(3):  # a miss (records), then hits
            got = _run(call, needs, mesh, seed)
            _same(got[0], normal[0], f"{name}: output (call {attempt})")
            for i, (g, h) in enumerate(zip(got[1], normal[1])):
                _same(g, h, f"{name}: grad {i} (call {attempt})")
        assert torch.allclose(got[2], expected.detach(), atol=1e-12), name
        for g, e in zip(got[3], expected_grads):
            assert torch.allclose(g.to(e.dtype), e, atol=1e-12), name
        hits = fastpath.stats()["grad hits"] - before
        assert (hits >= 2) == fast, f"{name}: {hits} grad-mode hits, expected {'some' if fast else 'none'}"
    return True


def test_grad_hits_equal_normal_route(seed):
    run_on_ranks(_check_calls, 4, args=(seed,))


def _graph_semantics(rank, world, seed):
    """retain_graph, accumulation into .grad, version checks of saved tensors, switching
    no_grad / inference_mode / grad mode, the same key with and without grad: all as on the
    normal route."""
    mesh = DeviceMesh("cpu", (world,))
    x, y = _rand((4 * world, 6), seed), _rand((4 * world, 6), seed + 1)
    runs = []
    for on in (False, True):
        fastpath.enable(on)
        fastpath.clear()
        facts = []
        dx = distribute(x, mesh, [Shard(0)]).requires_grad_()
        dy = distribute(y, mesh, [Shard(0)]).requires_grad_()
        for _ in range(3):
            dx * dy  # records, then hits
        # retain_graph: backward twice through the same graph; .grad accumulates
        z = (dx * dy) * 3.0
        loss = (z.full_tensor() * z.full_tensor()).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        facts += [_facts(dx.grad), _facts(dy.grad)]
        assert torch.allclose(dx.grad.full_tensor(), 2 * 2 * 9 * x * y * y)
        # a saved output changed in place: autograd's version check fires on both routes
        e = torch.exp(dx)
        e2 = torch.exp(dx)
        assert e._version == e2._version == 0
        e.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            e.full_tensor().sum().backward()
        # in-place on a result of a hit (not a leaf): recorded by autograd, grads follow
        dx.grad = None
        w = dx * 2.0
        w.mul_(dy)
        w.full_tensor().sum().backward()
        facts.append(_facts(dx.grad))
        assert torch.allclose(dx.grad.full_tensor(), 2 * y)
        # the same key without autograd: no graph, same values
        with torch.no_grad():
            for _ in range(2):
                n = dx * dy
            assert not n.requires_grad and n.grad_fn is None
        with torch.inference_mode():
            for _ in range(2):
                i = dx * dy
            assert i.is_inference() and not i.requires_grad
        facts += [_facts(n), _facts(i)]
        # grad mode back on: hits record again
        g = dx * dy
        assert g.requires_grad and g.grad_fn is not None and g.grad_fn.name() == "MulBackward0"
        # inputs that require grad, grad mode on, but a detached one: key of one grad input
        h = dx.detach() * dy
        assert h.requires_grad
        (gy,) = torch.autograd.grad(h.full_tensor().sum(), [dy])
        facts.append(_facts(gy))
        assert torch.allclose(gy.full_tensor(), x)
        # backward() on a DTensor that enters the handler (the output of a call that was just
        # recorded) is never recorded itself: a recorder holding the gradient would make
        # autograd copy the leaf's first gradient instead of keeping it (same values, another
        # layout than the normal route's)
        fastpath.clear()
        leaf = distribute(x, mesh, [Shard(1)]).requires_grad_()
        labels = distribute(torch.arange(4 * world) % 6, mesh, [Replicate()])
        recording = []
        leaf.register_hook(lambda grad: recording.append(len(RECORDING)))
        F.cross_entropy(leaf, labels).backward()
        assert recording == [0]
        facts.append(_facts(leaf.grad))
        runs.append(facts)
        if on:
            # leaves that required grad in a call carry torch's disabled handler on the instance:
            # calls whose DTensors all carry it skip the fast path's handler (and so do their
            # grad-mode outputs); a call with another DTensor enters it and is a grad-mode hit
            entered = []

            def spy(cls, func, types, args=(), kwargs=None):
                entered.append(func)
                return fastpath.torch_function(cls, func, types, args, kwargs)

            DTensor.__torch_function__ = classmethod(spy)
            try:
                assert vars(dx)["__torch_function__"] is torch._C._disabled_torch_function_impl
                s = (dx * dy) * 3.0
                assert entered == [] and s.grad_fn.name() == "MulBackward0"
                plain = distribute(y, mesh, [Shard(0)])
                hits = fastpath.stats()["grad hits"]
                for _ in range(3):
                    m = dx * plain
                assert entered and fastpath.stats()["grad hits"] == hits + 2 and m.requires_grad
            finally:
                fastpath.enable(True)
            assert torch.equal(s._local, (3 * (dx._local * dy._local)).detach())
            assert torch.equal(m._local, (dx._local * plain._local).detach())
    for i, (a, b) in enumerate(zip(runs[0], runs[1])):
        _same(a, b, f"fact {i}")
    return True


def test_graph_semantics_match_normal_route(seed):
    run_on_ranks(_graph_semantics, 4, args=(seed,))


def _ready_guard(rank, world, seed):
    """An output computed ahead is served only to the op, DTensors and thread it was made for."""
    mesh = DeviceMesh("cpu", (world,))
    fastpath.enable(False)
    x, y = distribute(_rand((4 * world, 6), seed), mesh, [Shard(0)]), \
        distribute(_rand((4 * world, 6), seed + 1), mesh, [Shard(0)])
    bogus = x * 100.0
    add, mul = torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor
    try:
        # a wrong op, the right objects in the wrong order, a wrong object: dropped, the normal route runs
        for ready_op, args in ((mul, (x, y)), (add, (y, x)), (add, (x, x))):
            READY.value = ReadyOutput(ready_op, (0, 1), (x, y), bogus)
            z = add(*args)
            assert z is not bogus and READY.value is False
            assert torch.equal(z.full_tensor(), args[0].full_tensor() + args[1].full_tensor())
        # another thread's pending output is not this thread's
        READY.value = ReadyOutput(add, (0, 1), (x, y), bogus)
        seen = []
        worker = threading.Thread(target=lambda: seen.append(add(x, y) is bogus))
        worker.start()
        worker.join()
        assert seen == [False] and READY.value.out is bogus
        assert add(x, y) is bogus and READY.value is None  # the right op, objects and thread
    finally:
        READY.value = None
        fastpath.enable(True)
    return True


def test_ready_output_guard():
    run_on_ranks(_ready_guard, 2, args=(7,))
