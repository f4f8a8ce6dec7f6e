"""The torch-function fast path: a repeated op call on DTensors served before torch's dispatcher.

Every torch call that involves a DTensor first reaches ``DTensor.__torch_function__``. The
normal route from there (torch's C++ dispatcher -> ``__torch_dispatch__`` -> ``ops/dispatch.py``)
costs ~6 us per aten op beyond the op itself even with its plan cached (docs/dtensor.md,
"Dispatch overhead", has the breakdown). This
module remembers, per torch-level call shape, what that route did, and when it did nothing
but run the op on the local tensors and wrap the result, later calls of the same shape do
exactly that directly::

    >>> z = x + y          # x, y (64, 32) in (Shard(0),) on 4 ranks: recorded (one aten.add.Tensor,
    ...                    # no data moved, output (Shard(0),)); the normal route ran
    >>> z = x + y          # a hit: torch.add on the (16, 32) local tensors, wrapped as (64, 32)

A call's *key* is the torch function plus, per argument, a DTensor's tag (one small int per
(spec, dtype, stride): no spec hashing on the hot path) or a plain scalar's (type, value).
On a miss, the normal route runs while ``__torch_dispatch__`` records the aten ops it
dispatches; the key becomes a fast entry only when all of these hold:

* each aten op had a cached plan that kept every argument where it was (no redistribute),
  ran the op itself on the local tensors (no rule-specific local function), and took no
  pending-sum input; none writes its inputs (in-place, ``out=``) or draws random numbers;
* the call returned the last op's DTensor, which is not a view of an input (a view must stay
  a view in autograd's eyes: version counter and ``_base``), and a deferred GEMM did not
  happen (``ops.dispatch.DEFER_GEMM`` is part of the entry);
* the torch function run once more on the plain local tensors gives the same local result
  (shape, dtype, strides, values, a new tensor): the proof that local decompositions match.

Any other key is remembered as slow and goes the normal route at once; a torch function
that dispatched nothing (a getter such as ``x.shape``) or returned a view does so for good,
whatever its arguments. Every call also needs: no torch dispatch mode (it must see the aten
ops on DTensors), no autocast.

**With autograd** (grad mode on, a DTensor argument requires grad) autograd must record the
call, and only torch's dispatcher does that in C++ (a ``torch.autograd.Function`` per call
costs more than the whole route). Which arguments require grad is part of the key, and
such a key is recorded on the normal route under autograd; it becomes a fast entry when the
*first* aten op qualifies as above, takes the call's DTensors at their own positions and
gives the call's result (later ops are autograd's own, e.g. ``detach`` of an output it saves
for backward: they keep the normal route). A hit computes the output on the local tensors,
leaves it in ``dtensor._READY`` and calls the torch function through the dispatcher:
autograd records the op, and ``__torch_dispatch__`` returns the ready output to that op on
those same DTensor objects in this thread, without running ops/dispatch.py (any other op
drops it, and the key goes back to the normal route)::

    >>> z = x + y          # x, y require grad: recorded under autograd (one aten.add.Tensor)
    >>> z = x + y          # a grad-mode hit: local add, wrapped, then AddBackward0 recorded in C++

DTensors that require grad also stop entering this module at all: the grad check sets
``__torch_function__`` on the *instance* to torch's disabled one (torch's C++ looks the
attribute up on the object, so the class's handler is skipped for calls whose DTensors all
carry it), and so do grad-mode outputs (here, and in ops/dispatch.py's plainest cached case
when an input carries it). Such a call goes straight to the dispatcher and
``ops/dispatch.py``'s cached route, which now costs less than entering this module twice
(docs/dtensor.md, "Dispatch overhead"), and its getters cost what plain tensors' do. Results
are the same either way; a DTensor that stops requiring grad keeps skipping the handler.

``enable(False)`` (or ``AXEDIST_FASTPATH=0`` before import) puts torch's plain disabled
``__torch_function__`` back on the class: every call takes the normal route, and getters
cost what they cost without this module (with it, 1-2 us more each).
"""

from __future__ import annotations

import threading

import torch

from .. import dtensor as _dtensor
from . import dispatch as _dispatch_module

__all__ = ["enable", "enabled", "clear", "stats"]

DTensor = _dtensor.DTensor
_disabled = torch._C._disabled_torch_function_impl
_no_torch_function = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_any_autocast = torch._C._is_any_autocast_enabled
_make_wrapper = torch.Tensor._make_wrapper_subclass
_POSITIONAL = _dtensor.WRAPPER_POSITIONAL
_READY = _dtensor._READY
_STRIDED = torch.strided
_OUTSTANDING = _dtensor._OUTSTANDING
_STATS = _dispatch_module._STATS  # fast hits count as plan-cache hits (ops.dispatch.cache_info)
_EMPTY: dict = {}  # kwargs for torch's disabled impl when none were given (never written)

_SCALARS = _dispatch_module._FAST_SCALARS  # the plain arguments dispatch's own fast key takes
_SEQUENCES = frozenset({tuple, list, torch.Size})
_SLOW = object()          # a key that must take the normal route
_KWARGS = object()        # separates positional from keyword arguments in a key
_GRAD = object()          # precedes the requires-grad bits of a grad-mode key
_CACHE: dict = {}         # key -> _Entry or _SLOW
# Torch functions that always take the normal route, decided when first recorded: those that
# dispatched nothing (getters, size(), ...) and views. Backward is never recorded: a recorder
# holding the gradients it sees would keep autograd from taking ownership of a leaf's first
# gradient (it copies it instead, into a tensor laid out as new_empty_strided gives).
_NEVER_RECORDED = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
_PASS: set = set(_NEVER_RECORDED)
_COUNTS = {"hits": 0, "grad hits": 0, "recorded": 0, "slow": 0, "passed": 0}


class _Entry:
    """What a hit does: wrap the local result in ``spec`` (after ``unsqueeze(0)`` for a pending sum).
    A grad-mode entry also names the aten ``op`` whose output that is and the ``positions`` of
    its DTensor arguments (the torch call's own positions)."""

    __slots__ = ("spec", "shape", "dtype", "device", "stride", "unsqueeze", "tag", "defer", "op", "positions")

    def __init__(self, spec, dtype, device, stride, unsqueeze, defer, op=None, positions=()):
        self.spec, self.shape, self.dtype, self.device = spec, spec.shape, dtype, device
        self.stride, self.unsqueeze, self.defer = stride, unsqueeze, defer
        self.tag = (spec, _tag_for(spec, dtype, stride))  # (spec, int): the output's key tag
        self.op, self.positions = op, positions

    def __repr__(self) -> str:
        via = f"{self.op} (grad mode), " if self.op is not None else ""
        return f"_Entry({via}-> {self.spec}, {str(self.dtype).replace('torch.', '')}, stride {self.stride})"


_tag_for = _dispatch_module._tag_for
_tag_of = _dispatch_module._tag_of


def torch_function(cls, func, types, args=(), kwargs=None):
    """``DTensor.__torch_function__`` while the fast path is on."""
    if func in _PASS:
        return _disabled(func, types, args, kwargs or _EMPTY)
    grad = 0  # with grad mode on: a bit per positional DTensor that requires grad
    if _grad_enabled():
        with _no_torch_function():  # requires_grad without coming back here
            bit = 1
            for a in args:
                if type(a) is DTensor:
                    if a.requires_grad:
                        grad |= bit
                        a.__torch_function__ = _disabled  # later calls skip this handler (docstring)
                    bit <<= 1
    key = [func]
    local_args = []
    found = False  # any DTensor among the positional arguments
    waits = False  # a DTensor whose data is still coming (async redistribute, deferred GEMM)
    for a in args:
        t = type(a)
        if t is DTensor:
            tag = a._tag
            # (spec, tag): re-derived when the spec changed (an in-place op may reduce a pending sum)
            key.append(tag[1] if tag is not None and tag[0] is a._spec else _tag_of(a))
            local_args.append(a._value)
            found = True
            waits = waits or a._pending is not None
        elif t in _SCALARS:
            key.append(t)
            key.append(a)
            local_args.append(a)
        elif t in _SEQUENCES and all(type(v) is int for v in a):
            key.append(t)
            key.append(tuple(a))
            local_args.append(a)
        else:
            return _disabled(func, types, args, kwargs or _EMPTY)
    if kwargs:
        key.append(_KWARGS)
        for name, a in kwargs.items():
            t = type(a)
            if t in _SCALARS or (t in _SEQUENCES and all(type(v) is int for v in a)):
                key.append(name)
                key.append(t)
                key.append(tuple(a) if t in _SEQUENCES else a)
            else:
                return _disabled(func, types, args, kwargs)
    if not found:
        return _disabled(func, types, args, kwargs or _EMPTY)
    if grad:
        # which inputs require grad is part of the key: a composite function may take another
        # route then (and autograd records different ops)
        key.append(_GRAD)
        key.append(grad)
    key = tuple(key)
    entry = _CACHE.get(key)
    if entry is _SLOW:
        return _disabled(func, types, args, kwargs or _EMPTY)
    if _dispatch_modes() or _any_autocast():
        return _disabled(func, types, args, kwargs or _EMPTY)
    if entry is None:
        return _record(func, types, args, kwargs, key, grad)
    if entry.defer is not None and entry.defer != _dispatch_module.DEFER_GEMM:
        return _disabled(func, types, args, kwargs or _EMPTY)
    if _OUTSTANDING:
        _dtensor._flush_deferred()  # as dispatch does: no op runs while a deferred product waits
    if waits:  # only now: a call that takes the normal route must find a deferred GEMM unrun
        local_args = [a._local if type(a) is DTensor else a for a in args]
    value = func(*local_args, **kwargs) if kwargs else func(*local_args)
    unlike = value._is_view() or value.dtype != entry.dtype
    for a in local_args:
        unlike = unlike or a is value
    if unlike:
        # The local call aliased an input where the recorded one did not (contiguous() or
        # reshape() decide on local strides, the normal route on global ones), or its dtype
        # changed (torch.set_default_dtype and int / int): no side effect happened yet, so
        # take the normal route, now and for this key.
        _CACHE[key] = _SLOW
        return _disabled(func, types, args, kwargs or _EMPTY)
    if entry.unsqueeze:
        value = value.unsqueeze(0)
    if _POSITIONAL:
        out = _make_wrapper(DTensor, entry.shape, entry.stride, None, None, entry.dtype, _STRIDED, entry.device)
    else:
        out = DTensor._wrap(value, entry.spec, entry.stride)
    out._value = value
    out._spec = entry.spec
    out._tag = entry.tag
    if not grad:
        _STATS["hits"] += 1
        _COUNTS["hits"] += 1
        return out
    # Autograd must record the call: it goes through torch's dispatcher after all (autograd's
    # C++ kernel for the op: graph node, saved tensors, version bookkeeping), and
    # __torch_dispatch__ hands back this output instead of running ops/dispatch.py.
    out.__torch_function__ = _disabled  # it will require grad: later calls skip this handler
    _READY.value = (entry.op, entry.positions, args, out)
    try:
        result = _disabled(func, types, args, kwargs or _EMPTY)
    finally:
        served = _READY.value is None
        _READY.value = None
    if served:
        _STATS["hits"] += 1
        _COUNTS["hits"] += 1
        _COUNTS["grad hits"] += 1
    else:
        # the first aten op was not the recorded one (the normal route ran instead): not again
        _CACHE[key] = _SLOW
    return result


class _Recorder:
    """Stands in for ``ops.dispatch.dispatch`` during one torch-level call: runs it, and keeps
    the top-level aten calls (ops that dispatch runs inside them are not steps)."""

    def __init__(self):
        self.steps: list = []
        self.depth = 0
        self.thread = threading.get_ident()

    def __call__(self, func, args, kwargs):
        if threading.get_ident() != self.thread:  # another thread's op: its own recorder, if any
            for recorder in reversed(_dtensor._RECORDING):
                if recorder.thread == threading.get_ident():
                    return recorder(func, args, kwargs)
            return _dispatch_module.dispatch(func, args, kwargs)
        self.depth += 1
        try:
            out = _dispatch_module.dispatch(func, args, kwargs)
        finally:
            self.depth -= 1
        if self.depth == 0:
            self.steps.append((func, args, kwargs, out))
        return out


def _record(func, types, args, kwargs, key, grad=0):
    recorder = _Recorder()
    _dtensor._RECORDING.append(recorder)
    try:
        result = _disabled(func, types, args, kwargs or _EMPTY)
    finally:
        _dtensor._RECORDING.pop()
    last = recorder.steps[-1][0] if recorder.steps else None
    # Nothing dispatched (a getter), or (without autograd, which adds ops of its own, e.g. a
    # detach of an output it saves) a view, which the normal route makes a view of its base
    # for autograd: the normal route for this torch function with any arguments.
    if last is None or (not grad and any(r.alias_info is not None for r in last._schema.returns)):
        _PASS.add(func)
        _COUNTS["passed"] += 1
        return result
    if grad:
        entry = _grad_entry_for(func, recorder.steps, result, args, kwargs)
    else:
        entry = _entry_for(func, recorder.steps, result, args, kwargs)
    if len(_CACHE) > 16384:
        _CACHE.clear()
    _CACHE[key] = entry
    _COUNTS["recorded" if entry is not _SLOW else "slow"] += 1
    return result


def _grad_entry_for(func, steps, result, args, kwargs):
    """The grad-mode entry proven by these steps, or _SLOW.

    Under autograd the call's result is what ``__torch_dispatch__`` returned for the first
    aten op (later ones are autograd's own, e.g. ``detach`` of an output it saves, and keep
    the normal route on every call). That first op must qualify as a step of a no-grad entry,
    take the torch call's DTensors at their own positions (so ``__torch_dispatch__`` can tell
    it by identity) and none in its keyword arguments, and give the call's result.
    """
    if not steps or type(result) is not DTensor or result is not steps[0][3]:
        return _SLOW
    op, op_args, op_kwargs, _ = steps[0]
    positions = tuple(i for i, a in enumerate(args) if type(a) is DTensor)
    if any(i >= len(op_args) or op_args[i] is not args[i] for i in positions):
        return _SLOW
    if any(isinstance(a, DTensor) for i, a in enumerate(op_args) if i not in positions) or \
            any(isinstance(v, (DTensor, list, tuple)) for v in (op_kwargs or _EMPTY).values()):
        return _SLOW
    entry = _entry_for(func, steps[:1], result, args, kwargs)
    if entry is _SLOW:
        return _SLOW
    entry.op, entry.positions = op, positions
    return entry


def _plan_of(op, args, kwargs):
    """The plan ops/dispatch.py cached for this aten call (None: it has none, or no rule), and
    the call's DTensors."""
    inputs, _, key = _dispatch_module._scan(op, args, kwargs)
    plan = _dispatch_module._PLANS.get(key)
    if plan is None and not kwargs:
        fast_key = _dispatch_module._fast_key(op, args)
        plan = _dispatch_module._FAST.get(fast_key) if fast_key is not None else None
    return (plan if isinstance(plan, _dispatch_module._CallPlan) else None), inputs


def _local_plan(op, args, kwargs, out):
    """The plan of this aten call if dispatch ran it as "the op on the local tensors, wrapped"
    (no input moved, no rule-specific local function, no pending-sum input, one output,
    nothing written, nothing random), else None."""
    plan, inputs = _plan_of(op, args, kwargs)
    info = _dispatch_module._op_info(op)
    if plan is None or type(out) is not DTensor or out._pending is not None:
        return None
    if info.inplace or info.out_names or info.written or info.foreach or torch.Tag.nondeterministic_seeded in op.tags:
        return None
    if plan.structure != "single" or plan.sharding.local is not None or plan.reduce_self is not None:
        return None
    if all(t is None for t in plan.targets) and not any(d._spec.reduce_op for d in inputs):
        return plan
    return None


def _entry_for(func, steps, result, args, kwargs):
    """The fast entry proven by these recorded steps, or _SLOW (see the module docstring)."""
    if type(result) is not DTensor or result is not steps[-1][3]:
        return _SLOW
    plans = []
    for step in steps:
        plan = _local_plan(*step)
        if plan is None:
            return _SLOW
        plans.append(plan)
    local_args = [a._local if type(a) is DTensor else a for a in args]  # the steps used (so waited for) them
    # the entry holds while this setting does
    defer = _dispatch_module.DEFER_GEMM if any(plan.defer for plan in plans) else None
    out = plans[-1].outputs[0]
    unsqueeze = bool(out.spec.reduce_op)
    expected = result._value
    try:
        again = func(*local_args, **(kwargs or {}))
        if unsqueeze:
            again = again.unsqueeze(0)
    except Exception:
        return _SLOW
    if (type(again) is not torch.Tensor or again.shape != expected.shape or again.dtype != expected.dtype
            or again.device != expected.device or again.stride() != expected.stride()):
        return _SLOW
    inputs = {a.untyped_storage().data_ptr() for a in local_args if isinstance(a, torch.Tensor)}
    if again.numel() and again.untyped_storage().data_ptr() in inputs:
        return _SLOW
    same = again == expected
    if again.is_floating_point() or again.is_complex():
        same |= again.isnan() & expected.isnan()
    if not bool(same.all()):
        return _SLOW
    return _Entry(out.spec, expected.dtype, expected.device, out.stride, unsqueeze, defer)


# ---------------------------------------------------------------------------
# Switching it on and off
# ---------------------------------------------------------------------------

_HANDLER = classmethod(torch_function)


def enable(on: bool = True) -> None:
    """Turn the fast path on or off for every DTensor (results are the same either way)."""
    DTensor.__torch_function__ = _HANDLER if on else _disabled


def enabled() -> bool:
    return DTensor.__dict__.get("__torch_function__") is _HANDLER


def clear() -> None:
    """Forget recorded calls (they are recorded again on next use)."""
    _CACHE.clear()
    _PASS.clear()
    _PASS.update(_NEVER_RECORDED)


def stats() -> dict:
    """``{"hits", "grad hits", "recorded", "slow", "passed", "size"}``: fast hits (of which
    ``grad hits`` had autograd record them), keys recorded as fast,
    keys recorded as slow, torch functions sent to the normal route for good (getters, views),
    cached keys."""
    return dict(_COUNTS, size=len(_CACHE))
