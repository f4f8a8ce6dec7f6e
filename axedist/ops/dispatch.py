"""Running a torch op on axedist DTensors: look up the rule, move inputs, run locally, wrap.

``DTensor.__torch_dispatch__`` calls :func:`dispatch` for every aten op that reaches a
DTensor (below autograd, so backward ops arrive here too). For ``a + b`` with ``a`` in
``[Shard(0)]`` and ``b`` in ``[Replicate()]`` on 4 ranks, shape ``(8, 6)``:

1. each DTensor argument becomes an :class:`ArgSpec` (shape, dtype, placements/layout);
2. the rule for ``aten.add.Tensor`` (``ops/pointwise.py``) says: ``b`` to ``[Shard(0)]``,
   output ``[Shard(0)]`` -- cached per (op, argument specs, non-tensor arguments), together
   with the global output shape (the op run once on meta tensors of the global shapes);
3. ``b`` is redistributed (a local slice here: no communication), ``aten.add`` runs on the
   ``(2, 6)`` local tensors, and the ``(2, 6)`` result is wrapped as a ``(8, 6)`` DTensor.

Also handled here, for every family: in-place ops (the result is ``self``, whose layout must
not change; a pending ``self`` that the op cannot keep pending is reduced in its own buffer
first), ``out=`` (the functional op, then a copy into ``out``), ``_foreach_*`` ops (one
call per list element), fused optimizer steps (one call on the local tensors), plain 0-dim tensors (scalars), plain tensors that hold one value
on every rank (replicated; autograd formulas make them), non-tensor outputs, pending
reductions (``Partial``: the local summand dim of extent 1 is removed before the op and
added back to outputs that stay partial), and ops with no rule: every argument gathered,
the op run on whole tensors, the result replicated, with a one-time warning naming the op.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..layout import Layout, LayoutError
from ..spec import (DTensorSpec, element_table, make_spec, nested_chunk, placements_of, replicated_layout,
                    spec_from_placements)
from .registry import ArgSpec, OpCall, Sharding, rule_for

__all__ = ["dispatch", "DispatchError", "clear_caches", "cache_info", "fallback_ops"]

aten = torch.ops.aten


class DispatchError(RuntimeError):
    """An op on DTensors that cannot run as called (mixed meshes, plain tensors, a rule's mistake)."""


class _PlainTensorError(DispatchError):
    """A plain tensor with dims among DTensor arguments (maybe a constant: see ``_adopt_constants``)."""


# The dtensor module is imported on first use: ops sit above dtensor in the layering, and
# dtensor only reaches this module from inside __torch_dispatch__.
_dt = None


_DEFERRED: list = []  # dtensor._OUTSTANDING (bound on first use): deferred products not yet used


def _dtensor_module():
    global _dt, _DEFERRED
    if _dt is None:
        from .. import dtensor as module

        _dt = module
        _DEFERRED = module._OUTSTANDING
    return _dt


# ---------------------------------------------------------------------------
# Per-op facts read from the schema (cached)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _OpInfo:
    inplace: bool                 # writes its first (positional) argument and returns it
    out_names: tuple[str, ...]    # kwarg-only written arguments (the out= variant)
    written: tuple[int, ...]      # positional indices of other written arguments
    foreach: bool


@functools.lru_cache(maxsize=None)
def _op_info(func) -> _OpInfo:
    schema = func._schema
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    out_names = tuple(schema.arguments[i].name for i in written if schema.arguments[i].kwarg_only)
    positional = tuple(i for i in written if not schema.arguments[i].kwarg_only)
    inplace = positional[:1] == (0,) and not out_names
    return _OpInfo(inplace, out_names, positional[1:] if inplace else positional,
                   schema.name.startswith("aten::_foreach_"))


@functools.lru_cache(maxsize=None)
def _functional_of(func):
    """The overload of ``func``'s packet with the same non-out arguments and no writes
    (``add.out`` -> ``add.Tensor``), or None."""
    schema = func._schema
    wanted = [(a.name, str(a.type)) for a in schema.arguments if not (a.alias_info and a.alias_info.is_write)]
    packet = func._overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        args = candidate._schema.arguments
        if any(a.alias_info is not None and a.alias_info.is_write for a in args):
            continue
        if [(a.name, str(a.type)) for a in args] == wanted:
            return candidate
    return None


# ---------------------------------------------------------------------------
# Specs: placements of a spec, ArgSpecs, specs of placements (all cached)
# ---------------------------------------------------------------------------

_ARG_SPECS: dict = {}


def _arg_spec(dt) -> ArgSpec:
    spec = dt._spec
    key = (spec, dt.dtype)
    found = _ARG_SPECS.get(key)
    if found is None:
        try:
            placements = placements_of(spec)
        except LayoutError:
            placements = None
        found = ArgSpec(spec.shape, dt.dtype, spec.mesh, spec.layout, placements, spec.reduce_op, spec)
        if len(_ARG_SPECS) > 4096:
            _ARG_SPECS.clear()
        _ARG_SPECS[key] = found
    return found


@functools.lru_cache(maxsize=4096)
def _spec_of(shape: tuple, mesh, target, summands: int | None = None):
    """The spec of placements (or a Layout) for a global shape."""
    if isinstance(target, Layout):
        return make_spec(mesh, target, shape)
    return spec_from_placements(shape, mesh, tuple(target), summands_for_partial=summands)


@functools.lru_cache(maxsize=4096)
def _expected_local_shape(spec, placements) -> tuple[int, ...]:
    """This rank's local shape under ``spec`` (placements, when known, avoid the element table)."""
    mesh = spec.mesh
    if placements is not None and not any(isinstance(p, _StridedShard) for p in placements):
        coords = mesh.coordinates()
        per_dim: dict[int, list] = {}
        for axis, k, p in zip(mesh.axis_names, mesh.shape, placements):
            if isinstance(p, Shard):
                per_dim.setdefault(p.dim % max(len(spec.shape), 1), []).append((k, coords[axis]))
        shape = tuple(nested_chunk(n, per_dim.get(d, ()))[1] for d, n in enumerate(spec.shape))
        return ((1,) if spec.reduce_op else ()) + shape
    if spec.padded == spec.shape and not spec.true_index:
        # unpadded: every reached device holds the whole local box
        return spec.local_padded if _reaches_here(spec.layout, mesh) else (0,) * len(spec.full_shape)
    return tuple(element_table(spec).local_shapes[mesh.position()])


def _reaches_here(layout: Layout, mesh) -> bool:
    """Does the layout put any element on this rank? (enumerates only the mesh-axis digits)"""
    import itertools

    here = mesh.coordinates()
    iters = [it for it in list(layout.shard) + list(layout.replica) if it.axis != "m"]
    if math.prod(it.extent for it in iters) > 1 << 16:
        return True  # such a layout covers the mesh many times over
    base = {a: layout.offset.get(a, 0) for a in mesh.axis_names}
    for digits in itertools.product(*(range(it.extent) for it in iters)):
        point = dict(base)
        for it, d in zip(iters, digits):
            point[it.axis] += d * it.stride
        if point == here:
            return True
    return False


# ---------------------------------------------------------------------------
# Walking arguments
# ---------------------------------------------------------------------------


def _scan(func, args, kwargs):
    """DTensors (in ``OpCall.specs`` order), their mesh, and a hashable key of the call
    (None if some argument is unhashable). Raises for plain non-scalar tensors and mixed meshes."""
    DTensor = _dtensor_module().DTensor
    found: list = []
    key: list = [func]
    hashable = [True]
    mesh = [None]

    def item(value, where):
        if isinstance(value, DTensor):
            spec = value._spec
            if mesh[0] is None:
                mesh[0] = spec.mesh
            elif spec.mesh is not mesh[0] and spec.mesh != mesh[0]:
                raise DispatchError(f"{func}: {where} is on mesh {spec.mesh}, another argument on {mesh[0]}; "
                                    f"an op needs all its DTensors on one mesh")
            found.append(value)
            return (spec, value.dtype, value.stride())
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                return ("scalar", value.dtype, value.device.type)
            raise _PlainTensorError(f"{func}: {where} is a plain torch.Tensor of shape {tuple(value.shape)} mixed "
                                    f"with axedist DTensors; distribute it first (ax.distribute or "
                                    f"DTensor.from_local)")
        if isinstance(value, (list, tuple)):
            return (type(value).__name__,) + tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))
        try:
            hash(value)
        except TypeError:
            hashable[0] = False
            return None
        return value

    names = [a.name for a in func._schema.arguments]
    for i, value in enumerate(args):
        key.append(item(value, f"argument {names[i] if i < len(names) else i!r}"))
    for name in kwargs:
        key.append((name, item(kwargs[name], f"argument {name!r}")))
    return found, mesh[0], (tuple(key) if hashable[0] else None)


def _replace(value, convert):
    """``value`` with every DTensor (also inside lists) replaced by ``convert(dtensor)``."""
    DTensor = _dtensor_module().DTensor
    if isinstance(value, DTensor):
        return convert(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, (DTensor, list, tuple)) for v in value):
        return type(value)(_replace(v, convert) for v in value)
    return value


def _replace_all(args, kwargs, convert):
    return (tuple(_replace(a, convert) for a in args), {k: _replace(v, convert) for k, v in kwargs.items()})


# ---------------------------------------------------------------------------
# The cached plan of one call
# ---------------------------------------------------------------------------


@dataclass
class _OutSpec:
    spec: Any            # dtensor _Spec, or None for a non-tensor output
    local_shape: tuple
    stride: tuple | None  # None: contiguous


@dataclass
class _CallPlan:
    call: OpCall
    sharding: Sharding
    targets: list        # per DTensor: target _Spec, or None to keep the argument as it is
    outputs: list        # _OutSpec per output (flattened)
    structure: str       # "single", "tuple", "list", "none"
    defer: bool = False  # mm/addmm giving a pending sum: the local GEMM waits (fusable with a reduce-scatter)
    fast: tuple | None = None  # (argument slots, output) for dispatch's fast path, or None
    reduce_self: Any = None  # in-place op on a pending value it cannot keep: self's spec with it applied
    # the fast path's plainest case, "the op on the local tensors, wrapped" (no input moved or
    # stripped of a summand dim, no rule-specific local function, not in-place): (DTensor
    # positions, the op's C++ callable, output spec, local shape, stride, unsqueeze, output
    # dtype, output tag, a deferrable GEMM: then only where DEFER_GEMM would not defer it)
    simple: tuple | None = None


def _meta(value):
    DTensor = _dtensor_module().DTensor
    if isinstance(value, DTensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):  # a 0-dim scalar
        return torch.empty((), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def _meta_outputs(func, args, kwargs, sharding):
    """The op's outputs on meta tensors of the global shapes: checks the call like torch
    would (shape mismatches raise torch's error before any data moves) and gives the
    global output shapes."""
    meta_args = tuple(_meta(a) for a in args)
    meta_kwargs = {k: _meta(v) for k, v in kwargs.items()}
    if "device" in meta_kwargs and meta_kwargs["device"] is not None:
        meta_kwargs["device"] = "meta"
    try:
        return func(*meta_args, **meta_kwargs)
    except NotImplementedError:
        if sharding is None or sharding.out_shape is None:
            raise DispatchError(f"{func} has no meta kernel, so its global output shape is unknown; its sharding "
                                f"rule must give out_shape") from None
        shapes = sharding.out_shape
        if isinstance(shapes, (tuple, list)) and shapes and isinstance(shapes[0], (tuple, list, torch.Size)):
            return tuple(torch.empty(s, device="meta") for s in shapes)
        return torch.empty(shapes, device="meta")


def _normalize_outputs(outputs, count: int, func):
    """A rule's ``outputs`` as one entry per output."""
    def one(entry):
        return entry is None or isinstance(entry, (Layout, ArgSpec, DTensorSpec)) or (
            isinstance(entry, (list, tuple)) and all(not isinstance(p, (list, tuple, Layout)) and p is not None
                                                     for p in entry))

    if count == 1 and one(outputs) and not (isinstance(outputs, tuple) and len(outputs) == 1
                                            and isinstance(outputs[0], (list, tuple, Layout, ArgSpec))):
        return [outputs]
    if isinstance(outputs, (list, tuple)) and len(outputs) == count:
        return list(outputs)
    raise DispatchError(f"{func}: the sharding rule gave outputs {outputs!r} for {count} outputs")


def _plan_call(func, args, kwargs, dts, mesh, info: _OpInfo) -> _CallPlan | None:
    rule = rule_for(func)
    if rule is None:
        return None
    specs = [_arg_spec(d) for d in dts]
    iterator = iter(specs)
    spec_args, spec_kwargs = _replace_all(args, kwargs, lambda d: next(iterator))
    call = OpCall(func, spec_args, spec_kwargs, mesh)
    sharding = rule(call)
    if sharding is None:  # a rule may decline (e.g. a layout it cannot reason about): gather
        return None
    if len(sharding.inputs) != len(dts):
        raise DispatchError(f"{func}: rule {rule.__name__} gave {len(sharding.inputs)} input placements for "
                            f"{len(dts)} DTensor arguments ({specs})")
    targets = []
    for d, spec, wanted in zip(dts, specs, sharding.inputs):
        own = d._spec
        if wanted is None:
            target = own
        else:
            summands = None if isinstance(wanted, Layout) else own.summands
            if summands is not None and spec.placements is not None and \
                    sum(isinstance(p, Partial) for p in wanted) != sum(isinstance(p, Partial) for p in spec.placements):
                summands = None  # [Partial, Partial] -> [Partial, Replicate]: the target has fewer summands
            target = _spec_of(own.shape, mesh, wanted if isinstance(wanted, Layout) else tuple(wanted), summands)
            if target == own:
                target = own
        if target.reduce_op and _expected_local_shape(target, spec.placements if target is own else
                                                      (None if isinstance(wanted, Layout) else tuple(wanted)))[0] != 1:
            raise DispatchError(f"{func}: rule {rule.__name__} keeps {spec}, a pending {target.reduce_op} with more "
                                f"than one summand per device; ask for placements instead")
        # None, not the spec: a cached plan serves later DTensors whose equal specs are other objects
        targets.append(None if target is own else target)
    reduce_self = None
    for i, d in enumerate(dts):
        is_self = info.inplace and d is args[0]
        written = is_self or any(d is w for w in _written(args, kwargs, info))
        if not written or targets[i] is None:
            continue
        if is_self and _only_reduces(d._spec, targets[i]):
            # exp_ of a pending sum: the sum is applied in self's own buffer first (run time)
            reduce_self = targets[i]
            continue
        raise DispatchError(f"{func} is in-place on {specs[i]}, but rule {rule.__name__} needs it as "
                            f"{sharding.inputs[i]}; an in-place op cannot change its tensor's layout "
                            f"(redistribute first, or use the out-of-place op)")
    if reduce_self is not None:
        targets = [None if d is args[0] else t for d, t in zip(dts, targets)]
    # meta: the op on the global shapes of the (redistributed) inputs
    returns_tensor = any("Tensor" in str(r.type) for r in func._schema.returns)
    out = _meta_outputs(func, args, kwargs, sharding) if returns_tensor else None
    if isinstance(out, torch.Tensor):
        flat, structure = [out], "single"
    elif isinstance(out, (tuple, list)):
        flat, structure = list(out), "list" if isinstance(out, list) else "tuple"
    else:
        flat, structure = [out], "none"
    count = len(flat)
    entries = _normalize_outputs(sharding.outputs, count, func) if structure != "none" else [None]
    outputs = []
    for value, entry in zip(flat, entries):
        if not isinstance(value, torch.Tensor):
            outputs.append(_OutSpec(None, (), ()))
            continue
        if entry is None:
            if value.numel() == 0:  # an unused empty output, e.g. flash attention's debug mask: stays plain
                outputs.append(_OutSpec(None, (), ()))
                continue
            raise DispatchError(f"{func}: rule {rule.__name__} gave no placements for a tensor output")
        shape = tuple(value.shape)
        if isinstance(entry, ArgSpec):  # exactly that argument's spec (alias, detach)
            spec, placements = entry.spec, entry.placements
        elif isinstance(entry, DTensorSpec):
            spec, placements = entry, None
        elif isinstance(entry, Layout):
            spec = _spec_of(shape, mesh, entry)
            placements = None
        else:
            placements = tuple(entry)
            spec = _spec_of(shape, mesh, placements)
        outputs.append(_OutSpec(spec, _expected_local_shape(spec, placements),
                                None if value.is_contiguous() else tuple(value.stride())))
    if info.inplace:
        self_spec = dts[0]._spec if dts and dts[0] is args[0] else None
        if reduce_self is not None:
            self_spec = reduce_self
        if outputs[0].spec != self_spec:
            raise DispatchError(f"{func} is in-place on {specs[0]}, but rule {rule.__name__} gives its result as "
                                f"{entries[0]}; an in-place op cannot change its tensor's layout")
    defer = (func in _DEFERRABLE and structure == "single" and outputs[0].spec.reduce_op == "sum"
             and sum(isinstance(p, Partial) for p in (_placements_or_none(outputs[0].spec) or ())) == 1)
    fast = None if reduce_self is not None else _fast_form(args, kwargs, dts, info, targets, structure, outputs,
                                                           sharding)
    simple = None
    if fast is not None and not info.inplace and sharding.local is None and \
            all(target is None and not strip for _, target, strip in fast[0]):
        dtype = flat[0].dtype
        simple = (tuple(i for i, _, _ in fast[0]), func._op, fast[3], fast[5], fast[6], fast[4], dtype,
                  (fast[3], _tag_for(fast[3], dtype, fast[6])), defer)
    return _CallPlan(call, sharding, targets, outputs, structure, defer, fast, reduce_self, simple)


def _only_reduces(own, target) -> bool:
    """Is ``target`` ``own`` with its pending reduction applied and nothing else moved
    (``[Partial(), Shard(0)]`` -> ``[Replicate(), Shard(0)]``)?"""
    if not own.reduce_op or target.reduce_op:
        return False
    mine, theirs = _placements_or_none(own), _placements_or_none(target)
    if mine is None or theirs is None:
        return False
    return all((isinstance(p, Partial) and isinstance(q, Replicate)) or p == q for p, q in zip(mine, theirs))


def _reduce_in_place(func, dt, target) -> None:
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
        raise DispatchError(f"{func} is in-place on a view of a pending {dt._spec.reduce_op} ({dt._spec}); it would "
                            f"have to reduce the pending value of the view alone, which its base shares. Apply it to "
                            f"the base, or redistribute the view to Replicate first")
    buffer = dt._local
    value = _dtensor_module().redistribute_local(buffer, dt._spec, target)
    if tuple(value.shape) != tuple(buffer.shape[1:]):
        raise DispatchError(f"{func}: reducing {dt._spec} to {target} changes the local shape "
                            f"{tuple(buffer.shape)} -> {tuple(value.shape)}; an in-place op cannot do that")
    buffer.squeeze_(0)  # the summand dim of extent 1 goes: same storage, same tensor object
    if value.data_ptr() != buffer.data_ptr():
        buffer.copy_(value)
    dt._value = buffer
    dt._spec = target



# mm/addmm whose output is a pending sum over one mesh axis run later (``dtensor._DeferredGemm``):
# redistributing the result to row shards on that axis then runs the fused GEMM + reduce-scatter.
_DEFERRABLE = (aten.mm.default, aten.addmm.default)


def _placements_or_none(spec):
    try:
        return placements_of(spec)
    except LayoutError:
        return None


def _written(args, kwargs, info: _OpInfo) -> list:
    """The written positional arguments other than an in-place op's self (lists flattened)."""
    out = []
    for i in info.written:
        if i < len(args):
            out.extend(args[i] if isinstance(args[i], (list, tuple)) else [args[i]])
    return out


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------

_PLANS: dict = {}
_STATS = {"hits": 0, "misses": 0, "uncached": 0, "fallbacks": 0}
_WARNED: set = set()
_NO_RULE = object()


def clear_caches() -> None:
    """Forget cached plans (rules are re-run on next use)."""
    _PLANS.clear()
    _FAST.clear()
    _ARG_SPECS.clear()


def cache_info() -> dict:
    """Counts of cached-plan hits and misses and of fallback runs (for tests and benchmarks)."""
    return dict(_STATS, size=len(_PLANS))


def fallback_ops() -> set:
    """Ops that ran through the gather fallback in this process (each warned once)."""
    return set(_WARNED)


# The fast path: calls whose DTensors are all top-level positional arguments and whose other
# arguments are plain scalars or lists of them (most calls). Its key is built without walking
# the schema; a hit goes straight to the cached plan's argument positions and output spec.
_FAST: dict = {}
_FAST_SCALARS = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.memory_format,
                           torch.layout, complex})
_DTensorClass = None
_POSITIONAL = False  # dtensor.WRAPPER_POSITIONAL, bound with _DTensorClass


def _fast_key(func, args):
    """(func, per argument: a DTensor's tag or a plain value's type and value), or None when
    not fast-path shaped."""
    key = [func]
    for a in args:
        t = type(a)
        if t is _DTensorClass:
            tag = a._tag
            # (spec, tag): re-derived when the spec changed (an in-place op may reduce a pending sum)
            key.append(tag[1] if tag is not None and tag[0] is a._spec else _tag_of(a))
        elif t in _FAST_SCALARS:
            key.append(t)
            key.append(a)
        elif t is list or t is tuple:
            if all(type(v) is int for v in a):  # dims and shapes: no per-element types needed
                key.append((t, tuple(a)))
            elif all(type(v) in _FAST_SCALARS for v in a):
                key.append((t, tuple((type(v), v) for v in a)))
            else:
                return None
        else:
            return None
    return tuple(key)


# Tags: one small int per (spec, dtype, global stride) of a DTensor, kept on the DTensor as
# ``_tag = (spec, int)``, so a cache key holds ints instead of hashing specs on every call.
_TAGS: dict = {}          # (spec, dtype, stride or None) -> tag
_NEXT_TAG = itertools.count(1)  # tags are never reused, even after _TAGS is cleared


def _tag_for(spec, dtype, stride) -> int:
    key = (spec, dtype, None if stride is None else tuple(stride))
    tag = _TAGS.get(key)
    if tag is None:
        if len(_TAGS) > 65536:  # tags in cached keys stay valid: only new DTensors get new tags
            _TAGS.clear()
        tag = _TAGS[key] = next(_NEXT_TAG)
    return tag


def _tag_of(dt) -> int:
    with _no_torch_function():
        stride = tuple(dt.stride())
    spec = dt._spec
    contiguous = _contiguous(spec.shape)
    tag = _tag_for(spec, dt._value.dtype, None if stride == contiguous else stride)
    dt._tag = (spec, tag)
    return tag


@functools.lru_cache(maxsize=4096)
def _contiguous(shape) -> tuple:
    return tuple(make_contiguous_strides_for(shape)) if shape else ()


_no_torch_function = torch._C.DisableTorchFunctionSubclass
_make_wrapper = torch.Tensor._make_wrapper_subclass
_grad_enabled = torch.is_grad_enabled
_DISABLED = torch._C._disabled_torch_function_impl
_STRIDED = torch.strided


def dispatch(func, args, kwargs):
    if _DEFERRED:
        _dt._flush_deferred()  # no op may run while a deferred product waits on its operands
    fast_key = None
    if not kwargs and _DTensorClass is not None:
        fast_key = _fast_key(func, args)
        if fast_key is not None:
            plan = _FAST.get(fast_key)
            if plan is not None:
                _STATS["hits"] += 1
                simple = plan.simple
                if simple is None:
                    return _run_fast(func, args, plan)
                # the op itself on the local tensors of DTensors that stay where they are
                positions, op, spec, local_shape, stride, unsqueeze, dtype, tag, defer = simple
                if defer and DEFER_GEMM != "never" and (DEFER_GEMM == "always" or args[positions[0]]._value.is_cuda):
                    return _run_fast(func, args, plan)  # the GEMM may wait (see _deferred)
                local_args = list(args)
                for i in positions:
                    d = args[i]
                    local_args[i] = d._value if d._pending is None else d._local
                value = op(*local_args)
                if unsqueeze:
                    value = value.unsqueeze(0)
                if value.shape != local_shape:
                    _wrong_shape(func, value, spec, local_shape, plan)
                if _POSITIONAL:
                    out = _make_wrapper(_DTensorClass, spec.shape, stride, None, None, value.dtype, _STRIDED,
                                        value.device)
                    out._value = value
                    out._spec = spec
                else:
                    out = _DTensorClass._wrap(value, spec, stride)
                if value.dtype is dtype:  # (always, unless the op's dtype rules changed since planning)
                    out._tag = tag  # the next op's key needs no stride() call
                if _grad_enabled():
                    for i in positions:
                        if args[i].__torch_function__ is _DISABLED:
                            # it will require grad: its calls skip ops/fastpath.py's handler too
                            out.__torch_function__ = _DISABLED
                            break
                return out
    kwargs = kwargs or {}
    info = _op_info(func)
    if info.foreach:
        return _dispatch_foreach(func, args, kwargs)
    if func in _FUSED_OPTIMIZERS:
        result = _dispatch_fused_optimizer(func, args, kwargs)
        if result is not _NO_RULE:
            return result
    if info.out_names:
        return _dispatch_out(func, args, kwargs, info)
    try:
        dts, mesh, key = _scan(func, args, kwargs)
    except _PlainTensorError as error:
        args, kwargs = _adopt_constants(func, args, kwargs, error)
        dts, mesh, key = _scan(func, args, kwargs)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _plan_call(func, args, kwargs, dts, mesh, info)
        if plan is None:
            plan = _NO_RULE
        if key is not None:
            _STATS["misses"] += 1
            if len(_PLANS) > 16384:
                _PLANS.clear()
            _PLANS[key] = plan
        else:
            _STATS["uncached"] += 1
    else:
        _STATS["hits"] += 1
    if plan is _NO_RULE:
        if _decomposable(func):
            # A composite op (linear, rms_norm, chunk, sdpa, ...) reaches us undecomposed under
            # inference_mode; its decomposition runs on ops that have rules.
            result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return _fallback(func, args, kwargs, dts, mesh, info)
    if fast_key is not None and plan.fast is not None:
        if len(_FAST) > 16384:
            _FAST.clear()
        _FAST[fast_key] = plan
    return _run(func, args, kwargs, dts, mesh, plan, info)


def _adopt_constants(func, args, kwargs, error: _PlainTensorError):
    """``args``/``kwargs`` with each plain tensor that holds one value, the same on every rank
    of the mesh, replaced by a replicated DTensor; else ``error`` is raised (on every rank).

    Autograd formulas make such constants next to DTensors: prod's backward concatenates
    ``torch.ones(1, 3)`` with slices of the input (``ones`` follows only dtype and device).
    Whether every rank holds the same value takes one small all-reduce over the mesh, which
    every rank joins (the arguments' structure is the same on every rank), so none waits.
    """
    DTensor = _dtensor_module().DTensor
    mesh, plain = None, []

    def visit(value):
        nonlocal mesh
        if isinstance(value, DTensor):
            mesh = mesh or value._spec.mesh
        elif isinstance(value, torch.Tensor):
            if value.dim() > 0:
                plain.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for value in list(args) + list(kwargs.values()):
        visit(value)
    if mesh is None or not plain:
        raise error
    # per tensor: (not constant here, its value, minus its value), reduced with MAX over the mesh
    facts = []
    for t in plain:
        first = t.reshape(-1)[0] if t.numel() else None
        constant = (first is not None and not t.requires_grad and not t.is_complex()
                    and bool((t == first).all()))
        v = float(first) if constant else 0.0
        facts += [0.0 if constant else 1.0, v, -v]
    agreed = torch.tensor(facts, dtype=torch.float64, device=mesh.device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=mesh.group(mesh.axis_names))
    for i in range(len(plain)):
        not_constant, high, minus_low = agreed[3 * i:3 * i + 3].tolist()
        if not_constant or high != -minus_low:
            raise DispatchError(f"{error} (a plain tensor is taken as replicated only when it holds one value, the "
                                f"same on every rank, like the ones an autograd formula makes)") from None
    adopted = {id(t): DTensor(t.to(mesh.device).contiguous(),
                              _spec_of(tuple(t.shape), mesh, (Replicate(),) * mesh.ndim)) for t in plain}

    def swap(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return adopted.get(id(value), value)
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


def _fast_form(args, kwargs, dts, info: _OpInfo, targets, structure: str, outputs, sharding):
    """``(positions, out)`` for the fast path, or None: each DTensor a top-level positional
    argument, one tensor output (or an in-place op), no kwargs."""
    global _DTensorClass, _POSITIONAL
    _DTensorClass = _dtensor_module().DTensor
    _POSITIONAL = _dt.WRAPPER_POSITIONAL
    if kwargs or info.foreach or info.out_names or info.written:
        return None
    positions = [i for i, a in enumerate(args) if isinstance(a, _DTensorClass)]
    if len(positions) != len(dts) or any(type(args[i]) is not _DTensorClass for i in positions):
        return None
    if not info.inplace and structure != "single":
        return None
    slots = tuple((i, t, t is None and bool(args[i]._spec.reduce_op)) for i, t in zip(positions, targets))
    if info.inplace:
        return slots, None, sharding.local, None, False, None, None
    out = outputs[0]
    return (slots, out, sharding.local, out.spec, bool(out.spec.reduce_op), torch.Size(out.local_shape),
            out.stride)


def _wrong_shape(func, value, spec, local_shape, plan):
    raise DispatchError(f"{func}: the local result has shape {tuple(value.shape)}, but the output layout "
                        f"{spec} gives this rank {tuple(local_shape)} (a wrong sharding rule: {plan.sharding})")


def _run_fast(func, args, plan: "_CallPlan"):
    slots, out, local, spec, unsqueeze, local_shape, stride = plan.fast
    local_args = list(args)
    for i, target, strip in slots:
        d = args[i]
        if target is None and d._pending is None:
            local_args[i] = d._value[0] if strip else d._value
        else:
            local_args[i] = _local_of(d, target)
    if plan.defer:
        deferred = _deferred(func, plan, local_args, {})
        if deferred is not None:
            return deferred
    value = local(plan.call, *local_args) if local is not None else func(*local_args)
    if out is None:  # in-place
        return args[0]
    if unsqueeze:
        value = value.unsqueeze(0)
    if value.shape != local_shape:
        raise DispatchError(f"{func}: the local result has shape {tuple(value.shape)}, but the output layout "
                            f"{spec} gives this rank {local_shape} (a wrong sharding rule: {plan.sharding})")
    return _DTensorClass._wrap(value, spec, stride)


def _local_of(dt, target):
    local = dt._local
    if target is None:
        return local[0] if dt._spec.reduce_op else local
    local = _dtensor_module().redistribute_local(local, dt._spec, target)
    return local[0] if target.reduce_op else local


def _run(func, args, kwargs, dts, mesh, plan: _CallPlan, info: _OpInfo):
    DTensor = _dtensor_module().DTensor
    if plan.reduce_self is not None:
        _reduce_in_place(func, args[0], plan.reduce_self)
    locals_ = {id(d): _local_of(d, t) for d, t in zip(dts, plan.targets)}
    local_args, local_kwargs = _replace_all(args, kwargs, lambda d: locals_[id(d)])
    if plan.defer:
        deferred = _deferred(func, plan, local_args, local_kwargs)
        if deferred is not None:
            return deferred
    if plan.sharding.local is not None:
        result = plan.sharding.local(plan.call, *local_args, **local_kwargs)
    else:
        result = func(*local_args, **local_kwargs)
    if info.inplace:
        return args[0]
    if plan.structure == "none":
        return result
    flat = [result] if plan.structure == "single" else list(result)
    wrapped = []
    for value, out in zip(flat, plan.outputs):
        if out.spec is None or value is None:  # None: an undefined optional output (CUDA flash attention's cum_seq)
            wrapped.append(value)
            continue
        if out.spec.reduce_op:
            value = value.unsqueeze(0)
        if tuple(value.shape) != out.local_shape:
            raise DispatchError(f"{func}: the local result has shape {tuple(value.shape)}, but the output layout "
                                f"{out.spec} gives this rank {out.local_shape} (a wrong sharding rule: "
                                f"{plan.sharding})")
        wrapped.append(DTensor(value, out.spec, stride=out.stride))
    if plan.structure == "single":
        return wrapped[0]
    return wrapped if plan.structure == "list" else tuple(wrapped)


# When mm/addmm with a pending-sum output defers its GEMM: "auto" only where the fused kernel
# can run (CUDA, bf16/fp16 operands: elsewhere deferring could only cost), "always" (tests of
# the deferral on CPU), "never".
DEFER_GEMM = "auto"
_HALF = (torch.bfloat16, torch.float16)


def _deferred(func, plan: _CallPlan, local_args, local_kwargs):
    """The pending-sum output of mm/addmm with its local GEMM deferred (see ``_DEFERRABLE``),
    or None when ``DEFER_GEMM`` says to run it now."""
    local, call = plan.sharding.local, plan.call
    if func is aten.mm.default:
        (a, b), bias, alpha, beta = local_args[:2], None, 1, 1
    else:
        bias, a, b = local_args[:3]
        beta, alpha = local_kwargs.get("beta", 1), local_kwargs.get("alpha", 1)
    if DEFER_GEMM != "always" and (DEFER_GEMM == "never" or not a.is_cuda or a.dtype not in _HALF):
        return None

    def compute():
        value = local(call, *local_args, **local_kwargs) if local is not None else func(*local_args, **local_kwargs)
        return value.unsqueeze(0)

    out = plan.outputs[0]
    return _dt._defer_gemm(compute, a, b, bias, alpha, beta, out.spec, out.local_shape, out.stride)


@functools.lru_cache(maxsize=None)
def _decomposable(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _warn_fallback(func) -> None:
    if func not in _WARNED:
        _WARNED.add(func)
        warnings.warn(f"axedist: no sharding rule for {func}; it runs by gathering every DTensor argument to "
                      f"Replicate and replicating the result (correct, but moves whole tensors)",
                      stacklevel=4)


def _fallback(func, args, kwargs, dts, mesh, info: _OpInfo):
    """Gather every DTensor, run the op on the whole tensors, lay the result out replicated."""
    dtm = _dtensor_module()
    _warn_fallback(func)
    _STATS["fallbacks"] += 1
    full = {}
    for d in dts:
        if id(d) not in full:
            replicated = make_spec(mesh, replicated_layout(d.shape, mesh), d.shape)
            full[id(d)] = (d, replicated, dtm.redistribute_local(d._local, d._spec, replicated))
    local_args, local_kwargs = _replace_all(args, kwargs, lambda d: full[id(d)][2])
    result = func(*local_args, **local_kwargs)
    # written arguments: lay the whole result back out in their own layout
    first = args[0] if info.inplace else []
    written = (list(first) if isinstance(first, (list, tuple)) else [first]) + _written(args, kwargs, info)
    for target in written:
        if isinstance(target, dtm.DTensor):
            d, replicated, value = full[id(target)]
            d._local.copy_(_laid_out(func, value, replicated, d._spec))
    if not func._schema.returns:  # torch wants None from an op that returns nothing (_fused_adamw_)
        return None
    if info.inplace:
        return args[0]

    def wrap(value):
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.numel() > 0:
                spec = make_spec(mesh, replicated_layout(value.shape, mesh), value.shape) \
                    if value.numel() > 0 else None
                if spec is not None:
                    return dtm.DTensor(value, spec, stride=tuple(value.stride()) if value.is_contiguous() else None)
            raise DispatchError(f"{func} (run through the gather fallback) returned an empty tensor of shape "
                                f"{tuple(value.shape)}; axedist DTensors need every dim >= 1")
        if isinstance(value, (list, tuple)):
            return type(value)(wrap(v) for v in value)
        return value

    return wrap(result)


def _laid_out(func, value, replicated, spec) -> torch.Tensor:
    """This rank's local tensor of the whole ``value`` (given ``replicated``) in ``spec``.

    A pending ``spec`` (a written argument that was a partial sum) gets a valid set of
    summands of ``value``: for a sum, ``value`` on the rank at coordinate 0 of the partial
    axes and 0 on the others; for avg/max/min, ``value`` on every rank.
    """
    dtm = _dtensor_module()
    if not spec.reduce_op:
        return dtm.redistribute_local(value, replicated, spec)
    placements = _placements_or_none(spec)
    if placements is None:
        raise DispatchError(f"{func} (run through the gather fallback) writes an argument pending a "
                            f"{spec.reduce_op} in a layout with no placement form ({spec}); redistribute it first")
    whole = _spec_of(spec.shape, spec.mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in placements))
    local = dtm.redistribute_local(value, replicated, whole)
    if spec.reduce_op == "sum":
        here = spec.mesh.coordinates()
        if any(here[a] != 0 for a, p in zip(spec.mesh.axis_names, placements) if isinstance(p, Partial)):
            local = torch.zeros_like(local)
    return local.unsqueeze(0)


# Fused optimizer steps (``torch.optim.AdamW(fused=True)``, ``SGD(fused=True)``): one call over
# lists of parameters, gradients and states.
_FUSED_OPTIMIZERS = tuple(getattr(getattr(aten, name), overload) for name in ("_fused_adam_", "_fused_adamw_",
                                                                             "_fused_sgd_")
                          if hasattr(aten, name) for overload in getattr(aten, name).overloads())


def _dispatch_fused_optimizer(func, args, kwargs):
    """A fused optimizer step on DTensor parameters, or ``_NO_RULE`` (then the fallback runs).

    Element ``i`` of every list lives where parameter ``i`` does (its states were made by
    ``zeros_like(param)``); the gradient, which the step only reads (no ``grad_scale``), is
    moved there (a pending sum reduced or reduce-scattered), and the op runs once on all the
    local tensors: AdamW on a ``[Shard(0)]`` weight with a ``[Partial()]`` gradient updates
    each rank's rows with its rows of the summed gradient.
    """
    DTensor = _dtensor_module().DTensor
    if kwargs.get("grad_scale") is not None or kwargs.get("found_inf") is not None:
        return _NO_RULE  # the step would write the unscaled gradients back
    params = args[0]
    if not all(isinstance(p, DTensor) and not p._spec.reduce_op for p in params):
        return _NO_RULE
    mesh = params[0]._spec.mesh if params else None
    local_args = [[p._local for p in params]]
    for k, values in enumerate(args[1:], start=1):
        if not isinstance(values, (list, tuple)):
            local_args.append(values)
            continue
        locals_ = []
        for i, t in enumerate(values):
            if not isinstance(t, DTensor):
                locals_.append(t)  # plain 0-dim step counters
            elif t._spec.mesh != mesh:
                return _NO_RULE
            elif t._spec == params[i]._spec:
                locals_.append(t._local)
            elif k == 1:
                locals_.append(_dtensor_module().redistribute_local(t._local, t._spec, params[i]._spec))
            else:
                return _NO_RULE  # a state in another layout than its parameter: written, so not moved
        local_args.append(locals_)
    local_kwargs = {k: (v._local if isinstance(v, DTensor) and v._spec.mesh == mesh and
                        all(isinstance(p, Replicate) for p in (_placements_or_none(v._spec) or [None])) else v)
                    for k, v in kwargs.items()}
    if any(isinstance(v, DTensor) for v in local_kwargs.values()):
        return _NO_RULE
    func(*local_args, **local_kwargs)
    return None


def _dispatch_out(func, args, kwargs, info: _OpInfo):
    """``op(..., out=o)``: the functional op, then the result copied into ``o`` in ``o``'s layout."""
    dtm = _dtensor_module()
    functional = _functional_of(func)
    if functional is None:
        dts, mesh, _ = _scan(func, args, kwargs)
        return _fallback(func, args, kwargs, dts, mesh, info)
    outs = [kwargs[name] for name in info.out_names]
    rest = {k: v for k, v in kwargs.items() if k not in info.out_names}
    result = dispatch(functional, args, rest)
    results = [result] if len(outs) == 1 else list(result)
    for o, r in zip(outs, results):
        if not isinstance(o, dtm.DTensor):
            raise DispatchError(f"{func}: out= is a plain tensor but the result is a DTensor; pass a DTensor")
        if tuple(o.shape) != tuple(r.shape):
            raise DispatchError(f"{func}: out= has shape {tuple(o.shape)}, the result {tuple(r.shape)} "
                                f"(axedist does not resize DTensors)")
        if not isinstance(r, dtm.DTensor):
            raise DispatchError(f"{func}: the result is not a DTensor")
        value = r._local if r._spec == o._spec else dtm.redistribute_local(r._local, r._spec, o._spec)
        o._local.copy_(value)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _dispatch_foreach(func, args, kwargs):
    """``_foreach_op(list, ...)``: the same op once per list element (lists of one),
    so each element follows its own sharding rule."""
    schema = func._schema.arguments
    is_list = [isinstance(v, (list, tuple)) and isinstance(a.type, torch.ListType) for v, a in zip(args, schema)]
    lengths = {len(v) for v, lst in zip(args, is_list) if lst}
    lengths |= {len(v) for v in kwargs.values() if isinstance(v, (list, tuple))}
    if len(lengths) != 1:
        raise DispatchError(f"{func}: list arguments of different lengths {sorted(lengths)}")
    (n,) = lengths
    DTensor = _dtensor_module().DTensor
    results = []
    for i in range(n):
        # element i of every list argument, as a list of one (the op still takes lists)
        one_args = tuple([v[i]] if lst else v for v, lst in zip(args, is_list))
        one_kwargs = {k: ([v[i]] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}
        if any(isinstance(x, DTensor) for v in one_args for x in (v if isinstance(v, list) else [v])):
            results.append(_dispatch_single_foreach(func, one_args, one_kwargs))
        else:
            results.append(func(*one_args, **one_kwargs))
    returns = func._schema.returns
    if returns and isinstance(returns[0].type, torch.ListType):
        return [r[0] for r in results]
    return None


def _dispatch_single_foreach(func, args, kwargs):
    dts, mesh, key = _scan(func, args, kwargs)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _plan_call(func, args, kwargs, dts, mesh, _FOREACH_INFO) or _NO_RULE
        if key is not None:
            _PLANS[key] = plan
    if plan is _NO_RULE:
        return _fallback(func, args, kwargs, dts, mesh, _FOREACH_WRITE if _writes_first(func) else _FOREACH_INFO)
    if _writes_first(func):
        for d, t in zip(dts, plan.targets):
            if d is args[0][0] and t is not None:
                raise DispatchError(f"{func} is in-place on {d._spec}, but its rule needs it moved; an in-place op "
                                    f"cannot change its tensor's layout")
    return _run(func, args, kwargs, dts, mesh, plan, _FOREACH_INFO)


_FOREACH_INFO = _OpInfo(False, (), (), True)
_FOREACH_WRITE = _OpInfo(False, (), (0,), True)


@functools.lru_cache(maxsize=None)
def _writes_first(func) -> bool:
    a = func._schema.arguments[0]
    return a.alias_info is not None and a.alias_info.is_write
