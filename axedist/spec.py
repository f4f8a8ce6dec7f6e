"""The DTensor spec: a layout with the shapes it admits, on a mesh, checked once.

Everything about a distributed tensor but its data. Shape ``(8, 6)`` as ``[Shard(0)]`` on 4
ranks is the spec ``[8, 6] S[(4,2,6):(1@gpuid,6,1)]``: rank 2 holds rows 4..5, a local
``(2, 6)`` tensor. Placements and layouts convert here, both ways, and ``torch.chunk``'s
arithmetic for uneven dims lives here once (``chunk``, ``nested_chunk``, ``chunk_ranges``).

Uneven shapes: the layout admits a *padded* shape (``torch.chunk`` rounds each sharded dim
up); local tensors are the real (unpadded) boxes. Where torch chunks a dim again inside each
chunk (two ``Shard`` of one dim), every chunk is padded to the largest and ``true_index``
records the true row of each padded row. A pending reduction (torch's ``Partial``) is a
leading *summand* dim of the layout plus a reduce op; ``shape`` excludes that dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .caches import cached
from .layout import MEMORY_AXIS, Iter, Layout, LayoutError, row_major_memory
from .mesh import DeviceMesh
from .tracing import keep_on_copy, outside_tracing

__all__ = [
    "REDUCE_OPS", "DTensorSpec", "ElementTable", "make_spec", "element_table", "chunk", "nested_chunk",
    "chunk_ranges", "contiguous_strides", "row_major_iters", "replicated_layout", "is_placements",
    "spec_for_layout", "target_spec", "even_shape_from_local", "spec_from_placements", "placements_of",
    "layout_from_placements", "placements_from_layout", "without_summands",
]

REDUCE_OPS = ("sum", "avg", "max", "min")


# ---------------------------------------------------------------------------
# torch.chunk's arithmetic (the one place it is written)
# ---------------------------------------------------------------------------


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of piece ``index`` when ``torch.chunk`` cuts ``n`` into ``parts``:
    pieces of ``ceil(n / parts)``, the last ones short or empty. ``chunk(10, 4, 3) == (9, 1)``."""
    step = -(-n // parts)
    start, stop = min(index * step, n), min((index + 1) * step, n)
    return start, stop - start


def nested_chunk(n: int, splits) -> tuple[int, int]:
    """``(start, size)`` after chunking ``n`` once per ``(parts, index)`` in ``splits``, each
    inside the previous piece (two mesh axes sharding one dim): ``nested_chunk(5, [(2, 0), (2, 1)])
    == (2, 1)`` (5 -> 3 + 2, then 3 -> 2 + 1)."""
    start, size = 0, n
    for parts, index in splits:
        offset, size = chunk(size, parts, index)
        start += offset
    return start, size


def chunk_ranges(n: int, ks: Sequence[int]) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every piece of ``n`` chunked by ``ks`` in turn: ``{coordinates: (start, size)}``."""
    coordinates = [()]
    for k in ks:
        coordinates = [c + (i,) for c in coordinates for i in range(k)]
    return {c: nested_chunk(n, zip(ks, c)) for c in coordinates}


# ---------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DTensorSpec:
    """Everything about a DTensor but its data; ``layout`` admits ``full_shape`` (the summand dim
    of a pending reduction, then ``padded``). Build it with :func:`make_spec` (checked, interned).

    ``(5, 6)`` as ``[Shard(0)]`` on 4 ranks: ``shape (5, 6)``, ``padded (8, 6)`` (chunks of 2),
    layout ``S[(4,2,6):(1@gpuid,6,1)]``, ``local_padded (2, 6)``; rank 2 holds row 4 only, rank 3
    nothing (``element_table(spec).local_shapes``).
    """

    mesh: DeviceMesh
    layout: Layout
    shape: tuple[int, ...]          # logical global shape (no summand dim)
    padded: tuple[int, ...]         # what the layout's logical dims admit (>= shape)
    reduce_op: str | None = None    # pending reduction over the leading summand dim
    summands: int = 1
    # Per logical dim, the true index at each padded index (-1: padding), or None when the
    # first shape[d] indices are the real ones (torch's nested chunking pads in the middle).
    true_index: tuple[tuple[int, ...] | None, ...] | None = None
    local_padded: tuple[int, ...] = field(default=(), compare=False, hash=False)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return ((self.summands,) if self.reduce_op else ()) + self.padded

    @property
    def full_true(self) -> tuple[int, ...]:
        return ((self.summands,) if self.reduce_op else ()) + self.shape

    @property
    def full_true_index(self) -> tuple[tuple[int, ...] | None, ...]:
        maps = self.true_index or (None,) * len(self.shape)
        return ((None,) if self.reduce_op else ()) + maps

    def _fields(self) -> tuple:
        return (self.mesh, self.layout, self.shape, self.padded, self.reduce_op, self.summands, self.true_index)

    # Specs key every cached plan: hash once, and compare by identity first (specs are interned
    # by make_spec, so equal specs are mostly the same object).
    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self._fields())
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if type(other) is not DTensorSpec:
            return NotImplemented
        return hash(self) == hash(other) and self._fields() == other._fields()

    __copy__ = __deepcopy__ = keep_on_copy  # immutable (and a mesh holds process groups)

    def __repr__(self) -> str:
        return self._text(self.layout, rows=False)

    def _text(self, layout, rows: bool = True) -> str:
        pending = f", pending {self.reduce_op} over {self.summands} summands" if self.reduce_op else ""
        padded = f" (padded {list(self.padded)})" if self.padded != self.shape else ""
        true = f", true rows {list(self.true_index)}" if rows and self.true_index else ""
        return f"{list(self.shape)}{padded} {layout}{pending}{true}"

    def canonical_text(self) -> str:
        """The spec as ranks compare it: equal specs read the same (the layout in canonical form),
        e.g. ``[8, 6] S[(4,12):(1@gpuid,1)]`` for ``Shard(0)`` on 4 ranks."""
        return self._text(self.layout.canonicalize())


def make_spec(mesh, layout, shape, padded=None, reduce_op=None, summands=1, true_index=None) -> DTensorSpec:
    """Check ``layout`` against the mesh and shapes, then build the spec (interned: the same
    arguments give the same spec object, checked once). Refused with a LayoutError: a shape the
    layout does not admit, an axis the mesh lacks, a replica or offset on ``m``, a point outside
    the mesh, two elements in one (device, m) slot, a local tensor that is not row-major."""
    try:
        return _interned_spec(mesh, layout, tuple(shape), None if padded is None else tuple(padded), reduce_op,
                              summands, true_index)
    except TypeError:  # an unhashable argument (e.g. lists in true_index): build it afresh
        return _new_spec(mesh, layout, shape, padded, reduce_op, summands, true_index)


@cached(maxsize=8192)
@outside_tracing
def _interned_spec(mesh, layout, shape, padded, reduce_op, summands, true_index) -> DTensorSpec:
    return _new_spec(mesh, layout, shape, padded, reduce_op, summands, true_index)


def _new_spec(mesh, layout, shape, padded=None, reduce_op=None, summands=1, true_index=None) -> DTensorSpec:
    shape = tuple(int(s) for s in shape)
    padded = tuple(max(s, 1) for s in shape) if padded is None else tuple(int(s) for s in padded)
    if not isinstance(layout, Layout):
        raise LayoutError(f"expected an axedist Layout or a list of placements, got {layout!r}")
    if any(s < 0 for s in shape):
        raise LayoutError(f"shape {shape} has a negative dim")
    if len(padded) != len(shape) or any(p < max(s, 1) for p, s in zip(padded, shape)):
        raise LayoutError(f"padded shape {padded} must have the rank of {shape} and be >= it (and >= 1) in every dim "
                          f"(an empty dim is padded: a layout has no extent 0)")
    if reduce_op is not None and reduce_op not in REDUCE_OPS:
        raise LayoutError(f"reduce op must be one of {REDUCE_OPS}, got {reduce_op!r}")
    if true_index is not None:
        if all(m is None for m in true_index):
            true_index = None
        elif len(true_index) != len(shape) or any(
                m is not None and (len(m) != p or sorted(i for i in m if i >= 0) != list(range(s)))
                for m, p, s in zip(true_index, padded, shape)):
            raise LayoutError(f"true_index must map each padded dim onto 0..n-1 once, for shape {shape}")
    full = ((summands,) if reduce_op else ()) + padded
    if not layout.admits(full):
        what = "shape" if padded == shape else "padded shape"
        hint = ""
        if padded == shape and layout.size > math.prod(full):  # an uneven tensor given without its padded shape
            example = f" (here {(layout.size,)})" if len(full) == 1 else ""
            hint = f"; for an uneven tensor pass padded_shape=, the shape the layout admits{example}"
        raise LayoutError(f"layout {layout} of size {layout.size} does not admit the {what} {full} "
                          f"({math.prod(full)} elements){hint}")
    for axis in layout.axes:
        if axis != MEMORY_AXIS and axis not in mesh.axis_names:
            raise LayoutError(f"layout {layout} uses axis {axis!r}, which mesh axes {mesh.axis_names} do not have")
    if any(it.axis == MEMORY_AXIS for it in layout.replica) or layout.offset.get(MEMORY_AXIS, 0):
        raise LayoutError(f"layout {layout}: replicas and offsets must be on mesh axes, not on 'm'")
    for axis, extent in zip(mesh.axis_names, mesh.shape):
        low, high = layout.bounds(axis)
        if low < 0 or high >= extent:
            raise LayoutError(f"layout {layout} reaches {axis} = {low if low < 0 else high}, outside the mesh axis "
                              f"{axis} of size {extent}")
    if not layout.is_injective():
        raise LayoutError(f"layout {layout} puts two elements in one (device, m) slot")
    blocks = layout.blocks(full)
    local, strides = row_major_memory(blocks)
    for dim, (block, expected) in enumerate(zip(blocks, strides)):
        for it, stride in zip(block, expected):
            if stride is not None and it.stride != stride:
                raise LayoutError(
                    f"layout {layout}: dim {dim}'s m iter {it} should have stride {stride} for a row-major local "
                    f"tensor of shape {local} (axedist local tensors are row-major over the m iters of each dim)")
    return DTensorSpec(mesh, layout, shape, padded, reduce_op, summands, true_index, local)


def without_summands(spec: DTensorSpec, axes=None) -> DTensorSpec:
    """A pending reduction's value laid out where its summands lie: the summand dim's mesh iters
    become replicas, its memory iters go. ``[4, 6] S[(2,2,2,2,6):(1@dp,12,1@tp,6,1)]``, sum (two
    summands a rank in memory) -> ``[4, 6] S[(2,2,6):(1@tp,6,1)] + R[2:1@dp]``: every rank's piece
    has its local tensor's shape without the summand dim (torch's ``[Partial(), Shard(0)]`` ->
    ``[Replicate(), Shard(0)]``). With ``axes``, only the summand iters on those mesh axes become
    replicas and the rest stay pending (fewer summands; FSDP's own gradient of a data-parallel
    rank): ``S[(2,2,4,6):(1@dp,1@tp,6,1)]``, axes ``("dp",)`` -> ``S[(2,4,6):(1@tp,6,1)] + R[2:1@dp]``,
    pending over 2."""
    if not spec.reduce_op:
        return spec
    summand, *dims = spec.layout.blocks(spec.full_shape)
    moved = [it for it in summand if it.axis != MEMORY_AXIS and (axes is None or it.axis in axes)]
    kept = [] if axes is None else [it for it in summand if it not in moved and it.extent > 1]
    layout = Layout(kept + [it for block in dims for it in block], spec.layout.replica + tuple(moved),
                    spec.layout.offset)
    if not kept:
        return make_spec(spec.mesh, layout, spec.shape, spec.padded, true_index=spec.true_index)
    return make_spec(spec.mesh, layout, spec.shape, spec.padded, spec.reduce_op, math.prod(it.extent for it in kept),
                     spec.true_index)


# ---------------------------------------------------------------------------
# Where each element lives
# ---------------------------------------------------------------------------


def _unravel(index, shape):
    out = []
    for extent in reversed(shape):
        out.append(index % extent)
        index = index // extent
    return out[::-1]


def _ravel(indices, shape, count: int):
    flat = torch.zeros(count, dtype=torch.int64)
    for i, s in zip(indices, shape):
        flat = flat * s + i
    return flat


@dataclass(frozen=True)
class ElementTable:
    """Where each real element lives: ``holders[g, r]`` (mesh position of replica r of
    element g, row-major over ``full_true``) and ``offsets[g]`` (its position in the
    local tensor); ``local_shapes[p]`` is the local tensor shape at mesh position p."""

    holders: torch.Tensor
    offsets: torch.Tensor
    local_shapes: tuple[tuple[int, ...], ...]


@cached(maxsize=256)
@outside_tracing
def element_table(spec: DTensorSpec) -> ElementTable:
    """Evaluate the layout on every element at once (``shard_coordinates`` on an arange)."""
    mesh, layout, full, true = spec.mesh, spec.layout, spec.full_shape, spec.full_true
    n = math.prod(full)
    x = torch.arange(n, dtype=torch.int64)
    coords = layout.shard_coordinates(x)

    def on(axis, values):
        v = values.get(axis, 0)
        return v if isinstance(v, torch.Tensor) else torch.full((n,), int(v), dtype=torch.int64)

    strides = mesh.strides()
    device = sum((on(a, coords) * strides[a] for a in mesh.axis_names), torch.zeros(n, dtype=torch.int64))
    replicas = torch.tensor([sum(r.get(a, 0) * strides[a] for a in mesh.axis_names) for r in layout.replica_offsets]
                            or [0], dtype=torch.int64)
    local_index = _unravel(on(MEMORY_AXIS, coords), spec.local_padded)
    global_index = _unravel(x, full)
    reached = torch.zeros(mesh.size(), dtype=torch.bool)
    reached[device] = True
    # A device's real elements along dim d: local indices whose padded index maps to a true one.
    boxes = torch.zeros(mesh.size(), len(full), dtype=torch.int64)
    real = torch.ones(n, dtype=torch.bool)
    true_index = []
    for d, (lp, t, mapping) in enumerate(zip(spec.local_padded, true, spec.full_true_index)):
        index = global_index[d] if mapping is None else torch.tensor(mapping, dtype=torch.int64)[global_index[d]]
        real_d = (index >= 0) & (index < t)
        true_index.append(index)
        real &= real_d
        grid = torch.zeros(mesh.size(), lp, dtype=torch.bool)
        grid[device, local_index[d]] = real_d
        boxes[:, d] = grid.sum(1)
        prefix = torch.arange(lp)[None, :] < boxes[:, d:d + 1]
        if not torch.equal(grid[reached], prefix[reached]):
            p = int((grid != prefix).any(1).logical_and(reached).nonzero()[0])
            raise LayoutError(f"layout {layout} over padded shape {full} with true shape {true}: the real elements of "
                              f"mesh position {p} along dim {d} are not a leading range of its local tensor")
    offsets = torch.full((math.prod(true),), -1, dtype=torch.int64)
    holders = torch.empty((math.prod(true), len(replicas)), dtype=torch.int64)
    count = int(real.sum())
    g = _ravel([i[real] for i in true_index], true, count)
    offsets[g] = _ravel([i[real] for i in local_index], list(boxes[device[real]].T), count)
    holders[g] = device[real][:, None] + replicas[None, :]
    shapes = torch.zeros(mesh.size(), len(full), dtype=torch.int64)
    for r in replicas.tolist():  # replicas hold the same elements as the base device
        shapes[torch.nonzero(reached).flatten() + r] = boxes[reached]
    return ElementTable(holders, offsets, tuple(tuple(s) for s in shapes.tolist()))



# ---------------------------------------------------------------------------
# Placements <-> layouts
# ---------------------------------------------------------------------------


def contiguous_strides(shape) -> tuple[int, ...]:
    """torch's strides of a contiguous tensor of ``shape`` (an empty dim counts as 1, as torch's do)."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def row_major_iters(shape) -> list[Iter]:
    """``S[(8,6):(6,1)]``: the whole tensor in one local tensor (an empty dim padded to one row)."""
    return [Iter(max(s, 1), st) for s, st in zip(shape, contiguous_strides(shape))]


def replicated_layout(shape, mesh: DeviceMesh) -> Layout:
    """Row-major ``shape`` on every device: ``S[(8,6):(6,1)] + R[4:1@gpuid]``."""
    return Layout(row_major_iters(shape), [Iter(k, 1, a) for a, k in zip(mesh.axis_names, mesh.shape)])


def is_placements(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(p, Placement) for p in value)


def spec_for_layout(mesh, layout, shape, padded, reduce_op, dims_include_summands) -> DTensorSpec:
    """A spec from a user's layout. With ``reduce_op``, ``shape`` (and ``padded``) include the
    leading summand dim when ``dims_include_summands``."""
    shape = tuple(shape)
    padded = tuple(max(s, 1) for s in shape) if padded is None else tuple(padded)
    if reduce_op is None:
        return make_spec(mesh, layout, shape, padded)
    if dims_include_summands:
        if padded[0] != shape[0]:
            raise LayoutError(f"the summand dim is not padded: shape {shape}, padded {padded}")
        return make_spec(mesh, layout, shape[1:], padded[1:], reduce_op, shape[0])
    summands, rest = divmod(layout.size, math.prod(padded))
    if rest:
        raise LayoutError(f"layout {layout} of size {layout.size} is not a whole number of copies of {padded}")
    return make_spec(mesh, layout, shape, padded, reduce_op, summands)


def target_spec(spec: DTensorSpec, target, padded, reduce_op) -> DTensorSpec:
    if is_placements(target):
        if padded is not None or reduce_op is not None:
            raise LayoutError("padded_shape and reduce_op go with a layout; placements imply both")
        return _placement_target(spec.shape, spec.mesh, tuple(target), spec.summands)
    return spec_for_layout(spec.mesh, target, spec.shape, padded, reduce_op, dims_include_summands=False)


@cached(maxsize=1024)
@outside_tracing
def _placement_target(shape, mesh, placements, summands) -> DTensorSpec:
    """Placements -> spec, cached: a redistribute call names its target anew each time."""
    return spec_from_placements(shape, mesh, placements, summands_for_partial=summands)



def even_shape_from_local(local_shape, mesh, placements) -> tuple[int, ...]:
    shape = list(local_shape)
    for k, p in zip(mesh.shape, placements):
        if isinstance(p, (Shard, _StridedShard)):
            shape[_dim_of(p, len(shape), f"placements {list(placements)} for a local shape {tuple(local_shape)}")] *= k
    return tuple(shape)


def _split_local(block: list, factors: list[tuple[int, str | None]], what: str) -> list:
    """Split the memory part of one dim (its ``('m', e)`` pieces, outer to inner, with device
    pieces in between staying put) into ``factors`` ``(extent, owner)``, outer to inner."""
    factors = [[e, owner] for e, owner in factors if e > 1]
    out = []
    for piece in block:
        if piece[0] != MEMORY_AXIS:
            out.append(piece)
            continue
        extent = piece[1]
        while extent > 1:
            if not factors:
                raise LayoutError(f"{what}: internal split mismatch")
            want, owner = factors[0]
            if want % extent == 0:
                take = extent
            elif extent % want == 0:
                take = want
            else:
                raise LayoutError(f"{what}: cannot split a local extent {extent} into {want} parts evenly")
            out.append((MEMORY_AXIS, take) if owner is None else (owner, take))
            extent //= take
            factors[0][0] //= take
            if factors[0][0] == 1:
                factors.pop(0)
    return out


def spec_from_placements(shape, mesh: DeviceMesh, placements, summands_for_partial: int | None = None) -> DTensorSpec:
    """Placements as a layout over a padded shape (``torch.chunk``'s split).

    ``(8, 6)`` as ``[Shard(0)]`` on 4 ranks: dim 0's block is ``(4@gpuid, 2 local)``, so the layout
    is ``S[(4,2,6):(1@gpuid,6,1)]``; ``(5, 6)`` pads dim 0 to 8 (chunks of 2, the last one empty).
    """
    shape = tuple(int(s) for s in shape)
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise LayoutError(f"mesh {mesh} has {mesh.ndim} axes but {len(placements)} placements {placements}")
    what = f"placements {list(placements)} for shape {list(shape)} on mesh {mesh.shape}"
    nested = _nested_uneven_dims(shape, mesh, placements)
    blocks, padded, replica, partial, op = _placement_blocks(shape, mesh, placements, nested, what)
    true_index: list[tuple[int, ...] | None] = [None] * len(shape)
    for d, axes in nested.items():
        blocks[d], padded[d], true_index[d] = _nested_block(shape[d], axes)
    layout = Layout(partial + _iters_of_blocks(blocks), replica)
    if op is None:
        return make_spec(mesh, layout, shape, tuple(padded), true_index=tuple(true_index))
    summands = math.prod(it.extent for it in partial)
    if summands_for_partial not in (None, 1, summands):
        raise LayoutError(f"{what}: {summands} partial summands, the tensor has {summands_for_partial}")
    return make_spec(mesh, layout, shape, tuple(padded), op, summands, tuple(true_index))


def _placement_blocks(shape, mesh: DeviceMesh, placements, nested, what: str):
    """Per dim, its pieces ``(axis or 'm', extent)`` outer to inner after every Shard (dims that
    nested uneven chunking splits are left for ``_nested_block``); the padded shape; the replica
    and partial iters; the pending reduce op."""
    blocks = [[(MEMORY_AXIS, max(n, 1))] for n in shape]  # an empty dim is one padding row
    padded = [max(n, 1) for n in shape]
    sharded: set[int] = set()
    replica, partial, op = [], [], None
    for axis, k, p in zip(mesh.axis_names, mesh.shape, placements):
        if isinstance(p, Replicate):
            replica.append(Iter(k, 1, axis))
        elif isinstance(p, Partial):
            if op is not None and p.reduce_op != op:
                raise LayoutError(f"{what}: one pending reduce op per tensor ({op} and {p.reduce_op})")
            op = p.reduce_op
            partial.append(Iter(k, 1, axis))
        elif isinstance(p, (Shard, _StridedShard)):
            d = _dim_of(p, len(shape), what)
            if d in nested:
                continue
            split = p.split_factor if isinstance(p, _StridedShard) else 1
            local = math.prod(e for a, e in blocks[d] if a == MEMORY_AXIS)
            if local % (split * k):
                if split != 1 or d in sharded:
                    raise LayoutError(f"{what}: dim {d} is uneven under a _StridedShard; torch's chunking of it "
                                      f"has no single layout")
                padded[d] = -(-local // k) * k  # torch.chunk: ceil(n/k) per shard, the last ones short or empty
                blocks[d] = [(MEMORY_AXIS, padded[d])]
                local = padded[d]
            sharded.add(d)
            blocks[d] = _split_local(blocks[d], [(split, None), (k, axis), (local // (split * k), None)], what)
        else:
            raise LayoutError(f"{what}: unsupported placement {p!r}")
    return blocks, padded, replica, partial, op


def _nested_block(n: int, axes: list[tuple[str, int]]):
    """A dim of extent ``n`` that torch chunks again inside each chunk (one chunk per coordinate of
    ``axes``): every chunk padded to the largest; returns the block, the padded extent and the true
    row of each padded row (-1: padding). ``n = 5`` on two axes of 2: chunks 2, 1, 1, 1 padded to 2,
    true rows ``(0, 1, 2, -1, 3, -1, 4, -1)``."""
    ks = [k for _, k in axes]
    ranges = chunk_ranges(n, ks)
    largest = max(max(size for _, size in ranges.values()), 1)  # an empty dim: one padding row per chunk
    padded = math.prod(ks) * largest
    mapping = [-1] * padded
    for coords, (start, size) in ranges.items():
        position = 0
        for c, k in zip(coords, ks):
            position = position * k + c
        mapping[position * largest:position * largest + size] = range(start, start + size)
    return [(axis, k) for axis, k in axes] + [(MEMORY_AXIS, largest)], padded, tuple(mapping)


def _iters_of_blocks(blocks) -> list[Iter]:
    """The shard iters of per-dim blocks: ``m`` pieces row-major over the local shape, each mesh
    axis's pieces nested outer to inner (strides in that axis's own units)."""
    local_shape = [math.prod(e for a, e in block if a == MEMORY_AXIS) for block in blocks]
    shard: list[Iter] = []
    inner = math.prod(local_shape)
    for d, block in enumerate(blocks):
        inner //= local_shape[d]
        mem_stride = inner * local_shape[d]
        axis_stride: dict[str, int] = {}
        for a, e in block:
            if a != MEMORY_AXIS:
                axis_stride[a] = axis_stride.get(a, 1) * e
        for a, e in block:
            if a == MEMORY_AXIS:
                mem_stride //= e
                shard.append(Iter(e, mem_stride))
            else:
                axis_stride[a] //= e
                shard.append(Iter(e, axis_stride[a], a))
    return shard


def _dim_of(placement, ndim: int, what: str) -> int:
    d = placement.dim if placement.dim >= 0 else placement.dim + ndim
    if not 0 <= d < ndim:
        raise LayoutError(f"{what}: {placement} names dim {placement.dim} of a {ndim}-d tensor")
    return d


def _nested_uneven_dims(shape, mesh: DeviceMesh, placements) -> dict[int, list[tuple[str, int]]]:
    """Dims that two or more plain Shards split and that their product does not divide:
    ``{dim: [(axis, size), ...] in mesh order}``."""
    what = f"placements {list(placements)} for shape {list(shape)}"
    by_dim: dict[int, list] = {}
    for axis, k, p in zip(mesh.axis_names, mesh.shape, placements):
        if isinstance(p, (Shard, _StridedShard)):
            by_dim.setdefault(_dim_of(p, len(shape), what), []).append((axis, k, p))
    return {d: [(axis, k) for axis, k, _ in shards] for d, shards in by_dim.items()
            if shape[d] == 0 or (len(shards) > 1 and shape[d] % math.prod(k for _, k, _ in shards)
                                 and not any(isinstance(p, _StridedShard) for _, _, p in shards))}


def layout_from_placements(shape: Sequence[int], mesh: DeviceMesh, placements) -> Layout:
    """The layout of torch placements: ``(8,6)``, 4 GPUs, ``[Shard(0)]`` -> ``S[(4,2,6):(1@gpuid,6,1)]``.

    For an uneven dim the layout admits the padded shape (each shard ``ceil(n/k)``, padding at
    the end: pass it as ``padded_shape=``); with ``Partial`` it has the leading summand dim.
    Refused where torch chunks one uneven dim on two mesh axes (``(5,)`` as ``[Shard(0), Shard(0)]``
    on 2x2: rows 3 + 2, then 2 + 1 and 1 + 1): each chunk is padded in the middle of the dim, which a
    layout over a padded shape cannot say; ``spec_from_placements`` carries it (``true_index``).
    """
    spec = spec_from_placements(shape, mesh, placements)
    if spec.true_index is not None:
        dims = [d for d, m in enumerate(spec.true_index) if m is not None]
        raise LayoutError(f"placements {list(placements)} chunk dim(s) {dims} of shape {tuple(spec.shape)} on several "
                          f"mesh axes unevenly: torch pads each chunk (padded rows sit inside the dim), which no layout "
                          f"over a padded shape says. Use the placements themselves, or spec_from_placements(...) "
                          f"(its true_index says where the real rows are)")
    return spec.layout


def placements_of(spec: DTensorSpec) -> tuple[Placement, ...]:
    """Read placements off the layout's blocks, then check they give back the same map."""
    mesh = spec.mesh
    blocks = spec.layout.blocks(spec.full_shape)
    first_dim = 1 if spec.reduce_op else 0
    placements = []
    for index, axis in enumerate(mesh.axis_names):
        where = [d for d, block in enumerate(blocks) if any(it.axis == axis for it in block)]
        if not where:
            placements.append(Replicate())
            continue
        d = where[0]
        if spec.reduce_op and d == 0:
            placements.append(Partial(spec.reduce_op))
            continue
        block = blocks[d]
        first = next(i for i, it in enumerate(block) if it.axis == axis)
        split = math.prod(it.extent for it in block[:first]
                          if it.axis != MEMORY_AXIS and mesh.axis_names.index(it.axis) > index)
        dim = d - first_dim
        placements.append(_StridedShard(dim, split_factor=split) if split > 1 else Shard(dim))
    try:
        again = spec_from_placements(spec.shape, mesh, placements, spec.summands)
    except LayoutError as e:
        again, reason = None, str(e)
    if again is None or (again.layout, again.padded, again.true_index) != (spec.layout, spec.padded, spec.true_index):
        got = reason if again is None else f"those give {again.layout} over {list(again.padded)}"
        raise LayoutError(f"layout {spec.layout} over {list(spec.full_shape)} has no placement form on mesh "
                          f"{mesh.axis_names}={mesh.shape} (nearest: {placements}; {got})")
    return tuple(placements)


def placements_from_layout(layout: Layout, mesh: DeviceMesh, shape: Sequence[int], *,
                           reduce_op: str | None = None) -> tuple[Placement, ...]:
    """Torch placements with the same map: ``S[(4,2,6):(1@gpuid,6,1)]``, shape (8,6) -> ``(Shard(0),)``.

    ``shape`` is the shape the layout admits (with ``reduce_op``: without the summand dim).
    Raises LayoutError naming the layout when no placements give the same map.
    """
    return placements_of(spec_for_layout(mesh, layout, shape, None, reduce_op, dims_include_summands=False))
