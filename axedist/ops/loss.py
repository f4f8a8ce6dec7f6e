"""Cross-entropy over class-sharded logits, without gathering the logits (vocab-parallel loss).

``F.cross_entropy(logits, target)`` reaches DTensors as ``_log_softmax`` (ops/norm.py:
over a sharded class dim, an all-reduce of the row max and of the row sum of exponentials),
then ``nll_loss_forward`` (``nll_loss2d_forward`` for a class dim followed by spatial dims),
and in backward ``nll_loss_backward`` and ``_log_softmax_backward_data``. Label smoothing
decomposes into a sum over the class dim (ops/reduction.py), which gives a partial sum.

**It is automatic**: no context manager. When the log-probabilities are sharded on the
class dim, ``nll_loss_forward`` picks each row's target entry on the rank that holds it
(other ranks contribute zero), so the loss is a ``Partial("sum")`` with no communication;
its backward writes ``-weight[t]/total`` into the rank's own class columns. That is the
cheapest correct plan whenever the logits are class-sharded, so there is nothing to opt in to
(torch needs ``loss_parallel()`` because its default gathers them).

Example, 4 ranks, logits ``(2, 10)`` in ``[Shard(1)]`` (classes ``[0,3) [3,6) [6,9) [9,10)``),
targets ``[4, 9]`` replicated, ``reduction="sum"``: rank 1 holds ``-lp[0,4]``, rank 3 holds
``-lp[1,9]``, ranks 0 and 2 hold 0; ``loss.full_tensor()`` adds them: ``-lp[0,4] - lp[1,9]``.

Other placements: logits sharded on the batch (or a spatial) dim shard the targets the same
way; ``reduction="mean"`` then all-reduces the scalar total weight (one tiny collective) so
each rank's share is ``local sum / global weight`` (exact for uneven shards). Partial-sum
logits stay partial (the loss is linear in them). ``ignore_index`` and per-class ``weight``
(gathered: it is one value per class) work everywhere. Logits whose classes a layout with no
placement form deals (``specs.dim_dealt``: classes round-robin in pairs) work as class-sharded
ones: each rank knows its classes from the layout (``shard_ranges.Held``). Rows a layout with no
placement form deals, every class whole in each piece, with the targets dealt alike
(``logits.view(-1, V)`` of batch-first logits sharded on the sequence, and its targets), work as
batch-sharded ones: each device picks its own rows' targets (``_rows_dealt``).
"""

from __future__ import annotations

import math

import torch

from ..runtime import checks
from ..runtime.carriers import all_reduce_
from .pointwise import pointwise_sharding
from .registry import ArgSpec, OpCall, Partial, Replicate, Shard, Sharding, register
from .shard_ranges import Held, held_along, held_under, inputs_by_name
from .specs import dim_dealt, layout_only, pending_in_place, reduced_in_place

aten = torch.ops.aten

__all__ = ["nll_loss_rule", "nll_loss_backward_rule"]

_NONE, _MEAN, _SUM = 0, 1, 2   # torch's reduction enum


def _placements(spec: ArgSpec | None, mesh) -> tuple:
    if spec is None or spec.placements is None:
        return (Replicate(),) * mesh.ndim
    return spec.placements


def _class_dim(scores: ArgSpec) -> int:
    return 1 if scores.ndim >= 2 else 0


def _target_dim(dim: int, class_dim: int) -> int:
    """The target's dim for a (non-class) dim of the scores: the class dim is absent from it."""
    return dim if dim < class_dim else dim - 1


def _score_dim(dim: int, class_dim: int) -> int:
    return dim if dim < class_dim else dim + 1


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_rule(call: OpCall) -> Sharding:
    scores, target, weight, reduction = call.args[:4]
    mesh = call.mesh
    class_dim = _class_dim(scores)
    dealt = _classes_dealt(call, scores, class_dim)
    if dealt is not None:
        inputs, partial, held = dealt
        return Sharding(inputs=inputs, outputs=(partial, (Replicate(),) * mesh.ndim),
                        local=_nll_forward(scores.shape[class_dim], class_dim, held, ()))
    rows = _rows_dealt(call, scores, target)
    if rows is not None:
        layout, partial, held = rows
        dealing = tuple(axis for axis, p in zip(mesh.axis_names, partial) if isinstance(p, Partial))
        everything = (Replicate(),) * mesh.ndim
        out, total = {_NONE: (layout, everything), _SUM: (partial, partial), _MEAN: (partial, everything)}[reduction]
        return Sharding(inputs=inputs_by_name(call, {"self": None, "target": None}, default=everything),
                        outputs=(out, total), local=_nll_forward(scores.shape[class_dim], class_dim, held, dealing),
                        note="rows dealt by a layout: each device's own rows")
    s_in, t_in, out, total = [], [], [], []
    batch_axes = []
    for axis, sp, tp in zip(mesh.axis_names, _placements(scores, mesh), _placements(target, mesh)):
        if type(sp) is Shard and sp.dim % scores.ndim == class_dim:
            s_in.append(sp), t_in.append(Replicate()), out.append(Partial("sum")), total.append(Replicate())
        elif isinstance(sp, Partial) and sp.reduce_op == "sum":
            s_in.append(sp), t_in.append(Replicate()), out.append(Partial("sum")), total.append(Replicate())
        elif type(sp) is Shard or (isinstance(sp, Replicate) and type(tp) is Shard):
            # rows of the batch (or spatial) dims: the target is split the same way
            d = sp.dim % scores.ndim if type(sp) is Shard else _score_dim(tp.dim % target.ndim, class_dim)
            td = _target_dim(d, class_dim)
            s_in.append(Shard(d)), t_in.append(Shard(td))
            out.append(Shard(td) if reduction == _NONE else Partial("sum"))
            # mean divides by the global weight (all-reduced in the local step); otherwise it stays a partial sum
            total.append(Replicate() if reduction == _MEAN else Partial("sum"))
            batch_axes.append(axis)
        else:
            s_in.append(Replicate()), t_in.append(Replicate()), out.append(Replicate()), total.append(Replicate())
    everything = (Replicate(),) * mesh.ndim  # per-class weight: small, so every rank has it all
    s_in = tuple(s_in)
    inputs = inputs_by_name(call, {"self": s_in, "target": tuple(t_in)}, default=everything)
    return Sharding(inputs=inputs, outputs=(tuple(out), tuple(total)),
                    local=_nll_forward(scores.shape[class_dim], class_dim, held_under(scores.shape, mesh, s_in, class_dim), tuple(batch_axes)))


def _classes_dealt(call: OpCall, scores: ArgSpec, class_dim: int, wanted_extra=None):
    """``(inputs, output placements, this rank's classes)`` for scores whose class dim a layout
    with no placement form deals and nothing else (``specs.dim_dealt``: the logits of an output
    layer whose vocabulary rows are dealt round-robin): each rank picks the targets it holds, the
    loss is a pending sum over the dealing axes and replicated over the others; the scores stay
    where they are, everything else is read whole. None for other scores."""
    if scores.placements is not None:
        return None
    axes = dim_dealt(scores, class_dim)
    held = held_along(scores.spec, class_dim) if axes else None
    if held is None:
        return None
    everything = (Replicate(),) * call.mesh.ndim
    inputs = inputs_by_name(call, {"self": None, **(wanted_extra or {})}, default=everything)
    return inputs, tuple(Partial("sum") if a in axes else Replicate() for a in call.mesh.axis_names), held


def _rows_dealt(call: OpCall, scores: ArgSpec, target):
    """``(the rows' layout, the placements of a sum over them, this rank's classes: all)`` for 2-D
    scores whose layout (no placement form) deals whole rows, the classes whole and innermost in
    every piece (``specs.reduced_in_place``), with the target laid out as those rows: each device
    picks its own rows' targets; a sum over them is pending over the dealing axes
    (``specs.pending_in_place``). None otherwise."""
    if scores.ndim != 2 or not isinstance(target, ArgSpec) or not layout_only(target):
        return None
    rows = reduced_in_place(scores, [1])
    if rows is None or target.layout != rows:
        return None
    partial = pending_in_place(target, "sum")
    if partial is None:
        return None
    classes = scores.shape[1]
    return rows, partial, Held(classes, range(classes))  # each piece holds every class


def _picks(scores, target, weight, ignore_index: int, classes: int, class_dim: int, held: Held):
    """Per target element: its score here (0 where this rank lacks its class), whether it is
    here, and its weight (0 for ignored targets)."""
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    # read at once, or where that would wait for the device, later (runtime/checks.py)
    checks.check_range(safe, classes, f"nll_loss: target {{value}} is out of bounds for {classes} classes")
    inside, index = held.locate(safe)
    here = valid & inside
    if weight is None:
        weights = valid.to(scores.dtype)
    else:
        weights = weight[safe].to(scores.dtype).masked_fill(~valid, 0)
    if held.size == 0:  # an uneven class split leaves this rank no classes
        return scores.new_zeros(target.shape), here, weights
    picked = scores.movedim(class_dim, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked, here, weights


def _nll_forward(classes: int, class_dim: int, held: Held, batch_axes):
    def local(call, scores, target, weight=None, reduction=_MEAN, ignore_index=-100):
        picked, here, weights = _picks(scores, target, weight, ignore_index, classes, class_dim, held)
        losses = (-picked * weights).masked_fill(~here, 0)
        total = weights.sum()
        if reduction == _NONE:
            # torch gives a total weight without a reduction only for a single (0-dim) target
            return losses, total if target.dim() == 0 else torch.zeros_like(total)
        if reduction == _SUM:
            return losses.sum(), total
        if batch_axes:
            all_reduce_(total, group=call.mesh.group(list(batch_axes)))
        return losses.sum() / total, total

    return local


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward_rule(call: OpCall) -> Sharding:
    grad, scores, target, weight, reduction, _ignore, total_weight = call.args[:7]
    mesh = call.mesh
    class_dim = _class_dim(scores)
    dealt = _classes_dealt(call, scores, class_dim, None if reduction == _MEAN else {"total_weight": None})
    if dealt is not None:
        inputs, _, held = dealt
        return Sharding(inputs=inputs, outputs=scores.layout, local=_nll_backward(scores.shape[class_dim], class_dim, held))
    rows = _rows_dealt(call, scores, target)
    if rows is not None:
        everything = (Replicate(),) * mesh.ndim
        # per-row losses' gradient: asked in the rows' map (a replicated one, as ``loss.sum()`` gives, is cut where it is)
        wanted = {"grad_output": rows[0] if reduction == _NONE else everything, "self": None, "target": None}
        if reduction != _MEAN:
            wanted["total_weight"] = None  # read only by mean
        return Sharding(inputs=inputs_by_name(call, wanted, default=everything), outputs=scores.layout,
                        local=_nll_backward(scores.shape[class_dim], class_dim, rows[2]),
                        note="rows dealt by a layout: each device's own rows")
    g_in, s_in, t_in, out = [], [], [], []
    for sp, tp in zip(_placements(scores, mesh), _placements(target, mesh)):
        if type(sp) is Shard and sp.dim % scores.ndim == class_dim:
            g_in.append(Replicate()), s_in.append(sp), t_in.append(Replicate()), out.append(sp)
        elif type(sp) is Shard or (isinstance(sp, Replicate) and type(tp) is Shard):
            d = sp.dim % scores.ndim if type(sp) is Shard else _score_dim(tp.dim % target.ndim, class_dim)
            td = _target_dim(d, class_dim)
            g_in.append(Shard(td) if reduction == _NONE else Replicate())
            s_in.append(Shard(d)), t_in.append(Shard(td)), out.append(Shard(d))
        else:
            # the scores' values are not read (only their shape): a partial input keeps its summands
            g_in.append(Replicate()), s_in.append(sp if isinstance(sp, Partial) else Replicate())
            t_in.append(Replicate()), out.append(Replicate())
    s_in = tuple(s_in)
    wanted = {"grad_output": tuple(g_in), "self": s_in, "target": tuple(t_in)}
    if reduction != _MEAN:
        wanted["total_weight"] = None  # read only by mean
    inputs = inputs_by_name(call, wanted, default=(Replicate(),) * mesh.ndim)
    return Sharding(inputs=inputs, outputs=tuple(out),
                    local=_nll_backward(scores.shape[class_dim], class_dim, held_under(scores.shape, mesh, s_in, class_dim)))


def _nll_backward(classes: int, class_dim: int, held: Held):
    def local(call, grad, scores, target, weight, reduction, ignore_index, total_weight):
        result = torch.zeros_like(scores)
        if held.size == 0:
            return result
        _, here, weights = _picks(scores, target, weight, ignore_index, classes, class_dim, held)
        coefficient = -weights * grad
        if reduction == _MEAN:
            coefficient = coefficient / total_weight
        # after the division: every target ignored makes total 0, and torch's grad is then 0, not nan
        coefficient = coefficient.masked_fill(~here, 0)
        index = held.locate(torch.where(here, target, torch.zeros_like(target)))[1]
        # one entry per row; rows whose class is elsewhere write their 0 into column 0 of their own row
        result.movedim(class_dim, -1).scatter_(-1, index.unsqueeze(-1), coefficient.unsqueeze(-1).to(result.dtype))
        return result

    return local


# ---------------------------------------------------------------------------
# Elementwise losses (mse, huber, smooth_l1, soft_margin, binary_cross_entropy) and their backward
# ---------------------------------------------------------------------------

# op -> position of its ``reduction`` argument
_ELEMENTWISE_LOSSES = {aten.mse_loss.default: 2, aten.huber_loss.default: 2, aten.smooth_l1_loss.default: 2,
                       aten.soft_margin_loss.default: 2, aten.binary_cross_entropy.default: 3,
                       aten.binary_cross_entropy_with_logits.default: 4,
                       aten.mse_loss_backward.default: 3, aten.huber_loss_backward.default: 3,
                       aten.smooth_l1_loss_backward.default: 3, aten.soft_margin_loss_backward.default: 3,
                       aten.binary_cross_entropy_backward.default: 4}


def _with_sum(func, position: int, scale: float):
    """The local function: the op with ``reduction="sum"`` on this rank's elements, times ``scale``
    (``1 / global count`` for a mean: exact for uneven shards)."""
    def local(call, *args, **kwargs):
        args = list(args)
        if position < len(args):
            args[position] = _SUM
        else:
            kwargs["reduction"] = _SUM
        value = func(*args, **kwargs)
        return value * scale if scale != 1 else value

    return local


@register(*_ELEMENTWISE_LOSSES)
def elementwise_loss_rule(call: OpCall) -> Sharding | None:
    """``F.mse_loss(x, y)`` with ``x``, ``y`` (8, 6) in ``[Shard(0)]``: each rank's squared errors.
    ``reduction="none"``: ``[Shard(0)]``; ``"sum"``: the local sums, ``[Partial("sum")]``;
    ``"mean"``: the local sums over the global count (48), ``[Partial("sum")]``. The backward
    (input gradient laid out as ``x``) takes a mean's ``1/48`` the same way."""
    position = _ELEMENTWISE_LOSSES[call.func]
    reduction = call.arg(position, "reduction", _MEAN)
    backward = call.func._schema.name.endswith("_backward")
    data = call.specs[1:] if backward and isinstance(call.args[0], ArgSpec) else call.specs  # (not grad_output)
    if len({tuple(s.shape) for s in data}) != 1:
        return None  # broadcast operands: torch's mean divides by another count in forward and backward
    elem = pointwise_sharding(call)
    count = math.prod(data[0].shape)
    scale = 1.0 / count if reduction == _MEAN else 1.0
    if not isinstance(elem.outputs, tuple):
        return _elementwise_loss_in_place(call, elem, data[0], reduction, backward, position, scale)
    if any(isinstance(p, Partial) for p in elem.outputs):
        return None
    if reduction == _NONE:
        return Sharding(inputs=elem.inputs, outputs=elem.outputs)
    if backward:
        return Sharding(inputs=elem.inputs, outputs=elem.outputs, local=_with_sum(call.func, position, scale)
                        if reduction == _MEAN else None)
    out = tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in elem.outputs)
    return Sharding(inputs=elem.inputs, outputs=out, local=_with_sum(call.func, position, scale))


def _elementwise_loss_in_place(call: OpCall, elem: Sharding, x: ArgSpec, reduction: int, backward: bool,
                               position: int, scale: float) -> Sharding | None:
    """An elementwise loss of tensors laid out by a layout with no placement form, each device on
    its own elements (``elem``: the pointwise way, the output laid out as ``x``): ``"none"`` and
    the backward keep that layout (a mean's ``1/count`` taken locally); ``"sum"`` / ``"mean"`` are
    pending sums over the axes that deal the elements (``specs.pending_in_place``). None where the
    output is not laid out as ``x`` or cannot be summed in place (the placement way then)."""
    if getattr(elem.outputs, "layout", elem.outputs) != x.layout:  # (a spec or a Layout)
        return None
    if reduction == _NONE:
        return Sharding(inputs=elem.inputs, outputs=elem.outputs)
    if backward:
        return Sharding(inputs=elem.inputs, outputs=elem.outputs,
                        local=_with_sum(call.func, position, scale) if reduction == _MEAN else None)
    whole = pending_in_place(x, "sum")
    if whole is None:
        return None
    return Sharding(inputs=elem.inputs, outputs=whole, local=_with_sum(call.func, position, scale))
