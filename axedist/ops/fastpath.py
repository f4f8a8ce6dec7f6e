"""The torch-function fast path: a repeated op call on DTensors served before torch's dispatcher.

Every torch call on a DTensor first reaches ``DTensor.__torch_function__``. The first call of a
given shape (the torch function; per argument a DTensor's tag or a scalar's type and value; a
list of DTensors, ``torch.cat``'s, and DTensors among the keyword arguments where none of the
call's DTensors requires grad) takes the normal route (torch's dispatcher -> ``__torch_dispatch__``
-> the dispatcher) while a recorder keeps the aten ops it dispatched. When all of them just ran
the op on the local tensors and wrapped the result (the call's result the last op's output, or
one output of its tuple), and the torch function on the plain local tensors gives the identical
local result, later calls do exactly that directly::

    >>> z = x + y   # x, y (64, 32) in (Shard(0),) on 4 ranks: recorded (one aten.add.Tensor, nothing moved)
    >>> z = x + y   # a hit: torch.add on the (16, 32) local tensors, wrapped as (64, 32)

A float (or complex) argument is keyed by its type alone when every recorded aten op is
pointwise, whose output layout no scalar value changes: AdamW's ``exp_avg_sq.sqrt() / c`` with a
bias correction ``c`` new at every step is recorded once, not once a step (each recording runs
the normal route and the op a second time). A hit still checks the local result's shape and dtype.

With grad mode on, which DTensors require grad is part of the key; a hit computes the output,
leaves it in ``state.READY`` and calls the torch function through the dispatcher, so that
autograd records the op in C++ and ``__torch_dispatch__`` hands the ready output back. Results
equal the normal route's either way; docs/dtensor.md ("Dispatch overhead") has the full rules
and the measurements.
"""

from __future__ import annotations

import threading

import torch

from ..runtime.deferred import pending_gather, pending_product
from ..runtime.tails import pending_tail
from ..tracing import eager_only
from .call_plan import SCALAR_TYPES, LocalRoute, decomposable, op_info, replace_dtensors
from .state import READY, RECORDING, ReadyOutput, wrap

__all__ = ["FastPath"]

_disabled = torch._C._disabled_torch_function_impl
_no_torch_function = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_any_autocast = torch._C._is_any_autocast_enabled
_inference_mode = torch.is_inference_mode_enabled
_EMPTY: dict = {}  # kwargs for torch's disabled impl when none were given (never written)
_SEQUENCES = frozenset({tuple, list, torch.Size})
_SLOW = object()          # a key that must take the normal route
_SELF = object()          # a key whose call returns its first argument itself
_KWARGS = object()        # separates positional from keyword arguments in a key
_GRAD = object()          # precedes the requires-grad bits of a grad-mode key
_ANY = object()           # a float's value in a loose key (pointwise entries)
_LOOSE = frozenset({float, complex})
# Never recorded: a recorder holding the gradients that backward sees would keep autograd from
# taking ownership of a leaf's first gradient (it copies it instead, in another layout).
_NEVER_RECORDED = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


class FastPath:
    """The fast path of one dispatcher: ``enable``/``enabled``/``clear``/``stats``.

    ``torch_function`` is the handler ``enable(True)`` installs as the tensor class's
    ``__torch_function__``; ``enable(False)`` puts torch's disabled one back (every call takes
    the normal route; getters then cost 1-2 us less each).
    """

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        # torch functions that always take the normal route: those that dispatched nothing
        # (getters, size(), ...) and backward
        self.passed: set = set(_NEVER_RECORDED)
        # torch functions that return a view: the normal route but under inference_mode (ops/view.py
        # docstring: there autograd tracks no view, so a view entry gives what the normal route gives)
        self.views: set = set()
        self.counts = {"hits": 0, "grad hits": 0, "recorded": 0, "slow": 0, "passed": 0}
        self.torch_function = _handler(self)
        self._installed = classmethod(self.torch_function)

    def enable(self, on: bool = True) -> None:
        """Turn the fast path on or off for every DTensor (results are the same either way)."""
        self.dispatcher.cls.__torch_function__ = self._installed if on else _disabled

    def enabled(self) -> bool:
        return self.dispatcher.cls.__dict__.get("__torch_function__") is self._installed

    def clear(self) -> None:
        """Forget recorded calls (they are recorded again on next use)."""
        self.dispatcher.cache.clear("torch_calls")
        self.passed.clear()
        self.passed.update(_NEVER_RECORDED)
        self.views.clear()

    def stats(self) -> dict:
        """``{"hits", "grad hits", "recorded", "slow", "passed", "size"}``: fast hits (of which
        ``grad hits`` had autograd record them), keys recorded as fast, keys recorded as slow,
        torch functions sent to the normal route for good (getters, views), cached keys."""
        return dict(self.counts, size=len(self.dispatcher.cache.torch_calls))

    # -- recording ---------------------------------------------------------------

    def record(self, func, types, args, kwargs, key, grad=0, loose=None):
        """Run the call on the normal route, recording its aten ops, and cache what it proves:
        under ``loose`` (the key with its floats' values left out) a pointwise entry or a
        normal-route one (always right), else under ``key``."""
        recorder = _Recorder(self.dispatcher.dispatch, self._decomposed)
        RECORDING.append(recorder)
        try:
            result = _disabled(func, types, args, kwargs or _EMPTY)
        finally:
            RECORDING.pop()
        last = recorder.last_top
        # Nothing dispatched (a getter): the normal route for this torch function with any arguments.
        if last is None:
            self.passed.add(func)
            self.counts["passed"] += 1
            return result
        # An op that returned its first argument itself, writing nothing (to() of that tensor's own
        # dtype under inference_mode, where it reaches the dispatcher): that argument, for every
        # call of this key.
        if _returned_self(recorder.steps, result, args):
            self.dispatcher.cache.put("torch_calls", key, _SELF)
            self.counts["recorded"] += 1
            return result
        # Without autograd (which adds ops of its own, e.g. a detach of an output it saves), a view:
        # outside inference_mode the normal route makes it a view of its base for autograd, so that
        # route for this torch function with any arguments; under inference_mode (no view tracking)
        # an entry that gives the same local view. An op that may alias but made a new tensor here
        # (to() of another dtype, reshape of an expanded tensor) is not a view: a plain entry whose
        # hits check that theirs is a new tensor too (``fresh``).
        view = not grad and any(r.alias_info is not None for r in last._schema.returns)
        fresh = view and not _aliases(result, args, kwargs, self.dispatcher.cls)
        view = view and not fresh
        if view:
            self.views.add(func)
            if not _inference_mode():
                self.counts["passed"] += 1
                return result
        if grad:
            entry = self._grad_entry_for(func, recorder.steps, result, args, kwargs)
        elif type(result) is tuple:
            entry = self._views_entry_for(func, recorder.steps, result, args, kwargs) if view else _SLOW
        else:
            entry = self._entry_for(func, recorder.steps, result, args, kwargs, view, fresh)
        if loose is not None and (entry is _SLOW or entry.pointwise):
            key = loose
        self.dispatcher.cache.put("torch_calls", key, entry)
        self.counts["recorded" if entry is not _SLOW else "slow"] += 1
        return result

    def _decomposed(self, op, args, kwargs) -> bool:
        """Whether the dispatcher ran this aten call as its decomposition (a composite op, no plan)."""
        return decomposable(op) and self.dispatcher.cached_plan(op, args, kwargs)[0] is None

    def _grad_entry_for(self, func, steps, result, args, kwargs):
        """The grad-mode entry proven by these steps, or _SLOW.

        Under autograd the call's result is what ``__torch_dispatch__`` returned for the first
        aten op (later ones are autograd's own, e.g. ``detach`` of an output it saves). That
        first op must qualify as a step of a no-grad entry, take the torch call's DTensors at
        their own positions (so ``__torch_dispatch__`` can tell it by identity) and none in its
        keyword arguments, and give the call's result.
        """
        cls = self.dispatcher.cls
        if not steps or type(result) is not cls or result is not steps[0][3]:
            return _SLOW
        op, op_args, op_kwargs, _ = steps[0]
        positions = tuple(i for i, a in enumerate(args) if type(a) is cls)
        if any(i >= len(op_args) or op_args[i] is not args[i] for i in positions):
            return _SLOW
        if any(isinstance(a, cls) for i, a in enumerate(op_args) if i not in positions) or \
                any(isinstance(v, (cls, list, tuple)) for v in (op_kwargs or _EMPTY).values()):
            return _SLOW
        entry = self._entry_for(func, steps[:1], result, args, kwargs)
        if entry is _SLOW:
            return _SLOW
        entry.op, entry.positions = op, positions
        return entry

    def _views_entry_for(self, func, steps, result, args, kwargs):
        """The entry of a call giving a tuple of views under inference_mode (``chunk``, ``split``),
        or _SLOW: one aten op whose local plan gave that tuple's DTensors, and the
        torch function on the plain local tensors giving views of its input's storage identical to
        the normal route's (shape, dtype, strides). A ``Views`` of one route per output."""
        cls = self.dispatcher.cls
        if len(steps) != 1 or type(steps[0][3]) not in (tuple, list) or len(steps[0][3]) != len(result) or \
                any(type(o) is not cls or o is not r or o._pending is not None for o, r in zip(steps[0][3], result)):
            return _SLOW
        plan = self._local_plan(*steps[0], several=True)
        if plan is None or plan.view == 2 or len(plan.outputs) != len(result):
            return _SLOW
        local_args, local_kwargs = replace_dtensors(cls, args, kwargs or _EMPTY, _waited)
        inputs = _storages(local_args, local_kwargs)
        try:
            again = func(*local_args, **local_kwargs)
        except Exception:
            return _SLOW
        if type(again) is not tuple or len(again) != len(result):
            return _SLOW
        routes = []
        for piece, out, r in zip(again, plan.outputs, result):
            expected = r._value
            if out.unsqueeze or not _like(piece, expected) or _storage(piece) not in inputs or \
                    _storage(piece) != _storage(expected):
                return _SLOW
            tag = self.dispatcher.tag_for(out.spec, expected.dtype, out.stride, expected.device)
            routes.append(LocalRoute(None, (), out, expected.dtype, tag, False, False, expected.device, True))
        return Views(tuple(routes))

    def _local_plan(self, op, args, kwargs, out, several: bool = False):
        """The plan of this aten call if the dispatcher ran it as "the op on the local tensors,
        wrapped" (no input moved, no rule-specific local function but a reshape to the local shape
        (view.py: metadata only, which the entry's check of the result's shape and strides covers)
        or a kernel choice for the op (one with ``torch_twins``: the decode product, ops/matmul.py),
        no pending-sum input but to such a reshape, nothing written, nothing random) and gave one
        output, or (``several``: the call's last op, of which the call returns one output or all) a
        tuple or list of them; else None."""
        plan, inputs = self.dispatcher.cached_plan(op, args, kwargs)
        if plan is None or plan.structure not in (("tuple", "list") if several else ("single",)):
            return None
        if not several and (type(out) is not self.dispatcher.cls or out._pending is not None):
            return None
        info = op_info(op)
        if info.inplace or info.out_names or info.written or info.foreach or _random(op, args, kwargs):
            return None
        local = plan.sharding.local
        reshapes = local is not None and getattr(local, "only_reshapes", False)
        if plan.reduce_self is not None or (local is not None and not reshapes and not _twins(local)):
            return None
        # a pending sum may only be reshaped (a view is linear: the view of the sum is the sum of the views)
        if all(t is None for t in plan.targets) and (reshapes or not any(d._spec.reduce_op for d in inputs)):
            return plan
        return None

    def _entry_for(self, func, steps, result, args, kwargs, view: bool = False, fresh: bool = False):
        """The fast entry proven by these recorded steps, or _SLOW: every step a local plan, the
        call's result the last step's output (or one output of its tuple: ``F.rms_norm`` returns
        the first of ``_fused_rms_norm``'s), and the torch function on the plain local tensors
        giving the identical local result (shape, dtype, strides, values, a new tensor; for a
        ``view`` under inference_mode, a view of the same input storage, as the normal route's; no
        step that moved its input or computed the view anew, ``CallPlan.view`` 2). Where a step's
        local function chose the op's kernel (``torch_twins``), its twin for the torch function
        stands in for it, the whole call on the plain local tensors with that kernel choice. A view,
        expand or reshape whose torch call gives global sizes the local tensor does not have runs its
        plan's local function (``_local_view``)."""
        cls = self.dispatcher.cls
        last = steps[-1][3]
        if type(result) is not cls or result._pending is not None:
            return _SLOW
        if result is last:
            index = 0
        elif type(last) is tuple and any(o is result for o in last):
            index = next(i for i, o in enumerate(last) if o is result)
        else:
            return _SLOW
        plans = []
        for i, step in enumerate(steps):
            plan = self._local_plan(*step, several=i == len(steps) - 1 and result is not last)
            if plan is None or plan.view == 2:
                return _SLOW
            plans.append(plan)
        run = _twin(func, plans)
        if run is _SLOW:
            return _SLOW
        # the steps used (so waited for) them
        local_args, local_kwargs = replace_dtensors(cls, args, kwargs or _EMPTY, _waited)
        local_args = list(local_args)
        # a deferrable GEMM among the steps: hits check the defer_gemm policy (OpDispatcher.defers)
        defer = any(plan.defer for plan in plans)
        out = plans[-1].outputs[index]
        expected = result._value
        again = _rerun(run or func, local_args, local_kwargs, out.unsqueeze, expected)
        if again is None and run is None:  # global sizes (x.view(s, b, heads, d) of sharded heads)
            run = _local_view(steps, plans, args, cls)
            again = None if run is None else _rerun(run, local_args, local_kwargs, out.unsqueeze, expected)
        if again is None:
            return _SLOW
        inputs = _storages(local_args, local_kwargs)
        if view:
            # the normal route's local result and this one: views of one input's storage
            # (inference tensors keep no view metadata: _is_view() is False for them)
            if _storage(again) != _storage(expected) or _storage(again) not in inputs:
                return _SLOW
        elif again.numel() and _storage(again) in inputs:
            return _SLOW
        # Values: compared where that costs no device sync (CPU, where the test suite proves every
        # rule's entries). On a GPU a new scalar (AdamW's bias correction changes every step) would
        # otherwise stop the host once per call for a check the metadata above already implies:
        # every step ran the op on the local tensors with nothing moved and no local function.
        if expected.device.type == "cpu":
            same = again == expected
            if again.is_floating_point() or again.is_complex():
                same |= again.isnan() & expected.isnan()
            if not bool(same.all()):
                return _SLOW
        tag = self.dispatcher.tag_for(out.spec, expected.dtype, out.stride, expected.device)
        return LocalRoute(None, (), out, expected.dtype, tag, defer, _pointwise(steps), expected.device, view, run,
                          fresh)


class Views:
    """A fast-path entry for a call giving a tuple of views (``chunk``): one ``LocalRoute`` per
    output. Its attributes a hit reads before it runs the call are those of a LocalRoute's."""

    __slots__ = ("routes", "local_shapes", "defer", "view", "run")

    def __init__(self, routes: tuple):
        self.routes, self.local_shapes = routes, tuple(r.local_shape for r in routes)
        self.defer, self.view, self.run = False, True, None

    def __repr__(self) -> str:
        return f"Views({', '.join(map(repr, self.routes))})"


_INDEX = object()  # precedes an index's key (_index_key)
_INDEX_ITEMS = frozenset({int, type(None), type(Ellipsis), slice})


def _index_key(index):
    """A hashable key of an index made of ints, None, Ellipsis and slices whose bounds are ints or
    None (a slice is unhashable before Python 3.12), or None for any other index."""
    items = index if type(index) is tuple else (index,)
    key = []
    for v in items:
        if type(v) is slice:
            if not all(type(b) in (int, type(None)) for b in (v.start, v.stop, v.step)):
                return None
            key.append((v.start, v.stop, v.step))
        else:
            key.append(v)
    return type(index) is tuple, tuple(key)


def _rerun(run, local_args, local_kwargs, unsqueeze: bool, expected: torch.Tensor):
    """``run`` on the local arguments (``unsqueeze(0)``: a pending sum's) if it gives a tensor of
    ``expected``'s shape, dtype, device and strides (neither conjugate nor negative view), else None."""
    try:
        again = run(*local_args, **local_kwargs)
        if unsqueeze:
            again = again.unsqueeze(0)
    except Exception:
        return None
    return again if _like(again, expected) else None


def _like(t, expected: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor of ``expected``'s shape, dtype, device and strides, neither a
    conjugate nor a negative view."""
    return (type(t) is torch.Tensor and t.shape == expected.shape and t.dtype == expected.dtype
            and t.device == expected.device and t.stride() == expected.stride() and not t.is_conj()
            and not t.is_neg())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storages(local_args, local_kwargs) -> set:
    """The storages of the tensors among a call's local arguments (lists' included)."""
    return {_storage(a) for a in _flat(list(local_args) + list(local_kwargs.values())) if isinstance(a, torch.Tensor)}


def _local_view(steps, plans, args, cls):
    """For a call of one aten op whose plan runs a metadata-only local function (view.py's reshape
    or expand to the local shape, planned from the call's sizes: its key's) on the call's one
    DTensor, its first argument: that function, on the local tensor alone; else None."""
    local = plans[0].sharding.local if len(steps) == 1 else None
    if local is None or not getattr(local, "only_reshapes", False):
        return None
    op_args = steps[0][1]
    if not op_args or op_args[0] is not args[0] or any(type(a) is cls for a in args[1:]):
        return None
    call = plans[0].call
    return lambda x, *sizes, **kwargs: local(call, x)


def _returned_self(steps, result, args) -> bool:
    """Whether the call ran one aten op, which wrote nothing and returned the call's first argument."""
    if len(steps) != 1 or not args or result is not args[0] or steps[0][3] is not result:
        return False
    info = op_info(steps[0][0])
    return not (info.inplace or info.out_names or info.written)


def _aliases(result, args, kwargs, cls) -> bool:
    """Whether ``result``, a DTensor whose data is here, shares its local storage with one of the
    call's DTensors (True for anything else, and for an empty one: no storage to tell by)."""
    if type(result) is not cls or result._pending is not None or not result._value.numel():
        return True
    return _storage(result._value) in _storages(*replace_dtensors(cls, args, kwargs or _EMPTY, _waited))


def _twins(local) -> dict | None:
    """A plan's local function's twins (torch function -> that call on plain local tensors)."""
    return getattr(local, "torch_twins", None)


def _twin(func, plans):
    """What a hit runs in place of ``func`` on the local tensors: None (``func`` itself) where no
    step chose its kernel; else the one twin for ``func`` its steps' kernel choices agree on, or
    _SLOW where one has none (its kernel choice is not the torch function's)."""
    chosen = {id(t): t for t in (_twins(plan.sharding.local) for plan in plans) if t is not None}
    if not chosen:
        return None
    runs = {t.get(func) for t in chosen.values()}
    return _SLOW if len(runs) != 1 or None in runs else runs.pop()


def _nested_grad(args, kwargs, cls) -> bool:
    """Whether a ``cls`` DTensor in a list argument or among the keyword arguments requires grad
    (torch function disabled by the caller)."""
    for a in args:
        if type(a) in (list, tuple) and any(type(v) is cls and v.requires_grad for v in a):
            return True
    return bool(kwargs) and any(type(v) is cls and v.requires_grad for v in kwargs.values())


def _waited(dt):
    """A DTensor's local tensor, its data waited for (``replace_dtensors``' conversion)."""
    return dt._local


def _flat(values) -> list:
    return [v for value in values for v in (value if type(value) in (list, tuple) else (value,))]


def _random(op, args, kwargs) -> bool:
    """Whether the aten call draws random numbers: a seeded op, unless its ``dropout_p`` is 0
    (attention kernels without dropout)."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return True
    at = names.index("dropout_p")
    p = args[at] if at < len(args) else (kwargs or _EMPTY).get("dropout_p", op._schema.arguments[at].default_value)
    return p != 0


def _pointwise(steps) -> bool:
    """Every recorded aten op is pointwise: no scalar value changes its output's layout."""
    return all(torch.Tag.pointwise in op.tags for op, _, _, _ in steps)


class _Recorder:
    """Stands in for the dispatcher during one torch-level call: runs it, and keeps the
    top-level aten calls (ops that the dispatcher runs inside them are not steps), except that a
    composite op the dispatcher ran as its decomposition (``decomposed``: no rule of its own, as
    linear or matmul under inference_mode) is replaced by the calls it made, so that a torch
    function whose decomposition runs where its inputs are can be proven like any other."""

    def __init__(self, dispatch, decomposed):
        self.dispatch, self.decomposed = dispatch, decomposed
        self.steps: list = []
        self.calls = [self.steps]  # per depth of the calls running now: the list theirs go into
        self.last_top = None  # the last top-level aten op, as called (a decomposed one included)
        self.thread = threading.get_ident()

    def __call__(self, func, args, kwargs):
        if threading.get_ident() != self.thread:  # another thread's op: its own recorder, if any
            for recorder in reversed(RECORDING):
                if recorder.thread == threading.get_ident():
                    return recorder(func, args, kwargs)
            return self.dispatch(func, args, kwargs)
        inner: list = []
        self.calls.append(inner)
        try:
            out = self.dispatch(func, args, kwargs)
        finally:
            self.calls.pop()
        if inner and self.decomposed(func, args, kwargs):
            self.calls[-1].extend(inner)
        else:
            self.calls[-1].append((func, args, kwargs, out))
        if len(self.calls) == 1:
            self.last_top = func
        return out


# torch functions whose C++ reads an index tensor's data directly (no dispatch), which a DTensor
# (a wrapper with no storage of its own) cannot serve
_READS_INDEX_DATA = frozenset({torch.tensor_split, torch.Tensor.tensor_split})


def _with_index_values(func, types, args, kwargs, cls):
    """``torch.tensor_split(x, idx)`` with a DTensor ``idx``: its values (a few ints, the same
    on every rank) gathered into a list first, the op then split by those indices."""
    args = tuple(a.full_tensor().tolist() if i > 0 and type(a) is cls else a for i, a in enumerate(args))
    kwargs = {k: (v.full_tensor().tolist() if type(v) is cls else v) for k, v in (kwargs or _EMPTY).items()}
    return _disabled(func, types, args, kwargs)


def _add_kwargs(key: list, kwargs: dict, floats: list, cls=None, tag_of=None):
    """Extend a call's key by its keyword arguments (a float's value goes to ``floats``, ``_ANY``
    into the key; a ``cls`` DTensor, where ``cls`` is given, by its tag) and give the keyword
    arguments of the local call (``kwargs`` itself where no DTensor is among them); None when one
    is neither a scalar, a list of ints nor such a DTensor whose data is here."""
    key.append(_KWARGS)
    local = kwargs
    for name, a in kwargs.items():
        t = type(a)
        if t in SCALAR_TYPES or (t in _SEQUENCES and all(type(v) is int for v in a)):
            key.append(name)
            key.append(t)
            if t in _LOOSE:
                key.append(_ANY)
                floats.append(a)
            else:
                key.append(tuple(a) if t in _SEQUENCES else a)
        elif t is cls and a._pending is None:
            tag = a._tag
            key.append(name)
            key.append(t)
            key.append(tag.number if tag is not None and tag.spec is a._spec else tag_of(a))
            if local is kwargs:
                local = dict(kwargs)
            local[name] = a._value
        else:
            return None
    return local


def _handler(fast: FastPath):
    """The ``__torch_function__`` of ``fast``'s tensor class (its state bound in the closure)."""
    dispatcher = fast.dispatcher
    DTensor = dispatcher.cls
    # its entries live in the dispatcher's call cache: key -> LocalRoute, or _SLOW
    cache, passed, views, counts = dispatcher.cache.torch_calls, fast.passed, fast.views, fast.counts
    tag_of, record, wrap_ = dispatcher.tag_of, fast.record, wrap

    @eager_only  # never compiled frame by frame (see eager_only)
    def torch_function(cls, func, types, args=(), kwargs=None):
        if func in passed or (func in views and not _inference_mode()):
            return _disabled(func, types, args, kwargs or _EMPTY)
        grad = 0  # with grad mode on: a bit per positional DTensor that requires grad
        grad_mode = _grad_enabled()
        if grad_mode:
            with _no_torch_function():  # requires_grad without coming back here
                bit = 1
                for a in args:
                    if type(a) is DTensor:
                        if a.requires_grad:
                            grad |= bit
                            # later calls whose DTensors all carry this skip the handler (torch
                            # looks __torch_function__ up on the object first)
                            a.__torch_function__ = _disabled
                        bit <<= 1
        key = [func]
        local_args = []
        floats = []  # the float and complex scalars' values (the key holds _ANY in their place)
        found = False  # any DTensor among the positional arguments
        nested = False  # a DTensor in a list argument (torch.cat's) or among the keyword arguments
        waits = False  # a DTensor whose data is still coming (async redistribute, deferred GEMM)
        for a in args:
            t = type(a)
            if t is DTensor:
                tag = a._tag
                # re-derived when the spec changed (an in-place op may reduce a pending sum)
                key.append(tag.number if tag is not None and tag.spec is a._spec else tag_of(a))
                local_args.append(a._value)
                found = True
                waits = waits or a._pending is not None
            elif t in SCALAR_TYPES:
                key.append(t)
                if t in _LOOSE:
                    key.append(_ANY)
                    floats.append(a)
                else:
                    key.append(a)
                local_args.append(a)
            elif t in _SEQUENCES and all(type(v) is int for v in a):
                key.append(t)
                key.append(tuple(a))
                local_args.append(a)
            elif t is slice or (t is tuple and all(type(v) in _INDEX_ITEMS for v in a)):
                index = _index_key(a)  # x[:s], x[:, None, None, :]: ints, None, ..., slices of ints
                if index is None:
                    return _disabled(func, types, args, kwargs or _EMPTY)
                key.append(_INDEX)
                key.append(index)
                local_args.append(a)
            elif (t is tuple or t is list) and a and all(type(v) is DTensor and v._pending is None for v in a):
                key.append(t)  # torch.cat's tensors
                key.append(tuple(v._tag.number if v._tag is not None and v._tag.spec is v._spec else tag_of(v)
                                 for v in a))
                local_args.append(t(v._value for v in a))
                found = nested = True
            else:
                return _disabled(func, types, args, kwargs or _EMPTY)
        local_kwargs = kwargs
        if kwargs:
            local_kwargs = _add_kwargs(key, kwargs, floats, DTensor, tag_of)
            if local_kwargs is None:
                return _disabled(func, types, args, kwargs)
            if local_kwargs is not kwargs:
                found = nested = True
        if nested and grad_mode and (grad or _nested_grad(args, kwargs, DTensor)):
            # served only where no DTensor of the call requires grad: autograd's recording of a hit
            # takes the DTensors at their positions
            return _disabled(func, types, args, kwargs or _EMPTY)
        if not found:
            return _disabled(func, types, args, kwargs or _EMPTY)
        if waits and any(type(a) is DTensor and pending_tail(a._pending) for a in args):
            # a deferred decode all-reduce: the normal route, where the residual add keeps it
            # pending and an RMSNorm runs it fused (ops/fusion.py); never recorded here
            return _disabled(func, types, args, kwargs or _EMPTY)
        if grad:
            # which inputs require grad is part of the key: a composite function may take another
            # route then (and autograd records different ops)
            key.append(_GRAD)
            key.append(grad)
        # without floats one key; with floats the loose one (pointwise entries, normal-route
        # marks) and the exact one, (loose, values)
        loose = tuple(key)
        key = (loose, tuple(floats)) if floats else loose
        entry = cache.get(loose)
        if entry is None and floats:
            entry = cache.get(key)
        if entry is _SLOW:
            return _disabled(func, types, args, kwargs or _EMPTY)
        if _dispatch_modes() or _any_autocast():
            return _disabled(func, types, args, kwargs or _EMPTY)
        if entry is None:
            if func in _READS_INDEX_DATA:
                return _with_index_values(func, types, args, kwargs, DTensor)
            return record(func, types, args, kwargs, key, grad, loose if floats else None)
        if entry is _SELF:
            counts["hits"] += 1
            return args[0]
        if entry.defer and dispatcher.defers(entry.cuda):  # (a GEMM the policy lets wait)
            return _disabled(func, types, args, kwargs or _EMPTY)
        if waits and any(type(a) is DTensor and (pending_gather(a._pending) or pending_product(a._pending))
                         for a in args):
            # deferred work: the normal route, where an mm with column-sharded weights fuses a
            # gather, and a view or a sum of products keeps them pending
            return _disabled(func, types, args, kwargs or _EMPTY)
        if waits:  # only now: a call that takes the normal route must find a deferred GEMM unrun
            local_args = replace_dtensors(DTensor, args, _EMPTY, _waited)[0]
        run = entry.run or func
        try:
            value = run(*local_args, **local_kwargs) if kwargs else run(*local_args)
        except RuntimeError:
            if not entry.view:
                raise
            # a view the local tensor's strides do not allow (its layout's normal route copies):
            # nothing happened yet; the normal route, now and for this key
            cache[key] = cache[loose] = _SLOW
            return _disabled(func, types, args, kwargs or _EMPTY)
        if type(entry) is Views:
            return views_hit(func, types, args, kwargs, key, loose, entry, value)
        # (a view entry's local result is a view of its input, as the normal route's; any other
        # entry's a new tensor)
        unlike = (value._is_view() and not entry.view) or value.dtype != entry.dtype
        for a in local_args:
            unlike = unlike or a is value
        if entry.fresh and value.numel():  # (an op that may alias, new on the recorded call)
            ptr = value.untyped_storage().data_ptr()
            for a in local_args if local_kwargs is kwargs else (*local_args, *local_kwargs.values()):
                unlike = unlike or (isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr)
        if local_kwargs is not kwargs:
            for a in local_kwargs.values():
                unlike = unlike or a is value
        if entry.unsqueeze:
            value = value.unsqueeze(0)
        if floats:  # an entry for any float values: its shape too, for this one
            unlike = unlike or value.shape != entry.local_shape
        if unlike:
            # The local call aliased an input where the recorded one did not (contiguous() or
            # reshape() decide on local strides, the normal route on global ones), or its dtype
            # changed (torch.set_default_dtype and int / int), or its shape did (a loose key's
            # float would have changed it): no side effect happened yet, so take the normal
            # route, now and for this key.
            cache[key] = cache[loose] = _SLOW
            return _disabled(func, types, args, kwargs or _EMPTY)
        out = wrap_(DTensor, value, entry.spec, entry.stride, entry.dtype, entry.device)
        out._tag = entry.tag
        if entry.view and getattr(args[0], "_copied_view", False):  # a view of a copied view is one too
            out._copied_view = True
        if grad:
            return grad_hit(func, types, args, kwargs, loose, entry, out)
        counts["hits"] += 1  # (the dispatcher's cache_info counts them as plan-cache hits too)
        return out

    def views_hit(func, types, args, kwargs, key, loose, entry, value):
        # a tuple of local views (chunk) of the recorded shapes: each wrapped by its route
        if type(value) is not tuple or tuple(v.shape for v in value) != entry.local_shapes:
            cache[key] = cache[loose] = _SLOW  # (nothing happened yet: the normal route, now and for this key)
            return _disabled(func, types, args, kwargs or _EMPTY)
        copied = getattr(args[0], "_copied_view", False)  # views of a copied view are such views too
        outs = []
        for v, route in zip(value, entry.routes):
            out = wrap_(DTensor, v, route.spec, route.stride, route.dtype, route.device)
            out._tag = route.tag
            if copied:
                out._copied_view = True
            outs.append(out)
        counts["hits"] += 1
        return tuple(outs)

    def grad_hit(func, types, args, kwargs, key, entry, out):
        # Autograd must record the call: it goes through torch's dispatcher after all (autograd's
        # C++ kernel for the op: graph node, saved tensors, version bookkeeping), and
        # __torch_dispatch__ hands back this output instead of running the dispatcher.
        out.__torch_function__ = _disabled  # it will require grad: later calls skip this handler
        READY.value = ReadyOutput(entry.op, entry.positions, args, out)
        try:
            result = _disabled(func, types, args, kwargs or _EMPTY)
        finally:
            served = READY.value is None
            READY.value = None
        if served:
            counts["hits"] += 1
            counts["grad hits"] += 1
        else:
            # the first aten op was not the recorded one (the normal route ran instead): not again
            cache[key] = _SLOW
        return result

    return torch_function
