"""Which buffer slots of each device hold real (unpadded) elements, and each device's true box.

Uneven shapes pad their dims (``torch.chunk``); plans are derived on the padded layouts and
then leave the padding out. ``(3,)`` padded to 4 as ``S[(2,2):(1@gpuid,1)]`` on 2 devices:
position 0 holds rows 0, 1 (both real), position 1 rows 2, 3 (row 3 padding); true boxes
``((2,), (1,))``. Answered per dim where a layout's memory is per-dim row-major (O(sum of dims
x mesh size)), else element by element (O(elements), the reference: ``ELEMENTWISE = True``).
A mesh here is anything with ``axis_names``, ``shape``, ``size`` and ``strides()``.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from ..caches import cached
from ..layout import MEMORY_AXIS, Layout, LayoutError
from .plans import buffer_size
from .steps import Transfer

__all__ = ["ELEMENTWISE", "true_rows", "Holdings", "holdings_of", "holdings_per_dim", "holdings_everywhere", "dim_placements",
           "index_terms", "offset_and_shifts", "reached", "outer", "box_index", "true_boxes", "position_choices"]

# Set to True (tests do) to answer every padding question element by element: the reference the
# per-dim route is checked against (also the route for layouts whose memory is not per-dim).
ELEMENTWISE = False


def true_rows(rows) -> Sequence[int]:
    """One dim's true rows (the padded index of each true row) in one form: ``range(n)`` where the
    ``n`` true rows lead the dim in order (O(1) to hash and compare however long), else a tuple.
    A flat FSDP buffer's rows run to millions: as tuples they made a first step plan for a minute."""
    if isinstance(rows, range) and rows.start == 0 and rows.step == 1:
        return rows
    rows = tuple(int(i) for i in rows)
    return range(len(rows)) if rows == tuple(range(len(rows))) else rows


def box_index(transfers: Sequence[Transfer], side: str) -> torch.Tensor:
    """Flat slots of the boxes of ``transfers`` on ``side`` ("source"/"target"), row-major, concatenated."""
    parts = []
    for t in transfers:
        offset, strides = (t.source_offset, t.source_strides) if side == "source" else (t.target_offset, t.target_strides)
        index = torch.tensor(offset, dtype=torch.int64)
        for extent, stride in zip(t.extents, strides):
            index = index.unsqueeze(-1) + torch.arange(extent, dtype=torch.int64) * stride
        parts.append(index.reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def outer(vectors) -> torch.Tensor:
    """The outer AND of 1-D bool tensors: a grid of ``len(vectors)`` dims."""
    grid = torch.ones((), dtype=torch.bool)
    for v in vectors:
        grid = grid.unsqueeze(-1) & v
    return grid


class Holdings:
    """Which buffer slots of each mesh position hold real (unpadded) elements, and each
    position's true local box, for one (layout, padded shape, true rows, mesh).

    Per dim (``real``): when each position is one choice of per-dim device terms and replica
    point, what it holds is a product of per-dim index sets, so its real slots are the row-major
    product of ``real[p][d]`` (a bool per local row of dim ``d``). Else ``dense``: a
    ``[position, slot]`` bool tensor built from every element, the reference. Example, ``(3,)``
    padded to 4 as ``S[(2,2):(1@gpuid,1)]`` on 2 devices: real ``[True, True]``, ``[True, False]``;
    boxes ``((2,), (1,))``; masks ``[[True, True], [True, False]]``.
    """

    def __init__(self, layout: Layout, full, rows, size: int, boxes, local_padded=None, real=None, dense=None):
        self.layout, self.full, self.rows, self.size, self.boxes = layout, tuple(full), rows, size, boxes
        self.local_padded, self.real, self._dense = local_padded, real, dense
        if real is not None:
            self.inner = tuple(math.prod(local_padded[d + 1:]) for d in range(len(local_padded)))

    def masks(self) -> torch.Tensor:
        """``[position, slot]``: whether the slot holds a real element (built once from ``real``)."""
        if self._dense is None:
            masks = torch.zeros(len(self.real), self.size, dtype=torch.bool)
            for p, dims in enumerate(self.real):
                if dims is not None:
                    masks[p] = outer(dims).reshape(-1)[:self.size]
            self._dense = masks
        return self._dense

    @functools.cached_property
    def all_real(self) -> bool:
        if self.real is None:
            return bool(self._dense.all())
        return math.prod(self.local_padded) == self.size and \
            all(dims is not None and all(bool(v.all()) for v in dims) for dims in self.real)

    def keep(self, position: int, t: Transfer) -> tuple[Transfer, list[tuple[tuple[int, ...], torch.Tensor]]]:
        """Which elements of ``t``'s source box (on ``position``) are real: ``(box, groups)``, where
        ``box`` is ``t`` or the same box with a dim that runs over the end of a tensor dim's local
        rows cut in two (``(24,)`` at stride 7 over local rows of 14 slots -> ``(12, 2)`` at strides
        ``(14, 7)``), and ``groups`` are ``(box dims, bool grid over them)`` whose outer product is
        the answer: one group per tensor dim the box walks (per dim), else one of all box dims."""
        if self.real is not None:
            found = self._keep_per_dim(position, t)
            if found is not None:
                return found
        grid = self.masks()[position][box_index([t], "source")].reshape(t.extents)
        return t, [(tuple(range(len(t.extents))), grid)]

    def _keep_per_dim(self, position: int, t: Transfer):
        """``keep`` from the per-dim rows, or None where a box dim does not walk one tensor dim's
        local rows (after cutting at their ends), or two box dims together run past its end."""
        dims, lp = self.real[position], self.local_padded
        if dims is None:  # the layout puts nothing here
            return t, [(tuple(range(len(t.extents))), torch.zeros(t.extents, dtype=torch.bool))]
        if not 0 <= t.source_offset < math.prod(lp):
            return None
        start = [(t.source_offset // self.inner[d]) % lp[d] for d in range(len(lp))]
        t = self._cut_box(t, start)
        if t is None:
            return None
        groups, walks = self._walks(t)
        for d, members in walks.items():
            if not self._within(d, start[d], [(e, c) for _, e, c in members]):
                return None
            index = torch.tensor(start[d], dtype=torch.int64)
            for _, e, c in members:
                index = index.unsqueeze(-1) + torch.arange(e, dtype=torch.int64) * c
            groups.append((tuple(k for k, _, _ in members), dims[d][index]))
        # a dim no box dim walks stays at its start row: real or not for the whole box
        groups += [((), dims[d][start[d]]) for d in range(len(lp)) if d not in walks]
        return t, groups

    def _cut_box(self, t: Transfer, start) -> Transfer | None:
        """``t`` with each box dim cut where its walk carries into the next tensor dim; None if inexact."""
        box = []  # (extent, source stride, target stride) per box dim
        for walk in zip(t.extents, t.source_strides, t.target_strides):
            cut = self._cut(*walk, start)
            if cut is None:
                return None
            box += cut
        if len(box) == len(t.extents):
            return t
        return Transfer(t.source, t.target, tuple(e for e, _, _ in box), t.source_offset,
                        tuple(s for _, s, _ in box), t.target_offset, tuple(s for _, _, s in box))

    def _walks(self, t: Transfer) -> tuple[list, dict[int, list]]:
        """(groups of box dims that stay in place, ``{tensor dim: [(box dim, extent, row step)]}``)."""
        walks: dict[int, list] = {}
        groups = []
        for k, (extent, stride) in enumerate(zip(t.extents, t.source_strides)):
            d = self._walked(extent, stride)
            if d is None:
                groups.append(((k,), torch.ones(extent, dtype=torch.bool)))
            else:
                walks.setdefault(d, []).append((k, extent, stride // self.inner[d]))
        return groups, walks

    def _walked(self, extent: int, stride: int) -> int | None:
        """The tensor dim a box dim walks: the outermost whose row-major stride divides its stride
        (the only one it can walk without carrying); None for a box dim that stays in place."""
        if extent == 1 or stride == 0:
            return None
        return next((d for d in range(len(self.local_padded))
                     if self.local_padded[d] > 1 and stride % self.inner[d] == 0), -1)

    def _within(self, d: int, start: int, steps) -> bool:
        """Whether local row ``start`` plus any ``j * c`` (``j < e``, per ``(e, c)``) stays in dim ``d``."""
        low = start + sum(min(0, (e - 1) * c) for e, c in steps)
        high = start + sum(max(0, (e - 1) * c) for e, c in steps)
        return 0 <= low and high < self.local_padded[d]

    def _cut(self, extent: int, stride: int, target_stride: int, start) -> list | None:
        """A box dim as box dims that each walk one tensor dim: itself, or, where it runs from dim
        ``d``'s first rows over its end into the dim before (a coalesced box), an outer dim at
        ``run`` times the stride and an inner one of ``run`` steps; None where neither is exact."""
        d = self._walked(extent, stride)
        if d is None:
            return [(extent, stride, target_stride)]
        if d < 0:
            return None
        c = stride // self.inner[d]
        if self._within(d, start[d], [(extent, c)]):
            return [(extent, stride, target_stride)]
        if c <= 0 or self.local_padded[d] % c or start[d] >= c:
            return None
        run = self.local_padded[d] // c  # steps until the walk carries into dim d - 1
        if run <= 1 or extent % run:
            return None
        cut = self._cut(extent // run, run * stride, run * target_stride, start)
        return None if cut is None else cut + [(run, stride, target_stride)]

    def __repr__(self) -> str:
        how = "per dim" if self.real is not None else "element-wise"
        return f"Holdings({self.layout} over {list(self.full)}, {how})"


def holdings_of(layout: Layout, full, rows, mesh, everywhere: bool = False) -> Holdings:
    """What each position holds of the true rows (``rows[d]``: the padded indices of dim ``d``
    holding true rows): per dim where it factors (``holdings_per_dim``), else element by element.
    Cached: a spec pair's first plan asks about each side several times."""
    full, rows = tuple(full), tuple(true_rows(r) for r in rows)  # the cache's key
    held = None if everywhere else holdings_per_dim(layout, full, rows, mesh)
    return held if held is not None else holdings_everywhere(layout, full, rows, mesh)


def index_terms(block, extent: int, strides) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each index of one dim: its mesh-position term, its ``m`` term and its local index
    along the dim (each iter of a grouped layout belongs to one dim, so these add up per dim)."""
    index = torch.arange(extent, dtype=torch.int64)
    device = torch.zeros(extent, dtype=torch.int64)
    memory = torch.zeros(extent, dtype=torch.int64)
    local = torch.zeros(extent, dtype=torch.int64)
    inner = 1
    for it in reversed(block):  # row-major within the block: the last iter is fastest
        digit = (index // inner) % it.extent
        inner *= it.extent
        if it.axis == MEMORY_AXIS:
            memory += digit * it.stride
            local = local + digit * math.prod(i.extent for i in block[block.index(it) + 1:] if i.axis == MEMORY_AXIS)
        else:
            device += digit * it.stride * strides[it.axis]
    return device, memory, local


def offset_and_shifts(layout: Layout, mesh) -> tuple[int, list[int]]:
    """The flat mesh position the offset ``O`` adds, and the one each replica point adds (``[0]``
    without replicas): ``O = {x: 1}`` and ``R = 2:1@y`` on 2x2 (x, y) give ``(2, [0, 1])``."""
    strides = mesh.strides()
    flat = lambda point: sum(point.get(a, 0) * strides[a] for a in mesh.axis_names)
    return flat(layout.offset), [flat(r) for r in layout.replica_offsets or ({},)]


def reached(layout: Layout, mesh) -> set[int]:
    """Mesh positions holding any element: the mesh iters' digits (at most the mesh's size), plus replicas."""
    strides = mesh.strides()
    iters = [it for it in layout.shard if it.axis != MEMORY_AXIS]
    base, offsets = offset_and_shifts(layout, mesh)
    points = {base}
    for it in iters:
        points = {p + k * it.stride * strides[it.axis] for p in points for k in range(it.extent)}
    return {p + o for p in points for o in offsets}


def dim_placements(layout: Layout, full, mesh):
    """Where each index of each dim puts its element, per dim: ``(device0, shifts, local_padded,
    per_dim)`` with ``per_dim[d] = (device terms, local rows)`` (tensors over the indices of dim
    ``d``). An element sits at ``device0 + sum of its dims' device terms + shift`` (one shift per
    replica point), at local index ``local rows[d][i_d]`` along each dim of the row-major local
    tensor. None where the layout's memory is not per-dim row-major (an ``m`` offset, or a dim
    whose ``m`` term is not its local row times the row-major stride of the dim): then only the
    element-wise evaluation knows. Raises LayoutError where the layout has no per-dim blocks.
    ``S[(2,4,6):(1@x,6,1)]`` over ``(8, 6)`` on 2x2 (x, y): dim 0's device terms are 0 for rows
    0-3 and 2 for rows 4-7 (x = 1 is flat position 2), its local rows 0,1,2,3,0,1,2,3; dim 1's
    terms are all 0, local rows 0..5; device0 0, shifts [0], local_padded (4, 6).
    """
    blocks = layout.blocks(full)
    if layout.offset.get(MEMORY_AXIS, 0) != 0:
        return None
    local_padded = tuple(math.prod(it.extent for it in block if it.axis == MEMORY_AXIS) for block in blocks)
    strides = mesh.strides()
    device0, shifts = offset_and_shifts(layout, mesh)
    per_dim = []
    for d, block in enumerate(blocks):
        device, memory, digits = index_terms(list(block), full[d], strides)  # the terms dim d adds
        inner = math.prod(local_padded[d + 1:])
        local = memory // inner
        # the m term must be the dim's local row (its memory digits row-major) times its stride
        if bool((memory % inner != 0).any()) or not torch.equal(local, digits):
            return None
        per_dim.append((device, local))
    return device0, shifts, local_padded, per_dim


@cached(maxsize=32)
def holdings_per_dim(layout: Layout, full, rows, mesh) -> Holdings | None:
    """``Holdings`` from each dim's own indices, or None where a position is not one product of
    per-dim index sets (two choices of per-dim device terms, or of replica points, land on it)
    or the memory is not per-dim row-major."""
    try:
        placed = dim_placements(layout, full, mesh)
    except LayoutError:
        return None
    if placed is None:
        return None
    device0, shifts, local_padded, per_dim = placed
    terms = [sorted(set(device.tolist())) for device, _ in per_dim]
    at = position_choices(device0, shifts, terms, mesh)
    if at is None:
        return None
    real_of, box_of = [], []  # per dim: {device term: real local rows}, {device term: box extent}
    for d, (device, local) in enumerate(per_dim):
        true = torch.arange(len(rows[d])) if isinstance(rows[d], range) else torch.tensor(sorted(rows[d]))
        true_device, true_local = device[true], local[true]
        reals, boxes = {}, {}
        for t in terms[d]:
            mine = true_local[true_device == t]
            reals[t] = torch.zeros(local_padded[d], dtype=torch.bool).index_fill_(0, mine, True)
            boxes[t] = int(mine.max()) + 1 if mine.numel() else 0  # the true box is leading
        real_of.append(reals)
        box_of.append(boxes)
    real, boxes = [None] * mesh.size(), [(0,) * len(full)] * mesh.size()
    for p, c in at.items():
        real[p] = tuple(real_of[d][t] for d, t in enumerate(c))
        boxes[p] = tuple(box_of[d][t] for d, t in enumerate(c))
    return Holdings(layout, full, rows, buffer_size(layout), tuple(boxes), local_padded, tuple(real))


def position_choices(device0: int, shifts, terms, mesh) -> dict | None:
    """``{position: the device term of each dim that puts elements there}``; None where two
    choices of terms (or replica points) land on one position, or one falls off the mesh."""
    choice = {device0: ()}
    for ts in terms:
        widened = {p + t: c + (t,) for p, c in choice.items() for t in ts}
        if len(widened) != len(choice) * len(ts):
            return None
        choice = widened
    at = {p + shift: c for shift in shifts for p, c in choice.items()}
    if len(at) != len(choice) * len(shifts) or not all(0 <= p < mesh.size() for p in at):
        return None
    return at


def _spread(terms, ndim: int) -> torch.Tensor:
    """Sum of 1-D tensors, the ``d``-th along dim ``d`` of an ``ndim``-dim grid, flattened row-major."""
    total = torch.zeros((), dtype=torch.int64)
    for d, t in enumerate(terms):
        shape = [1] * ndim
        shape[d] = -1
        total = total + t.view(shape)
    return total.reshape(-1)


@cached(maxsize=4)  # O(elements) each: few
def holdings_everywhere(layout: Layout, full, rows, mesh) -> Holdings:
    """``Holdings`` from every element: each dim's iters give it a device term and an ``m`` term;
    the real elements' slots are their sums over a grid of the real rows (O(elements))."""
    strides = mesh.strides()
    ndim = len(full)
    terms = [index_terms(list(block), extent, strides) for block, extent in zip(layout.blocks(full), full)]
    real = [torch.tensor(sorted(r), dtype=torch.int64) for r in rows]
    base_device, shifts = offset_and_shifts(layout, mesh)
    device = base_device + _spread([t[0][r] for t, r in zip(terms, real)], ndim)
    memory = layout.offset.get(MEMORY_AXIS, 0) + _spread([t[1][r] for t, r in zip(terms, real)], ndim)
    masks = torch.zeros(mesh.size(), buffer_size(layout), dtype=torch.bool)
    for shift in shifts:
        masks[device + shift, memory] = True
    boxes = torch.zeros(mesh.size(), ndim, dtype=torch.int64)
    for d in range(ndim):  # along dim d a box counts the true rows of d alone (any index elsewhere)
        on_d = base_device + _spread([t[0][real[e]] if e == d else t[0] for e, t in enumerate(terms)], ndim)
        sizes = [len(real[e]) if e == d else full[e] for e in range(ndim)]
        view = [1] * ndim
        view[d] = -1
        local = terms[d][2][real[d]].view(view).expand(sizes).reshape(-1)
        for shift in shifts:  # the true box is leading (DTensor checks it): its extent is the largest index + 1
            boxes[:, d].scatter_reduce_(0, on_d + shift, local + 1, "amax")
    return Holdings(layout, full, rows, buffer_size(layout), tuple(tuple(b) for b in boxes.tolist()), dense=masks)


def true_boxes(layout: Layout, full, rows, mesh) -> tuple[tuple[int, ...], ...]:
    """Each mesh position's true (unpadded) local shape under ``layout`` over the padded ``full``
    shape whose true rows are ``rows``: ``(7,)`` as ``Shard(0)`` on 4 (padded 8) -> ``((2,), (2,), (2,), (1,))``."""
    rows = tuple(true_rows(r) for r in rows)
    if all(r == range(f) for r, f in zip(rows, full)):
        # nothing padded: the padded local tensor where the layout reaches a device, else empty
        local = tuple(math.prod(it.extent for it in block if it.axis == MEMORY_AXIS) for block in layout.blocks(full))
        there = reached(layout, mesh)
        return tuple(local if p in there else (0,) * len(full) for p in range(mesh.size()))
    return holdings_of(layout, full, rows, mesh, ELEMENTWISE).boxes
