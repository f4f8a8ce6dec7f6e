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

The channel dim itself is gathered where it is split (weights and statistics are read whole)
and a pending input is reduced first (batch norm is not linear in it).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..runtime.carriers import all_reduce_
from .reduction import accumulation_dtype
from .registry import ArgSpec, OpCall, Sharding, register
from .specs import pending_in_place, reduced_in_place
from .tensor_ops import placements_of, unshard, without_partial

aten = torch.ops.aten


def _split(call: OpCall, x: ArgSpec):
    """``(x's target, the mesh axes that split its elements)``: its placements with the channel
    dim whole and nothing pending, or where a layout with no placement form deals whole samples
    (``specs.reduced_in_place`` of all but dim 0), that layout (taken where it is, a replicated
    gradient cut into it) and its dealing axes. None where such a layout cannot say its dealing
    axes (``specs.pending_in_place``)."""
    if x.placements is None:
        if x.reduce_op or reduced_in_place(x, range(1, x.ndim)) is None:
            return None
        pending = pending_in_place(x, "sum")
        if pending is None:
            return None
        return x.layout, tuple(a for a, p in zip(call.mesh.axis_names, pending) if isinstance(p, Partial))
    target = without_partial(unshard(placements_of(x), [1], x.ndim))
    return target, tuple(a for a, p in zip(call.mesh.axis_names, target) if isinstance(p, Shard))


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
    split = _split(call, x)
    if split is None:
        return None
    target, axes = split
    everywhere = (Replicate(),) * call.mesh.ndim
    cudnn = call.func is aten.cudnn_batch_norm.default
    outputs = (target, everywhere, everywhere) + ((everywhere,) if cudnn else ())
    # eval's saved statistics: (C,) from native_batch_norm, empty from cudnn_batch_norm (as their meta kernels say)
    meta = None if call.arg(5, "training") else call.meta_outputs()
    empty_stats = meta is not None and meta[1].numel() == 0
    return Sharding(inputs=[target] + [everywhere] * (len(call.specs) - 1), outputs=outputs,
                    local=_forward(math.prod(x.shape) // x.shape[1], axes, cudnn, empty_stats))


def _forward(count: int, axes, cudnn: bool, empty_stats: bool):
    """The local step: ``count`` elements per channel in the whole tensor, summed over ``axes``;
    in eval mode, the saved statistics empty where ``empty_stats``."""
    def local(call, x, weight, bias, running_mean, running_var, training, momentum, eps):
        acc = accumulation_dtype(x.dtype)
        if training:
            dims = [0, *range(2, x.ndim)]
            mean = _sum_over(x.to(acc).sum(dims), axes, call.mesh) / count
            centered = x.to(acc) - _per_channel(mean, x.ndim)
            var = _sum_over(centered.square().sum(dims), axes, call.mesh) / count
            invstd = torch.rsqrt(var + eps)
            with torch.no_grad():  # every device updates its replica alike
                if running_mean is not None:
                    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                if running_var is not None:
                    unbiased = var * (count / (count - 1)) if count > 1 else var
                    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
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


@register(aten.native_batch_norm_backward.default, aten.cudnn_batch_norm_backward.default)
def batch_norm_backward_rule(call: OpCall) -> Sharding | None:
    cudnn = call.func is aten.cudnn_batch_norm_backward.default
    grad, x = (call.args[1], call.args[0]) if cudnn else (call.args[0], call.args[1])
    if not isinstance(x, ArgSpec) or not isinstance(grad, ArgSpec) or x.ndim < 2 or x.shape[1] == 0:
        return None
    split = _split(call, x)
    if split is None:
        return None
    target, axes = split
    training = True if cudnn else call.arg(7, "train")
    mask = [True] * 3 if cudnn else list(call.arg(9, "output_mask"))
    everywhere = (Replicate(),) * call.mesh.ndim
    # training: the sums are all-reduced in the local step; eval: each device's own sums, pending
    summed = everywhere if training else tuple(Partial("sum") if a in axes else Replicate() for a in call.mesh.axis_names)
    outputs = (target, summed, summed)  # (a masked-out one comes back None, as torch's)
    inputs = [target if s is x or s is grad else everywhere for s in call.specs]
    count = math.prod(x.shape) // x.shape[1]
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
