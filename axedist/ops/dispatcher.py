"""The op dispatcher: one object per tensor class that runs aten ops on its DTensors.

The tensor class creates it (``OpDispatcher(DTensor)``) and routes ``__torch_dispatch__`` and
``__torch_function__`` to it; this package never imports the tensor module. Every call goes
unwrap (the DTensors, their mesh, a key) -> propagate (the op family's rule, cached as a
``CallPlan``) -> redistribute (inputs the rule wants elsewhere) -> the local op -> wrap. For
``a + b`` with ``a`` in ``[Shard(0)]`` and ``b`` in ``[Replicate()]``, shape ``(8, 6)``, on 4 ranks:
``b`` is sliced to ``[Shard(0)]`` (no communication), ``aten.add`` runs on the ``(2, 6)`` local
tensors, and the result is wrapped as an ``(8, 6)`` DTensor in ``[Shard(0)]``.

Also handled, for every family: in-place ops (the result is ``self``, whose layout must not
change; a pending ``self`` the op cannot keep pending is reduced in its own buffer first),
plain 0-dim tensors (scalars), pending reductions (the local summand dim of extent 1 is removed
before the op and added back to outputs that stay pending), deferred GEMMs and deferred work
that an op takes as it stands (two hooks into ``ops/fusion.py``, the home of eager fusion),
and, through ``ops/variants.py``, ``out=``, ``_foreach_*``, fused optimizer steps, plain
constants and the gather fallback of ops with no rule.
"""

from __future__ import annotations

import itertools
import warnings

import torch
from torch._prims_common import make_contiguous_strides_for

from ..caches import cached, register
from ..peers import is_peer_failure, peer_error
from ..runtime import redistribute_local
from ..runtime.deferred import PENDING, POLICIES
from ..tracing import eager_only
from .call_cache import CallCache
from .call_plan import (SCALAR_TYPES, CallPlan, DispatchError, OpInfo, PlainTensorError, decomposable, decompose,
                        local_of, op_info, plan_call, replace_dtensors, scan, written)
from .fastpath import FastPath
from .fusion import defer_product, take_pending
from .registry import ArgSpec
from .reshape_inplace import RESHAPING_INPLACE, dispatch_reshaping_inplace
from .specs import placements_or_none
from .state import READY, RECORDING, wrap
from .variants import (FUSED_OPTIMIZERS, NOT_HANDLED, adopt_constants, dispatch_foreach, dispatch_fused_optimizer,
                       dispatch_out, gather_fallback)

__all__ = ["OpDispatcher", "DispatchError", "Tag"]

aten = torch.ops.aten
_no_torch_function = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled
_DISABLED = torch._C._disabled_torch_function_impl
_NO_RULE = object()
_DECOMPOSE = object()  # a positional key's entry: the call runs as its decomposition (a composite op, no rule)
_KWARGS = object()     # in a cache key: the keyword arguments' entries end here


class Tag:
    """A small int standing for a DTensor's (spec, dtype, global stride, device), kept on the
    DTensor (``_tag``) with the spec it was made for, so cache keys hold ints instead of hashing
    specs. The device is the local tensor's: a piece kept off the mesh's device (FSDP's CPU
    offload, ``DTensor.cpu()`` on a CUDA mesh, a meta-built model) keys its own entries, whose
    results are wrapped with its device."""

    __slots__ = ("spec", "number")

    def __init__(self, spec, number: int):
        self.spec, self.number = spec, number

    def __repr__(self) -> str:
        return f"Tag({self.number}: {self.spec})"


@cached(maxsize=4096)
def _contiguous(shape) -> tuple:
    return tuple(make_contiguous_strides_for(shape)) if shape else ()


class OpDispatcher:
    """Runs aten ops on DTensors of ``cls``; owns the call cache (``cache``, ops/call_cache.py),
    the tags and the counts.

    ``cache_info()``, ``fallback_ops()``, ``clear_caches()``, ``defer_gemm``, ``pending`` (the
    deferred work, ops/fusion.py) and ``fastpath`` (``enable``/``enabled``/``clear``/``stats``)
    are its public controls, reached as
    ``DTensor.dispatcher``: ``DTensor.dispatcher.cache_info()`` -> ``{"hits": 12, "misses": 3, ...}``.
    """

    def __init__(self, cls):
        self.cls = cls
        self.cache = CallCache()     # every call record, by key (the fast path's too)
        self.stats = {"hits": 0, "misses": 0, "uncached": 0, "fallbacks": 0}
        self.warned: set = set()     # ops that ran through the gather fallback (warned once each)
        self._tags: dict = {}        # (spec, dtype, stride or None, device) -> Tag
        self._next_tag = itertools.count(1)  # tag numbers are never reused, even after _tags is cleared
        self._defer_gemm = "auto"
        # the process's deferred work (one for every thread: autograd's backward thread defers
        # products that the main thread's writes must compute first; runtime/deferred.PendingWork)
        self.pending = PENDING
        self.fastpath = FastPath(self)
        self.torch_dispatch = _torch_dispatch_handler(self.dispatch)
        register(f"ops.dispatcher of {cls.__name__}", self.clear_caches)

    # -- public controls -----------------------------------------------------------

    @property
    def defer_gemm(self) -> str:
        """When mm/addmm with a pending-sum output defer their GEMM: ``"auto"`` only where the
        fused kernel can run (CUDA, bf16/fp16 operands: elsewhere deferring could only cost),
        ``"always"`` (tests of the deferral on CPU), ``"never"``."""
        return self._defer_gemm

    @defer_gemm.setter
    def defer_gemm(self, value: str) -> None:
        if value not in POLICIES:
            raise ValueError(f"defer_gemm must be one of {POLICIES}, got {value!r}")
        self._defer_gemm = value

    def defers(self, cuda: bool) -> bool:
        """Whether the ``defer_gemm`` policy lets a deferrable GEMM on local tensors (on CUDA or
        not) wait; where it does, the GEMM takes the plan's route (``fusion.defer_product``), never
        a cached "op on the local tensors" one."""
        policy = self._defer_gemm
        return policy == "always" or (policy == "auto" and cuda)

    def clear_caches(self) -> None:
        """Forget cached plans, fast-path entries and the tag table (rules are re-run on next use;
        tags already kept on DTensors stay valid, numbers are never reused)."""
        self.cache.clear()
        self.fastpath.clear()
        self._tags.clear()

    def cache_info(self) -> dict:
        """Counts of cached-plan hits (the fast path's hits among them) and misses and of fallback
        runs (for tests and benchmarks)."""
        return dict(self.stats, hits=self.stats["hits"] + self.fastpath.counts["hits"], size=len(self.cache.plans))

    def fallback_ops(self) -> set:
        """Ops that ran through the gather fallback in this process (each warned once)."""
        return set(self.warned)

    def forget_fallbacks(self) -> None:
        """Warn again on the next gather fallback of every op (ranks pooled across tests share a process)."""
        self.warned.clear()

    def note_fallback(self, func) -> None:
        """Count a gather fallback of ``func``, warning the first time."""
        self.stats["fallbacks"] += 1
        if func not in self.warned:
            self.warned.add(func)
            warnings.warn(f"axedist: no sharding rule for {func}; it runs by gathering every DTensor argument to "
                          f"Replicate and replicating the result (correct, but moves whole tensors)", stacklevel=5)

    # -- keys and tags -------------------------------------------------------------

    def tag_for(self, spec, dtype, stride, device) -> Tag:
        key = (spec, dtype, None if stride is None else tuple(stride), device)
        tag = self._tags.get(key)
        if tag is None:
            if len(self._tags) > 65536:  # tags in cached keys stay valid: only new DTensors get new tags
                self._tags.clear()
            tag = self._tags[key] = Tag(spec, next(self._next_tag))
        return tag

    def tag_of(self, dt) -> int:
        """The tag number of ``dt`` (derived and kept on it when it has none for its spec)."""
        with _no_torch_function():
            stride = tuple(dt.stride())
        spec = dt._spec
        value = dt._value
        tag = self.tag_for(spec, value.dtype, None if stride == _contiguous(spec.shape) else stride, value.device)
        if tag.spec is not spec:  # an equal spec, another object: the identity check needs this one
            tag = Tag(spec, tag.number)
        dt._tag = tag
        return tag.number

    def cache_key(self, func, args, kwargs):
        """(func, per argument: a DTensor's tag number or a plain value's type and value; then per
        keyword argument its name, type and value), or None when the call is not fast-path shaped
        (DTensors inside lists or among the keyword arguments, ...)."""
        cls = self.cls
        key = [func]
        if kwargs:
            for name, a in kwargs.items():
                t = type(a)
                if t in SCALAR_TYPES:
                    key.append((name, t, a))
                elif (t is list or t is tuple) and all(type(v) is int for v in a):
                    key.append((name, t, tuple(a)))
                else:
                    return None
            key.append(_KWARGS)
        for a in args:
            t = type(a)
            if t is cls:
                tag = a._tag
                # re-derived when the spec changed (an in-place op may reduce a pending sum)
                key.append(tag.number if tag is not None and tag.spec is a._spec else self.tag_of(a))
            elif t in SCALAR_TYPES:
                key.append(t)
                key.append(a)
            elif t is list or t is tuple:
                if all(type(v) is int for v in a):  # dims and shapes: no per-element types needed
                    key.append((t, tuple(a)))
                elif all(type(v) in SCALAR_TYPES for v in a):
                    key.append((t, tuple((type(v), v) for v in a)))
                else:
                    return None
            else:
                return None
        return tuple(key)

    # -- the route -------------------------------------------------------------------

    def dispatch(self, func, args, kwargs):
        """Run the aten op ``func`` on DTensors (what ``__torch_dispatch__`` calls)."""
        if self.pending.outstanding:  # eager fusion (ops/fusion.py): an op may take deferred work as it stands
            kept = take_pending(self, func, args, kwargs)
            if kept is not None:
                return kept
        fast_key = self.cache_key(func, args, kwargs)
        if fast_key is not None:
            plan = self.cache.positional.get(fast_key)
            if plan is not None:
                self.stats["hits"] += 1
                if plan is _DECOMPOSE:
                    result = decompose(func, args, kwargs)
                    if result is not NotImplemented:
                        return result
                    return self._dispatch_uncached(func, args, kwargs, None)
                route = plan.plain
                if route is None:
                    return self._run_fast(func, args, kwargs, plan)
                # the op itself on the local tensors of DTensors that stay where they are
                positions = route.positions
                if route.defer and self.defers(args[positions[0]]._value.is_cuda):
                    return self._run_fast(func, args, kwargs, plan)  # the GEMM may wait (fusion.defer_product)
                local_args = list(args)
                for i in positions:
                    d = args[i]
                    local_args[i] = d._value if d._pending is None else d._local
                value = route.op(*local_args, **kwargs) if kwargs else route.op(*local_args)
                if route.unsqueeze:
                    value = value.unsqueeze(0)
                spec = route.spec
                if value.shape != route.local_shape:
                    _wrong_shape(func, value, spec, route.local_shape, plan)
                out = wrap(self.cls, value, spec, route.stride, value.dtype, value.device)
                if value.dtype is route.dtype:  # (always, unless the op's dtype rules changed since planning)
                    out._tag = route.tag  # the next op's key needs no stride() call
                if route.view and args[0]._copied_view:
                    out._copied_view = True
                if _grad_enabled():
                    for i in positions:
                        if args[i].__torch_function__ is _DISABLED:
                            # it will require grad: its calls skip the fast path's handler too
                            out.__torch_function__ = _DISABLED
                            break
                return out
        return self._dispatch_uncached(func, args, kwargs or {}, fast_key)

    def _dispatch_uncached(self, func, args, kwargs, fast_key):
        """Unwrap, plan (cached by the call's full key), run; the variants branch off here."""
        if func.namespace == "c10d":
            raise _collective_on_dtensor(func)
        info = op_info(func)
        if info.inplace or info.written or info.out_names:
            _refuse_writes_to_copied_views(func, args, kwargs, info)
        if info.foreach:
            return dispatch_foreach(self, func, args, kwargs)
        if func in FUSED_OPTIMIZERS:
            result = dispatch_fused_optimizer(self, func, args, kwargs)
            if result is not NOT_HANDLED:
                return result
        if info.out_names:
            return dispatch_out(self, func, args, kwargs, info)
        if func in RESHAPING_INPLACE:  # the tensor itself changes shape: rebound to its new spec
            return dispatch_reshaping_inplace(self, func, args, kwargs)
        try:
            dts, mesh, key = scan(self.cls, func, args, kwargs)
        except PlainTensorError as error:
            args, kwargs = adopt_constants(self.cls, func, args, kwargs, error)
            dts, mesh, key = scan(self.cls, func, args, kwargs)
        plan = self.plan(func, args, kwargs, dts, mesh, key, info)
        if plan is None:
            if decomposable(func):
                # A composite op (linear, rms_norm, chunk, sdpa, ...) reaches us undecomposed under
                # inference_mode; its decomposition runs on ops that have rules.
                result = decompose(func, args, kwargs)
                if result is not NotImplemented:
                    if fast_key is not None and not (info.inplace or info.written):
                        self.cache.put("positional", fast_key, _DECOMPOSE)  # later calls go straight there
                    return result
            return gather_fallback(self, func, args, kwargs, dts, mesh, info)
        if fast_key is not None and plan.fast is not None:
            self.cache.put("positional", fast_key, plan)
        return self.run(func, args, kwargs, dts, plan, info)

    def plan(self, func, args, kwargs, dts, mesh, key, info: OpInfo) -> CallPlan | None:
        """The call's plan (propagate: the rule's answer, cached by ``key`` unless it is None), or
        None when no rule answers."""
        plan = self.cache.plans.get(key) if key is not None else None
        if plan is None:
            plan = plan_call(self.cls, func, args, kwargs, dts, [self.arg_spec(d) for d in dts], mesh, info,
                             self.tag_for) or _NO_RULE
            if key is not None:
                self.stats["misses"] += 1
                self.cache.put("plans", key, plan)
            else:
                self.stats["uncached"] += 1
        else:
            self.stats["hits"] += 1
        return None if plan is _NO_RULE else plan

    def cached_plan(self, func, args, kwargs):
        """The plan cached for this call (None: none yet, or no rule) and the call's DTensors. A call
        with a plain tensor among its DTensors has none: the tensor is adopted per call, once the
        ranks are seen to agree (``adopt_constants``)."""
        try:
            dts, _, key = scan(self.cls, func, args, kwargs)
        except PlainTensorError:
            return None, []
        plan = self.cache.plans.get(key)
        if plan is None:
            fast_key = self.cache_key(func, args, kwargs)
            plan = self.cache.positional.get(fast_key) if fast_key is not None else None
        return (plan if isinstance(plan, CallPlan) else None), dts

    def arg_spec(self, dt) -> ArgSpec:
        """What a rule sees of ``dt`` (cached per (spec, dtype))."""
        spec = dt._spec
        key = (spec, dt.dtype)
        found = self.cache.arg_specs.get(key)
        if found is None:
            found = ArgSpec(spec.shape, dt.dtype, spec.mesh, spec.layout, placements_or_none(spec), spec.reduce_op,
                            spec)
            self.cache.put("arg_specs", key, found)
        return found

    # -- redistribute -> local op -> wrap -----------------------------------------------

    def run(self, func, args, kwargs, dts, plan: CallPlan, info: OpInfo):
        """Move the inputs to the plan's targets, run the op on the local tensors, wrap the outputs."""
        if plan.reduce_self is not None:
            self._reduce_in_place(func, args[0], plan.reduce_self)
        locals_ = {id(d): local_of(d, t) for d, t in zip(dts, plan.targets)}
        local_args, local_kwargs = replace_dtensors(self.cls, args, kwargs, lambda d: locals_[id(d)])
        if plan.defer:
            deferred = defer_product(self, func, plan, local_args, local_kwargs)
            if deferred is not None:
                return deferred
        if plan.sharding.local is not None:
            try:  # a rule's local function may run collectives (softmax's row max and sum, ...)
                result = plan.sharding.local(plan.call, *local_args, **local_kwargs)
            except RuntimeError as error:
                if not is_peer_failure(error):
                    raise
                raise _failed_rule(func, plan, error) from error
        else:
            result = func(*local_args, **local_kwargs)
        if info.inplace:
            return args[0]
        if plan.structure == "none":
            return result
        if plan.structure == "single":
            return self._wrap_outputs(func, args, plan, [result], plan.outputs)[0]
        return self._wrap_outputs(func, args, plan, result, plan.outputs)

    def _wrap_outputs(self, func, args, plan: CallPlan, result, outputs, bits: bool = True):
        """The local ``result`` (a tuple or list, as ``plan.structure`` says) wrapped per ``outputs``
        (``bits``: a value may be marked conjugate or negative, which the constructor resolves)."""
        wrapped = []
        for value, out in zip(result, outputs):
            if out.spec is None or value is None:  # None: an undefined optional output (CUDA flash attention's cum_seq)
                wrapped.append(value)
                continue
            if out.unsqueeze:
                value = value.unsqueeze(0)
            if value.shape != out.local_shape:
                _wrong_shape(func, value, out.spec, out.local_shape, plan)
            if bits:
                wrapped.append(self.cls(value, out.spec, stride=out.stride))  # (resolves a conjugate / negative bit)
            else:
                wrapped.append(wrap(self.cls, value, out.spec, out.stride, value.dtype, value.device))
        if plan.view and (plan.view == 2 or args[0]._copied_view):
            for value in wrapped:
                if isinstance(value, self.cls):
                    value._copied_view = True
        return wrapped if plan.structure == "list" else tuple(wrapped)

    def _run_fast(self, func, args, kwargs, plan: CallPlan):
        """``run`` for a call in its FastForm (positional DTensors, scalar keyword arguments)."""
        fast = plan.fast
        if fast.out is None and fast.outs is None and getattr(args[0], "_copied_view", False):  # in-place
            _refuse_writes_to_copied_views(func, args, kwargs, op_info(func))
        local_args = list(args)
        for slot in fast.slots:
            i, target = slot.position, slot.target
            d = args[i]
            if target is None and d._pending is None:
                local_args[i] = d._value[0] if slot.strip else d._value
            else:
                local_args[i] = local_of(d, target)
        if plan.defer:
            deferred = defer_product(self, func, plan, local_args, kwargs)
            if deferred is not None:
                return deferred
        if fast.local is not None:
            try:
                value = fast.local(plan.call, *local_args, **kwargs)
            except RuntimeError as error:
                if not is_peer_failure(error):
                    raise
                raise _failed_rule(func, plan, error) from error
        else:
            value = func(*local_args, **kwargs)
        out = fast.out
        if out is None:
            if fast.outs is not None:  # a tuple or a list of outputs
                return self._wrap_outputs(func, args, plan, value, fast.outs, bits=False)  # (plan_call's FastForm)
            return args[0]  # in-place
        if out.unsqueeze:
            value = value.unsqueeze(0)
        spec = out.spec
        if value.shape != out.local_shape:
            _wrong_shape(func, value, spec, out.local_shape, plan)
        out = wrap(self.cls, value, spec, out.stride, value.dtype, value.device)  # (no conjugate / negative bit: plan_call's FastForm)
        if value.dtype is fast.dtype:
            out._tag = fast.tag
        if plan.view and (plan.view == 2 or args[0]._copied_view):  # (one read for an op that is not a view)
            out._copied_view = True
        return out

    def _reduce_in_place(self, func, dt, target) -> None:
        """Apply ``dt``'s pending reduction in its own local buffer and give it ``target``'s spec.

        An in-place op that does not keep a pending value (``p.exp_()`` of ``[Partial()]``) must
        first turn it into the value it stands for; ``dt`` then is ``[Replicate()]`` on those axes
        (its local tensor loses the summand dim of extent 1). Autograd sees one in-place change of
        ``dt`` (the op's), so saved-tensor version checks stay exact. Refused on a view of another
        DTensor (its base would keep claiming ``Partial`` over reduced values). Known limit: views
        taken of ``dt`` before this call share its buffer and are not told (they read reduced
        values as summands); redistribute such a tensor to ``Replicate`` before a non-affine
        in-place op.
        """
        if dt._is_view():
            raise DispatchError(f"{func} is in-place on a view of a pending {dt._spec.reduce_op} ({dt._spec}); it "
                                f"would have to reduce the pending value of the view alone, which its base shares. "
                                f"Apply it to the base, or redistribute the view to Replicate first")
        buffer = dt._local
        value = redistribute_local(buffer, dt._spec, target)
        if tuple(value.shape) != tuple(buffer.shape[1:]):
            raise DispatchError(f"{func}: reducing {dt._spec} to {target} changes the local shape "
                                f"{tuple(buffer.shape)} -> {tuple(value.shape)}; an in-place op cannot do that")
        buffer.squeeze_(0)  # the summand dim of extent 1 goes: same storage, same tensor object
        if value.data_ptr() != buffer.data_ptr():
            buffer.copy_(value)
        dt._value = buffer
        dt._spec = target


def _refuse_writes_to_copied_views(func, args, kwargs, info: OpInfo) -> None:
    """Raise where ``func`` writes a DTensor that is a view of a copy (``DTensor._copied_view``):
    the write would change the copy, not the tensor the view was taken of, which autograd and the
    user take it to change. Every rank decides alike (the flag comes from the plan of the view)."""
    targets = ([args[0]] if info.inplace else []) + written(args, kwargs, info)
    targets += [kwargs[name] for name in info.out_names if name in kwargs]
    for target in targets:
        for t in (target if isinstance(target, (list, tuple)) else [target]):
            if getattr(t, "_copied_view", False):
                raise DispatchError(
                    f"{func} writes in place to a view that could not be taken where its base is ({t._spec}): "
                    f"the view op moved its input first (or computed the view's values, as z.conj() does), so "
                    f"the write would change a copy and not the base. Take the view of a tensor laid out so "
                    f"that the viewed dims are whole on each device (redistribute the base first), or write "
                    f"to a clone")


def _failed_rule(func, plan: CallPlan, error: RuntimeError) -> RuntimeError:
    """The ``PeerError`` for a peer's failure (timeout, closed connection) in one of the
    collectives a rule's local function runs: it names the op."""
    return peer_error(f"{func}'s collectives ({plan.sharding})", plan.call.mesh.ranks, error)


def _wrong_shape(func, value, spec, local_shape, plan):
    raise DispatchError(f"{func}: the local result has shape {tuple(value.shape)}, but the output layout "
                        f"{spec} gives this rank {tuple(local_shape)} (a wrong sharding rule: {plan.sharding})")


def _torch_dispatch_handler(dispatch):
    """The tensor class's ``__torch_dispatch__``: a grad-mode fast-path hit's ready output, a
    recorder of the fast path, or ``dispatch``."""

    @eager_only  # never compiled frame by frame (see eager_only)
    def torch_dispatch(cls, func, types, args=(), kwargs=None):
        ready = READY.value
        if ready:
            # A grad-mode fast-path hit: the fast path ran the op on the local tensors and let
            # autograd record the call through torch's dispatcher, which brings it here. The
            # output is served only to the op it was computed for, on the same DTensor objects
            # (this thread's first aten op of the call); anything else drops it.
            if func is ready.op:
                count = len(args)
                expected = ready.args
                for i in ready.positions:
                    if i >= count or args[i] is not expected[i]:
                        break
                else:
                    READY.value = None
                    return ready.out
            READY.value = False
        if RECORDING:  # the fast path is recording what this torch call dispatches
            return RECORDING[-1](func, args, kwargs)
        return dispatch(func, args, kwargs)

    return torch_dispatch


def _collective_on_dtensor(func) -> TypeError:
    """A ``torch.distributed`` collective or send given a DTensor: refused (torch's DTensor has no
    rule for them either). Run on the gathered tensor, as an op without a rule is, it would send
    or sum the whole tensor where the caller may mean its piece, and wait for ranks of the mesh
    that are not in the call (a pipeline's peer stage)."""
    name = func.name().split("::")[-1].rstrip("_")
    return TypeError(f"torch.distributed's {name} ({func.name()}) got an axedist DTensor: pass a plain tensor, "
                     f"its local piece (dt.to_local()) or the whole tensor (dt.full_tensor()); move a DTensor "
                     f"between layouts with dt.redistribute(...). A pipeline stage hands plain tensors to the "
                     f"next (torch's styles' use_local_output=True, or .to_local() at the stage's end)")
