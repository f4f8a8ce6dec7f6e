"""View ops (view/reshape/flatten/unsqueeze/squeeze, transpose/permute/t, expand, alias/detach).

A view keeps the map from elements to (device, ``m``): only the shape the layout is
grouped by changes. So the output layout is the input's layout regrouped for the new
shape (``Layout.group``), when ``m`` stays row-major over the new local shape; the
local tensor is then the local view, and no data moves. Example, 4 ranks: ``x`` of shape
``(2, 8, 6)`` sharded on the sequence dim (``[Shard(1)]``,
``S[(2,4,2,6):(12,1@gpuid,6,1)]``) viewed as ``(16, 6)``: the same layout grouped by
``(16, 6)`` is ``S[(2,4,2,6):(12,1@gpuid,6,1)]`` -- rows ``2b + 8r'`` ... each rank keeps
its ``(4, 6)`` local rows, which no placement list can say (rank r holds rows
``2r, 2r+1, 8+2r, 9+2r``). Permutes reorder the layout's dims (and re-stride ``m``).

With placements and uneven (padded) dims the placements way is used: a ``Shard`` of a
dim that the view leaves whole (or that stays the outer part of a merged or split dim
with an even split) moves to the new dim index; anything else is replicated first.
"""

from __future__ import annotations

import functools

import torch

from ..layout import Iter, Layout, LayoutError, row_major_memory, with_dims_inserted, with_inner_dims, without_dims
from ..spec import DTensorSpec, make_spec
from .registry import ArgSpec, OpCall, Partial, Replicate, Shard, Sharding, overload_named, register, rule_for
from .specs import expected_local_shape, local_shape_of, padded, spec_of

aten = torch.ops.aten


def _out_shape(call: OpCall) -> tuple[int, ...]:
    spec = call.specs[0]
    meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    args = (meta,) + tuple(call.args[1:])
    return tuple(call.func(*args, **call.kwargs).shape)


def _groups(old: tuple, new: tuple):
    """Pair consecutive runs of old dims with runs of new dims of equal product (torch's view
    groups), size-1 dims alone: ``[(old dims), (new dims)]``."""
    out, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            out.append(((i,), ()))
            i += 1
            continue
        if j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
            out.append(((), (j,)))
            j += 1
            continue
        a, b = [i], [j]
        pa, pb = old[i], new[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= old[i]
                a.append(i)
                i += 1
            else:
                pb *= new[j]
                b.append(j)
                j += 1
        out.append((tuple(a), tuple(b)))
    return out


def _reshape_placements(spec: ArgSpec, new: tuple, mesh) -> tuple:
    """Placements of the reshaped tensor: a Shard kept where it stays the outer part of its
    group and splits evenly (or its dim is unchanged); otherwise Replicate (None: input must change)."""
    old = spec.shape
    where = {}
    for a, b in _groups(old, new):
        for k, d in enumerate(a):
            where[d] = (a, b, k)
    out = []
    for axis_index, (k, p) in enumerate(zip(mesh.shape, spec.placements)):
        if isinstance(p, Shard):
            a, b, pos = where[p.dim]
            if not b:
                out.append(None)
            elif a == (p.dim,) and len(b) == 1:
                out.append(Shard(b[0]))
            elif pos == 0 and new[b[0]] % k == 0 and old[p.dim] % k == 0 and \
                    sum(isinstance(q, Shard) and q.dim == p.dim for q in spec.placements) == 1:
                out.append(Shard(b[0]))
            else:
                out.append(None)
        else:
            out.append(p)
    return tuple(out)


def _local_reshape(out_placements_or_layout, out_shape, mesh, reduce_op=None):
    """The local function: reshape this rank's piece to its local shape under the output."""
    @functools.lru_cache(maxsize=None)
    def local_shape():
        target = out_placements_or_layout
        spec = target if isinstance(target, DTensorSpec) else spec_of(out_shape, mesh, target)
        shape = expected_local_shape(spec, None if not isinstance(target, tuple) else target)
        return shape[1:] if spec.reduce_op else shape

    def local(call, x, *args, **kwargs):
        # a view where one exists (the strides view() accepts), else a copy: no exception raised
        # and caught per call (about 20 us of host time)
        return x.reshape(local_shape())

    local.only_reshapes = True  # metadata only: the fast path may prove a call through it (ops/fastpath.py)
    return local


def _layout_way(spec: ArgSpec, new_shape: tuple, perm=None):
    """The input's layout regrouped for ``new_shape`` (reshape) or with dims permuted;
    a spec, or None where m would not be row-major or the layout is padded."""
    s = spec.spec
    if s.padded != s.shape or s.true_index:
        return None
    lead = (s.summands,) if s.reduce_op else ()
    try:
        if perm is None:
            blocks = s.layout.blocks(lead + tuple(new_shape))
        else:
            old = s.layout.blocks(lead + tuple(s.shape))
            blocks = old[:len(lead)] + tuple(old[len(lead) + p] for p in perm)
        # m iters re-strided row-major over the new local shape (the local tensor is a logical view)
        _, strides = row_major_memory(blocks)
        iters = [Iter(it.extent, st, it.axis) if st is not None else it
                 for block, block_strides in zip(blocks, strides) for it, st in zip(block, block_strides)]
        layout = Layout(iters, s.layout.replica, s.layout.offset)
        return make_spec(s.mesh, layout, tuple(new_shape), None, s.reduce_op, s.summands)
    except LayoutError:
        return None


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints,
          aten.unflatten.int, aten.view_as.default if hasattr(aten, "view_as") else aten.view.default)
def reshape(call: OpCall) -> Sharding:
    spec = call.specs[0]
    others = [None] * (len(call.specs) - 1)   # view_as's other argument: only its shape matters
    new = _out_shape(call)
    mesh = call.mesh
    if 0 in spec.shape:  # no elements: replicated costs nothing, and torch's view groups have no runs to pair
        full = (Replicate(),) * mesh.ndim
        return Sharding(inputs=[full] + others, outputs=full, local=_local_reshape(full, new, mesh))
    if spec.placements is not None:
        kept = _reshape_placements(spec, new, mesh)
        if all(p is not None for p in kept):
            return Sharding(inputs=[None] + others, outputs=kept, local=_local_reshape(kept, new, mesh))
    layout_spec = _layout_way(spec, new)
    if layout_spec is not None:
        return Sharding(inputs=[None] + others, outputs=layout_spec, local=_local_reshape(layout_spec, new, mesh))
    if spec.placements is not None:
        # replicate what cannot stay (a partial stays: a view is linear)
        want = tuple(Replicate() if p is None else q for p, q in zip(kept, spec.placements))
        want = tuple(Replicate() if isinstance(q, Shard) and k is None else q for q, k in zip(want, kept))
        out = tuple(Replicate() if k is None else k for k in kept)
        return Sharding(inputs=[want] + others, outputs=out, local=_local_reshape(out, new, mesh))
    full = (Replicate(),) * mesh.ndim
    return Sharding(inputs=[full] + others, outputs=full, local=_local_reshape(full, new, mesh))


def _permutation(call: OpCall) -> tuple[int, ...]:
    ndim = call.specs[0].ndim
    func = call.func
    if func is aten.t.default:
        return (1, 0) if ndim == 2 else tuple(range(ndim))
    if func in (aten.transpose.int,):
        if ndim == 0:  # torch transposes a 0-dim tensor's dims 0 / -1 into itself
            return ()
        d0, d1 = (call.args[1] % ndim, call.args[2] % ndim)
        perm = list(range(ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return tuple(perm)
    dims = call.args[1]
    return tuple(d % max(ndim, 1) for d in dims)[:ndim]


@register(aten.t.default, aten.transpose.int, aten.permute.default)
def permute(call: OpCall) -> Sharding:
    spec = call.specs[0]
    perm = _permutation(call)
    inverse = {p: i for i, p in enumerate(perm)}
    if spec.placements is not None and all(type(p) in (Shard, Replicate, Partial) for p in spec.placements):
        out = tuple(Shard(inverse[p.dim % spec.ndim]) if isinstance(p, Shard) else p for p in spec.placements)
        return Sharding(inputs=[None], outputs=out)
    new_shape = tuple(spec.shape[p] for p in perm)
    layout_spec = _layout_way(spec, new_shape, perm)
    if layout_spec is not None:
        return Sharding(inputs=[None], outputs=layout_spec)
    full = (Replicate(),) * call.mesh.ndim
    return Sharding(inputs=[full], outputs=full)


def _per_row_way(spec: ArgSpec, new: tuple) -> Sharding | None:
    """``expand`` of a layout with no placement form over its trailing size-1 dims only (a
    reduction's gradient, ``mean(-1, keepdim=True)``'s backward): each piece expands its own
    rows, the output keeps their map with the new dims whole and innermost
    (``layout.with_inner_dims``). None otherwise."""
    if spec.placements is not None or spec.reduce_op or padded(spec) or len(new) != spec.ndim:
        return None
    first = next((d for d in range(spec.ndim) if spec.shape[d] != new[d]), spec.ndim)
    if first == spec.ndim or any(spec.shape[d] != 1 for d in range(first, spec.ndim)):
        return None
    out = with_inner_dims(spec.layout, spec.shape[:first], new[first:])
    if out is None:
        return None

    def local(call_, x, *args, **kwargs):
        return x.expand(*x.shape[:first], *new[first:])

    return Sharding(inputs=[None], outputs=out, local=local)


def _whole_dims_way(spec: ArgSpec, new: tuple) -> Sharding | None:
    """``expand`` of a layout with no placement form into new leading dims and size-1 dims
    anywhere (``repeat_kv``'s ``x[:, :, None].expand(...)`` of dealt rows): each piece expands
    its own, the new extents whole and local at their places in each piece's row-major memory
    (``layout.with_dim_inserted``). None where the pieces are not row-major, or the tensor is
    pending or padded."""
    if spec.placements is not None or spec.reduce_op or padded(spec) or len(new) < spec.ndim:
        return None
    lead = len(new) - spec.ndim
    grown = [d for d in range(spec.ndim) if spec.shape[d] != new[lead + d]]
    if any(spec.shape[d] != 1 for d in grown) or 0 in new:
        return None
    # the size-1 dims off, then every new extent in at its place
    layout = without_dims(spec.layout, spec.shape, grown)
    if layout is None:
        return None
    shape = [s for d, s in enumerate(spec.shape) if d not in grown]
    layout = with_dims_inserted(layout, shape, [(position, new[position])
                                                for position in [*range(lead), *(lead + d for d in grown)]])
    if layout is None:
        return None
    kept = [-1 if p >= lead and p - lead not in grown else new[p] for p in range(len(new))]

    def local(call_, x, *args, **kwargs):
        return x.expand(*kept)

    return Sharding(inputs=[None], outputs=layout, local=local)


@register(aten.expand.default)
def expand(call: OpCall) -> Sharding:
    """Broadcast dims (extent 1 -> n) are replicated; the others keep their shards."""
    spec = call.specs[0]
    new = _out_shape(call)
    mesh = call.mesh
    lead = len(new) - spec.ndim
    per_row = _per_row_way(spec, new)
    if per_row is not None:
        return per_row
    whole = _whole_dims_way(spec, new)
    if whole is not None:
        return whole
    if spec.placements is None:
        full = (Replicate(),) * mesh.ndim
        want, out = full, full
    else:
        want, out = [], []
        for p in spec.placements:
            if isinstance(p, Shard) and spec.shape[p.dim] == new[lead + p.dim]:
                want.append(p)
                out.append(Shard(lead + p.dim))
            elif isinstance(p, Shard):
                want.append(Replicate())
                out.append(Replicate())
            else:
                want.append(p)
                out.append(p)
        want, out = tuple(want), tuple(out)

    @functools.lru_cache(maxsize=None)
    def local_shape():
        return local_shape_of(new, mesh, out)

    def local(call_, x, *args, **kwargs):
        return x.expand(local_shape())

    local.only_reshapes = True  # metadata only, as a reshape's (the fast path may prove a call through it)
    return Sharding(inputs=[None if want == spec.placements else want], outputs=out, local=local)


@register(aten.alias.default, aten.detach.default, aten.lift_fresh.default)
def alias(call: OpCall) -> Sharding:
    """Same data, same spec."""
    return Sharding(inputs=[None], outputs=call.specs[0])


# ---------------------------------------------------------------------------
# The ``*_copy`` variants: the view's rule, its local result copied (no aliasing)
# ---------------------------------------------------------------------------

_COPIES = {name: view for name, view in (
    ("view_copy.default", "view.default"), ("t_copy.default", "t.default"),
    ("transpose_copy.int", "transpose.int"), ("permute_copy.default", "permute.default"),
    ("unsqueeze_copy.default", "unsqueeze.default"), ("squeeze_copy.default", "squeeze.default"),
    ("squeeze_copy.dim", "squeeze.dim"), ("squeeze_copy.dims", "squeeze.dims"),
    ("expand_copy.default", "expand.default"), ("unbind_copy.int", "unbind.int"),
    ("split_with_sizes_copy.default", "split_with_sizes.default"), ("split_copy.Tensor", "split.Tensor"))}


_COPY_OF = {overload_named(copy): overload_named(view) for copy, view in _COPIES.items()
            if overload_named(copy) is not None and overload_named(view) is not None}


@register(*_COPY_OF)
def view_copy(call: OpCall) -> Sharding | None:
    """``x.t_copy()`` is ``x.t()`` with its own memory: the view's rule (``view.py`` or
    ``tensor_ops.py``), then each local result copied contiguous. ``(8, 6)`` ``[Shard(0)]``:
    ``t_copy`` gives ``(6, 8)`` ``[Shard(1)]``, no data moved."""
    view = _COPY_OF[call.func]
    rule = rule_for(view)  # whichever family registered it
    if rule is None:
        return None
    inner = rule(OpCall(view, call.args, call.kwargs, call.mesh))
    if inner is None:
        return None
    base = inner.local

    def local(call_, *args, **kwargs):
        result = base(OpCall(view, call_.args, call_.kwargs, call_.mesh), *args, **kwargs) if base is not None \
            else view(*args, **kwargs)
        if isinstance(result, (list, tuple)):
            return type(result)(r.clone(memory_format=torch.contiguous_format) for r in result)
        return result.clone(memory_format=torch.contiguous_format)

    return Sharding(inputs=inner.inputs, outputs=inner.outputs, local=local, out_shape=inner.out_shape,
                    note=inner.note)
