"""Sharding rules for embedding lookups (``aten.embedding``) and their backward.

Per mesh axis, the weight ``(V, D)`` decides:

- ``Shard(0)`` (vocab-parallel): every rank looks up only the rows it holds; an index
  outside its rows gives a zero row, so the output is ``Partial("sum")`` (exactly one rank
  adds each real row). The indices must be whole on that axis (``Replicate``).
- ``Shard(1)``: each rank's columns of every row: the output is ``Shard(-1)``.
- ``Partial("sum")``: a row of a sum is the sum of the rows: the output stays partial.
- ``Replicate``: the output follows the indices (``Shard(i)`` of the indices -> ``Shard(i)``).

Example: ``V = 10`` on 4 ranks with ``[Shard(0)]`` holds rows ``[0,3) [3,6) [6,9) [9,10)``;
indices ``[[1, 9]]`` (replicated) give rank 0 ``[[w[1], 0]]`` and rank 3 ``[[0, w[9]]]``;
their sum is ``[[w[1], w[9]]]``.

Backward (``embedding_dense_backward``, which sees the output grad and the indices but not
the weight): on an axis where both are whole (or the grad is a pending sum of fewer rows than
the vocabulary: reduced first, the cheaper all-reduce), every rank builds only its vocab rows of the
weight grad (``Shard(0)``: what a vocab-sharded weight needs, with no communication and
``1/k`` of the memory); a replicated weight then receives a ``Shard(0)`` grad, which an
optimizer step gathers. Batch-sharded grads give a ``Partial("sum")`` weight grad, a grad
sharded on its last dim gives ``Shard(1)``.
"""

from __future__ import annotations

import math

import torch

from ..runtime import checks
from .registry import ArgSpec, OpCall, Partial, Replicate, Shard, Sharding, register
from .shard_ranges import Held, held_along, held_under
from ..layout import with_inner_dims
from .specs import padded, pending_in_place, reduced_in_place

aten = torch.ops.aten

__all__ = ["embedding_rule", "embedding_backward_rule"]


def _placements(spec: ArgSpec, mesh) -> tuple:
    """An argument's placements; a layout with no placement form is asked for as replicated."""
    return spec.placements if spec.placements is not None else (Replicate(),) * mesh.ndim


def _isShard(p, dim: int, ndim: int) -> bool:
    return type(p) is Shard and p.dim % max(ndim, 1) == dim


@register(aten.embedding.default)
def embedding_rule(call: OpCall) -> Sharding:
    weight, indices = call.args[0], call.args[1]
    mesh = call.mesh
    out_ndim = indices.ndim + 1
    w_in, i_in, out = [], [], []
    vocab_sharded = False
    for wp, ip in zip(_placements(weight, mesh), _placements(indices, mesh)):
        if _isShard(wp, 0, 2):
            w_in.append(wp), i_in.append(Replicate()), out.append(Partial("sum"))
            vocab_sharded = True
        elif _isShard(wp, 1, 2):
            w_in.append(wp), i_in.append(Replicate()), out.append(Shard(out_ndim - 1))
        elif isinstance(wp, Partial) and wp.reduce_op == "sum":
            w_in.append(wp), i_in.append(Replicate()), out.append(Partial("sum"))
        elif type(ip) is Shard:
            w_in.append(Replicate()), i_in.append(ip), out.append(Shard(ip.dim % indices.ndim))
        else:
            w_in.append(Replicate()), i_in.append(Replicate()), out.append(Replicate())
    w_in, i_in = tuple(w_in), tuple(i_in)
    looked_up = _ids_dealt(indices, weight.shape[-1]) if weight.is_replicated() else None
    if looked_up is not None:  # each device looks up its own ids in the whole table
        return Sharding(inputs=(None, None), outputs=looked_up, note="ids dealt by a layout: each device's own")
    if weight.placements is None:
        dealt = _dealt_rows(weight)
        if dealt is not None:
            held, out = dealt
            return Sharding(inputs=(None, (Replicate(),) * mesh.ndim), outputs=out,
                            local=_masked_lookup(weight.shape[0], held), note="vocab dealt by its layout: masked lookup")
    if not vocab_sharded:
        return Sharding(inputs=(w_in, i_in), outputs=tuple(out))
    held = held_under(weight.shape, mesh, w_in, 0)
    return Sharding(inputs=(w_in, i_in), outputs=tuple(out), local=_masked_lookup(weight.shape[0], held),
                    note="vocab-sharded: masked lookup, partial sum")


def _dealt_rows(weight: ArgSpec):
    """``(rows this rank holds, output placements)`` for a weight whose layout has no placement
    form but deals whole rows (each piece holds some rows, every column of them, row-major):
    each rank looks up its own rows and the output is a pending sum over the axes that deal
    them (``specs.pending_in_place``). None for any other layout (placements then gather it)."""
    out = pending_in_place(weight, "sum")
    if out is None or reduced_in_place(weight, [1]) is None:
        return None
    held = held_along(weight.spec, 0)
    return None if held is None else (held, out)


def _masked_lookup(vocab: int, held: Held):
    """The local lookup of a weight whose rows are split over ranks: rows this rank lacks give zeros."""

    def local(call, weight, indices, *rest, **kwargs):
        _check_in_range(indices, vocab)
        if held.size == 0:  # an uneven vocab leaves this rank no rows
            return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
        inside, rows = held.locate(indices)
        return aten.embedding(weight, rows).masked_fill(~inside.unsqueeze(-1), 0)  # an inf row times 0 would be nan

    return local


def _check_in_range(indices: torch.Tensor, vocab: int) -> None:
    """Every index names a row of the vocabulary (each rank masks the rows it lacks, so an index
    past the end would silently read zeros): ``IndexError`` naming the index, raised at once, or,
    on a GPU while autograd records, when the check settles (``runtime/checks.py``: at the end of
    the backward, or when a value is read) so that the host does not wait for the device here;
    a device-side assert in a compiled graph."""
    checks.check_range(indices, vocab, f"embedding: index {{value}} is out of range for a vocabulary of {vocab} rows")


def _ids_dealt(indices: ArgSpec, width: int):
    """The layout of the looked-up rows (each id's row of ``width`` whole, innermost) where a
    layout with no placement form deals the ids (no padding, nothing pending); None otherwise."""
    if indices.placements is not None or indices.reduce_op or padded(indices) or width < 1 or 0 in indices.shape:
        return None
    return with_inner_dims(indices.layout, tuple(indices.shape), (width,))


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall) -> Sharding:
    grad, indices, num_weights, padding_idx, scale_grad_by_freq = call.args[:5]
    mesh = call.mesh
    rows = None if scale_grad_by_freq else _ids_dealt(indices, grad.shape[-1])  # (counts would need every id)
    summed = None if rows is None else pending_in_place(indices, "sum")
    if summed is not None:  # each device adds its own ids' rows: a pending sum over the axes that deal them
        return Sharding(inputs=(rows, None), outputs=summed, note="ids dealt by a layout: each device's own")
    last = grad.ndim - 1
    g_in, i_in, out = [], [], []
    for gp, ip in zip(_placements(grad, mesh), _placements(indices, mesh)):
        if _isShard(gp, last, grad.ndim):
            g_in.append(gp), i_in.append(Replicate()), out.append(Shard(1))
        elif isinstance(gp, Partial) and gp.reduce_op == "sum" and math.prod(grad.shape[:-1]) >= num_weights:
            g_in.append(gp), i_in.append(Replicate()), out.append(Partial("sum"))
        elif not scale_grad_by_freq and (type(gp) is Shard or type(ip) is Shard):
            # batch-sharded: each rank's rows of the grad add into every weight row (a partial sum);
            # with scale_grad_by_freq the counts need every index, so that case gathers below
            d = gp.dim % grad.ndim if type(gp) is Shard else ip.dim % indices.ndim
            g_in.append(Shard(d)), i_in.append(Shard(d)), out.append(Partial("sum"))
        else:
            g_in.append(Replicate()), i_in.append(Replicate()), out.append(Shard(0))
    vocab = tuple(out)
    if not any(_isShard(p, 0, 2) for p in vocab):
        return Sharding(inputs=(tuple(g_in), tuple(i_in)), outputs=vocab)
    held = held_under((num_weights, grad.shape[-1]), mesh, vocab, 0)
    return Sharding(inputs=(tuple(g_in), tuple(i_in)), outputs=vocab, local=_masked_backward(held))


def _masked_backward(held: Held):
    """This rank's vocab rows of the weight grad: only the indices that fall in its rows count.
    The others (and the padding index) are sent to one extra row that is the padding row of the
    local backward, then dropped: no data-dependent shape (traceable, with no collective)."""

    def local(call, grad, indices, _num_weights, padding_idx, scale_grad_by_freq):
        checks.settle_after_backward()  # the forward's index check, if it waits
        size = held.size
        inside, local_rows = held.locate(indices)
        counted = inside & (indices != padding_idx)
        rows = torch.where(counted, local_rows, torch.full_like(indices, size))
        return aten.embedding_dense_backward(grad, rows, size + 1, size, scale_grad_by_freq)[:size]

    return local
