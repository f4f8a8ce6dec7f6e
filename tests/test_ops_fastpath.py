"""The torch-function fast path (axedist/ops/fastpath.py) against the normal dispatch route.

Every call runs first with the fast path off (the normal route: torch's dispatcher ->
``__torch_dispatch__`` -> the dispatcher), then three times with it on (a miss that
records, then hits); each result must equal the normal route's exactly (spec, dtype,
global strides, local tensor bit for bit) and the unsharded op on the full tensors.
Fresh random inputs each run (hypothesis seeds), several placements, uneven shapes.
"""

import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from axedist.dtensor import DTensor, distribute, fused_gemm_stats
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

fastpath = DTensor.dispatcher.fastpath



def _rand(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _facts(result):
    """Everything a caller can observe of a result (on this rank)."""
    if isinstance(result, (tuple, list)):  # (also torch.return_types)
        return ("sequence", type(result), tuple(_facts(r) for r in result))
    if isinstance(result, DTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return ("DTensor", result._spec, result.dtype, tuple(result.shape), result.stride(),
                    result.requires_grad, result._local.clone())
    return ("plain", result)


def _same(a, b, what):
    assert a[0] == b[0], what
    if a[0] == "sequence":
        assert a[1] is b[1] and len(a[2]) == len(b[2]), what
        for k, (x, y) in enumerate(zip(a[2], b[2])):
            _same(x, y, f"{what}[{k}]")
        return
    if a[0] == "plain":
        assert type(a[1]) is type(b[1]) and (a[1] == b[1] if not isinstance(a[1], torch.Tensor)
                                            else torch.equal(a[1], b[1])), what
        return
    assert a[1:6] == b[1:6], f"{what}: {a[1:6]} != {b[1:6]}"
    assert torch.equal(a[6], b[6]) or (a[6].isnan() == b[6].isnan()).all() and torch.equal(
        a[6].nan_to_num(), b[6].nan_to_num()), what


def _inputs(mesh, seed):
    """(name -> (DTensor, full tensor)) over several placements and an uneven shape."""
    r = lambda shape, k, dtype=torch.float64: _rand(shape, seed + k, dtype)  # noqa: E731
    world = mesh.size()
    made = {
        "x": (r((4 * world, 6), 1), [Shard(0)]),
        "y": (r((4 * world, 6), 2), [Shard(0)]),
        "c": (r((4 * world, 6), 3), [Shard(1)]),
        "u": (r((4 * world + 1, 5), 4), [Shard(0)]),           # uneven: torch.chunk shards
        "a": (r((6, 4 * world), 5), [Shard(1)]),
        "b": (r((4 * world, 3), 6), [Shard(0)]),
        "inp": (r((5, 6), 7), [Replicate()]),
        "w": (r((2 * world, 6), 8), [Shard(0)]),
        "bias": (r((2 * world,), 9), [Shard(0)]),
        "v": (r((2 * world, 3, 4), 10), [Shard(0)]),
        "f": (r((4 * world, 6), 11, torch.float32), [Shard(0)]),
        "n": (r((6,), 12), [Replicate()]),
        "q": (r((1, 2 * world, 5, 4), 13), [Shard(1)]),
        "k": (r((1, 2 * world, 5, 4), 14), [Shard(1)]),
        "qu": (r((1, world + 1, 5, 4), 15), [Shard(1)]),         # uneven heads: some rank has one less
    }
    out = {name: (distribute(t, mesh, p), t) for name, (t, p) in made.items()}
    ints = torch.randint(-5, 5, (4 * world, 3), generator=torch.Generator().manual_seed(seed))
    out["i"] = (distribute(ints, mesh, [Shard(0)]), ints)
    # a pending sum: every rank's summand, and their total
    parts = [r((4, 3), 20 + k) for k in range(world)]
    out["p"] = (DTensor.from_local(parts[mesh.position()], mesh, [Partial()]), sum(parts))
    return out


# name, call on (DTensors or full tensors), kept fast after recording (else: the normal route)
CALLS = [
    ("add", lambda t: t["x"] + t["y"], True),
    ("add alpha kwarg", lambda t: torch.add(t["x"], t["y"], alpha=0.5), True),
    ("radd scalar", lambda t: 2.5 + t["x"], True),
    ("mul float", lambda t: t["x"] * 2.0, True),
    ("mul int", lambda t: t["x"] * 3, True),
    ("int tensor * int", lambda t: t["i"] * 2, True),           # int64 result
    ("int tensor * float", lambda t: t["i"] * 2.0, True),       # float result: not the int entry
    ("int tensor * bool", lambda t: t["i"] * True, True),
    ("sub, exp", lambda t: torch.exp(t["x"] - t["y"]), True),
    ("uneven tanh", lambda t: torch.tanh(t["u"]), True),
    ("sum dim", lambda t: t["x"].sum(1), True),
    ("sum dim keepdim", lambda t: t["x"].sum(dim=1, keepdim=True), True),
    ("mean sharded dim", lambda t: t["x"].mean(0), False),       # communicates: normal route
    ("softmax", lambda t: torch.softmax(t["c"], dim=0), True),
    ("cast", lambda t: t["f"].to(torch.float64), True),
    ("mm -> pending sum", lambda t: torch.mm(t["a"], t["b"]), True),
    ("linear column-parallel", lambda t: F.linear(t["inp"], t["w"]), True),
    ("linear + bias", lambda t: F.linear(t["inp"], t["w"], t["bias"]), True),
    ("matmul", lambda t: t["inp"] @ t["w"].t(), True),
    ("needs a move", lambda t: t["x"] + t["c"], False),
    ("pending sum input", lambda t: t["p"] * 2.0, False),
    ("pending sum, nonlinear", lambda t: torch.exp(t["p"]), False),
    ("view", lambda t: t["v"].view(2 * t["v"].shape[0], 6), False),  # views keep the normal route
    ("transpose", lambda t: t["x"].transpose(0, 1), False),
    ("reshape", lambda t: t["v"].reshape(-1, 4), False),
    ("0-dim tensor scalar", lambda t: t["x"] * torch.tensor(3.0, dtype=torch.float64), False),
    ("clone", lambda t: t["x"].clone(), True),
    # (torch.cat's list, a weight among the keyword arguments, one output of a tuple: served where
    # no DTensor of the call requires grad, as here)
    ("cat of a list", lambda t: torch.cat([t["x"], t["y"]], dim=1), True),
    ("cat of a tuple along the sharded dim", lambda t: torch.cat((t["x"], t["y"])), False),
    # (with grad mode on, torch's composite runs the math ops, among them an in-place add)
    ("rms_norm, weight as a keyword", lambda t: F.rms_norm(t["x"], (6,), t["n"], 1e-6), False),
    ("sdpa, heads sharded", lambda t: F.scaled_dot_product_attention(t["q"], t["k"], t["k"], is_causal=True), True),
    ("sdpa, scale keyword", lambda t: F.scaled_dot_product_attention(t["q"], t["k"], t["q"], scale=0.3), True),
    ("sdpa, uneven heads", lambda t: F.scaled_dot_product_attention(t["qu"], t["qu"], t["qu"]), False),
    ("chunk", lambda t: t["x"].chunk(2, dim=1), False),           # views: the normal route
    ("split sizes", lambda t: torch.split(t["c"], [1, 5], dim=1), False),
    ("max dim (values, indices)", lambda t: t["x"].max(dim=1), None),
]


def _full(result):
    if isinstance(result, (tuple, list)):
        return [_full(r) for r in result]
    if isinstance(result, DTensor):
        return result.full_tensor()
    return result


# Under inference_mode composite ops reach the dispatcher undecomposed and run as their decomposition
# (t, view, mm, _unsafe_view for a linear); the fast path proves the torch call through those steps.
# None: either route may serve it (a step the fast path does not prove, e.g. an in-place bias add)
INFERENCE_CALLS = [
    ("3-D linear column-parallel", lambda t: F.linear(t["x3"], t["w"]), True),
    ("3-D linear row-parallel -> pending sum", lambda t: F.linear(t["x3c"], t["wr"]), True),
    ("3-D linear over batch-sharded rows", lambda t: F.linear(t["x3b"], t["wfull"]), True),
    ("3-D matmul", lambda t: torch.matmul(t["x3"], t["wt"]), True),
    ("3-D linear + bias", lambda t: F.linear(t["x3"], t["w"], t["bias"]), None),
    ("rms_norm", lambda t: F.rms_norm(t["x3b"], (6,), eps=1e-6), None),
    ("2-D linear", lambda t: F.linear(t["inp"], t["w"]), True),
    # (global sizes the local tensor does not have: the plan's local reshape serves it)
    ("view merging a sharded dim", lambda t: t["v"].view(2 * t["v"].shape[0], 6), True),
    # views under inference_mode (no autograd view tracking): the local view, where the torch function's
    # sizes are the local ones (dims no device splits)
    ("view of a replicated tensor", lambda t: t["x3"].view(6, 6), True),
    ("view of dims a shard keeps whole", lambda t: t["x3b"].view(t["x3b"].shape[0], 3, 2, 3)[:, :, 1], None),
    ("index with None and slices", lambda t: t["x3"][:, None, None, 1:], True),
    ("index a slice", lambda t: t["x3"][:1], True),
    ("permute, transpose, unsqueeze, expand", lambda t: t["x3"].permute(2, 0, 1).transpose(0, 1).unsqueeze(0)
     .expand(2, 2, 6, 3), True),
    ("rms_norm, weight as a keyword", lambda t: F.rms_norm(t["x3b"], (6,), t["n"], 1e-6), True),
    ("cat of a list", lambda t: torch.cat([t["x3"], t["x3"] * 2.0], dim=-1), True),
    ("sdpa, heads sharded", lambda t: F.scaled_dot_product_attention(t["q"], t["k"], t["k"], is_causal=True), True),
    ("sdpa, uneven heads", lambda t: F.scaled_dot_product_attention(t["qu"], t["qu"], t["qu"]), False),
    ("chunk", lambda t: t["x3"].chunk(2, dim=-1), True),  # (a tuple of views)
    # (ops that may alias but made a new tensor: entries whose hits check theirs is new too)
    ("cast (to -> _to_copy with a dtype keyword)", lambda t: t["f"].to(torch.float64), True),
    ("reshape of an expanded view (a copy)", lambda t: t["xe"].reshape(2, 3, 12), True),
]


def _inference_inputs(mesh, seed):
    world = mesh.size()
    out = _inputs(mesh, seed)
    made = {"x3": ((2, 3, 6), [Replicate()]), "x3c": ((2, 3, 4 * world), [Shard(2)]),
            "wr": ((5, 4 * world), [Shard(1)]), "x3b": ((2 * world, 3, 6), [Shard(0)]),
            "wfull": ((5, 6), [Replicate()]), "wt": ((6, 2 * world), [Shard(1)])}
    for k, (name, (shape, placements)) in enumerate(made.items()):
        full = _rand(shape, seed + 40 + k)
        out[name] = (distribute(full, mesh, placements), full)
    x3, full = out["x3"]
    out["xe"] = (x3.unsqueeze(2).expand(2, 3, 2, 6), full.unsqueeze(2).expand(2, 3, 2, 6))  # a view, not contiguous
    return out


def _check_calls(rank, world, seed, inference=False):
    mesh = DeviceMesh("cpu", (world,))
    fastpath.clear()
    fast_seen = []
    # (inputs made inside inference mode: a DTensor made outside cannot be viewed inside, as torch's;
    # nn.to_inference says so)
    with torch.inference_mode(inference):
        t = (_inference_inputs if inference else _inputs)(mesh, seed)
        dts = {k: d for k, (d, _) in t.items()}
        full = {k: f for k, (_, f) in t.items()}
        for name, call, fast in INFERENCE_CALLS if inference else CALLS:
            _check_call(name, call, fast, dts, full, fast_seen)
    return fast_seen


def _check_call(name, call, fast, dts, full, fast_seen):
    """One call: fast path off (the normal route), then on three times (a miss that records, then
    hits), every result equal to the normal route's and the full tensors'."""
    fastpath.enable(False)
    normal = _facts(call(dts))
    expected = call(full)
    fastpath.enable(True)
    before = fastpath.stats()["hits"]
    for attempt in range(3):  # a miss (records), then hits
        result = call(dts)
        _same(_facts(result), normal, f"{name} (call {attempt})")
    got = _full(result)  # the same facts on every rank: the same global tensor each time
    for g, e in zip(got, expected) if isinstance(got, list) else [(got, expected)]:
        assert g.dtype == e.dtype, name
        assert torch.allclose(g, e, atol=1e-12), name
    hits = fastpath.stats()["hits"] - before
    fast_seen.append((name, hits))
    assert fast is None or (hits >= 2) == fast, f"{name}: {hits} fast hits, expected {'some' if fast else 'none'}"


def test_fast_path_equals_normal_route(seed):
    run_on_ranks(_check_calls, 4, args=(seed,))


def test_fast_path_under_inference_mode_equals_normal_route(seed):
    run_on_ranks(_check_calls, 2, args=(seed, True))


def _in_place_and_out(rank, world, seed):
    """In-place ops and out= take the normal route; their results (and the tensor written)
    equal the normal route's, also after the functional op's key was cached."""
    mesh = DeviceMesh("cpu", (world,))
    x, y = _rand((4 * world, 6), seed), _rand((4 * world, 6), seed + 1)
    runs = []
    for on in (False, True):
        fastpath.enable(on)
        dx, dy = distribute(x, mesh, [Shard(0)]), distribute(y, mesh, [Shard(0)])
        dx + dy
        dx + dy  # the functional add is cached now
        z = dx.clone()
        version = z._version
        z.add_(dy, alpha=2.0)
        z.mul_(0.5)
        assert z._version == version + 2  # in-place ops bump the wrapper's version counter (autograd relies on it)
        out = distribute(torch.zeros(4 * world, 6, dtype=torch.float64), mesh, [Shard(0)])
        r = torch.add(dx, dy, out=out)
        assert r is out
        runs.append((_facts(z), _facts(out)))
        assert torch.allclose(z.full_tensor(), (x + 2 * y) * 0.5) and torch.allclose(out.full_tensor(), x + y)
    for a, b in zip(runs[0], runs[1]):
        _same(a, b, "in-place / out=")


def test_in_place_and_out(seed):
    run_on_ranks(_in_place_and_out, 4, args=(seed,))


def _autograd(rank, world, seed):
    """A cached key never skips autograd: with inputs requiring grad (grad mode on) the call
    takes the normal route, and gradients equal the fast-path-off run's."""
    mesh = DeviceMesh("cpu", (world,))
    x, w = _rand((4, 6), seed), _rand((2 * world, 6), seed + 1)
    grads = []
    for on in (False, True):
        fastpath.enable(on)
        dx = distribute(x, mesh, [Replicate()])
        dw = distribute(w, mesh, [Shard(0)])
        for _ in range(3):  # cache the key without grad
            F.linear(dx, dw)
            (dx * 2.0).sum(1)
        dw.requires_grad_()
        y = F.linear(dx, dw)
        assert y.grad_fn is not None and y.requires_grad
        loss = (y * 2.0).sum(1).sum()
        assert loss.grad_fn is not None
        loss.backward()
        grads.append(_facts(dw.grad))
        with torch.no_grad():  # no autograd to record: the fast path may serve it
            hits = fastpath.stats()["hits"]
            z = F.linear(dx, dw)
            assert not z.requires_grad and z.grad_fn is None
            if on:
                assert fastpath.stats()["hits"] == hits + 1
        expected = (2 * torch.ones(4, 2 * world, dtype=torch.float64)).T @ x
        assert torch.allclose(dw.grad.full_tensor(), expected)
    _same(grads[0], grads[1], "grad of w")


def test_autograd_takes_the_normal_route(seed):
    run_on_ranks(_autograd, 4, args=(seed,))


class _AtenLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, [type(a).__name__ for a in args]))
        return func(*args, **(kwargs or {}))


class _CallLog(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _modes_views_state(rank, world, seed):
    """Modes see what they saw before; views stay views; deferred GEMMs and inference mode."""
    mesh = DeviceMesh("cpu", (world,))
    fastpath.enable(True)
    x, y = _rand((4 * world, 6), seed), _rand((4 * world, 6), seed + 1)
    dx, dy = distribute(x, mesh, [Shard(0)]), distribute(y, mesh, [Shard(0)])
    for _ in range(3):
        dx + dy
    # a torch dispatch mode must see the aten op on DTensors: the fast path steps aside
    with _AtenLog() as log:
        z = dx + dy
    assert (torch.ops.aten.add.Tensor, ["DTensor", "DTensor"]) in log.ops
    assert torch.allclose(z.full_tensor(), x + y)
    # a torch function mode sees the call, and the result is the same
    hits = fastpath.stats()["hits"]
    with _CallLog() as calls:
        z = dx + dy
    assert calls.calls >= 1 and torch.allclose(z.full_tensor(), x + y)
    assert fastpath.stats()["hits"] == hits + 1
    # views stay views of their base (autograd's version counter and _base), never fast
    v = distribute(_rand((2 * world, 3, 4), seed + 2), mesh, [Shard(0)])
    for _ in range(3):
        view = v.view(2 * world * 3, 4)
    assert view._is_view() and view._base is v
    view.mul_(2.0)
    assert torch.allclose(v.full_tensor(), 2 * _rand((2 * world, 3, 4), seed + 2))
    # a deferred GEMM recorded as "not deferred" under defer_gemm="auto" defers again under "always"
    a, b = distribute(_rand((6, 4 * world), seed + 3), mesh, [Shard(1)]), \
        distribute(_rand((4 * world, 3), seed + 4), mesh, [Shard(0)])
    for _ in range(3):
        p = torch.mm(a, b)
    assert p._pending is None
    DTensor.dispatcher.defer_gemm = "always"
    try:
        q = torch.mm(a, b)
        assert q._pending is not None
        # calls that take the normal route without using the data leave the product unrun
        # (a fused reduce-scatter may still take it): getters, first seen or not
        fastpath.clear()
        materialized = fused_gemm_stats()["materialized"]
        assert not q.requires_grad and tuple(q.shape) == (6, 3) and q.dim() == 2
        assert q._pending.value is None and fused_gemm_stats()["materialized"] == materialized
        assert torch.allclose(q.full_tensor(), p.full_tensor())
    finally:
        DTensor.dispatcher.defer_gemm = "auto"
    # inference mode: fast hits give inference tensors, like the normal route
    with torch.inference_mode():
        for _ in range(3):
            s = dx * 3.0
        assert s.is_inference()
        assert torch.allclose(s.full_tensor(), 3 * x)
    # a DTensor whose spec changes in place (dispatch reduces a pending sum in place for exp_
    # of a Partial) is keyed by its new spec, never by the tag of the old one
    e, r = distribute(x, mesh, [Shard(0)]), distribute(x, mesh, [Replicate()])
    for _ in range(3):
        e * 2.0
        r * 2.0
    e._spec, e._value = r._spec, r._value
    assert (e * 2.0).placements == (Replicate(),) and torch.allclose((e * 2.0).full_tensor(), 2 * x)
    # getters and methods still answer through the fast path's handler
    assert tuple(dx.shape) == (4 * world, 6) and dx.dtype == torch.float64 and dx.dim() == 2
    assert dx.size(0) == 4 * world and not dx.requires_grad


def test_modes_views_and_state(seed):
    run_on_ranks(_modes_views_state, 4, args=(seed,))


def test_env_var_turns_it_off():
    # on by default: installed when axedist.dtensor is imported
    assert DTensor.__dict__["__torch_function__"] is not torch._C._disabled_torch_function_impl
    code = ("import torch, axedist.dtensor as d; "
            "print(d.DTensor.__dict__['__torch_function__'] is torch._C._disabled_torch_function_impl)")
    env = dict(os.environ, AXEDIST_FASTPATH="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_wrapper_takes_positions():
    """The positional ``_make_wrapper_subclass`` check succeeds on the torch in use: a failed
    check falls back to keywords (same results, ~1 us more per output on every route)."""
    from axedist.ops.state import WRAPPER_POSITIONAL

    assert WRAPPER_POSITIONAL


def _changing_floats(rank, world, seed):
    """A pointwise call with a float that changes every call (AdamW's bias correction) is
    recorded once and then hit, with or without autograd, each value right; a call whose op is
    not pointwise keeps the float's value in its key (another value records again)."""
    mesh = DeviceMesh("cpu", (world,))
    fastpath.clear()
    x, w = _rand((4 * world, 6), seed), _rand((4 * world, 6), seed + 1)
    dx = distribute(x, mesh, [Shard(0)])
    out = []
    recorded = fastpath.stats()["recorded"]
    for step in range(1, 6):
        c = 1 - 0.999 ** step
        got = dx / c
        assert torch.equal(got.full_tensor(), x / c), step
        got = torch.add(dx, dx, alpha=c)                    # a float keyword
        assert torch.equal(got.full_tensor(), torch.add(x, x, alpha=c)), step
    out.append(fastpath.stats()["recorded"] - recorded)
    hits = fastpath.stats()["grad hits"]
    dw = distribute(w, mesh, [Shard(0)]).requires_grad_()
    total = 0
    for step in range(1, 5):
        c = 0.5 + step
        loss = (dw * c).sum()
        loss.backward()
        total += c
        torch.testing.assert_close(dw.grad.full_tensor(), torch.full_like(w, total), rtol=0, atol=1e-12)
    out.append(fastpath.stats()["grad hits"] - hits)
    recorded = fastpath.stats()["recorded"]
    for p in (2.0, 3.0, 2.0):                               # a norm over the unsharded dim: local, not pointwise
        got = torch.linalg.vector_norm(dx, p, dim=1)
        torch.testing.assert_close(got.full_tensor(), torch.linalg.vector_norm(x, p, dim=1), rtol=0, atol=1e-12)
    out.append(fastpath.stats()["recorded"] - recorded)
    return out


def test_changing_floats_are_recorded_once_for_pointwise_ops(seed):
    for recorded, grad_hits, norms_recorded in run_on_ranks(_changing_floats, 2, args=(seed,)):
        assert recorded == 2, recorded            # x / c and add(..., alpha=c): once each for five values
        assert grad_hits >= 3, grad_hits          # dw * c: recorded once, then served through autograd
        assert norms_recorded == 2, norms_recorded   # p = 2.0 and p = 3.0 each; 2.0 again is a hit


def _list_beside_a_waiting_tensor(rank, world, seed):
    """A fast entry whose call holds a list of DTensors (index_put's indices) served while the
    positional DTensor still waits for its data (an async redistribute): the local call gets the
    list's local tensors and the waited-for data; the result equals torch's."""
    mesh = DeviceMesh("cpu", (world,))
    full, values = _rand((4 * world, 6), seed), _rand((2, 6), seed + 1)
    rows = torch.tensor([1, 2 * world])
    fastpath.clear()
    x = distribute(full, mesh, [Replicate()])
    idx, v = distribute(rows, mesh, [Replicate()]), distribute(values, mesh, [Replicate()])
    sharded = distribute(full, mesh, [Shard(0)])
    before = fastpath.stats()["hits"]
    for _ in range(2):  # recorded, then a hit
        torch.index_put(x, (idx,), v)
    waiting = sharded.redistribute([Replicate()], async_op=True)
    got = torch.index_put(waiting, (idx,), v)
    return fastpath.stats()["hits"] - before, bool(torch.equal(got.full_tensor(), full.index_put((rows,), values)))


def test_a_list_beside_a_tensor_still_waiting(seed):
    for hits, same in run_on_ranks(_list_beside_a_waiting_tensor, 2, args=(seed,)):
        assert same
        assert hits == 2, hits  # the second call and the one with the waiting tensor


def _view_the_local_strides_refuse(rank, world, seed):
    """Under inference_mode a view entry recorded on one local tensor meets another of the same
    layout whose local strides refuse that view (a transposed local piece): the call takes the
    normal route instead, now and for that key, and gives the normal route's result."""
    mesh = DeviceMesh("cpu", (world,))
    fastpath.clear()
    with torch.inference_mode():
        x = DTensor.from_local(_rand((4, 6), seed), mesh, [Replicate()])
        y = DTensor.from_local(_rand((6, 4), seed + 1).t(), mesh, [Replicate()])  # same spec, strides (1, 4) here
        for _ in range(2):
            x.view(2, 12)  # recorded, then served
        hits = fastpath.stats()["hits"]
        fastpath.enable(False)
        normal = _facts(y.view(2, 12))
        fastpath.enable(True)
        got = [_facts(y.view(2, 12)) for _ in range(2)]
        hits = fastpath.stats()["hits"] - hits
    for facts in got:
        _same(facts, normal, "view with other local strides")
    return hits


def test_a_view_the_local_strides_refuse_takes_the_normal_route(seed):
    assert run_on_ranks(_view_the_local_strides_refuse, 2, args=(seed,)) == [0, 0]


def _decode_sized_linears(rank, world, seed):
    """F.linear whose mm the dispatcher runs as the decode product (ops/matmul.py: on CUDA the
    skinny GEMM; here ``decode_sized`` is made to say yes and the product is ``torch.mm``) under
    inference_mode: column- and row-parallel weights, 2-D and 3-D inputs. The first call records,
    later ones are served by the product's twin for the whole call (the product itself runs: its
    ``torch.mm`` counted, which F.linear's own kernel never calls), each result the normal route's.
    A bias (addmm: no decode product) is served the plain way."""
    import axedist
    from axedist.ops import matmul

    mesh = DeviceMesh("cpu", (world,))
    real_sized, real_mm = matmul.decode_sized, torch.mm
    products = []

    def counted_mm(a, b):
        products.append(tuple(a.shape))
        return real_mm(a, b)

    cases = {
        "colwise 3-D": ((2, 1, 8), [Replicate()], (12, 8), [Shard(0)], False),
        "colwise 2-D": ((3, 8), [Replicate()], (12, 8), [Shard(0)], False),
        "rowwise 3-D (a pending sum)": ((1, 2, 8), [Shard(2)], (12, 8), [Shard(1)], False),
        "colwise with a bias": ((2, 8), [Replicate()], (12, 8), [Shard(0)], True),
    }
    out = {}
    matmul.decode_sized = lambda call: True
    axedist.reset()
    try:
        with torch.inference_mode():
            for i, (name, (xs, xp, ws, wp, bias)) in enumerate(cases.items()):
                x = distribute(_rand(xs, seed + i), mesh, xp)
                w = distribute(_rand(ws, seed + 10 + i), mesh, wp)
                args = (x, w) + ((distribute(_rand(ws[:1], seed + 20 + i), mesh, [Shard(0)]),) if bias else ())
                fastpath.enable(False)
                normal = _facts(F.linear(*args))
                fastpath.enable(True)
                hits = fastpath.stats()["hits"]
                products.clear()
                torch.mm = counted_mm
                try:
                    got = [_facts(F.linear(*args)) for _ in range(3)]
                finally:
                    torch.mm = real_mm
                for k, facts in enumerate(got):
                    _same(facts, normal, f"{name}, call {k}")
                out[name] = (fastpath.stats()["hits"] - hits, len(products))
    finally:
        matmul.decode_sized = real_sized
        axedist.reset()
    return out


def test_decode_sized_linears_are_served_by_the_products_twin(seed):
    for counts in run_on_ranks(_decode_sized_linears, 2, args=(seed,)):
        for name in ("colwise 3-D", "colwise 2-D", "rowwise 3-D (a pending sum)"):
            # hits; products: the recording call's, the entry's proof, two hits
            assert counts[name] == (2, 4), (name, counts[name])
        assert counts["colwise with a bias"] == (2, 0), counts["colwise with a bias"]


def _ops_that_may_alias(rank, world, seed, inference):
    """Ops whose schema may alias that made a new tensor (``to`` of another dtype, ``reshape`` of
    an expanded tensor) and ``expand`` (a view to the local shape): recorded as entries and served,
    every result the normal route's; a later call of the same key whose local result aliases its
    input (the local strides allow the reshape as a view) takes the normal route. ``to`` of the
    same dtype returns the input itself, on hits too (as ``contiguous`` of a contiguous tensor,
    which dispatches nothing). Under inference_mode a tuple of views (``chunk``, ``split``) is
    served too."""
    mesh = DeviceMesh("cpu", (world,))
    base = _rand((2 * world, 1, 6), seed)
    calls = {
        "to another dtype": lambda t: t.to(torch.float32),
        "to the same dtype": lambda t: t.to(torch.float64),
        "contiguous": lambda t: t.contiguous(),
        "expand": lambda t: t.expand(2 * world, 3, 6),  # (global sizes: run as the plan's local expand)
        "reshape of an expand (a copy)": lambda t: t.expand(2 * world, 3, 6).reshape(2 * world, 18),
        "view of sharded rows": lambda t: t.view(world, 2, 6),  # (likewise)
        "chunk (a tuple of views)": lambda t: t.chunk(2, dim=-1),
        "split along dim 0": lambda t: t.split(world, dim=0),  # (of sharded rows: moved or global sizes)
    }
    hits = {}
    mode = torch.inference_mode if inference else torch.no_grad
    with mode():
        for placements in ([Shard(0)], [Replicate()]):
            x = distribute(base, mesh, placements)
            for name, call in calls.items():
                fastpath.clear()
                fastpath.enable(False)
                normal = _facts(call(x))
                fastpath.enable(True)
                before = fastpath.stats()["hits"]
                for k in range(3):
                    got = call(x)
                    _same(_facts(got), normal, f"{name}, {placements}, call {k}")
                    assert (got is x) == (name in ("to the same dtype", "contiguous")), (name, k)
                hits[f"{name}, {placements}"] = fastpath.stats()["hits"] - before
        # the same key, local strides that let the reshape be a view: the normal route's result
        expanded = DTensor.from_local(_rand((2, 1, 6), seed + 1).expand(2, 3, 6), mesh, [Shard(0)])
        whole = DTensor.from_local(_rand((2, 3, 6), seed + 2), mesh, [Shard(0)])
        fastpath.clear()
        for _ in range(2):
            expanded.reshape(2 * world, 18)  # recorded (a copy), then served
        fastpath.enable(False)
        normal = _facts(whole.reshape(2 * world, 18))
        fastpath.enable(True)
        before = fastpath.stats()["hits"]
        got = [_facts(whole.reshape(2 * world, 18)) for _ in range(2)]
        hits["reshape whose local view aliases"] = fastpath.stats()["hits"] - before
    for facts in got:
        _same(facts, normal, "reshape whose local view aliases")
    return hits


def test_ops_that_may_alias_are_served(seed):
    for inference in (True, False):
        for hits in run_on_ranks(_ops_that_may_alias, 2, args=(seed, inference)):
            for placements in ("[Shard(dim=0)]", "[Replicate()]"):
                assert hits[f"to another dtype, {placements}"] == 2, (inference, hits)
                # (and its expand, a view, under inference_mode; outside it, of sharded rows, its global
                # sizes reach two aten ops, clone and _unsafe_view: the normal route)
                want = 4 if inference else 2 if placements == "[Replicate()]" else 0
                assert hits[f"reshape of an expand (a copy), {placements}"] == want, (inference, hits)
                # (outside inference_mode it dispatches nothing: passed)
                assert hits[f"to the same dtype, {placements}"] == (2 if inference else 0), (inference, hits)
                assert hits[f"contiguous, {placements}"] == 0, (inference, hits)  # (dispatches nothing: passed)
                # views: served under inference_mode only
                assert hits[f"expand, {placements}"] == (2 if inference else 0), (inference, hits)
                assert hits[f"view of sharded rows, {placements}"] == (2 if inference else 0), (inference, hits)
                assert hits[f"chunk (a tuple of views), {placements}"] == (2 if inference else 0), (inference, hits)
            assert hits["split along dim 0, [Replicate()]"] == (2 if inference else 0), (inference, hits)
            assert hits["reshape whose local view aliases"] == 0, hits


def _pieces_on_two_devices(rank, world, seed, inference):
    """A DTensor whose piece is off the mesh's device (FSDP's CPU offload on a CUDA mesh; here a
    meta-built one on a CPU mesh) with the spec, dtype and strides of one on it: every call's
    result reports the device its piece is on, whichever of the two was called first and however
    often (the fast path's entries and the plans' output tags are keyed by the piece's device)."""
    mesh = DeviceMesh("cpu", (world,))
    calls = {"mul by a float": lambda t: t * 1.5, "clone": lambda t: t.clone(), "add": lambda t: t + t,
             "zeros_like": torch.zeros_like, "t": lambda t: t.t(), "chunk": lambda t: t.chunk(2, dim=1),
             "sum over rows (pending)": lambda t: t.sum(0), "view": lambda t: t.view(-1, 3),
             "to float32": lambda t: t.float(),
             "a Parameter of it, then zeros_like (AdamW's state)": lambda t: torch.zeros_like(
                 torch.nn.Parameter(t.detach(), requires_grad=False), memory_format=torch.preserve_format),
             "a Parameter of it, then mul": lambda t: torch.nn.Parameter(t.detach(), requires_grad=False) * 1.5}
    seen = []
    with torch.inference_mode(inference):  # (inputs made inside: views of others there fail, as torch's)
        for placements in ([Shard(0)], [Replicate()]):
            _on_two_devices(mesh, world, seed, placements, calls, seen)
    fastpath.enable(True)
    return {"cpu", "meta"} == set(seen)


def _on_two_devices(mesh, world, seed, placements, calls, seen):
    real = distribute(_rand((4 * world, 6), seed), mesh, placements)
    meta = distribute(torch.empty(4 * world, 6, dtype=torch.float64, device="meta"), mesh, placements)
    for on in (False, True):
        fastpath.enable(on)
        for order in ((real, meta), (meta, real)):
            for name, call in calls.items():
                for _ in range(3):
                    for dt in order:
                        out = call(dt)
                        for o in out if isinstance(out, tuple) else (out,):
                            where = (name, placements, on, o.device, o.to_local().device, dt.to_local().device)
                            assert o.device == o.to_local().device == dt.to_local().device, where
                            seen.append(o.device.type)


def test_pieces_off_the_mesh_device_report_their_device(seed):
    for inference in (False, True):
        assert all(run_on_ranks(_pieces_on_two_devices, 2, args=(seed, inference)))
