"""Routes between specs whose padding differs: sides, local re-pads, and gathers that make them meet.

A *side* is a layout over a padded shape and where each device keeps the true rows. When
torch chunks a dim differently on the two sides (two ``Shard`` of one uneven dim), the
buffers have no common padded index map: gather what conflicts, re-pad each device's true
local tensor in place (no communication), and plan on from there. ``(5, 6)`` on 2x2,
``[Shard(0), Shard(0)] -> [Shard(0), Replicate]``: an all-gather over ``y`` leaves x = 0 with
rows 0,1,2 and x = 1 with 3,4, the target's rows, so a local re-pad finishes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from ..layout import MEMORY_AXIS, Iter, Layout, LayoutError, row_major_memory
from .held_rows import held_rows
from .holdings import true_rows
from .padding import cheapest, real_slots
from .plans import Plan

__all__ = ["Side", "RepadRoute", "side_of", "common_sides", "repad_route", "reduced_in_place", "split_summands",
           "from_blocks"]

Positions = tuple  # per full dim: the local index of each true row, or None where the true rows lead


@dataclass(frozen=True, eq=False)
class Side:
    """A layout over the padded shape ``full``, the padded index of each true row per dim
    (``rows``), and, per mesh position, where its local tensor keeps them (``positions``: None
    when the true rows lead everywhere, as in a spec's own local tensors). Compared by identity:
    a route's sides key the executor's cached index tensors."""

    layout: Layout
    full: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]
    positions: tuple[Positions, ...] | None = None

    @functools.cached_property
    def local_padded(self) -> tuple[int, ...]:
        """The padded local tensor's shape: ``(2, 6)`` for ``S[(4,2,6):(1@gpuid,6,1)]`` over ``(8, 6)``."""
        return tuple(math.prod(it.extent for it in block if it.axis == MEMORY_AXIS)
                     for block in self.layout.blocks(self.full))

    def positions_at(self, position: int) -> Positions:
        return (None,) * len(self.full) if self.positions is None else self.positions[position]

    @property
    def padded(self) -> bool:
        """Whether some slot of some device holds padding."""
        return any(len(r) != f for r, f in zip(self.rows, self.full))


def side_of(spec) -> Side:
    """A spec's own side: its layout over ``full_shape``, true rows from ``true_index``."""
    rows = []
    for n, mapping in zip(spec.full_true, spec.full_true_index):
        if mapping is None:
            rows.append(range(n))
        else:
            where = {t: p for p, t in enumerate(mapping) if t >= 0}
            rows.append(true_rows(where[t] for t in range(n)))
    return Side(spec.layout, tuple(spec.full_shape), tuple(rows))


class RepadRoute(NamedTuple):
    """Two plans with a local re-pad between them: ``gathered`` is the first plan's target side,
    ``middle`` the second's source side, ``boxes`` each position's true local shape between."""

    plans: tuple[Plan, Plan]
    gathered: Side
    middle: Side
    last: Side
    boxes: tuple[tuple[int, ...], ...]


def _leading(rows) -> Positions:
    """Positions for a side holding whole dims: the true rows' padded indices where not leading."""
    return tuple(None if isinstance(true_rows(r), range) else r for r in rows)


def _free_dims(layout: Layout, full) -> set[int]:
    """Dims entirely in local memory (every device holding any of the dim holds all of it)."""
    return {d for d, block in enumerate(layout.blocks(full)) if all(it.axis == MEMORY_AXIS for it in block)}


def from_blocks(blocks, replica, offset) -> Layout:
    """The layout of per-dim iter blocks with row-major local memory (``m`` strides recomputed)."""
    _, strides = row_major_memory(blocks)
    shard = [Iter(it.extent, stride) if stride is not None else it
             for block, row in zip(blocks, strides) for it, stride in zip(block, row)]
    return Layout(shard, replica, offset)


def _repad(layout: Layout, full, changes: dict[int, int]) -> Layout:
    """The same map with free dim ``d`` grown to ``changes[d]`` (row-major local memory kept)."""
    blocks = [list(b) for b in layout.blocks(full)]
    for d, extent in changes.items():
        blocks[d] = [Iter(extent, 1)]
    return from_blocks(blocks, layout.replica, layout.offset)


def common_sides(src: Side, dst: Side, size: int, lead: int = 0) -> tuple[Side, Side] | None:
    """Both sides re-padded on free dims to one padded index map; None when a dim cannot be matched.

    ``lead`` = 1 when the source has a leading summand dim the target lacks (it stays as it is);
    ``size`` is the mesh's (every position keeps the true rows at the same local indices).
    """
    src_changes, dst_changes = {}, {}
    src_free, dst_free = _free_dims(src.layout, src.full), _free_dims(dst.layout, dst.full)
    src_pos, dst_pos = [None] * len(src.full), [None] * len(dst.full)
    src_new, dst_new, rows = list(src.full), list(dst.full), list(src.rows)
    for d, (pd, rd) in enumerate(zip(dst.full, dst.rows)):
        e = d + lead
        ps, rs = src.full[e], src.rows[e]
        if ps == pd and rs == rd:
            continue
        if e in src_free:
            src_changes[e], src_pos[e], src_new[e], rows[e] = pd, rd, pd, rd
        elif d in dst_free:
            dst_changes[d], dst_pos[d], dst_new[d] = ps, rs, ps
        else:
            return None
    first = Side(_repad(src.layout, src.full, src_changes) if src_changes else src.layout, tuple(src_new),
                 tuple(rows), (tuple(src_pos),) * size)
    last = Side(_repad(dst.layout, dst.full, dst_changes) if dst_changes else dst.layout, tuple(dst_new),
                tuple(rows[lead:]), (tuple(dst_pos),) * size)
    return first, last


def _inner_layouts(src: Side, dst: Side, lead: int):
    """Per conflicting dim: the outer chunks both sides cut it into stay; the source's inner ones are
    gathered (``gathered`` blocks), the target's inner ones re-padded locally (``repadded`` blocks).
    Returns (gathered blocks, re-padded blocks, full, rows, gathered iters)."""
    src_blocks, dst_blocks = [list(b) for b in src.layout.blocks(src.full)], dst.layout.blocks(dst.full)
    src_free, dst_free = _free_dims(src.layout, src.full), _free_dims(dst.layout, dst.full)
    gathered, repadded = [list(b) for b in src_blocks], [list(b) for b in src_blocks]
    full, rows, extra = list(src.full), list(src.rows), []
    for d in range(len(dst.full)):  # a summand dim (lead = 1) stays as it is on both sides
        e = d + lead
        if (src.full[e], src.rows[e]) == (dst.full[d], dst.rows[d]) or e in src_free or d in dst_free:
            continue
        src_mesh = [it for it in src_blocks[e] if it.axis != MEMORY_AXIS]
        dst_mesh = [it for it in dst_blocks[d] if it.axis != MEMORY_AXIS]
        shared = 0  # the outer chunks both sides cut this dim into
        while shared < min(len(src_mesh), len(dst_mesh)) and src_mesh[shared] == dst_mesh[shared]:
            shared += 1
        gather, split = src_mesh[shared:], dst_mesh[shared:]
        gathered[e] = [Iter(it.extent, 1) if it in gather else it for it in src_blocks[e]]
        repadded[e] = [Iter(it.extent, 1) if it in split else it for it in dst_blocks[d]]
        full[e], rows[e] = dst.full[d], dst.rows[d]
        extra += gather
    return gathered, repadded, tuple(full), tuple(rows), extra


def _gather_inner(src: Side, dst: Side, lead: int, mesh):
    """No common padding: keep the outer chunks both sides cut a conflicting dim into; gather
    the source's inner ones (a copy: a pending reduction's summand dim is kept), re-pad each
    device's local tensor in place to the target's padding (its inner chunks still local),
    and plan on from there (reducing then, if pending).

    ``(5, 6)`` on 2x2, ``[Shard(0), Shard(0)] -> [Shard(0), Replicate]``: dim 0 is chunked by
    x then y in the source (padded 8: rows 0,1 | 2,- | 3,- | 4,-), by x in the target
    (padded 6: rows 0,1,2 | 3,4,-). Gathering the y iter only (an all-gather over y) leaves
    x=0 with rows 0,1,2,- and x=1 with 3,-,4,-: the target's rows per device, padded
    differently, so a local copy finishes (48 B a device, not a gather of all 30 values).
    The other way round (``[Shard(1), Shard(0)] -> [Shard(1), Shard(1)]`` of ``(2, 5)`` on
    2x4) nothing is gathered: each x chunk of 3 columns is re-padded to the target's 4 slots
    (one per y) before the plan moves rows and columns over y.
    Returns (gathered side, re-padded side, true box per position) or None when some device
    would hold other rows (then the caller gathers everything).
    """
    gathered, repadded, full, rows, extra = _inner_layouts(src, dst, lead)
    replica, offset = list(src.layout.replica) + extra, src.layout.offset
    try:
        middle, after = from_blocks(gathered, replica, offset), from_blocks(repadded, replica, offset)
        if not (middle.is_injective() and after.is_injective()):
            return None
        held_middle = held_rows(middle, src.full, src.rows, mesh)
        held_after = held_rows(after, full, rows, mesh)
    except LayoutError:
        return None
    if any(tuple(tuple(r for _, r in dim) for dim in a) != tuple(tuple(r for _, r in dim) for dim in b)
           for a, b in zip(held_middle, held_after)):
        return None  # some device would hold other rows: not a local re-pad
    boxes = tuple(tuple(len(dim) for dim in held) for held in held_middle)
    return (Side(middle, src.full, src.rows, _local_positions(held_middle)),
            Side(after, full, rows, _local_positions(held_after)), boxes)


def _local_positions(held) -> tuple[Positions, ...]:
    """Per position, per dim: the local rows holding its true rows in order (None: they lead)."""
    return tuple(tuple(None if [l_ for l_, _ in dim] == list(range(len(dim))) else tuple(l_ for l_, _ in dim)
                       for dim in at) for at in held)


def _inner_gather_route(src: Side, dst: Side, lead: int, mesh):
    """``_gather_inner``'s sides, and the target side its second plan runs to; None if none.

    The re-padded side may still re-pad dims it holds whole (``common_sides``): those take
    that positions map, the conflicting dims keep their per-device one.
    """
    inner = _gather_inner(src, dst, lead, mesh)
    if inner is None:
        return None
    gathered, after, boxes = inner
    ends = common_sides(after, dst, mesh.size(), lead)
    if ends is None:
        return None
    middle, last = ends
    positions = tuple(tuple(p if p is not None else q for p, q in zip(middle.positions_at(k), after.positions_at(k)))
                      for k in range(mesh.size()))
    return gathered, Side(middle.layout, middle.full, middle.rows, positions), last, boxes


def _replicated(full, mesh) -> Layout:
    strides, step = [], 1
    for s in reversed(full):
        strides.append(step)
        step *= s
    return Layout([Iter(s, st) for s, st in zip(full, reversed(strides))],
                  [Iter(k, 1, a) for a, k in zip(mesh.axis_names, mesh.shape)])


def _full_gather_route(src: Side, dst: Side, lead: int, mesh):
    """Every device gathers the whole tensor on the source's padding, then re-pads it to the target's."""
    kept, kept_rows = src.full[lead:], src.rows[lead:]
    gathered = Side(_replicated(kept, mesh), kept, kept_rows, (_leading(kept_rows),) * mesh.size())
    middle, _ = common_sides(gathered, dst, mesh.size())
    middle = Side(middle.layout, middle.full, middle.rows, (_leading(middle.rows),) * mesh.size())
    return gathered, middle, (tuple(len(r) for r in kept_rows),) * mesh.size()


def repad_route(src: Side, dst: Side, lead: int, partial, itemsize: int, mesh) -> RepadRoute:
    """Two plans for sides without a common padding: the inner gather when it applies (copy with
    the summands kept, re-pad, then reduce if pending), else a gather of everything (reduce while
    gathering, re-pad, then copy)."""
    inner = _inner_gather_route(src, dst, lead, mesh)
    if inner is not None:
        gathered, middle, last, boxes = inner
        partials = (None, partial)
    else:
        gathered, middle, boxes = _full_gather_route(src, dst, lead, mesh)
        last = common_sides(middle, dst, mesh.size())[1]
        partials = (partial, None)
    plans = (cheapest(src.layout, gathered.layout, gathered.full, itemsize, partials[0],
                      real_slots(src.layout, src.full, src.rows, mesh), mesh),
             cheapest(middle.layout, last.layout, last.full, itemsize, partials[1],
                      real_slots(middle.layout, middle.full, middle.rows, mesh), mesh))
    return RepadRoute(plans, gathered, middle, last, boxes)


def reduced_in_place(src: Side) -> Side:
    """``src`` after its pending reduction, with the data where it is: the summand axes become
    replicas (an all-reduce over them), the summand dim goes."""
    blocks = src.layout.blocks(src.full)
    replica = list(src.layout.replica) + [it for it in blocks[0] if it.axis != MEMORY_AXIS]
    offset = {a: v for a, v in src.layout.offset.items() if a != MEMORY_AXIS}
    return Side(from_blocks(blocks[1:], replica, offset), src.full[1:], src.rows[1:])


def split_summands(src: Side, dst: Side) -> Side:
    """``src``'s summand dim cut into (the summands ``dst`` no longer has, those it keeps): the
    same map, local buffer and true local tensor, seen with two leading summand dims.

    The kept part is made of the source's summand iters that the target's summand dim has
    (same axis, stride, extent), so kept summands stay where they are: ``[Partial, Partial]``
    on 2x2 (summand iters ``2:1@x, 2:1@y``) to ``[Replicate, Partial]`` (``2:1@y``) reduces
    over ``x`` and keeps ``y``; with no such match, the inner part of the summand dim is kept
    and the plan moves it into the target's places.
    """
    blocks = src.layout.blocks(src.full)
    summand, rest = list(blocks[0]), [it for block in blocks[1:] for it in block]
    total, keep = src.full[0], dst.full[0]
    reduced, kept = list(summand), []
    for it in dst.layout.blocks(dst.full)[0]:
        if it not in reduced:
            kept = None
            break
        reduced.remove(it)
        kept.append(it)
    if kept is None or math.prod(it.extent for it in kept) != keep:
        outer, inner = Layout(summand).blocks((total // keep, keep))
        reduced, kept = list(outer), list(inner)
    layout = Layout(reduced + kept + rest, src.layout.replica, src.layout.offset)
    lead = (total // keep, keep)
    return Side(layout, lead + src.full[1:], (range(lead[0]), range(lead[1])) + src.rows[1:])
