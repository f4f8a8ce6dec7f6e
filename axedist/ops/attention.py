"""Sharding rules for scaled dot-product attention (the fused aten kernels), forward and backward.

``F.scaled_dot_product_attention(q, k, v)`` with ``q: (B, H, L, E)``, ``k, v: (B, Hk, S, E)``
reaches DTensors as one fused kernel: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU;
``_scaled_dot_product_flash_attention`` / ``_efficient_attention`` / ``_cudnn_attention`` on
CUDA (each with its ``_backward``). Attention never mixes batch entries or heads, so each
mesh axis picks one *mode*, the same for every argument, and the kernel runs on local tensors:

- ``batch``: q, k, v (and the per-row statistics ``logsumexp``) ``Shard(0)``;
- ``head``: ``Shard(1)``. With grouped-query attention (``Hk < H``, ``enable_gqa``) a query
  head ``h`` reads key head ``h // (H/Hk)``, so heads are split only when every rank's
  key heads are whole groups (``Hk`` divisible by the ranks sharing the head dim);
- ``query`` (CPU flash kernel, not causal): q ``Shard(2)`` with k, v whole: each rank
  computes its query rows; the k and v grads are then ``Partial("sum")``;
- none: ``Replicate`` (so does ``dropout_p > 0``: every rank runs the same kernel with the
  same random state, which gives the unsharded result).

A mode comes from q's placement on that axis (then k's, v's). A q sharded on its sequence
dim with a causal mask or sharded k/v (sequence parallelism) moves to ``head`` (an
all-to-all) when the heads allow it, else to ``Replicate``. An ``attn_mask``/``attn_bias``
broadcast over ``(B, H, L, S)`` is split along the same dim when it has it (size > 1), else
kept whole; its grad (efficient attention) is a partial sum where it was broadcast.

Example: 4 ranks, ``q, k, v: (2, 8, 16, 64)`` in ``[Shard(1)]``: each rank runs the kernel
on its ``(2, 2, 16, 64)`` heads; the output is ``[Shard(1)]``, no communication, forward or
backward.

Layouts with no placement form run where they are (``_heads_in_place``): where every tensor
argument deals only its batch and head dims, the same way (heads dealt round-robin, as a
``ColwiseParallel(weight_layout=...)`` that deals head-sized blocks of output features leaves
them), with the sequence and feature dims whole and innermost in every piece, each device runs
the kernel on its own ``(b, h)`` pieces and every output keeps that map: no collective, forward or
backward. Placements would gather q, k and v first. Not for grouped-query attention (a device's
query heads must read key heads it may not hold), masks, dropout or the kernels whose statistics
are padded (efficient attention, cuDNN): those take the placement way.
"""

from __future__ import annotations

import torch

from ..layout import with_inner_dims
from .registry import ArgSpec, OpCall, Partial, Replicate, Shard, Sharding, register
from .shard_ranges import inputs_by_name, named_args
from .specs import reduced_in_place, spec_of

aten = torch.ops.aten

__all__ = ["attention_rule"]

_Q_LIKE = ("query", "grad_out", "grad_out_", "out")   # (B, H, L, *) arguments
_KV = ("key", "value")                                # (B, Hk, S, *)
_STATS = ("logsumexp",)                               # (B, H, L[padded], ...)
_MASKS = ("attn_mask", "attn_bias")                   # broadcast to (B, H, L, S)

# The role of each output, by position: q/k/v-like, stat (dims 0..2 as q's), bias grad,
# aux (seeds, offsets, cumulative lengths: whole on every rank), debug (the attention
# probabilities when return_debug_mask, else an empty tensor), None (not a tensor).
_OUTPUTS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("query", "stat"),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("query", "key", "value"),
    aten._scaled_dot_product_flash_attention.default:
        ("query", "stat", "aux", "aux", None, None, "aux", "aux", "debug"),
    aten._scaled_dot_product_flash_attention_backward.default: ("query", "key", "value"),
    aten._scaled_dot_product_efficient_attention.default: ("query", "stat", "aux", "aux"),
    aten._scaled_dot_product_efficient_attention_backward.default: ("query", "key", "value", "bias"),
    aten._scaled_dot_product_cudnn_attention.default:
        ("query", "stat", "aux", "aux", None, None, "aux", "aux", "debug"),
    aten._scaled_dot_product_cudnn_attention_backward.default: ("query", "key", "value"),
}

# Kernels whose statistics have exactly one entry per query row (efficient attention pads
# them), so their query rows may be split.
_QUERY_SPLIT = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)

_BATCH, _HEAD, _ROWS = 0, 1, 2   # the q dim each mode splits


def _placement(spec, index: int):
    if not isinstance(spec, ArgSpec) or spec.placements is None:
        return Replicate()
    return spec.placements[index]


def _choose_modes(call: OpCall, args: dict) -> list:
    """Per mesh axis: the q dim it splits (batch, head, query rows) or None (replicate)."""
    mesh = call.mesh
    query, key, value = args["query"], args["key"], args["value"]
    if args.get("dropout_p", 0.0) or query.ndim != 4:
        return [None] * mesh.ndim
    heads, kv_heads = query.shape[1], key.shape[1]
    head_parts = 1
    modes = []
    for index, k in enumerate(mesh.shape):
        placed = [_placement(s, index) for s in (query, key, value)]
        dims = [p.dim % 4 for p in placed if type(p) is Shard]
        mode = next((d for d in dims if d in (_BATCH, _HEAD)), None)
        head_ok = heads == kv_heads or kv_heads % (head_parts * k) == 0
        if mode == _HEAD and not head_ok:
            mode = None
        if mode is None and type(placed[0]) is Shard and placed[0].dim % 4 == _ROWS:
            kv_whole = all(isinstance(p, Replicate) for p in placed[1:])
            if kv_whole and not args.get("is_causal", False) and call.func in _QUERY_SPLIT:
                mode = _ROWS
            elif head_ok:
                mode = _HEAD  # sequence-sharded q/k/v: an all-to-all to heads beats gathering
        elif mode is None and dims and head_ok:
            mode = _HEAD
        if mode == _HEAD:
            head_parts *= k
        modes.append(mode)
    return modes


def _mask_placement(mask: ArgSpec, dim: int, grad: bool = False):
    """A mask broadcast to (B, H, L, S), split along q's ``dim`` where it has that dim."""
    mask_dim = mask.ndim - 4 + dim
    if mask_dim >= 0 and mask.shape[mask_dim] > 1:
        return Shard(mask_dim)
    return Partial("sum") if grad else Replicate()


def _role_placements(role: str, mode, mask: ArgSpec | None):
    if role == "aux":
        return Replicate()
    if mode is None:
        return Replicate()
    if role in ("key", "value") and mode == _ROWS:
        return Replicate()
    if role == "bias":
        return Replicate() if mask is None else _mask_placement(mask, mode, grad=True)
    if role == "debug":
        role = "stat"
    return Shard(mode)


# The kernels whose outputs' shapes the layout way knows: (B, H, L, Ev) outputs and gradients shaped
# as their inputs, (B, H, L) statistics (efficient attention and cuDNN pad or reshape theirs).
_IN_PLACE = (aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_flash_attention_backward.default)


def _heads_in_place(call: OpCall, args: dict) -> Sharding | None:
    """Every output laid out where the kernel runs on each device's own (batch, head) pieces: for
    tensor arguments whose layouts (no placement form, unpadded, nothing pending) all deal their
    first two dims by one map and hold the others whole and innermost in every piece, with as many
    key as query heads, no mask and no dropout. None otherwise."""
    if call.func not in _IN_PLACE or args.get("dropout_p", 0.0) or args.get("return_debug_mask", False):
        return None
    if any(isinstance(args.get(name), ArgSpec) for name in _MASKS):
        return None
    query, key, value = args["query"], args["key"], args["value"]
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4 or key.shape[1] != query.shape[1]:
        return None
    tensors = [args[name] for name in _Q_LIKE + _KV + _STATS if isinstance(args.get(name), ArgSpec)]
    # a replicated one (the output gradient of ``(out * g).sum()``) is cut where it is
    maps = {reduced_in_place(t, list(range(2, t.ndim))) for t in tensors if not t.is_replicated()}
    if len(maps) != 1 or None in maps:
        return None
    (heads,) = maps
    lead = tuple(query.shape[:2])
    replicated = [t for t in tensors if t.is_replicated()]
    cuts = [with_inner_dims(heads, lead, tuple(t.shape[2:])) for t in replicated]
    if None in cuts:
        return None
    inputs = [next((cut for t, cut in zip(replicated, cuts) if t is s), None) for s in call.specs]
    inner = {"query": (query.shape[2], value.shape[3]), "stat": (query.shape[2],)}
    if call.func in (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                     aten._scaled_dot_product_flash_attention_backward.default):
        inner = {name: tuple(args[name].shape[2:]) for name in ("query", "key", "value")}
    outputs = []
    for role in _OUTPUTS[call.func]:
        if role is None or role == "debug":
            outputs.append(None)
        elif role == "aux":
            outputs.append((Replicate(),) * call.mesh.ndim)
        else:
            laid = with_inner_dims(heads, lead, inner[role])
            if laid is None:
                return None
            outputs.append(laid)
    return Sharding(inputs=inputs, outputs=tuple(outputs), local=_run_kernel,
                    note="(batch, head) pieces dealt by a layout: each device's own heads")


@register(*_OUTPUTS)
def attention_rule(call: OpCall) -> Sharding:
    args = named_args(call)
    in_place = _heads_in_place(call, args)
    if in_place is not None:
        return in_place
    modes = _choose_modes(call, args)
    mask = next((args[name] for name in _MASKS if isinstance(args.get(name), ArgSpec)), None)
    wanted = {}
    for name in _Q_LIKE + _KV + _STATS:
        if isinstance(args.get(name), ArgSpec):
            role = "key" if name in _KV else "query"
            wanted[name] = tuple(_role_placements(role, m, None) for m in modes)
    if mask is not None:
        placed = tuple(Replicate() if m is None else _mask_placement(mask, m) for m in modes)
        for name in _MASKS:
            wanted[name] = placed
    inputs = inputs_by_name(call, wanted, default=(Replicate(),) * call.mesh.ndim)
    outputs = []
    backward_rows = call.func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    for role in _OUTPUTS[call.func]:
        if role is None or (role == "debug" and not args.get("return_debug_mask", False)):
            # an empty (0,) tensor has no DTensor form: the dispatcher hands it back as it is
            outputs.append(None)
        elif role in ("key", "value") and backward_rows:
            # each rank's query rows add into every key/value row
            outputs.append(tuple(Partial("sum") if m == _ROWS else _role_placements(role, m, mask) for m in modes))
        else:
            outputs.append(tuple(_role_placements(role, m, mask) for m in modes))
    # where every rank holds a whole, non-empty piece of every argument, the kernel is the op itself
    local = None if _pieces_filled(call, inputs) else _run_kernel
    return Sharding(inputs=inputs, outputs=tuple(outputs), local=local)


def _pieces_filled(call: OpCall, inputs) -> bool:
    """Whether every argument, laid out as its entry of ``inputs``, splits evenly into non-empty
    pieces on every rank (the same answer on every rank: it reads only global shapes)."""
    for spec, wanted in zip(call.specs, inputs):
        target = spec_of(spec.shape, call.mesh, tuple(wanted))
        if target.padded != target.shape or 0 in target.shape:
            return False
    return True


def _run_kernel(call: OpCall, *args, **kwargs):
    """The kernel on local tensors, except where a rank holds no rows: uneven splits (5 query
    rows on 4 ranks, 2 heads on 4) leave some ranks empty pieces, and the fused kernels may
    crash on those; such a rank's outputs are zeros of the shapes the kernel would give
    (its share of a partial k/v grad is zero too)."""
    names = [a.name for a in call.func._schema.arguments]
    named = dict(zip(names, args), **kwargs)
    if not any(isinstance(named.get(n), torch.Tensor) and named[n].numel() == 0 for n in _Q_LIKE + _KV):
        return call.func(*args, **kwargs)
    device = next(t.device for t in named.values() if isinstance(t, torch.Tensor))

    def meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    shapes = call.func(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})
    return tuple(torch.zeros(m.shape, dtype=m.dtype, device=device) if isinstance(m, torch.Tensor) else m
                 for m in shapes)
