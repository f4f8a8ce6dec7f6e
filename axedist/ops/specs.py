"""Specs that the dispatcher and the rules derive, cached: the spec of placements for a global
shape, and this rank's local shape under a spec.

``spec_of((8, 6), mesh, (Shard(0),))`` on 4 ranks is ``[8, 6] S[(4,2,6):(1@gpuid,6,1)]``, and
``expected_local_shape`` of it is ``(2, 6)`` on every rank (``(1, 2, 6)`` for a pending sum).
"""

from __future__ import annotations

import itertools
import math

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..caches import cached
from ..layout import MEMORY_AXIS, Layout, LayoutError, without_dims, without_inner_dims
from ..spec import element_table, make_spec, nested_chunk, placements_of, spec_from_placements

__all__ = ["spec_of", "expected_local_shape", "local_shape_of", "placements_or_none", "padded", "reduced_in_place",
           "dealing_axes", "pending_in_place", "dim_dealt", "layout_only"]


@cached(maxsize=4096)
def spec_of(shape: tuple, mesh, target, summands: int | None = None):
    """The spec of placements (a tuple) or of a Layout for a global shape."""
    if isinstance(target, Layout):
        return make_spec(mesh, target, shape)
    return spec_from_placements(shape, mesh, tuple(target), summands_for_partial=summands)


@cached(maxsize=4096)
def expected_local_shape(spec, placements) -> tuple[int, ...]:
    """This rank's local shape under ``spec`` (placements, when known, avoid the element table)."""
    mesh = spec.mesh
    if placements is not None and not any(isinstance(p, _StridedShard) for p in placements):
        coords = mesh.coordinates()
        per_dim: dict[int, list] = {}
        for axis, k, p in zip(mesh.axis_names, mesh.shape, placements):
            if isinstance(p, Shard):
                per_dim.setdefault(p.dim % max(len(spec.shape), 1), []).append((k, coords[axis]))
        shape = tuple(nested_chunk(n, per_dim.get(d, ()))[1] for d, n in enumerate(spec.shape))
        return ((1,) if spec.reduce_op else ()) + shape
    if spec.padded == spec.shape and not spec.true_index:
        # unpadded: every reached device holds the whole local box
        return spec.local_padded if _reaches_here(spec.layout, mesh) else (0,) * len(spec.full_shape)
    return tuple(element_table(spec).local_shapes[mesh.position()])


def local_shape_of(shape: tuple, mesh, target) -> tuple[int, ...]:
    """This rank's local shape of a tensor of global ``shape`` laid out as ``target``
    (placements or a Layout), without a pending sum's summand dim: what an op that takes a
    size (``select_backward``'s ``input_sizes``, ``expand``'s ``size``) must be given locally.
    ``(10, 6)`` as ``(Shard(0),)`` on 4 ranks: ``(3, 6)`` on ranks 0-2, ``(1, 6)`` on rank 3."""
    spec = spec_of(tuple(shape), mesh, target if isinstance(target, Layout) else tuple(target))
    local = expected_local_shape(spec, None if isinstance(target, Layout) else tuple(target))
    return tuple(local[1:] if spec.reduce_op else local)


def _reaches_here(layout: Layout, mesh) -> bool:
    """Does the layout put any element on this rank?"""
    reached = _reached(layout, mesh)
    here = mesh.coordinates()
    return reached is None or tuple(here[a] for a in mesh.axis_names) in reached


@cached(maxsize=1024)
def _reached(layout: Layout, mesh) -> frozenset | None:
    """The mesh coordinates (in axis order) the layout puts elements on, from its mesh-axis digits
    alone; None where they are more than 2**16 (such a layout covers the mesh many times over)."""
    iters = [it for it in list(layout.shard) + list(layout.replica) if it.axis != MEMORY_AXIS]
    if math.prod(it.extent for it in iters) > 1 << 16:
        return None
    base = {a: layout.offset.get(a, 0) for a in mesh.axis_names}
    points = set()
    for digits in itertools.product(*(range(it.extent) for it in iters)):
        point = dict(base)
        for it, d in zip(iters, digits):
            point[it.axis] += d * it.stride
        points.add(tuple(point[a] for a in mesh.axis_names))
    return frozenset(points)


def placements_or_none(spec):
    """``placements_of(spec)``, or None for a layout with no placement form."""
    try:
        return placements_of(spec)
    except LayoutError:
        return None


def padded(x) -> bool:
    """Whether an ``ArgSpec``'s local pieces may hold more than its elements: its full spec is
    unknown, or pads its shape, or maps indices (``true_index``). The layout ways of the op rules
    (each device computing on its own piece as it is) take only unpadded ones."""
    spec = getattr(x, "spec", None)
    return spec is None or spec.padded != spec.shape or bool(spec.true_index)


def layout_only(x) -> bool:
    """A layout with no placement form, unpadded, nothing pending."""
    return x.placements is None and not x.reduce_op and not padded(x)


def reduced_in_place(x, dims) -> Layout | None:
    """The layout of what an op that reduces ``x`` (an ``ArgSpec``) over ``dims`` leaves when
    every device reduces its own piece: for a layout with no placement form (placements would
    gather it) whose ``dims`` are its last ones, whole and innermost in every piece
    (``layout.without_inner_dims``), with no padding and nothing pending. None otherwise: the
    rule's placement strategies apply.

    The rows of ``h.view(B*S, H)`` for ``h`` (B, S, H) in ``[Shard(1)]``, summed over dim 1:
    each device sums its own rows, the (B*S,) result keeps their map; no data moves. Dims that
    are not the last ones qualify where each is whole and local in every piece and the pieces'
    memory is row-major (``layout.without_dims``): ``h.view(-1, 2, 3).sum(1)`` of dealt rows."""
    dims = sorted({d % max(x.ndim, 1) for d in dims})
    if not layout_only(x) or not dims:
        return None
    if dims == list(range(x.ndim - len(dims), x.ndim)):
        return without_inner_dims(x.layout, x.shape, len(dims))
    return without_dims(x.layout, x.shape, dims)


def dealing_axes(layout: Layout) -> set[str]:
    """The mesh axes a layout splits its elements over (the others replicate or offset them)."""
    return {it.axis for it in layout.shard if it.axis != MEMORY_AXIS}


def pending_in_place(x, op: str):
    """The placements of a reduction of every element of ``x`` (an ``ArgSpec`` with a layout with
    no placement form, no padding, nothing pending) that each device runs over its own piece:
    ``Partial(op)`` over the axes that split the elements, ``Replicate`` over the others (their
    devices hold the same pieces). None where an axis both splits and replicates them, or where
    some device holds nothing (a layout on part of the mesh: its devices would give a wrong
    summand, or claim a replica they lack)."""
    if not layout_only(x):
        return None
    dealt = dealing_axes(x.layout)
    if dealt & {it.axis for it in x.layout.replica}:
        return None
    reached = _reached(x.layout, x.mesh)
    if reached is None or len(reached) != x.mesh.size():
        return None
    return tuple(Partial(op) if axis in dealt else Replicate() for axis in x.mesh.axis_names)



def dim_dealt(x, d: int) -> tuple[str, ...] | None:
    """The mesh axes (in mesh order) that deal dim ``d`` of ``x`` (an ``ArgSpec`` with a layout with
    no placement form, no padding, nothing pending) where they deal nothing else: every other dim
    is whole and local in every piece, each of these axes deals ``d`` over all its devices (none
    replicates it), and every device holds a piece. The devices along them then hold each index
    of ``d`` once, so a reduction over ``d`` is a local one and an all-reduce over these axes
    (a softmax over classes dealt round-robin in pairs). None otherwise."""
    if not layout_only(x) or x.ndim == 0:
        return None
    try:
        blocks = x.layout.blocks(x.shape)
    except LayoutError:
        return None
    d %= x.ndim
    if any(it.axis != MEMORY_AXIS for e, block in enumerate(blocks) if e != d for it in block):
        return None
    extents: dict[str, int] = {}
    for it in blocks[d]:
        if it.axis != MEMORY_AXIS:
            extents[it.axis] = extents.get(it.axis, 1) * it.extent
    replicated = {it.axis for it in x.layout.replica}
    if not extents or any(axis in replicated or extent != x.mesh.size(axis) for axis, extent in extents.items()):
        return None
    reached = _reached(x.layout, x.mesh)
    if reached is None or len(reached) != x.mesh.size():
        return None
    return tuple(axis for axis in x.mesh.axis_names if axis in extents)
