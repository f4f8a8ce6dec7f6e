"""Sharding rules of ops that select, join, split and fill tensors.

cat/stack, split/split_with_sizes/unbind (``chunk`` arrives as ``split``), slice
(``narrow`` arrives as ``slice``), select, index_select, gather, scatter/scatter_add,
index_add, flip, and the backward ops these produce (``slice_backward``,
``select_backward``; ``index_add``/``scatter_add`` for index_select/gather, ``scatter``
for ``max.dim``).

The common idea: an op that only *moves* elements along some dims keeps every other
dim's sharding, and a dim it moves elements along must be whole on each device
(Replicate), unless the op leaves that dim untouched (a full slice). Example, 4 ranks,
``x`` of shape (8, 6) in ``[Shard(0)]``: ``x[:, 1:4]`` stays ``[Shard(0)]``, local
(2, 6) -> (2, 3), no communication; ``x[1:4]`` first gathers dim 0.

Pending reductions (``Partial``) commute with any op that only selects or places
elements (``sum_r x_r[i] = (sum_r x_r)[i]``), so selections keep them; an op that mixes
in values of its own (a nonzero fill of a pending sum) reduces first.

The placement helpers at the top are shared by ``reduction.py`` and ``norm.py``.
(``masked_fill`` and the ``new_*``/``*_like`` factories are elementwise: ``pointwise.py``.)
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .call_plan import DispatchError
from .registry import LINEAR_REDUCE_OPS, ArgSpec, OpCall, Sharding, register
from .shard_ranges import without_partial
from ..layout import Layout, with_dim_inserted, with_dims_inserted, with_inner_dims, without_dim
from .specs import layout_only, local_shape_of, padded, reduced_in_place

aten = torch.ops.aten

# ---------------------------------------------------------------------------
# Placement helpers (shared by the rules of this family, reductions and norms)
# ---------------------------------------------------------------------------


def placements_of(spec: ArgSpec) -> tuple[Placement, ...]:
    """The spec's placements; a layout with no placement form is asked to become replicated
    (the dispatcher moves the data), which is always correct."""
    if spec.placements is None:
        return (Replicate(),) * spec.mesh.ndim
    return tuple(spec.placements)


def shard_dim(p: Placement, ndim: int) -> int | None:
    """The tensor dim a ``Shard``/``_StridedShard`` splits (non-negative), else None."""
    if isinstance(p, (Shard, _StridedShard)):
        return p.dim % max(ndim, 1)
    return None


def is_plain_shard(p: Placement) -> bool:
    return isinstance(p, Shard) and not isinstance(p, _StridedShard)


def moved(p: Placement, dim: int) -> Placement:
    """The same kind of shard, on ``dim`` (a ``_StridedShard`` keeps its split factor)."""
    if isinstance(p, _StridedShard):
        return _StridedShard(dim, split_factor=p.split_factor)
    return Shard(dim)


def unshard(places, dims, ndim: int) -> tuple[Placement, ...]:
    """Replicate every mesh axis that shards one of ``dims``."""
    dims = {d % max(ndim, 1) for d in dims}
    return tuple(Replicate() if shard_dim(p, ndim) in dims else p for p in places)


def renumber(places, ndim: int, new_dim) -> tuple[Placement, ...]:
    """Shards moved to ``new_dim(old_dim)`` (None: that dim is gone, so Replicate)."""
    out = []
    for p in places:
        d = shard_dim(p, ndim)
        if d is None:
            out.append(p)
        else:
            nd = new_dim(d)
            out.append(Replicate() if nd is None else moved(p, nd))
    return tuple(out)


def reduce_op_of(places) -> str | None:
    for p in places:
        if isinstance(p, Partial):
            return p.reduce_op
    return None


def keeps_all_partials(own, target) -> bool:
    """Whether ``target`` keeps every pending axis of ``own`` or none of them: a tensor's
    pending reduction is applied over all its partial axes at once (``[Partial, Partial]``
    cannot become ``[Partial, Replicate]`` in one redistribute)."""
    kept = [isinstance(t, Partial) for o, t in zip(own, target) if isinstance(o, Partial)]
    return all(kept) or not any(kept)


def is_full_range(size: int, start, end, step) -> bool:
    """Whether ``slice(start, end, step)`` of a dim of ``size`` keeps it whole."""
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    return step == 1 and start <= 0 and end >= size


def _same_dim_choice(specs: list[ArgSpec], axis_index: int, allowed) -> Placement:
    """For joining ops (cat/stack): on one mesh axis, the plain Shard that the most inputs
    already have (replicated inputs take it by a local slice), or Replicate."""
    votes: dict[int, int] = {}
    for s in specs:
        p = placements_of(s)[axis_index]
        if is_plain_shard(p) and allowed(p.dim % max(s.ndim, 1)):
            votes[p.dim % max(s.ndim, 1)] = votes.get(p.dim % max(s.ndim, 1), 0) + s_numel(s)
    if not votes:
        return Replicate()
    return Shard(max(votes, key=lambda d: (votes[d], -d)))


def s_numel(spec: ArgSpec) -> int:
    n = 1
    for s in spec.shape:
        n *= s
    return n


def joint_placements(specs: list[ArgSpec], allowed=lambda d: True, linear: bool = True) -> tuple[Placement, ...]:
    """One placement per mesh axis that every input of a joining op takes.

    An axis where every input holds the same pending reduction keeps it (the op is linear
    in all inputs together: ``cat(sum a_r, sum b_r) = sum cat(a_r, b_r)``); otherwise the
    Shard the inputs agree on most (by elements), or Replicate.
    """
    mesh = specs[0].mesh
    out = []
    for i in range(mesh.ndim):
        ps = [placements_of(s)[i] for s in specs]
        if linear and all(isinstance(p, Partial) for p in ps) and len({p.reduce_op for p in ps}) == 1:
            out.append(ps[0])
        else:
            out.append(_same_dim_choice(specs, i, allowed))
    if not all(keeps_all_partials(placements_of(s), out) for s in specs):
        out = [_same_dim_choice(specs, i, allowed) if isinstance(p, Partial) else p for i, p in enumerate(out)]
    return tuple(out)


def tensor_specs(values) -> list[ArgSpec]:
    return [v for v in values if isinstance(v, ArgSpec)]


# ---------------------------------------------------------------------------
# Joining: cat, stack
# ---------------------------------------------------------------------------


@register(aten.cat.default)
def cat_rule(call: OpCall) -> Sharding:
    """``cat([a, b], 1)`` with ``a: [Shard(0)]``, ``b: [Replicate()]`` -> both ``[Shard(0)]``
    (b by a local slice), output ``[Shard(0)]``; the cat dim itself must be whole."""
    tensors = call.args[0]
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    specs = tensor_specs(tensors)
    ndim = specs[0].ndim
    d = dim % max(ndim, 1)
    found = rows_in_place(specs, d, [sum(t.shape[-1] for t in specs)]) if len(specs) == len(tensors) else None
    if found is not None:  # along whole rows dealt by a layout: each device joins its own rows
        return Sharding(inputs=found[0], outputs=found[1][0])
    target = joint_placements(specs, allowed=lambda e: e != d)
    return Sharding(inputs=[target] * len(specs), outputs=target)


@register(aten.stack.default)
def stack_rule(call: OpCall) -> Sharding:
    """``stack([a, b], 0)`` of ``[Shard(1)]`` inputs -> ``[Shard(2)]``."""
    tensors = call.args[0]
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    specs = tensor_specs(tensors)
    ndim = specs[0].ndim
    d = dim % (ndim + 1)
    if ndim >= 2 and d >= ndim - 1 and len(specs) == len(tensors):  # the new dim beside the last one
        width = specs[0].shape[-1]
        inner = (len(specs), width) if d == ndim - 1 else (width, len(specs))
        found = rows_in_place(specs, ndim - 1, [inner])
        if found is not None:  # rows dealt by a layout: each device stacks its own rows
            return Sharding(inputs=found[0], outputs=found[1][0])
    if len(specs) == len(tensors):
        stacked = _stacked_in_place(specs, d)
        if stacked is not None:  # pieces of a layout: each device stacks its own at d
            return stacked
    target = joint_placements(specs)
    out = renumber(target, ndim, lambda e: e if e < d else e + 1)
    return Sharding(inputs=[target] * len(specs), outputs=out)


def _stacked_in_place(specs: list[ArgSpec], d: int) -> Sharding | None:
    """``stack`` at ``d`` where an input has a layout with no placement form whose pieces are
    row-major (``layout.with_dim_inserted``): every input is asked for that layout (a replicated
    one is cut where it is) and each device stacks its own pieces; the new dim is whole on every
    device. ``stack([x, y], 0)`` of rows dealt round-robin in pairs moves nothing. None where
    no input has such a layout, an input is pending, or the shapes differ."""
    if any(s.reduce_op for s in specs) or len({s.shape for s in specs}) != 1:
        return None
    source = next((s for s in specs if layout_only(s)), None)
    if source is None or math.prod(source.shape) == 0:
        return None
    out = with_dim_inserted(source.layout, source.shape, d, len(specs))
    return None if out is None else Sharding(inputs=[source.layout] * len(specs), outputs=out)


def _index_taken_in_place(x: ArgSpec, d: int):
    """The layout each device's pieces leave when it takes one index of dim ``d`` of ``x`` (a
    layout with no placement form whose dim ``d`` is whole and local everywhere:
    ``layout.without_dim``); None otherwise (the placement way)."""
    if not isinstance(x, ArgSpec) or not layout_only(x) or x.ndim < 2 or math.prod(x.shape) == 0:
        return None
    return without_dim(x.layout, x.shape, d)


# ---------------------------------------------------------------------------
# Splitting: split, split_with_sizes, unbind
# ---------------------------------------------------------------------------


def _split_count(size: int, split_size: int) -> int:
    return max(1, -(-size // split_size)) if split_size > 0 else 1


@register(aten.split.Tensor, aten.unsafe_split.Tensor)
def split_rule(call: OpCall) -> Sharding:
    """``x.split(2, dim=1)`` keeps every dim's sharding but dim 1's (replicated first)."""
    x, split_size = call.args[0], call.args[1]
    dim = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    d = dim % max(x.ndim, 1)
    size = x.shape[d] if x.ndim else 1
    widths = [min(split_size, size - i) for i in range(0, size, split_size)] if split_size > 0 else []
    found = rows_in_place([x], d, widths) if widths else None
    if found is not None:  # along whole rows dealt by a layout: each device splits its own rows
        return Sharding(inputs=found[0], outputs=tuple(found[1]))
    target = unshard(placements_of(x), [d], x.ndim)
    n = _split_count(x.shape[d], split_size)
    return Sharding(inputs=[target], outputs=tuple([target] * n))


@register(aten.split_with_sizes.default, aten.unsafe_split_with_sizes.default)
def split_with_sizes_rule(call: OpCall) -> Sharding:
    x, sizes = call.args[0], call.args[1]
    dim = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    found = rows_in_place([x], dim % max(x.ndim, 1), list(sizes))
    if found is not None:  # along whole rows dealt by a layout: each device splits its own rows
        return Sharding(inputs=found[0], outputs=tuple(found[1]))
    target = unshard(placements_of(x), [dim], x.ndim)
    return Sharding(inputs=[target], outputs=tuple([target] * len(sizes)))


@register(aten.unbind.int)
def unbind_rule(call: OpCall) -> Sharding:
    """``x.unbind(0)`` of ``[Shard(1)]`` (shape (3, 8)) -> three ``[Shard(0)]`` rows."""
    x = call.args[0]
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    d = dim % max(x.ndim, 1)
    taken = _index_taken_in_place(x, d)
    if taken is not None:  # the dim whole on every device: each unbinds its own pieces
        return Sharding(inputs=[x.layout], outputs=tuple([taken] * x.shape[d]))
    target = unshard(placements_of(x), [d], x.ndim)
    out = renumber(target, x.ndim, lambda e: e if e < d else e - 1)
    return Sharding(inputs=[target], outputs=tuple([out] * x.shape[d]))


# ---------------------------------------------------------------------------
# Selecting: slice, select, index_select, gather, flip (and their backward ops)
# ---------------------------------------------------------------------------


@register(aten.slice.Tensor)
def slice_rule(call: OpCall) -> Sharding:
    """``x[:, 1:4]`` of ``[Shard(0)]`` stays ``[Shard(0)]``; ``x[1:4]`` gathers dim 0 first
    (unless the slice keeps the dim whole, like ``x[0:]``)."""
    x = call.args[0]
    dim, start, end, step = (call.arg(1, "dim", 0), call.arg(2, "start"), call.arg(3, "end"),
                             call.arg(4, "step", 1))
    d = dim % max(x.ndim, 1)
    if x.ndim:
        found = rows_in_place([x], d, [len(range(*slice(start, end, step).indices(x.shape[d])))])
        if found is not None:  # along whole rows dealt by a layout: each device slices its own rows
            return Sharding(inputs=found[0], outputs=found[1][0])
    places = placements_of(x)
    if not is_full_range(x.shape[d], start, end, step):
        places = unshard(places, [d], x.ndim)
    return Sharding(inputs=[places], outputs=places)


@register(aten.slice_backward.default)
def slice_backward_rule(call: OpCall) -> Sharding:
    """The gradient of a slice: zeros of the input's size with ``grad`` placed in the sliced
    range; ``grad``'s other dims keep their sharding, and a pending sum stays pending (zeros
    add up to zeros)."""
    grad, sizes, dim, start, end, step = call.args[:6]
    d = dim % max(grad.ndim, 1)
    found = rows_in_place([grad], d, [sizes[d]]) if grad.ndim else None
    if found is not None:  # along whole rows dealt by a layout: each device pads its own rows
        return Sharding(inputs=found[0], outputs=found[1][0], local=_rows_padded)
    places = placements_of(grad)
    if not is_full_range(sizes[d], start, end, step) or grad.shape[d] != sizes[d]:
        places = unshard(places, [d], grad.ndim)
    return Sharding(inputs=[places], outputs=places, local=_with_local_sizes(sizes, call.mesh, places))


def _rows_padded(call, grad, sizes, *rest):
    """slice_backward of this device's rows: its rows' count, the whole last dim."""
    return call.func(grad, [*grad.shape[:-1], sizes[-1]], *rest)


def _with_local_sizes(sizes, mesh, out_places):
    """The local function of a backward op that takes the input's global ``sizes`` as its
    second argument: the op given this rank's sizes of its output instead (``select_backward``
    of a ``[Shard(0)]`` grad on 4 ranks makes ``(2, 6)`` zeros, not ``(8, 6)``)."""
    local_sizes = local_shape_of(tuple(sizes), mesh, out_places)

    def local(call, grad, _global_sizes, *rest, **kwargs):
        return call.func(grad, list(local_sizes), *rest, **kwargs)

    return local


@register(aten.narrow_copy.default)
def narrow_copy_rule(call: OpCall) -> Sharding:
    """``x.narrow_copy(1, 2, 3)``: as ``x[:, 2:5]`` (a slice), a new tensor."""
    x, dim, start, length = call.args[:4]
    d = dim % max(x.ndim, 1)
    places = placements_of(x)
    if not is_full_range(x.shape[d], start, start + length, 1):
        places = unshard(places, [d], x.ndim)
        return Sharding(inputs=[places], outputs=places)
    # the whole dim: each rank copies its own rows (the global start and length do not fit them)
    return Sharding(inputs=[places], outputs=places, local=_copy_of_local)


def _copy_of_local(call, local, *rest):
    return local.clone(memory_format=torch.contiguous_format)


@register(aten.select.int)
def select_rule(call: OpCall) -> Sharding:
    """``x[:, 2]`` of ``[Shard(0)]`` -> ``[Shard(0)]``; ``x[2]`` of ``[Shard(1)]`` -> ``[Shard(0)]``."""
    x, dim = call.args[0], call.args[1]
    d = dim % max(x.ndim, 1)
    taken = _index_taken_in_place(x, d)
    if taken is not None:  # the dim whole on every device: each selects from its own pieces
        return Sharding(inputs=[x.layout], outputs=taken)
    target = unshard(placements_of(x), [d], x.ndim)
    out = renumber(target, x.ndim, lambda e: e if e < d else e - 1)
    return Sharding(inputs=[target], outputs=out)


@register(aten.select_backward.default)
def select_backward_rule(call: OpCall) -> Sharding:
    """The gradient of ``x[:, i]``: zeros of ``x``'s size with ``grad`` in column ``i``; ``grad``'s
    shards move to the dims they are in ``x`` (the local op gets this rank's sizes)."""
    grad, sizes, dim = call.args[0], call.args[1], call.args[2]
    d = dim % len(sizes)
    places = placements_of(grad)
    out = renumber(places, grad.ndim, lambda e: e if e < d else e + 1)
    return Sharding(inputs=[places], outputs=out, local=_with_local_sizes(sizes, call.mesh, out))


@register(aten.flip.default)
def flip_rule(call: OpCall) -> Sharding:
    """Flipped dims must be whole on each device; the others keep their sharding."""
    x, dims = call.args[0], call.args[1]
    rows = _row_wise([x], dims[0] % x.ndim, 0) if x.ndim and len(dims) == 1 else None
    if rows is not None:  # along whole rows dealt by a layout: each device flips its own rows
        return rows
    target = unshard(placements_of(x), list(dims), x.ndim)
    return Sharding(inputs=[target], outputs=target)


@register(aten.index_select.default)
def index_select_rule(call: OpCall) -> Sharding:
    """``x.index_select(1, idx)``: dim 1 of ``x`` whole; ``x``'s other shards kept; an index
    sharded where ``x`` is replicated shards the output's dim 1 (each rank picks its rows).

    ``x: (4, 10) [Shard(0)]``, ``idx: (3,) [Replicate()]`` -> ``(4, 3) [Shard(0)]``.
    """
    x, dim, index = call.args[0], call.args[1], call.args[2]
    d = dim % max(x.ndim, 1)
    has_index = isinstance(index, ArgSpec)
    found = rows_in_place([x], d, [index.shape[0] if index.ndim else 1]) if x.ndim >= 2 else None
    if found is not None:  # along whole rows dealt by a layout: each device picks from its own rows
        everywhere = (Replicate(),) * call.mesh.ndim
        return Sharding(inputs=found[0] + ([everywhere] if has_index else []), outputs=found[1][0])
    xp = list(unshard(placements_of(x), [d], x.ndim))
    ip = list(without_partial(placements_of(index))) if has_index else []
    out = list(xp)
    for i in range(len(xp)):
        if not has_index:
            continue
        if is_plain_shard(ip[i]) and isinstance(xp[i], Replicate) and x.ndim:  # (a 0-dim result has no dim to shard)
            out[i] = Shard(d)
        else:
            ip[i] = Replicate()
    inputs = [tuple(xp)] + ([tuple(ip)] if has_index else [])
    return Sharding(inputs=inputs, outputs=tuple(out))


# Searching: each element of one tensor looked up in another, whole on every rank
# ---------------------------------------------------------------------------


@register(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.bucketize.Tensor)
def lookup_rule(call: OpCall) -> Sharding | None:
    """``torch.isin(x, test)`` / ``torch.bucketize(x, boundaries)``: each element of ``x`` on its own,
    against the whole second tensor: the output sharded as ``x`` (nothing pending), the second
    tensor replicated. ``x`` (8, 6) in ``[Shard(0)]``: local, ``[Shard(0)]``."""
    x = call.args[0]
    if not isinstance(x, ArgSpec):
        return None
    target = without_partial(placements_of(x))
    others = [(Replicate(),) * call.mesh.ndim] * (len(call.specs) - 1)
    return Sharding(inputs=[target] + others, outputs=target)


@register(aten.searchsorted.Tensor)
def searchsorted_rule(call: OpCall) -> Sharding | None:
    """``torch.searchsorted(sorted, x)`` with a 1-D ``sorted``: as ``bucketize`` (each element of ``x``
    looked up in the whole sequence); an N-D sequence or a ``sorter`` goes through the gather fallback."""
    sequence, x = call.args[0], call.args[1]
    if not isinstance(x, ArgSpec) or not isinstance(sequence, ArgSpec) or sequence.ndim != 1 \
            or call.kwargs.get("sorter") is not None or len(call.specs) != 2:
        return None
    target = without_partial(placements_of(x))
    return Sharding(inputs=[(Replicate(),) * call.mesh.ndim, target], outputs=target)


# ---------------------------------------------------------------------------
# Advanced indexing (plain index tensors and lists arrive replicated: ops/variants.py)
# ---------------------------------------------------------------------------


def _advanced_index(x: ArgSpec, indices):
    """Where ``x[indices]`` (advanced indexing, ``indices[d]`` None where dim ``d`` is taken whole)
    puts ``x``'s dims: ``(indexed dims, new_dim, result ndim)`` with ``new_dim(e)`` the result dim
    of an un-indexed dim ``e``. The indices' broadcast dims stand in place of the indexed dims where
    those are adjacent, else first (torch's rule); None for bool masks (a result size only their
    values give) and for an index with no tensor."""
    indexed = [d for d, i in enumerate(indices) if i is not None]
    if not indexed or any(indices[d].dtype in (torch.bool, torch.uint8) for d in indexed):
        return None
    nb = len(torch.broadcast_shapes(*(tuple(indices[d].shape) for d in indexed)))
    kept = [e for e in range(x.ndim) if e not in indexed]
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        def new_dim(e):
            return e if e < indexed[0] else e - len(indexed) + nb
    else:
        def new_dim(e):
            return nb + kept.index(e)
    return indexed, new_dim, nb + len(kept)


@register(aten.index.Tensor)
def index_rule(call: OpCall) -> Sharding | None:
    """``x[:, idx]``: the indexed dims whole on every device, the indices replicated; ``x``'s other
    shards stay with their dims (``_advanced_index``); a pending value stays pending (indexing only
    selects). Bool masks go through the gather fallback.
    ``x: (4, 6) [Shard(0)]``, ``x[:, [1, 3]]`` -> ``(4, 2) [Shard(0)]``; ``x: (4, 6, 8) [Shard(2)]``,
    ``x[idx0, :, idx2]`` with ``idx: (5,)`` -> ``(5, 6)`` replicated on that axis (dim 2 indexed)."""
    x, indices = call.args[0], call.args[1]
    where = _advanced_index(x, indices)
    if where is None:
        return None
    index_specs = [i for i in indices if isinstance(i, ArgSpec)]
    everywhere = (Replicate(),) * call.mesh.ndim
    if _last_dim_indexed(x, indices):  # whole rows dealt by a layout: each device picks from its own rows
        found = rows_in_place([x], x.ndim - 1, [tuple(indices[-1].shape)])
        if found is not None:
            return Sharding(inputs=found[0] + [everywhere] * len(index_specs), outputs=found[1][0])
    indexed, new_dim, _ = where
    target = unshard(placements_of(x), indexed, x.ndim)
    return Sharding(inputs=[target] + [everywhere] * len(index_specs), outputs=renumber(target, x.ndim, new_dim))


def _last_dim_indexed(x: ArgSpec, indices) -> bool:
    """Whether ``x[..., idx]`` indexes only ``x``'s last dim, with one index tensor (its shape
    replaces that dim): the case each device answers from its own whole rows."""
    return (len(indices) == x.ndim >= 2 and all(i is None for i in indices[:-1])
            and isinstance(indices[-1], (ArgSpec, torch.Tensor)))


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put_rule(call: OpCall) -> Sharding | None:
    """``x[:, idx] = values`` (``accumulate``: ``+=``; index's backward): the indexed dims of ``x``
    whole, the indices replicated, ``values`` sharded as ``x[:, idx]`` would be where it has that
    dim's full size (a broadcast dim of size 1 replicated); pending values reduced first. An
    in-place call whose ``x`` would have to move goes through the gather fallback.
    ``x: (4, 6) [Shard(0)]``, ``values: (4, 2)``, ``x[:, [1, 3]] = values`` -> values ``[Shard(0)]``."""
    x, indices, values = call.args[0], call.args[1], call.args[2]
    where = _advanced_index(x, indices)
    if where is None:
        return None
    rows = _rows_put(call, x, indices, values)
    if rows is not None:
        return rows
    indexed, new_dim, result_ndim = where
    target = without_partial(unshard(placements_of(x), indexed, x.ndim))
    if call.func != aten.index_put.default and x.placements != target:
        return None
    inputs = [target] + [(Replicate(),) * call.mesh.ndim] * sum(isinstance(i, ArgSpec) for i in indices)
    if isinstance(values, ArgSpec):
        lead = result_ndim - values.ndim
        wanted = []
        for p in target:
            d = shard_dim(p, x.ndim)
            j = None if d is None else new_dim(d) - lead
            wanted.append(moved(p, j) if j is not None and j >= 0 and values.shape[j] != 1 else Replicate())
        inputs.append(tuple(wanted))
    return Sharding(inputs=inputs, outputs=target)


def _rows_put(call: OpCall, x: ArgSpec, indices, values) -> Sharding | None:
    """``x[..., idx] = values`` (or ``+=``: index's backward) into whole rows dealt by a layout
    (of ``x`` or of ``values``, whose dims are ``x``'s rows then ``idx``'s): both in that map of
    rows, each device writes its own; a replicated ``values`` that broadcasts over the rows stays
    whole. An in-place call only where ``x`` stays. None otherwise (the placement way)."""
    if not _last_dim_indexed(x, indices) or x.reduce_op or 0 in x.shape:
        return None
    lead = tuple(x.shape[:-1])
    everywhere = (Replicate(),) * call.mesh.ndim
    in_rows = isinstance(values, ArgSpec) and values.ndim == len(lead) + indices[-1].ndim \
        and tuple(values.shape[:len(lead)]) == lead
    if isinstance(values, ArgSpec) and (values.reduce_op or 0 in values.shape or not (in_rows or values.is_replicated())):
        return None
    rows = reduced_in_place(x, [x.ndim - 1])
    if rows is None and in_rows:
        rows = reduced_in_place(values, range(len(lead), values.ndim))
    target = None if rows is None else with_inner_dims(rows, lead, (x.shape[-1],))
    if target is None:
        return None
    stays = x.placements is None and not padded(x) and target == x.layout
    if call.func is not aten.index_put.default and not stays:
        return None
    value_targets = []
    if isinstance(values, ArgSpec):
        value_targets.append(with_inner_dims(rows, lead, tuple(values.shape[len(lead):])) if in_rows else everywhere)
        if value_targets[0] is None:
            return None
    index_specs = sum(isinstance(i, ArgSpec) for i in indices)
    return Sharding(inputs=[None if stays else target] + [everywhere] * index_specs + value_targets, outputs=target)


@register(aten.index_add.default)
def index_add_rule(call: OpCall) -> Sharding:
    """``x.index_add(dim, idx, src)`` (index_select's backward): ``x`` and ``src`` share their
    shards off ``dim``, ``dim`` is whole, the index replicated; pending sums in both ``x``
    and ``src`` stay pending (the op is linear in them together)."""
    x, dim, index, src = call.args[:4]
    d = dim % max(x.ndim, 1)
    specs = [s for s in (x, src) if isinstance(s, ArgSpec)]
    found = rows_in_place(specs, d, [x.shape[-1]]) if len(specs) == 2 and x.ndim >= 2 else None
    if found is not None:  # along whole rows dealt by a layout: each device adds into its own rows
        (x_target, src_target), out = found[0], found[1][0]
    else:
        out = joint_placements(specs, allowed=lambda e: e != d and x.shape[e] == src.shape[e])
        x_target = src_target = out = tuple(p if not isinstance(p, Partial) or p.reduce_op == "sum" else Replicate()
                                            for p in out)
    everywhere = (Replicate(),) * x.mesh.ndim
    return Sharding(inputs=[x_target if v is x else src_target if v is src else everywhere
                            for v in (x, index, src) if isinstance(v, ArgSpec)], outputs=out)


def _index_axis(dim: int, shapes, ps):
    """One mesh axis of gather/scatter: the placement each tensor takes and the output's.

    ``shapes``/``ps``: (self, index, src?) shapes and placements. A dim ``e != dim`` may stay
    sharded when every tensor has the same size there (element (.., i_e, ..) of every
    tensor then sits on the same rank)."""
    ndim = len(shapes[0])
    for p in ps:
        e = shard_dim(p, ndim)
        if is_plain_shard(p) and e != dim and len({s[e] for s in shapes}) == 1:
            return [Shard(e)] * len(ps), Shard(e)
    return [Replicate()] * len(ps), Replicate()


def rows_in_place(tensors, d: int, widths) -> tuple[list, list] | None:
    """For an op that works row by row along the last dim ``d`` (gather / scatter, slicing,
    splitting and joining, scans, sort, flip, roll): ``(input targets, output layouts)`` where the
    tensors share their leading dims and one of them has a layout with no placement form that
    deals whole rows (``specs.reduced_in_place``). Every tensor is asked for that map of rows (a
    replicated one, such as the zeros of ``max``'s backward, is cut where it is) and each device
    works on its own rows; an output of last-dim width ``w`` (one per entry of ``widths``; a
    tuple for several inner dims, as ``stack`` makes) keeps the map of rows. None otherwise (the
    placement strategies apply)."""
    if not tensors or not all(isinstance(t, ArgSpec) for t in tensors) or any(t.reduce_op for t in tensors):
        return None
    last = tensors[0].ndim - 1
    if last < 1 or d != last or len({t.shape[:-1] for t in tensors}) != 1 or any(t.ndim != last + 1 for t in tensors):
        return None
    inners = [tuple(w) if isinstance(w, (tuple, list)) else (w,) for w in widths]
    if any(math.prod(inner) < 1 for inner in inners) or any(t.shape[-1] < 1 for t in tensors):
        return None  # (an empty row has no layout of its own: the placement way)
    rows = next((r for r in (reduced_in_place(t, [last]) for t in tensors) if r is not None), None)
    if rows is None:
        return None
    lead = tensors[0].shape[:-1]
    targets = [with_inner_dims(rows, lead, (t.shape[-1],)) for t in tensors]
    outputs = [with_inner_dims(rows, lead, inner) for inner in inners]
    if any(t is None for t in targets + outputs):
        return None
    return targets, outputs


def _row_wise(tensors, d: int, out_like: int) -> Sharding | None:
    """``rows_in_place`` for one output laid out as ``tensors[out_like]``, as a Sharding."""
    if not all(isinstance(t, ArgSpec) for t in tensors) or tensors[out_like].ndim < 2:
        return None
    found = rows_in_place(tensors, d, [tensors[out_like].shape[-1]])
    return None if found is None else Sharding(inputs=found[0], outputs=found[1][0])


@register(aten.gather.default)
def gather_rule(call: OpCall) -> Sharding:
    """``x.gather(1, idx)``: out[i, j] = x[i, idx[i, j]].

    Per mesh axis: an index sharded on ``dim`` with ``x`` replicated gives an output sharded
    the same way; a dim sharded alike in both (same size) stays sharded; a pending reduction
    of ``x`` with a replicated index stays pending (gather only selects); else replicate.
    ``x: (6, 5) [Shard(0)]``, ``idx: (6, 2) [Shard(0)]``, dim 1 -> out ``(6, 2) [Shard(0)]``.
    """
    x, dim, index = call.args[0], call.args[1], call.args[2]
    d = dim % max(x.ndim, 1)
    rows = _row_wise([x, index], d, out_like=1)
    if rows is not None:
        return rows
    xt, it, out = [], [], []
    for xp, ip in zip(_placements_or_scalar(x, call.mesh), without_partial(_placements_or_scalar(index, call.mesh))):
        if isinstance(xp, Partial):
            xt.append(xp), it.append(Replicate()), out.append(xp)
        elif is_plain_shard(ip) and ip.dim % max(x.ndim, 1) == d:
            xt.append(Replicate()), it.append(ip), out.append(ip)
        else:
            (a, b), o = _index_axis(d, [x.shape, index.shape], [xp, ip])
            xt.append(a), it.append(b), out.append(o)
    inputs = [tuple(p) for p, v in ((xt, x), (it, index)) if isinstance(v, ArgSpec)]
    return Sharding(inputs=inputs, outputs=tuple(out))


def _placements_or_scalar(value, mesh) -> tuple:
    """A DTensor argument's placements; a plain 0-dim tensor (a scalar: autograd's index of a
    0-dim input) reads as replicated."""
    return placements_of(value) if isinstance(value, ArgSpec) else (Replicate(),) * mesh.ndim


@register(aten.scatter.src, aten.scatter.value, aten.scatter_add.default)
def scatter_rule(call: OpCall) -> Sharding:
    """``x.scatter(dim, idx, src)`` / ``scatter_add``: dims off ``dim`` with equal sizes in all
    three tensors may stay sharded alike; ``dim`` and everything else replicated. With a
    replicated index, pending sums in both ``x`` and ``src`` stay pending (the op is linear in
    them together: every rank writes the same positions)."""
    x, dim, index = call.args[0], call.args[1], call.args[2]
    src = call.args[3] if len(call.args) > 3 else call.kwargs.get("src", call.kwargs.get("value"))
    d = dim % max(x.ndim, 1)
    tensors = [x, index] + ([src] if isinstance(src, ArgSpec) else [])
    rows = _row_wise(tensors, d, out_like=0)
    if rows is not None:
        return rows
    places = [_placements_or_scalar(t, call.mesh) for t in tensors]
    targets = [[] for _ in tensors]
    out = []
    # pending sums stay pending when x and src are pending on exactly the same axes
    data = [places[0]] + places[2:]
    linear = isinstance(src, ArgSpec) and len({tuple(isinstance(p, Partial) and p.reduce_op == "sum" for p in ps)
                                                 for ps in data}) == 1 and \
        not any(isinstance(p, Partial) for p in places[1]) and \
        all(not isinstance(p, Partial) or p.reduce_op == "sum" for p in places[0])
    for axis in range(call.mesh.ndim):
        ps = [p[axis] for p in places]
        if linear and isinstance(ps[0], Partial):
            chosen, o = [ps[0], Replicate()] + ps[2:], ps[0]
        else:
            chosen, o = _index_axis(d, [t.shape for t in tensors], ps)
        for t, c in zip(targets, chosen):
            t.append(c)
        out.append(o)
    return Sharding(inputs=[tuple(t) for t, v in zip(targets, tensors) if isinstance(v, ArgSpec)], outputs=tuple(out))


@register(aten.scatter_reduce.two)
def scatter_reduce_rule(call: OpCall) -> Sharding:
    """``x.scatter_reduce(dim, idx, src, "amax")``: as ``scatter`` (dims off ``dim`` of equal size
    in all three stay sharded alike), with every pending value applied first (not linear).

    "amax"/"amin" of a pending sum or average (``x`` or ``src``) is refused, as torch's DTensor
    refuses the op: autograd's formula saves the pending value and tests it for equality with the
    result, reducing it again along another route whose last bit can differ (4 summands reduced
    to ``Shard(1)`` and to ``Shard(0)``), so no element ties and its gradient is 0 / 0 = NaN."""
    x, dim, index, src = call.args[:4]
    d = dim % max(x.ndim, 1)
    tensors = [t for t in (x, index, src) if isinstance(t, ArgSpec)]
    if len(tensors) != 3:
        return None
    reduce = call.args[4] if len(call.args) > 4 else call.kwargs.get("reduce")
    for name, t in (("self", x), ("src", src)):
        if reduce in ("amax", "amin") and t.reduce_op in LINEAR_REDUCE_OPS:
            raise DispatchError(
                f"scatter_reduce(..., {reduce!r}) with {name} pending a {t.reduce_op} ({t}): its gradient "
                f"compares the pending value, reduced again, with the result, and a sum reduced along another "
                f"route can differ in the last bit (NaN gradients); reduce it first, e.g. "
                f"{name}.redistribute(placements=[Replicate()] * mesh.ndim) or {name}.full_tensor()")
    places = [without_partial(placements_of(t)) for t in tensors]
    targets, out = [[], [], []], []
    for axis in range(call.mesh.ndim):
        chosen, o = _index_axis(d, [t.shape for t in tensors], [p[axis] for p in places])
        for t, c in zip(targets, chosen):
            t.append(c)
        out.append(o)
    return Sharding(inputs=[tuple(t) for t in targets], outputs=tuple(out))


def self_stays(sharding: Sharding | None, self: ArgSpec) -> Sharding | None:
    """An in-place op's sharding when it neither moves ``self`` nor keeps a pending value, else
    None (the gather fallback writes the whole result back into ``self``'s layout)."""
    if sharding is None or sharding.inputs[0] is not None or self.reduce_op:
        return None
    if self.placements is None:  # a layout with no placement form: kept where the output keeps it
        return sharding if not padded(self) and sharding.outputs == self.layout else None
    return sharding if tuple(sharding.outputs) == tuple(placements_of(self)) else None


def _in_place(call: OpCall, rule) -> Sharding | None:
    """The out-of-place ``rule``'s sharding for the in-place form, where ``x`` keeps its layout."""
    x = call.args[0]
    inner = rule(call)
    own = x.placements if x.placements is not None else x.layout
    if inner.inputs[0] is not None and _as_target(inner.inputs[0]) == own:
        inner = Sharding(inputs=[None] + list(inner.inputs[1:]), outputs=inner.outputs)
    return self_stays(inner, x)


def _as_target(target):
    """A rule's target as it compares with a spec's placements (a tuple) or layout."""
    return target if isinstance(target, Layout) else tuple(target)


@register(aten.scatter_.value, aten.scatter_.src, aten.scatter_add_.default)
def scatter_inplace_rule(call: OpCall) -> Sharding | None:
    """``x.scatter_(dim, idx, v)``: ``scatter``'s rule where ``x`` keeps its layout."""
    return _in_place(call, scatter_rule)


@register(aten.index_add_.default)
def index_add_inplace_rule(call: OpCall) -> Sharding | None:
    """``x.index_add_(dim, idx, src)``: ``index_add``'s rule where ``x`` keeps its layout."""
    return _in_place(call, index_add_rule)


@register(aten.index_reduce.default, aten.index_copy.default)
def index_reduce_rule(call: OpCall) -> Sharding:
    """``x.index_reduce(dim, idx, src, "prod")`` / ``index_copy``: ``x`` and ``src`` share their
    shards off ``dim``, ``dim`` whole, the index replicated; pending values applied first."""
    x, dim, index, src = call.args[:4]
    d = dim % max(x.ndim, 1)
    specs = [s for s in (x, src) if isinstance(s, ArgSpec)]
    target = without_partial(joint_placements(specs, allowed=lambda e: e != d and x.shape[e] == src.shape[e],
                                              linear=False))
    inputs = []
    for value in (x, index, src):
        if isinstance(value, ArgSpec):
            inputs.append(target if value is not index else (Replicate(),) * x.mesh.ndim)
    return Sharding(inputs=inputs, outputs=target)


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill_rule(call: OpCall) -> Sharding:
    """``x.index_fill(1, idx, v)``: dim 1 whole, ``x``'s other shards kept, the index (and a
    tensor ``v``) replicated; a pending ``x`` applied first (the fill is no summand)."""
    x, dim = call.args[0], call.args[1]
    d = dim % max(x.ndim, 1)
    target = without_partial(unshard(placements_of(x), [d], x.ndim))
    full = (Replicate(),) * call.mesh.ndim
    return Sharding(inputs=[target] + [full] * (len(call.specs) - 1), outputs=target)


@register(aten.roll.default)
def roll_rule(call: OpCall) -> Sharding:
    """``x.roll(2, 1)``: rolled dims whole, the others keep their shards (a pending sum too:
    rolling only moves elements); with no dims (the flattened tensor) everything whole."""
    x, dims = call.args[0], call.arg(2, "dims", [])
    rows = _row_wise([x], dims[0] % x.ndim, 0) if x.ndim and len(dims) == 1 else None
    if rows is not None:  # along whole rows dealt by a layout: each device rolls its own rows
        return rows
    places = placements_of(x)
    target = unshard(places, list(dims), x.ndim) if dims else tuple(Replicate() for _ in places)
    return Sharding(inputs=[target], outputs=target)


def _repeated_in_place(x: ArgSpec, repeats: list[int]):
    """The layout each device's ``repeat`` of its pieces leaves, for ``x`` laid out with no
    placement form and row-major pieces: a repeated dim ``d`` of ``n`` becomes ``(r, n)`` with
    the ``r`` copies outermost in the piece's memory at ``d`` (``layout.with_dim_inserted``; the
    one list of iters reads as the ``r * n`` dim, index ``c * n + i`` at copy ``c`` of index
    ``i``), new leading dims whole and local. None otherwise (the placement way)."""
    lead = len(repeats) - x.ndim
    if not layout_only(x) or x.reduce_op or math.prod(x.shape) == 0 or min(repeats) < 1:
        return None
    # where each copies dim lands in the result before the merge: the new leading dims first,
    # then before each repeated dim of x
    inserted, position = [(e, r) for e, r in enumerate(repeats[:lead])], lead
    for d in range(x.ndim):
        if repeats[lead + d] > 1:
            inserted.append((position, repeats[lead + d]))
            position += 1
        position += 1
    return with_dims_inserted(x.layout, x.shape, inserted)


@register(aten.repeat.default)
def repeat_rule(call: OpCall) -> Sharding:
    """``x.repeat(1, 3)`` of (4, 5) ``[Shard(0)]``: (4, 15) ``[Shard(0)]``, local. A dim repeated
    more than once is whole (its tiles interleave the shards); new leading dims shift the rest.
    Where ``x`` has a layout with no placement form, each device repeats its own pieces
    (``_repeated_in_place``): nothing moves."""
    x, repeats = call.args[0], list(call.args[1])
    lead = len(repeats) - x.ndim
    found = _repeated_in_place(x, repeats) if isinstance(x, ArgSpec) else None
    if found is not None:
        return Sharding(inputs=[x.layout], outputs=found)
    places = placements_of(x)
    target = unshard(places, [e for e in range(x.ndim) if repeats[lead + e] != 1], x.ndim)
    return Sharding(inputs=[target], outputs=renumber(target, x.ndim, lambda e: e + lead))


@register(aten.slice_scatter.default, aten.select_scatter.default)
def slice_scatter_rule(call: OpCall) -> Sharding | None:
    """``x.slice_scatter(src, dim, 1, 3)`` / ``x.select_scatter(src, dim, i)``: ``dim`` whole in
    ``x`` (and ``src``); the other dims sharded alike in both where their sizes agree; pending
    values applied first."""
    x, src, dim = call.args[0], call.args[1], call.arg(2, "dim", 0)
    if not (isinstance(x, ArgSpec) and isinstance(src, ArgSpec)) or not x.ndim:
        return None
    d = dim % x.ndim
    select = call.func is aten.select_scatter.default
    src_dim = (lambda e: e if e < d else e - 1) if select else (lambda e: e)
    xt, st = [], []
    for p in without_partial(placements_of(x)):
        e = p.dim % x.ndim if is_plain_shard(p) else None
        if e is not None and e != d and src.shape[src_dim(e)] == x.shape[e]:
            xt.append(p), st.append(Shard(src_dim(e)))
        else:
            xt.append(Replicate()), st.append(Replicate())
    return Sharding(inputs=[tuple(xt), tuple(st)], outputs=tuple(xt))
