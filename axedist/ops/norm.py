"""Sharding rules of softmax, log_softmax (and attention's ``_safe_softmax``), layer norm and RMS norm, forward and backward.

Softmax over a dim no mesh axis shards runs locally and keeps every shard. Over a
sharded dim it still keeps the shards: each rank all-reduces its rows' maxima, then
the sums of ``exp(x - max)`` (two small all-reduces instead of gathering ``x``).
4 ranks, logits (2, 10) in ``[Shard(1)]`` (vocab pieces 3, 3, 3, 1): ``softmax(x, 1)``
is (2, 10) ``[Shard(1)]``, and every piece divides by the same global sum.

Layer norm and RMS norm normalize over trailing dims, which must be whole on each device
(redistributed if not); leading (batch, sequence) dims keep their shards. That is
sequence parallelism: ``x`` (B, S, H) in ``[Shard(1)]`` with a replicated weight runs
locally, and the backward's weight and bias gradients are sums over the local tokens,
pending sums over the sequence axis, ``[Partial("sum")]``, reduced when someone reads
them (``full_tensor``) or by the optimizer's redistribute.

RMS norm as torch 2.13 dispatches it: ``F.rms_norm``/``nn.RMSNorm`` on CPU decompose into
pointwise ops, ``mean`` and ``sum`` (rules in ``pointwise``/``reduction``); on CUDA they reach
aten as ``_fused_rms_norm`` and ``_fused_rms_norm_backward``, whose rules are here (the
backward has no CPU kernel, so on CPU its local step is computed from the formula).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..runtime.carriers import all_reduce_
from .batched import samples_in_place
from .reduction import accumulation_dtype
from .registry import ArgSpec, OpCall, Sharding, register
from .specs import dim_dealt, pending_in_place, reduced_in_place
from .tensor_ops import placements_of, shard_dim, unshard, without_partial

aten = torch.ops.aten


def _axes_sharding(mesh, places, dim: int, ndim: int) -> list[str]:
    return [axis for axis, p in zip(mesh.axis_names, places) if shard_dim(p, ndim) == dim]


def _linear_partial(p) -> bool:
    """A pending reduction a gradient may keep through a linear backward (sum only: the
    weight gradients add pending sums of their own, and a tensor has one pending op)."""
    return isinstance(p, Partial) and p.reduce_op == "sum"


def _grad_target(grad_places, data_places) -> tuple:
    """A gradient laid out like the data it flows through, except that pending sums stay
    pending where the data is replicated (the backward is linear in the gradient), as long
    as all of them can (a tensor's pending axes are reduced together)."""
    keep = all(_linear_partial(g) and isinstance(p, Replicate)
               for g, p in zip(grad_places, data_places) if isinstance(g, Partial))
    return tuple(g if keep and isinstance(g, Partial) else p for g, p in zip(grad_places, data_places))


# ---------------------------------------------------------------------------
# softmax / log_softmax
# ---------------------------------------------------------------------------


@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_rule(call: OpCall) -> Sharding:
    """``x.softmax(1)`` of ``[Shard(0)]``: local. Of ``[Shard(1)]``: stays ``[Shard(1)]``, with
    the row max and the row sum all-reduced over the axes that shard dim 1; likewise where a layout
    with no placement form deals dim 1 and nothing else (``specs.dim_dealt``). ``_safe_softmax``
    (attention's masked softmax) is softmax with rows that are all ``-inf`` set to 0."""
    x, dim = call.args[0], call.args[1]
    d = dim % max(x.ndim, 1)
    if reduced_in_place(x, [d]) is not None:  # a layout with no placement form, the dim whole locally
        return Sharding(inputs=[None], outputs=x.layout)
    axes = dim_dealt(x, d)
    if axes:  # the dim dealt by a layout with no placement form: as sharded, laid out as it is
        target, out = None, x.layout
    else:
        target = out = without_partial(placements_of(x))  # softmax is not linear: pending sums first
        axes = _axes_sharding(x.mesh, target, d, x.ndim)
    if not axes:
        return Sharding(inputs=[target], outputs=target)
    log = call.func is aten._log_softmax.default
    safe = call.func is aten._safe_softmax.default
    half_to_float = not safe and call.args[2]
    dtype = call.arg(2, "dtype") if safe else None

    def local(call_, t, *args, **kwargs):
        out_dtype = dtype or (torch.float32 if half_to_float else t.dtype)
        return _sharded_softmax(t, d, call_.mesh.group(axes), log, safe, out_dtype)

    return Sharding(inputs=[target], outputs=out, local=local)


# Temporaries of the sharded (log-)softmax and its backward are made piece by piece, at most
# this many elements each: a vocab-parallel loss's fp32 copies of [tokens, vocab / TP] logits
# are GiBs (Llama-3-8B layers at TP=2, 32768 tokens: 1 GiB each), made at the step's peak.
PIECE_ELEMENTS = 1 << 25


def _pieces(shape, d: int) -> list:
    """Indices that split a tensor of ``shape`` into pieces of at most ``PIECE_ELEMENTS``
    elements along its largest dim other than ``d`` (rows stay whole along ``d``); one piece,
    the whole, when it is small or has no other dim."""
    numel = math.prod(shape)
    others = [i for i in range(len(shape)) if i != d and shape[i] > 1]
    if numel <= PIECE_ELEMENTS or not others:
        return [(...,)]
    along = max(others, key=lambda i: shape[i])
    step = max(1, shape[along] * PIECE_ELEMENTS // numel)
    return [(slice(None),) * along + (slice(start, start + step),) for start in range(0, shape[along], step)]


def _sharded_softmax(t: torch.Tensor, d: int, group, log: bool, safe: bool, out_dtype) -> torch.Tensor:
    """(log-)softmax along ``d`` of a tensor whose dim ``d`` is split over ``group``, in
    ``out_dtype``: the row max and the row sum of ``exp(x - max)`` all-reduced (``safe``: rows
    whose max is ``-inf``, all masked, give 0). Computed in the accumulation dtype piece by
    piece (``_pieces``), so no whole-tensor temporary is made beside the result."""
    acc = accumulation_dtype(t.dtype)
    if t.shape[d]:
        top = t.amax(d, keepdim=True).to(acc)   # (a max is exact in any float dtype)
    else:
        shape = list(t.shape)
        shape[d] = 1
        top = torch.full(shape, float("-inf"), dtype=acc, device=t.device)
    all_reduce_(top, "max", group=group)
    pieces = _pieces(t.shape, d)
    total = torch.empty_like(top)
    for at in pieces:
        torch.sum(torch.sub(t[at], top[at]).exp_(), d, keepdim=True, out=total[at])   # (t promoted to acc)
    all_reduce_(total, group=group)
    out = torch.empty(t.shape, dtype=out_dtype, device=t.device)
    for at in pieces:
        shifted = torch.sub(t[at], top[at])
        value = shifted.sub_(total[at].log()) if log else shifted.exp_().div_(total[at])
        if safe:
            value.masked_fill_(top[at] == float("-inf"), 0.0)
        out[at] = value
    return out


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> Sharding:
    """``grad_x = y * (g - sum(g * y))`` (softmax) or ``g - exp(y) * sum(g)`` (log_softmax),
    sums over the softmax dim: local when that dim is whole, one all-reduce when sharded.
    Linear in ``g``, so a pending sum in ``g`` stays pending where ``y`` is replicated."""
    grad, out, dim, input_dtype = call.args[:4]
    d = dim % max(out.ndim, 1)
    if reduced_in_place(out, [d]) is not None:  # the forward's layout way: the gradient laid out alike
        return Sharding(inputs=[out.layout, None], outputs=out.layout)
    axes = dim_dealt(out, d)
    if axes:  # the forward's dealt dim: the gradient laid out alike, sums all-reduced as sharded
        grad_target, out_target, result = out.layout, None, out.layout
    else:
        out_target = without_partial(placements_of(out))
        grad_target = _grad_target(placements_of(grad), out_target)
        result = grad_target
        axes = _axes_sharding(out.mesh, out_target, d, out.ndim)
    if not axes:
        return Sharding(inputs=[grad_target, out_target], outputs=result)
    log = call.func is aten._log_softmax_backward_data.default

    def local(call_, g, y, *args, **kwargs):
        # in the accumulation dtype, piece by piece (as the forward)
        acc = accumulation_dtype(input_dtype)
        pieces = _pieces(g.shape, d)
        if log:
            total = g.sum(d, keepdim=True, dtype=acc)
        else:
            total = torch.empty((*g.shape[:d], 1, *g.shape[d + 1:]), dtype=acc, device=g.device)
            for at in pieces:
                torch.sum(g[at].to(acc) * y[at].to(acc), d, keepdim=True, out=total[at])
        all_reduce_(total, group=call_.mesh.group(axes))
        out = torch.empty(g.shape, dtype=input_dtype, device=g.device)
        for at in pieces:
            if log:   # g - exp(y) * total
                out[at] = y[at].to(acc).exp().mul_(total[at]).neg_().add_(g[at])
            else:     # y * (g - total)
                out[at] = torch.sub(g[at], total[at]).mul_(y[at])
        return out

    return Sharding(inputs=[grad_target, out_target], outputs=result, local=local)


# ---------------------------------------------------------------------------
# layer norm, fused RMS norm
# ---------------------------------------------------------------------------


def _norm_input(x: ArgSpec, normalized_ndim: int) -> tuple:
    """``x``'s placements with the normalized (trailing) dims whole and nothing pending."""
    return without_partial(unshard(placements_of(x), range(x.ndim - normalized_ndim, x.ndim), x.ndim))


def _replicated(spec) -> tuple | None:
    return (Replicate(),) * spec.mesh.ndim if isinstance(spec, ArgSpec) else None


def _specs_inputs(values, targets) -> list:
    """Targets for the ArgSpecs among ``values`` (a None weight/bias has no entry)."""
    return [t for v, t in zip(values, targets) if isinstance(v, ArgSpec)]


@register(aten.native_layer_norm.default)
def layer_norm_rule(call: OpCall) -> Sharding:
    """``native_layer_norm(x, [H], w, b)``, ``x`` (B, S, H) in ``[Shard(1)]``: local, outputs
    ``[Shard(1)]`` (mean and rstd are (B, S, 1), sharded alike); ``w``, ``b`` replicated."""
    x, normalized_shape, weight, bias = call.args[:4]
    stats = _stats_in_place(x, len(normalized_shape))
    if stats is not None:
        inputs = _specs_inputs([x, weight, bias], [None, _replicated(weight), _replicated(bias)])
        return Sharding(inputs=inputs, outputs=(x.layout, stats, stats))
    xt = _norm_input(x, len(normalized_shape))
    inputs = _specs_inputs([x, weight, bias], [xt, _replicated(weight), _replicated(bias)])
    return Sharding(inputs=inputs, outputs=(xt, xt, xt))


@register(aten._fused_rms_norm.default)
def fused_rms_norm_rule(call: OpCall) -> Sharding:
    """``_fused_rms_norm(x, [H], w, eps)`` -> (out, rstd): as layer norm, without mean/bias."""
    x, normalized_shape, weight = call.args[:3]
    stats = _stats_in_place(x, len(normalized_shape))
    if stats is not None:
        inputs = _specs_inputs([x, weight], [None, _replicated(weight)])
        return Sharding(inputs=inputs, outputs=(x.layout, stats))
    xt = _norm_input(x, len(normalized_shape))
    inputs = _specs_inputs([x, weight], [xt, _replicated(weight)])
    return Sharding(inputs=inputs, outputs=(xt, xt))


def _stats_in_place(x: ArgSpec, normalized_ndim: int):
    """The layout of a norm's per-token statistics (mean, rstd) when ``x`` has a layout with no
    placement form and its normalized dims whole and innermost in every piece: each device
    normalizes its own tokens, the output keeps ``x``'s layout (``specs.reduced_in_place``)."""
    return reduced_in_place(x, list(range(x.ndim - normalized_ndim, x.ndim)))


def _backward_in_place(x: ArgSpec, normalized_ndim: int):
    """(statistics layout, weight / bias gradient placements) of a norm backward over ``x``
    with a layout with no placement form (``_stats_in_place``): the input gradient keeps ``x``'s
    layout, the parameter gradients are pending sums over the axes that split the tokens (each
    device sums its own) and replicated over the others (``specs.pending_in_place``). (None, None)
    otherwise, and for a layout with an offset (devices that hold nothing: left to the placement
    path)."""
    stats = _stats_in_place(x, normalized_ndim)
    param = pending_in_place(x, "sum") if stats is not None and not x.layout.offset else None
    return (stats, param) if param is not None else (None, None)


def _backward_placements(grad: ArgSpec, x: ArgSpec, normalized_ndim: int):
    """Placements of a norm backward: ``x``'s (normalized dims whole); the gradient keeps a
    pending sum where ``x`` is replicated (the backward is linear in it); the input gradient
    follows; weight and bias gradients are pending sums over every axis that splits the
    tokens (each rank sums its own) or holds a pending gradient, replicated elsewhere."""
    xt = _norm_input(x, normalized_ndim)
    gt = _grad_target(placements_of(grad), xt)
    param = tuple(Partial("sum") if not isinstance(g, Replicate) else Replicate() for g in gt)
    return xt, gt, param


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(call: OpCall) -> Sharding:
    """``x`` (B, S, H) ``[Shard(1)]``: grad_input ``[Shard(1)]``; grad_weight and grad_bias (H,)
    ``[Partial("sum")]``."""
    grad, x, normalized_shape, mean, rstd, weight, bias = call.args[:7]
    stats, param = _backward_in_place(x, len(normalized_shape))
    if stats is not None:
        values = [grad, x, mean, rstd, weight, bias]
        inputs = _specs_inputs(values, [x.layout, None, stats, stats, _replicated(weight), _replicated(bias)])
        return Sharding(inputs=inputs, outputs=(x.layout, param, param))
    xt, gt, param = _backward_placements(grad, x, len(normalized_shape))
    values = [grad, x, mean, rstd, weight, bias]
    inputs = _specs_inputs(values, [gt, xt, xt, xt, _replicated(weight), _replicated(bias)])
    return Sharding(inputs=inputs, outputs=(gt, param, param))


def _rms_norm_backward_formula(grad, x, normalized_shape, rstd, weight, output_mask):
    """What ``_fused_rms_norm_backward`` computes, from the formula (it has no CPU kernel):
    with ``xhat = x * rstd`` and ``gw = grad * weight``,
    ``grad_x = rstd * (gw - xhat * mean(gw * xhat))`` over the normalized dims, and
    ``grad_weight = sum over the leading dims of grad * xhat``."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    acc = accumulation_dtype(x.dtype)
    g, xs, r = grad.to(acc), x.to(acc), rstd.to(acc)
    xhat = xs * r
    gw = g * weight.to(acc) if weight is not None else g
    grad_x = grad_w = None
    if output_mask[0]:
        grad_x = (r * (gw - xhat * (gw * xhat).mean(dims, keepdim=True))).to(x.dtype)
    if output_mask[1] and weight is not None:
        lead = list(range(x.dim() - len(normalized_shape)))
        grad_w = (g * xhat).sum(lead).to(weight.dtype) if lead else (g * xhat).to(weight.dtype)
    return grad_x, grad_w


def _fused_rms_norm_backward_local(call, grad, x, normalized_shape, rstd, weight, output_mask):
    if x.device.type == "cpu":
        return _rms_norm_backward_formula(grad, x, normalized_shape, rstd, weight, output_mask)
    return aten._fused_rms_norm_backward.default(grad, x, normalized_shape, rstd, weight, output_mask)


@register(aten._fused_rms_norm_backward.default)
def fused_rms_norm_backward_rule(call: OpCall) -> Sharding:
    grad, x, normalized_shape, rstd, weight = call.args[:5]
    stats, param = _backward_in_place(x, len(normalized_shape))
    if stats is not None:
        inputs = _specs_inputs([grad, x, rstd, weight], [x.layout, None, stats, _replicated(weight)])
        return Sharding(inputs=inputs, outputs=(x.layout, param), local=_fused_rms_norm_backward_local)
    xt, gt, param = _backward_placements(grad, x, len(normalized_shape))
    inputs = _specs_inputs([grad, x, rstd, weight], [gt, xt, xt, _replicated(weight)])
    return Sharding(inputs=inputs, outputs=(gt, param), local=_fused_rms_norm_backward_local)


# ---------------------------------------------------------------------------
# group norm: by batch (each image's groups normalized on their own)
# ---------------------------------------------------------------------------


def _by_batch(x: ArgSpec) -> tuple:
    """Per mesh axis: ``Shard(0)`` where ``x``'s batch dim is sharded (plainly), else Replicate."""
    return tuple(Shard(0) if type(p) is Shard and p.dim % x.ndim == 0 else Replicate() for p in placements_of(x))


@register(aten.native_group_norm.default)
def group_norm_rule(call: OpCall) -> Sharding:
    """``native_group_norm(x (N, C, *), w, b, N, C, HxW, G, eps)``, ``x`` in ``[Shard(0)]``: each
    rank's images (the op told this rank's N); out, mean and rstd (N, G) ``[Shard(0)]``. Images
    dealt by a layout with no placement form likewise, every output in their map
    (``batched.samples_in_place``)."""
    x, weight, bias = call.args[:3]

    def local(call_, t, w, b, _n, c, hxw, group, eps):
        if t.shape[0] == 0:  # an empty piece of an uneven batch
            stats = t.new_empty((0, group))
            return t.clone(), stats, stats.clone()
        return aten.native_group_norm.default(t, w, b, t.shape[0], c, hxw, group, eps)

    in_place = samples_in_place(call, 1, batched=1, local=local)
    if in_place is not None:
        return in_place
    batch = _by_batch(x)
    inputs = _specs_inputs([x, weight, bias], [batch, _replicated(weight), _replicated(bias)])
    return Sharding(inputs=inputs, outputs=(batch, batch, batch), local=local)


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(call: OpCall) -> Sharding:
    """By batch, as the forward: grad_input ``[Shard(0)]``; grad_weight and grad_bias sum over the
    images, ``[Partial("sum")]`` on the batch's axes (on the axes that deal them, for images dealt
    by a layout with no placement form)."""
    grad, x, mean, rstd, weight = call.args[:5]

    def local(call_, g, t, m, r, w, _n, c, hxw, group, mask):
        if t.shape[0] == 0:  # an empty piece of an uneven batch: no images, nothing summed
            zeros = t.new_zeros((c,)) if w is None else torch.zeros_like(w)
            return (g.clone() if mask[0] else None, zeros if mask[1] else None, zeros.clone() if mask[2] else None)
        return aten.native_group_norm_backward.default(g, t, m, r, w, t.shape[0], c, hxw, group, mask)

    in_place = samples_in_place(call, 1, batched=4, summed=(1, 2), local=local)
    if in_place is not None:
        return in_place
    batch = _by_batch(x)
    summed = tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in batch)
    inputs = _specs_inputs([grad, x, mean, rstd, weight], [batch, batch, batch, batch, _replicated(weight)])
    return Sharding(inputs=inputs, outputs=(batch, summed, summed), local=local)
