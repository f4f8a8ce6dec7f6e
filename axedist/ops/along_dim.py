"""Sharding rules of ops that work along one dim, each position of the other dims on its own:
scans (``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax``, ``cummin``), sorts and selections
(``sort``, ``topk``, ``kthvalue``, ``median`` / ``nanmedian`` / ``mode`` over a dim), ``renorm``,
the FFTs (over a list of dims), ``constant_pad_nd`` (over the dims it pads), ``glu``, ``unfold``,
``linalg_cross`` (over its dim, two operands alike) and ``rot90`` (over its two dims).
(``tril`` / ``triu`` are ``batched.py``'s: their last 2 dims whole, the batch dims keep their shards.)

The op's dim must be whole on each device; every other dim keeps its shards, so no whole
tensor moves when the op's dim is not the sharded one. 4 ranks, ``x`` (8, 10) in
``[Shard(0)]``: ``x.topk(3, dim=1)`` runs on each rank's (2, 10) rows and gives values and
indices (8, 3) in ``[Shard(0)]``; ``x.topk(3, dim=0)`` first gathers dim 0.

A pending reduction is applied first (none of these is linear), except by ``cumsum`` and the
FFTs (linear: a pending sum or mean stays pending).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial

from .registry import LINEAR_REDUCE_OPS, ArgSpec, OpCall, Sharding, register
from .shard_ranges import without_partial
from ..layout import with_inner_dims
from .specs import local_shape_of, reduced_in_place
from .tensor_ops import joint_placements, placements_of, renumber, rows_in_place, unshard

aten = torch.ops.aten

# op -> does it keep a pending sum (linear in its input)?
_SAME_SHAPE = {aten.cumsum.default: True, aten.cumprod.default: False, aten.logcumsumexp.default: False,
               aten._logcumsumexp.default: False, aten.cummax.default: False, aten.cummin.default: False,
               aten.sort.default: False, aten.sort.stable: False}
_REDUCING = (aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default)


def _dim_of(call: OpCall) -> int:
    """The op's dim, as a non-negative index (a 0-dim input's dims 0 / -1 are its only one)."""
    func, x = call.func, call.args[0]
    if func is aten.sort.stable:
        dim = call.kwargs.get("dim", -1)
    elif func in (aten.topk.default, aten.kthvalue.default):
        dim = call.arg(2, "dim", -1)
    elif func is aten.renorm.default:
        dim = call.arg(2, "dim")
    else:
        dim = call.arg(1, "dim", -1)
    return dim % max(x.ndim, 1)


def _whole_along(call: OpCall, keeps_sum: bool) -> tuple:
    """The input's placements with the op's dim whole and, unless the op keeps a pending sum,
    nothing pending."""
    x = call.args[0]
    places = placements_of(x)
    pending = [p for p in places if isinstance(p, Partial)]
    if not (keeps_sum and pending and all(p.reduce_op in LINEAR_REDUCE_OPS for p in pending)):
        places = without_partial(places)
    return unshard(places, [_dim_of(call)], x.ndim) if x.ndim else places


@register(*_SAME_SHAPE)
def scan_rule(call: OpCall) -> Sharding:
    """``x.cumsum(1)`` of ``[Shard(0)]``: local, ``[Shard(0)]``; of ``[Shard(1)]``: dim 1 gathered first."""
    two = call.func in (aten.cummax.default, aten.cummin.default, aten.sort.default, aten.sort.stable)
    x = call.args[0]
    found = rows_in_place([x], _dim_of(call), [x.shape[-1]]) if x.ndim else None
    if found is not None:  # along whole rows dealt by a layout: each device scans / sorts its own rows
        return Sharding(inputs=found[0], outputs=(found[1][0],) * 2 if two else found[1][0])
    target = _whole_along(call, _SAME_SHAPE[call.func])
    return Sharding(inputs=[target], outputs=(target, target) if two else target)


@register(aten.topk.default)
def topk_rule(call: OpCall) -> Sharding:
    """``x.topk(k, 1)`` of (8, 10) ``[Shard(0)]``: values and indices (8, k) ``[Shard(0)]``, local."""
    x = call.args[0]
    found = rows_in_place([x], _dim_of(call), [call.arg(1, "k")]) if x.ndim else None
    if found is not None:  # along whole rows dealt by a layout: each device picks from its own rows
        return Sharding(inputs=found[0], outputs=(found[1][0],) * 2)
    target = _whole_along(call, False)
    return Sharding(inputs=[target], outputs=(target, target))


@register(aten.renorm.default)
def renorm_rule(call: OpCall) -> Sharding:
    """``x.renorm(p, 0, maxnorm)`` scales each slice ``x[i]`` to a norm at most ``maxnorm``: the norm
    runs over every dim BUT ``dim``, so those are made whole and ``dim`` may stay sharded. (8, 10)
    ``[Shard(0)]``, dim 0: local, ``[Shard(0)]``; dim 1: dim 0 gathered first."""
    x = call.args[0]
    d = _dim_of(call)
    places = without_partial(placements_of(x))
    target = unshard(places, [e for e in range(x.ndim) if e != d], x.ndim) if x.ndim else places
    return Sharding(inputs=[target], outputs=target)


@register(*_REDUCING)
def select_along_rule(call: OpCall) -> Sharding:
    """``x.median(1)`` of (8, 10) ``[Shard(0)]``: values and indices (8,) ``[Shard(0)]``, local."""
    x = call.args[0]
    keepdim = call.arg(3 if call.func is aten.kthvalue.default else 2, "keepdim", False)
    target = _whole_along(call, False)
    d = _dim_of(call)
    out = target if keepdim or not x.ndim else renumber(target, x.ndim, lambda e: e if e < d else e - 1)
    return Sharding(inputs=[target], outputs=(out, out))


@register(aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default)
def fft_rule(call: OpCall) -> Sharding:
    """An FFT over ``dim`` (a list): those dims whole, the others keep their shards; linear, so a
    pending sum (or mean) stays pending. ``torch.fft.rfft(x)`` of (8, 16) ``[Shard(0)]``: (8, 9)
    ``[Shard(0)]``, local."""
    x, dims = call.args[0], call.args[1]
    places = placements_of(x)
    if not all(isinstance(p, Partial) and p.reduce_op in LINEAR_REDUCE_OPS for p in places if isinstance(p, Partial)):
        places = without_partial(places)
    target = unshard(places, list(dims), x.ndim)
    return Sharding(inputs=[target], outputs=target)


@register(aten.constant_pad_nd.default)
def pad_rule(call: OpCall) -> Sharding:
    """``F.pad(x, (1, 2))`` pads (or, negative, crops) the last dim: that dim whole, the others
    keep their shards; a zero fill keeps any pending reduction (every summand gets zeros)."""
    x, pad = call.args[0], call.args[1]
    value = call.arg(2, "value", 0)
    if len(pad) == 2 and x.ndim:  # the last dim alone: rows dealt by a layout pad their own rows
        found = rows_in_place([x], x.ndim - 1, [x.shape[-1] + pad[0] + pad[1]])
        if found is not None:
            return Sharding(inputs=found[0], outputs=found[1][0])
    padded = [x.ndim - 1 - i // 2 for i in range(0, len(pad), 2) if pad[i] or pad[i + 1]]
    places = placements_of(x)
    if value:
        places = without_partial(places)
    target = unshard(places, padded, x.ndim)
    return Sharding(inputs=[target], outputs=target)


@register(aten.glu.default, aten.glu_backward.default)
def glu_rule(call: OpCall) -> Sharding:
    """``F.glu(x, dim)`` multiplies the two halves of ``dim``: that dim whole, the others keep
    their shards (the backward's gradient and input alike); pending values applied first."""
    x = call.args[0] if call.func is aten.glu.default else call.args[1]
    dim = call.arg(1, "dim", -1) if call.func is aten.glu.default else call.args[2]
    target = without_partial(unshard(placements_of(x), [dim], x.ndim))
    return Sharding(inputs=[target] * len(call.specs), outputs=target)


@register(aten.unfold.default, aten.unfold_copy.default)
def unfold_rule(call: OpCall) -> Sharding:
    """``x.unfold(1, 3, 2)`` of (4, 9) ``[Shard(0)]``: windows of dim 1 (whole) as a new last dim,
    (4, 4, 3) ``[Shard(0)]``; a pending sum stays (windows only select)."""
    x, dimension, size, step = call.args[:4]
    if x.ndim >= 2:  # windows of whole rows dealt by a layout: each device cuts its own rows
        found = rows_in_place([x], dimension % x.ndim, [((x.shape[-1] - size) // step + 1, size)])
        if found is not None:
            return Sharding(inputs=found[0], outputs=found[1][0])
    target = unshard(placements_of(x), [dimension], x.ndim) if x.ndim else placements_of(x)
    return Sharding(inputs=[target], outputs=target)


@register(aten.unfold_backward.default)
def unfold_backward_rule(call: OpCall) -> Sharding:
    """The gradient of ``x.unfold(d, size, step)``: the windows' gradients summed back into ``x``'s
    size. ``d`` and the window dim whole; the other dims keep their shards (the local op gets
    this rank's sizes); linear, so a pending sum stays."""
    grad, sizes, dim = call.args[0], call.args[1], call.args[2]
    ndim = len(sizes)
    d = dim % max(ndim, 1)
    rows = _windows_of_rows(grad, sizes, d)
    if rows is not None:
        return rows
    places = placements_of(grad)
    if not all(p.reduce_op in LINEAR_REDUCE_OPS for p in places if isinstance(p, Partial)):
        places = without_partial(places)  # overlapping windows add up: a pending max is applied first
    target = unshard(places, [d, grad.ndim - 1], grad.ndim)
    out = renumber(target, grad.ndim, lambda e: e if e < ndim else None)
    local_sizes = local_shape_of(tuple(sizes), call.mesh, out)

    def local(call_, g, _sizes, *args, **kwargs):
        return aten.unfold_backward.default(g, list(local_sizes), *args, **kwargs)

    return Sharding(inputs=[target], outputs=out, local=local)


def _windows_of_rows(grad: ArgSpec, sizes, d: int) -> Sharding | None:
    """unfold_backward where ``d`` is the input's last dim and a layout with no placement form
    deals whole rows of windows (``specs.reduced_in_place`` of the last two dims of ``grad``):
    each device sums its own rows' windows back, the output keeps the map of rows. None otherwise."""
    if d != len(sizes) - 1 or d < 1 or grad.reduce_op or 0 in grad.shape:
        return None
    rows = reduced_in_place(grad, [grad.ndim - 2, grad.ndim - 1])
    lead = tuple(grad.shape[:-2])
    target = None if rows is None else with_inner_dims(rows, lead, tuple(grad.shape[-2:]))
    out = None if rows is None else with_inner_dims(rows, lead, (sizes[-1],))
    if target is None or out is None:
        return None

    def local(call, g, _sizes, *args, **kwargs):  # this device's rows, the whole last dim
        return call.func(g, [*g.shape[:-2], sizes[-1]], *args, **kwargs)

    return Sharding(inputs=[target], outputs=out, local=local)


@register(aten.linalg_cross.default)
def cross_rule(call: OpCall) -> Sharding | None:
    """``torch.linalg.cross(a, b, dim=1)`` of two (8, 3, 5) tensors in ``[Shard(0)]``: local, ``[Shard(0)]``;
    the cross dim whole, both operands sharded alike, nothing pending (the product is bilinear).
    Operands of different shapes (broadcasting) go through the gather fallback."""
    a, b = call.args[0], call.args[1]
    if not isinstance(a, ArgSpec) or not isinstance(b, ArgSpec) or a.shape != b.shape:
        return None
    d = call.arg(2, "dim", -1) % max(a.ndim, 1)
    target = joint_placements([a, b], allowed=lambda e: e != d, linear=False)
    return Sharding(inputs=[target, target], outputs=target)


@register(aten.rot90.default)
def rot90_rule(call: OpCall) -> Sharding:
    """``x.rot90(1, [1, 2])``: the two rotated dims whole (a transpose and a flip of them), every
    other dim keeps its shards and a pending value stays pending (a rotation only moves elements);
    ``k`` a multiple of 4 is the identity: nothing moves."""
    x = call.args[0]
    k, dims = call.arg(1, "k", 1), call.arg(2, "dims", [0, 1])
    places = placements_of(x)
    target = places if k % 4 == 0 else unshard(places, list(dims), x.ndim)
    return Sharding(inputs=[target], outputs=target)
