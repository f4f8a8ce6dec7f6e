"""Sharding rules of batch norm (``native_batch_norm`` on CPU, ``cudnn_batch_norm`` on CUDA), forward and backward.

Batch norm's statistics are per channel (dim 1) over every other dim, so a batch (or spatial)
dim split over devices needs the whole batch's statistics: each device sums its own elements
and an all-reduce over the splitting axes gives the global sums (two small all-reduces of C
values: the mean, then the squared deviations from it; the backward's two sums go in one).
Nothing else moves: ``x`` keeps its shards (or its layout, where one with no placement form
deals whole samples), the replicated running statistics are updated alike on every device.
2 ranks, ``x`` (8, 3, 5) in ``[Shard(0)]``: ``F.batch_norm(x, rm, rv, w, b, training=True)``
normalizes each rank's (4, 3, 5) with the mean and variance of all 40 values of a channel,
output (8, 3, 5) in ``[Shard(0)]``, as torch's on the whole batch. In eval mode the running
statistics normalize each element on its own, and the weight and bias gradients are pending
sums over the splitting axes.

Where a layout with no placement form deals the channels and nothing else (every other dim
whole in each piece), each device normalizes its own channels where they are: no collective, the
output keeps the layout, the per-channel tensors (weight, bias, statistics and their gradients)
lie in the channels' map (a replicated weight is cut where it is). 2 devices, ``x`` (4, 8, 5)
whose channels go round-robin in pairs, ``S[(4,2,2,2,5):(20,10,1@gpuid,5,1)]``: each device
normalizes its channels 0, 1, 4, 5 or 2, 3, 6, 7, its statistics in ``S[(2,2,2):(2,1@gpuid,1)]``.
A channel dim split otherwise is gathered (weights and statistics are read whole) and a pending
input is reduced first (batch norm is not linear in it).

The running statistics are updated in place, though the op's schema does not say so (the
dispatcher would move them like any input and update a copy): in training they never move.
Each device updates the channels its piece of them holds (``shard_ranges.held_along``), from
statistics it has for every channel, or for its own where they lie in the channels' map.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..layout import Layout
from ..runtime.carriers import all_reduce_
from .call_plan import DispatchError
from .reduction import accumulation_dtype
from .registry import ArgSpec, OpCall, Sharding, register
from .shard_ranges import held_along, inputs_by_name
from .specs import dim_dealt, pending_in_place, reduced_in_place, spec_of
from .tensor_ops import placements_of, unshard, without_partial

aten = torch.ops.aten
_CHANNELS_NOTE = "channels dealt by a layout: each device's own"


def _split(call: OpCall, x: ArgSpec):
    """``(x's target, the mesh axes that split its elements)``: where a layout with no placement
    form deals whole samples (``specs.reduced_in_place`` of all but dim 0) and can say its dealing
    axes (``specs.pending_in_place``), that layout (taken where it is, a replicated gradient cut
    into it) and its dealing axes; else its placements (a layout with none: replicated) with the
    channel dim whole and nothing pending."""
    if x.placements is None and not x.reduce_op and reduced_in_place(x, range(1, x.ndim)) is not None:
        pending = pending_in_place(x, "sum")
        if pending is not None:
            return x.layout, tuple(a for a, p in zip(call.mesh.axis_names, pending) if isinstance(p, Partial))
    target = without_partial(unshard(placements_of(x), [1], x.ndim))
    return target, tuple(a for a, p in zip(call.mesh.axis_names, target) if isinstance(p, Shard))


def _channels_dealt(x: ArgSpec) -> Layout | None:
    """The map of ``x``'s channels, a layout of (C,), where a layout with no placement form deals
    dim 1 and nothing else (``specs.dim_dealt``), every other dim whole and local in each piece
    and its memory row-major (``specs.reduced_in_place`` of them): each device normalizes its own
    channels. ``x`` (4, 8, 5) in ``S[(4,2,2,2,5):(20,10,1@gpuid,5,1)]`` (channels round-robin in
    pairs): ``S[(2,2,2):(2,1@gpuid,1)]``. None otherwise."""
    if x.placements is not None or dim_dealt(x, 1) is None:
        return None
    return reduced_in_place(x, [0, *range(2, x.ndim)])


def _in_channels(s: ArgSpec, channels: Layout, count: int) -> Layout | None:
    """The target of a per-channel argument on the channels' way: the channels' map where it has
    the ``count`` channels (a replicated weight is cut where it is); as it is where it is empty
    (the saved statistics of eval, or cudnn's reserve)."""
    return channels if tuple(s.shape) == (count,) else None


def _lies_in(s: ArgSpec | None, channels: Layout) -> bool:
    """Is ``s`` (None: no tensor) laid out in the channels' map already, so that the channels'
    way updates it where it is?"""
    return not isinstance(s, ArgSpec) or s.spec == spec_of(tuple(s.shape), s.mesh, channels)


def _held_channels(call: OpCall, s: ArgSpec | None):
    """The channels this rank's piece of a running statistic holds, in local order, for the
    placement way's update (its statistics have every channel): None where the piece is them
    all in order (replicated) or there is none. Raises where its layout gives this rank no set
    of channels (a pending sum): an update of a moved copy would be lost."""
    if not isinstance(s, ArgSpec) or s.is_replicated():
        return None
    held = held_along(s.spec, 0)
    if held is None:
        raise DispatchError(f"{call.func} updates its running statistics in place, but one is laid out as {s}, "
                            f"which gives this rank no set of channels; lay it out replicated or as the channels")
    return held


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast over (N, C, *spatial)."""
    return t.view(1, -1, *([1] * (ndim - 2)))


def _sum_over(t: torch.Tensor, axes, mesh) -> torch.Tensor:
    """``t`` summed over every device of ``axes`` (in place; nothing where no axis splits)."""
    return all_reduce_(t, group=mesh.group(list(axes))) if axes else t


@register(aten.native_batch_norm.default, aten.cudnn_batch_norm.default)
def batch_norm_rule(call: OpCall) -> Sharding | None:
    x = call.args[0]
    if not isinstance(x, ArgSpec) or x.ndim < 2 or x.shape[1] == 0:
        return None
    training = call.arg(5, "training")
    running = (call.arg(3, "running_mean"), call.arg(4, "running_var"))
    everywhere = (Replicate(),) * call.mesh.ndim
    cudnn = call.func is aten.cudnn_batch_norm.default
    reserve = (everywhere,) if cudnn else ()
    # eval's saved statistics: (C,) from native_batch_norm, empty from cudnn_batch_norm (as their meta kernels say)
    meta = None if training else call.meta_outputs()
    empty_stats = meta is not None and meta[1].numel() == 0
    count = math.prod(x.shape) // x.shape[1]
    channels = _channels_dealt(x)
    if channels is not None and (not training or all(_lies_in(s, channels) for s in running)):
        stats = everywhere if empty_stats else channels
        return Sharding(inputs=[x.layout if s is x else _in_channels(s, channels, x.shape[1]) for s in call.specs],
                        outputs=(x.layout, stats, stats) + reserve, local=_forward(count, (), cudnn, empty_stats),
                        note=_CHANNELS_NOTE)
    target, axes = _split(call, x)
    held = tuple(_held_channels(call, s) for s in running) if training else (None, None)
    # in training the running statistics stay where they are: the local step updates their pieces
    kept = {"running_mean": None, "running_var": None} if training else {}
    inputs = inputs_by_name(call, {"input": target, **kept}, default=everywhere)
    return Sharding(inputs=inputs, outputs=(target, everywhere, everywhere) + reserve,
                    local=_forward(count, axes, cudnn, empty_stats, held))


def _forward(count: int, axes, cudnn: bool, empty_stats: bool, held=(None, None)):
    """The local step: ``count`` elements per channel in the whole tensor, summed over ``axes``;
    in eval mode, the saved statistics empty where ``empty_stats``; ``held``: the channels of the
    running mean's and variance's pieces (``_held_channels``)."""
    def local(call, x, weight, bias, running_mean, running_var, training, momentum, eps):
        acc = accumulation_dtype(x.dtype)
        if training:
            dims = [0, *range(2, x.ndim)]
            mean = _sum_over(x.to(acc).sum(dims), axes, call.mesh) / count
            centered = x.to(acc) - _per_channel(mean, x.ndim)
            var = _sum_over(centered.square().sum(dims), axes, call.mesh) / count
            invstd = torch.rsqrt(var + eps)
            unbiased = var * (count / (count - 1)) if count > 1 else var
            for running, value, channels in zip((running_mean, running_var), (mean, unbiased), held):
                if running is not None:
                    _update(running, value, channels, momentum)
            saved = (mean, invstd)
        else:  # the backward of eval reads the running statistics, not the saved ones
            mean = running_mean.to(acc)
            centered = x.to(acc) - _per_channel(mean, x.ndim)
            invstd = torch.rsqrt(running_var.to(acc) + eps)
            saved = (x.new_empty(0, dtype=acc),) * 2 if empty_stats else (mean.clone(), invstd)
        out = centered * _per_channel(invstd, x.ndim)
        if weight is not None:
            out = out * _per_channel(weight.to(acc), x.ndim)
        if bias is not None:
            out = out + _per_channel(bias.to(acc), x.ndim)
        reserve = (x.new_empty(0, dtype=torch.uint8),) if cudnn else ()
        return (out.to(x.dtype), *saved, *reserve)

    return local


def _update(running: torch.Tensor, value: torch.Tensor, channels, momentum: float) -> None:
    """``running`` moved ``momentum`` of the way to ``value`` in place, on the channels its piece
    holds (``channels``; None: ``value``'s own, in order). Every device holding a channel
    updates it alike."""
    if channels is not None:
        value = value[channels.indices(value)]
    with torch.no_grad():
        running.mul_(1 - momentum).add_(value.to(running.dtype), alpha=momentum)


@register(aten.native_batch_norm_backward.default, aten.cudnn_batch_norm_backward.default)
def batch_norm_backward_rule(call: OpCall) -> Sharding | None:
    cudnn = call.func is aten.cudnn_batch_norm_backward.default
    grad, x = (call.args[1], call.args[0]) if cudnn else (call.args[0], call.args[1])
    if not isinstance(x, ArgSpec) or not isinstance(grad, ArgSpec) or x.ndim < 2 or x.shape[1] == 0:
        return None
    training = True if cudnn else call.arg(7, "train")
    mask = [True] * 3 if cudnn else list(call.arg(9, "output_mask"))
    count = math.prod(x.shape) // x.shape[1]
    channels = _channels_dealt(x)
    if channels is not None:  # each device's own channels: their sums are whole
        inputs = [x.layout if s is x or s is grad else _in_channels(s, channels, x.shape[1]) for s in call.specs]
        return Sharding(inputs=inputs, outputs=(x.layout, channels, channels), note=_CHANNELS_NOTE,
                        local=_backward(count, (), training, mask, cudnn))
    target, axes = _split(call, x)
    everywhere = (Replicate(),) * call.mesh.ndim
    # training: the sums are all-reduced in the local step; eval: each device's own sums, pending
    summed = everywhere if training else tuple(Partial("sum") if a in axes else Replicate() for a in call.mesh.axis_names)
    outputs = (target, summed, summed)  # (a masked-out one comes back None, as torch's)
    inputs = [target if s is x or s is grad else everywhere for s in call.specs]
    return Sharding(inputs=inputs, outputs=outputs, local=_backward(count, axes, training, mask, cudnn))


def _backward(count: int, axes, training: bool, mask, cudnn: bool):
    def local(call, *args):
        if cudnn:
            x, grad, weight, running_mean, running_var, save_mean, save_invstd, eps = args[:8]
        else:
            grad, x, weight, running_mean, running_var, save_mean, save_invstd, _train, eps = args[:9]
        acc = accumulation_dtype(x.dtype)
        dims = [0, *range(2, x.ndim)]
        if training:
            mean, invstd = save_mean.to(acc), save_invstd.to(acc)
        else:
            mean, invstd = running_mean.to(acc), torch.rsqrt(running_var.to(acc) + eps)
        g = grad.to(acc)
        normalized = (x.to(acc) - _per_channel(mean, x.ndim)) * _per_channel(invstd, x.ndim)
        sums = torch.stack([g.sum(dims), (g * normalized).sum(dims)])
        if training:  # the whole batch's sums: the input gradient needs them
            _sum_over(sums, axes, call.mesh)
        scale = invstd if weight is None else invstd * weight.to(acc)
        if training:
            g = g - _per_channel(sums[0], x.ndim) / count - normalized * _per_channel(sums[1], x.ndim) / count
        grad_input = (g * _per_channel(scale, x.ndim)).to(x.dtype)
        weight_dtype = x.dtype if weight is None else weight.dtype
        results = (grad_input, sums[1].to(weight_dtype), sums[0].to(weight_dtype))
        return tuple(r if wanted else None for r, wanted in zip(results, mask))

    return local
