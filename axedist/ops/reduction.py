"""Sharding rules of reductions: sum, mean, amax/amin, max/min, argmax/argmin, prod,
var/std, linalg_vector_norm, logsumexp, any/all (the scans cumsum/cumprod: ``along_dim.py``).

A reduction over dims that no mesh axis shards runs locally and keeps the other dims'
sharding. Over a sharded dim, each rank reduces its piece and the pieces combine:

- ``sum``: the local sums are a pending sum, ``Partial("sum")``, with no communication.
  4 ranks, ``x`` (8, 6) in ``[Shard(0)]``: ``x.sum(0)`` is (6,) ``[Partial("sum")]``, each
  rank holding the sum of its 2 rows.
- ``mean``: a pending sum of local sums divided by the *global* count (exact for uneven
  shards: 10 rows on 4 ranks are 3+3+3+1, and each rank divides by 10).
- ``amax``/``amin``/``max``/``min`` (no indices): ``Partial("max")``/``Partial("min")``;
  a rank whose piece is empty contributes the identity (-inf / +inf).
- ``linalg_vector_norm``: ord 1 and 0 are pending sums, ord +-inf pending max/min; any
  other p sums ``|x|^p`` locally, all-reduces, then takes the root.
- ``max.dim``/``argmax`` (indices), ``prod``, ``var``/``std``, ``logsumexp``, ``any``/``all``:
  a local function combines the pieces with all-reduces over the mesh axes that shard
  the reduced dims; the result is replicated over those axes.

A pending reduction of the input stays pending where the reduction commutes with it
(a sum of partial sums, a max of partial maxes); otherwise it is applied first.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate

from ..runtime.carriers import all_reduce_
from .registry import ArgSpec, OpCall, Sharding, register
from .shard_ranges import Held, held_under
from .specs import dim_dealt, pending_in_place, reduced_in_place
from .tensor_ops import is_plain_shard, moved, placements_of, shard_dim, without_partial

aten = torch.ops.aten

# Which pending reductions of the input each kind of reduction keeps: the reduction must
# commute with it (sum and mean are linear; a max of maxes is a max).
_KEEPS = {"sum": ("sum", "avg"), "max": ("max",), "min": ("min",)}


def reduced_dims(ndim: int, dim, *, empty_means_all: bool = True) -> list[int]:
    """``dim`` as a sorted list of non-negative dims (None, and ``[]`` where torch says so: all)."""
    if dim is None or (isinstance(dim, (list, tuple)) and not dim and empty_means_all):
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(ndim, 1) for d in dims}) if ndim else []


def _out_dim(dims: list[int], keepdim: bool):
    """Where an input dim lands in the output (None: reduced away)."""
    def new_dim(e):
        if e in dims:
            return None
        return e if keepdim else e - sum(1 for d in dims if d < e)
    return new_dim


class _Plan:
    """How a reduction of ``x`` over ``dims`` is laid out: ``target`` (x's placements for the
    op), ``out`` (the result's), ``comm_axes`` (axes whose pieces a local function combines)."""

    def __init__(self, x: ArgSpec, dims: list[int], keepdim: bool, pending: str | None, *,
                 keeps: tuple[str, ...] | None = None, exact_shards: bool = False):
        """``pending``: the Partial op that combines local results over a sharded reduced dim
        (None: a local function all-reduces them). ``keeps``: the input's pending reductions
        that may stay pending (default: those the reduction commutes with). ``exact_shards``:
        the local function needs plain ``Shard`` pieces (it computes global indices).

        A layout with no placement form whose reduced dims are its whole, innermost local ones
        (``specs.reduced_in_place``) is reduced where it is: ``target`` None (taken as it is),
        ``out`` the layout of the rest, nothing to combine. Where it deals one reduced dim and
        nothing else (``specs.dim_dealt``) it is taken as it is too: a pending op over the dealing
        axes, or (``pending`` None, no ``exact_shards``) the local function combining over them,
        the result whole on every device."""
        kept = reduced_in_place(x, dims) if dims else None
        if kept is not None:
            self.target, self.out, self.comm_axes, self.sharded = None, kept, [], False
            return
        # ... and over all its dims, where the pieces combine by a pending op: each reduces its own
        whole = pending_in_place(x, pending) if pending and x.ndim and dims == list(range(x.ndim)) else None
        if whole is None and pending and x.placements is None:
            whole = _pending_over_dealt(x, dims, pending)
        if whole is not None:
            self.target, self.out, self.comm_axes, self.sharded = None, whole, [], True
            return
        dealing = _dealing_axes(x, dims) if pending is None and not exact_shards and x.placements is None else None
        if dealing:
            self.target, self.out, self.comm_axes = None, (Replicate(),) * x.mesh.ndim, list(dealing)
            self.sharded = True
            return
        places = placements_of(x)
        keeps = _KEEPS.get(pending, ()) if keeps is None else keeps
        reduces_sharded = any(shard_dim(p, x.ndim) in dims for p in places)
        target = []
        for p in places:
            # one pending op per tensor: a kept input reduction must be the output's own
            if isinstance(p, Partial) and (p.reduce_op not in keeps or (reduces_sharded and p.reduce_op != pending)):
                p = Replicate()
            if exact_shards and shard_dim(p, x.ndim) in dims and not is_plain_shard(p):
                p = Replicate()
            target.append(p)
        new_dim = _out_dim(dims, keepdim)
        out, comm = [], []
        for axis, p in zip(x.mesh.axis_names, target):
            d = shard_dim(p, x.ndim)
            if d is None:
                out.append(p)
            elif d in dims:
                if pending is None:
                    out.append(Replicate())
                    comm.append(axis)
                else:
                    out.append(Partial(pending))
            else:
                out.append(moved(p, new_dim(d)))
        self.target, self.out, self.comm_axes = tuple(target), tuple(out), comm
        self.sharded = reduces_sharded and any(shard_dim(p, x.ndim) in dims for p in target)


def _dealing_axes(x: ArgSpec, dims: list[int]) -> tuple[str, ...] | None:
    """The axes that deal one of ``dims``, the only dim ``x``'s layout deals (``specs.dim_dealt``),
    or None: ``x.var(0)`` of rows dealt round-robin, each device's sums over its own rows then
    combined over those axes, where placements gathered the rows."""
    for d in dims:
        axes = dim_dealt(x, d)
        if axes:
            return axes
    return None


def _pending_over_dealt(x: ArgSpec, dims: list[int], pending: str) -> tuple | None:
    """The placements of a reduction over ``dims`` of ``x`` (a layout with no placement form)
    where one of them is the only dim the layout deals, every other dim whole and local in each
    piece (``specs.dim_dealt``): each device reduces its own, ``Partial(pending)`` over the
    dealing axes. ``grad.sum(0)`` of rows dealt round-robin (a bias's gradient): each device sums
    its rows, a pending sum, where placements gathered the rows. None otherwise."""
    axes = _dealing_axes(x, dims)
    if axes is None:
        return None
    return tuple(Partial(pending) if a in axes else Replicate() for a in x.mesh.axis_names)


def _identity(kind: str, dtype: torch.dtype):
    """The value an empty piece contributes to a max (-inf) or min (+inf)."""
    if dtype.is_floating_point:
        return float("-inf") if kind == "max" else float("inf")
    if dtype == torch.bool:
        return kind != "max"
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def _reduced_shape(shape, dims, keepdim):
    return tuple(1 if d in dims else s for d, s in enumerate(shape) if keepdim or d not in dims)


def _group(call: OpCall, axes):
    return call.mesh.group(axes)


# ---------------------------------------------------------------------------
# sum, mean
# ---------------------------------------------------------------------------


def _whole_or_dims(call: OpCall, x, whole_overload) -> tuple:
    """(dims, keepdim, dtype) of ``op(x, dtype=)`` (the whole tensor) or ``op(x, dim, keepdim, dtype=)``."""
    if call.func is whole_overload:
        return reduced_dims(x.ndim, None), False, call.arg(1, "dtype")
    return reduced_dims(x.ndim, call.arg(1, "dim")), call.arg(2, "keepdim", False), call.arg(3, "dtype")


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_rule(call: OpCall) -> Sharding:
    """``x.sum(0)`` of ``[Shard(0)]`` -> ``[Partial("sum")]``; ``x.sum(1)`` -> ``[Shard(0)]``."""
    x = call.args[0]
    dims, keepdim, _ = _whole_or_dims(call, x, aten.sum.default)
    plan = _Plan(x, dims, keepdim, "sum")
    return Sharding(inputs=[plan.target], outputs=plan.out)


@register(aten.nansum.default)
def nansum_rule(call: OpCall) -> Sharding:
    """``x.nansum(0)`` of ``[Shard(0)]`` -> ``[Partial("sum")]``, as ``sum``; a pending sum of the
    input is applied first (a NaN in one summand is a NaN of the value, which nansum skips whole)."""
    x = call.args[0]
    dims, keepdim = reduced_dims(x.ndim, call.arg(1, "dim")), call.arg(2, "keepdim", False)
    plan = _Plan(x, dims, keepdim, "sum", keeps=())
    return Sharding(inputs=[plan.target], outputs=plan.out)


@register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero_rule(call: OpCall) -> Sharding:
    """``x.count_nonzero(0)`` of ``[Shard(0)]``: each rank counts its rows, ``[Partial("sum")]``;
    a pending input applied first (summands' zeros are not the value's)."""
    x = call.args[0]
    plan = _Plan(x, reduced_dims(x.ndim, call.arg(1, "dim")), False, "sum", keeps=())
    return Sharding(inputs=[plan.target], outputs=plan.out)


@register(aten.mean.default, aten.mean.dim)
def mean_rule(call: OpCall) -> Sharding:
    """``x.mean(0)`` of (10, 6) ``[Shard(0)]`` on 4 ranks: local sums / 10, ``[Partial("sum")]``."""
    x = call.args[0]
    dims, keepdim, dtype = _whole_or_dims(call, x, aten.mean.default)
    plan = _Plan(x, dims, keepdim, "sum")
    if not plan.sharded:
        return Sharding(inputs=[plan.target], outputs=plan.out)
    count = math.prod(x.shape[d] for d in dims)

    def local(call_, t, *args, **kwargs):
        out_dtype = dtype or t.dtype
        # low-precision inputs accumulate in float32, like torch's mean
        acc = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
        return (torch.sum(t, dims, keepdim=keepdim, dtype=acc) / count).to(out_dtype)

    return Sharding(inputs=[plan.target], outputs=plan.out, local=local)


# ---------------------------------------------------------------------------
# amax/amin, max/min (values only)
# ---------------------------------------------------------------------------


def _extreme_rule(call: OpCall, kind: str, dims: list[int], keepdim: bool, fn) -> Sharding:
    x = call.args[0]
    plan = _Plan(x, dims, keepdim, kind)
    if not plan.sharded:
        return Sharding(inputs=[plan.target], outputs=plan.out)

    def local(call_, t, *args, **kwargs):
        if t.numel() == 0:  # an empty piece of an uneven shard: the identity of max/min
            return torch.full(_reduced_shape(t.shape, dims, keepdim), _identity(kind, t.dtype), dtype=t.dtype,
                              device=t.device)
        return fn(t)

    return Sharding(inputs=[plan.target], outputs=plan.out, local=local)


@register(aten.amax.default, aten.amin.default)
def amax_rule(call: OpCall) -> Sharding:
    """``x.amax(1)`` of ``[Shard(1)]`` -> ``[Partial("max")]`` (no communication)."""
    x = call.args[0]
    kind = "max" if call.func is aten.amax.default else "min"
    dims = reduced_dims(x.ndim, call.arg(1, "dim", []))
    keepdim = call.arg(2, "keepdim", False)
    fn = torch.amax if kind == "max" else torch.amin
    return _extreme_rule(call, kind, dims, keepdim, lambda t: fn(t, dims, keepdim))


@register(aten.max.default, aten.min.default)
def max_all_rule(call: OpCall) -> Sharding:
    """``x.max()``: the maximum of all elements, ``[Partial("max")]`` where ``x`` is sharded."""
    x = call.args[0]
    kind = "max" if call.func is aten.max.default else "min"
    fn = torch.amax if kind == "max" else torch.amin
    return _extreme_rule(call, kind, list(range(x.ndim)), False, lambda t: fn(t, list(range(t.dim()))))


# ---------------------------------------------------------------------------
# max.dim/min.dim, argmax/argmin: values with indices
# ---------------------------------------------------------------------------


def _global_arg_extreme(call: OpCall, t: torch.Tensor, d: int, kind: str, held: Held, axes):
    """The first global index of the max (min) along ``d`` and its value, with ``t`` this rank's
    piece (its indices along ``d``: ``held``): local max and index, all-reduce the values, then
    the smallest global index among the pieces that hold the winner (NaN wins, as in torch)."""
    group = _group(call, axes)
    if t.shape[d] == 0:
        shape = list(t.shape)
        shape[d] = 1
        value = torch.full(shape, _identity(kind, t.dtype), dtype=t.dtype, device=t.device)
        index = torch.zeros(shape, dtype=torch.int64, device=t.device)
    else:
        value, index = (torch.max if kind == "max" else torch.min)(t, d, keepdim=True)
    best = value.clone()
    all_reduce_(best, kind, group=group)
    holds = value == best
    if t.dtype.is_floating_point or t.dtype.is_complex:
        nan_here = torch.isnan(value)
        any_nan = nan_here.to(torch.uint8)
        all_reduce_(any_nan, "max", group=group)
        any_nan = any_nan.bool()
        best = torch.where(any_nan, torch.full_like(best, float("nan")), best)
        holds = torch.where(any_nan, nan_here, holds)
    if t.shape[d] == 0:
        holds = torch.zeros_like(holds)
    never = torch.iinfo(torch.int64).max
    candidate = torch.where(holds, held.global_of(index), torch.full_like(index, never))
    all_reduce_(candidate, "min", group=group)
    return best, candidate


@register(aten.max.dim, aten.min.dim)
def max_dim_rule(call: OpCall) -> Sharding:
    """``x.max(1)`` of (4, 10) ``[Shard(1)]``: values and global indices, ``[Replicate()]``
    (two small all-reduces of the (4,) results instead of gathering ``x``)."""
    x, dim = call.args[0], call.args[1]
    keepdim = call.arg(2, "keepdim", False)
    kind = "max" if call.func is aten.max.dim else "min"
    d = dim % max(x.ndim, 1)
    plan = _Plan(x, [d] if x.ndim else [], keepdim, None, exact_shards=True)
    if not plan.comm_axes:
        return Sharding(inputs=[plan.target], outputs=(plan.out, plan.out))
    target, axes = plan.target, plan.comm_axes
    held = held_under(x.shape, call.mesh, target, d)

    def local(call_, t, *args, **kwargs):
        value, index = _global_arg_extreme(call_, t, d, kind, held, axes)
        return (value, index) if keepdim else (value.squeeze(d), index.squeeze(d))

    return Sharding(inputs=[target], outputs=(plan.out, plan.out), local=local)


@register(aten.argmax.default, aten.argmin.default)
def argmax_rule(call: OpCall) -> Sharding:
    """``x.argmax(1)`` of ``[Shard(1)]``: global indices, replicated over the shard axes.
    ``x.argmax()`` (flattened) gathers a sharded ``x`` first."""
    x = call.args[0]
    dim, keepdim = call.arg(1, "dim"), call.arg(2, "keepdim", False)
    kind = "max" if call.func is aten.argmax.default else "min"
    if dim is None or x.ndim == 0:
        target = tuple(Replicate() for _ in placements_of(x))
        return Sharding(inputs=[target], outputs=target)
    d = dim % x.ndim
    plan = _Plan(x, [d], keepdim, None, exact_shards=True)
    if not plan.comm_axes:
        return Sharding(inputs=[plan.target], outputs=plan.out)
    target, axes = plan.target, plan.comm_axes
    held = held_under(x.shape, call.mesh, target, d)

    def local(call_, t, *args, **kwargs):
        _, index = _global_arg_extreme(call_, t, d, kind, held, axes)
        return index if keepdim else index.squeeze(d)

    return Sharding(inputs=[target], outputs=plan.out, local=local)


# ---------------------------------------------------------------------------
# prod, any/all, var/std, logsumexp, linalg_vector_norm: local pieces combined by all-reduce
# ---------------------------------------------------------------------------


def _all_reduce(value: torch.Tensor, op, group) -> torch.Tensor:
    if value.dtype == torch.bool:  # collectives do not take bool: reduce as bytes
        as_bytes = value.to(torch.uint8)
        all_reduce_(as_bytes, op, group=group)
        return as_bytes.bool()
    all_reduce_(value, op, group=group)
    return value


def _combined_rule(call: OpCall, x: ArgSpec, dims, keepdim, compute) -> Sharding:
    """A reduction whose pieces combine in ``compute(t, group)`` (group None: nothing to combine)."""
    plan = _Plan(x, dims, keepdim, None)
    target = plan.target
    axes = plan.comm_axes

    def local(call_, t, *args, **kwargs):
        return compute(t, _group(call_, axes) if axes else None)

    return Sharding(inputs=[target], outputs=plan.out, local=local if axes else None)


@register(aten.prod.default, aten.prod.dim_int)
def prod_rule(call: OpCall) -> Sharding:
    """``x.prod(0)`` of ``[Shard(0)]``: local products, one all-reduce (PRODUCT); ``[Replicate()]``."""
    x = call.args[0]
    dims, keepdim, dtype = _whole_or_dims(call, x, aten.prod.default)

    def compute(t, group):
        value = t.to(dtype) if dtype is not None else t
        if t.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32) and dtype is None:
            value = t.to(torch.int64)  # torch's prod promotes integers to int64
        for d in sorted(dims, reverse=True):
            value = value.prod(d, keepdim=keepdim)
        return _all_reduce(value, "product", group) if group is not None else value

    return _combined_rule(call, x, dims, keepdim, compute)


@register(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def any_all_rule(call: OpCall) -> Sharding:
    """``m.any(1)`` of ``[Shard(1)]``: local any, all-reduced (max of bytes); ``[Replicate()]``."""
    x = call.args[0]
    packet = call.func._overloadpacket
    kind = "any" if packet is aten.any else "all"
    if call.func in (aten.any.default, aten.all.default):
        dims, keepdim = list(range(x.ndim)), False
    else:
        dims = reduced_dims(x.ndim, call.arg(1, "dim"), empty_means_all=False)
        keepdim = call.arg(2, "keepdim", False)

    def compute(t, group):
        value = t.bool()
        for d in sorted(dims, reverse=True):
            value = (value.any if kind == "any" else value.all)(d, keepdim=keepdim)
        if group is None:
            return value
        return _all_reduce(value, "max" if kind == "any" else "min", group)

    if not dims:
        places = without_partial(placements_of(x))
        return Sharding(inputs=[places], outputs=places)
    return _combined_rule(call, x, dims, keepdim, compute)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` sums in: float32 for float16/bfloat16, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register(aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction)
def var_rule(call: OpCall) -> Sharding:
    """``x.var(0)`` of (10, 6) ``[Shard(0)]``: all-reduce the local sums (global mean), then the
    local squared deviations from it; divide by ``10 - correction``. ``[Replicate()]``."""
    x = call.args[0]
    name = call.func._overloadpacket.__name__
    dims = reduced_dims(x.ndim, call.arg(1, "dim"))
    correction = call.kwargs.get("correction")
    correction = 1 if correction is None else correction
    keepdim = call.kwargs.get("keepdim", False)
    count = math.prod(x.shape[d] for d in dims)
    is_std, with_mean = name.startswith("std"), name.endswith("_mean")

    plan = _Plan(x, dims, keepdim, None)
    target = plan.target
    axes = plan.comm_axes
    out = (plan.out, plan.out) if with_mean else plan.out
    if not axes:
        return Sharding(inputs=[target], outputs=out)

    def local(call_, t, *args, **kwargs):
        group = _group(call_, axes)
        real = t.real.dtype if t.is_complex() else t.dtype
        work = t.to(accumulation_dtype(t.dtype))
        total = work.sum(dims, keepdim=True)
        all_reduce_(total, group=group)
        mean = total / count
        squares = (work - mean).abs().pow(2).sum(dims, keepdim=True)
        all_reduce_(squares, group=group)
        value = squares / max(count - correction, 0)
        if is_std:
            value = value.sqrt()
        if not keepdim:
            value, mean = value.squeeze(dims) if dims else value, mean.squeeze(dims) if dims else mean
        value, mean = value.to(real), mean.to(t.dtype)
        return (value, mean) if with_mean else value

    return Sharding(inputs=[target], outputs=out, local=local)


@register(aten.logsumexp.default)
def logsumexp_rule(call: OpCall) -> Sharding:
    """``x.logsumexp(1)`` of ``[Shard(1)]``: all-reduce the local max, then the sums of
    ``exp(x - max)``; ``[Replicate()]``."""
    x, dim = call.args[0], call.args[1]
    keepdim = call.arg(2, "keepdim", False)
    dims = reduced_dims(x.ndim, dim)

    def compute(t, group):
        if group is None:
            return torch.logsumexp(t, dims, keepdim=keepdim)
        work = t.to(accumulation_dtype(t.dtype)) if t.is_floating_point() else t.double()
        if work.numel():
            top = work.amax(dims, keepdim=True)
        else:
            top = torch.full(_reduced_shape(t.shape, dims, True), float("-inf"), dtype=work.dtype,
                             device=t.device)
        all_reduce_(top, "max", group=group)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # all -inf (or an inf): no shift
        total = (work - top).exp().sum(dims, keepdim=True)
        all_reduce_(total, group=group)
        value = top + total.log()
        if not keepdim and dims:
            value = value.squeeze(dims)
        return value.to(t.dtype if t.is_floating_point() else torch.get_default_dtype())

    return _combined_rule(call, x, dims, keepdim, compute)


@register(aten.linalg_vector_norm.default)
def vector_norm_rule(call: OpCall) -> Sharding:
    """``torch.linalg.vector_norm(x, p, dim)`` over a sharded dim.

    ord 1 -> pending sum of local ``sum |x|``; ord 0 -> pending sum of counts; ord +-inf ->
    pending max/min of ``|x|``; any other p: local ``sum |x|^p``, all-reduced, then ``^(1/p)``,
    replicated. (10,) ``[Shard(0)]`` on 4 ranks, p = 2: each rank sums 3, 3, 3, 1 squares.
    """
    x = call.args[0]
    ord_ = float(call.arg(1, "ord", 2))
    dims = reduced_dims(x.ndim, call.arg(2, "dim"))
    keepdim = call.arg(3, "keepdim", False)
    dtype = call.kwargs.get("dtype")
    pending = {1.0: "sum", 0.0: "sum", math.inf: "max", -math.inf: "min"}.get(ord_)
    plan = _Plan(x, dims, keepdim, pending, keeps=())  # |a + b| != |a| + |b|: reduce inputs first
    target = plan.target
    if not plan.sharded:
        return Sharding(inputs=[target], outputs=plan.out)
    axes = plan.comm_axes

    def local(call_, t, *args, **kwargs):
        work = t.to(dtype) if dtype is not None else t
        magnitude = work.abs()
        real = magnitude.dtype
        if ord_ in (math.inf, -math.inf):
            if magnitude.numel() == 0:
                # |x| >= 0, so an empty piece contributes 0 to a max and +inf to a min
                return torch.full(_reduced_shape(t.shape, dims, keepdim), 0.0 if ord_ > 0 else math.inf,
                                  dtype=real, device=t.device)
            return (magnitude.amax if ord_ > 0 else magnitude.amin)(dims, keepdim=keepdim)
        if ord_ == 0:
            return (magnitude != 0).to(real).sum(dims, keepdim=keepdim)
        if ord_ == 1:
            return magnitude.sum(dims, keepdim=keepdim)
        acc = accumulation_dtype(real)
        total = magnitude.to(acc).pow(ord_).sum(dims, keepdim=keepdim)
        all_reduce_(total, group=_group(call_, axes))
        return total.pow(1.0 / ord_).to(real)

    return Sharding(inputs=[target], outputs=plan.out, local=local)


@register(aten.norm.ScalarOpt_dim)
def norm_rule(call: OpCall) -> Sharding:
    """``torch.norm(x, p, dim, keepdim)``: ``linalg_vector_norm``'s rule (``p`` None is 2)."""
    x, p = call.args[0], call.arg(1, "p")
    dim, keepdim = call.arg(2, "dim"), call.arg(3, "keepdim", False)
    vector = OpCall(aten.linalg_vector_norm.default, (x, 2 if p is None else p, dim, keepdim), {}, call.mesh)
    return vector_norm_rule(vector)


__all__ = ["reduced_dims", "accumulation_dtype"]
