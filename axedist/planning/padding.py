"""Plans that leave padding out: transfers cut to their real elements, and the cheapest such plan.

Realness follows the values step by step: a step's input is real where its source layout holds
a true element (``holdings``), or where a real value landed in the step before. A box that is
partly padding is cut into boxes of its real part; output slots of padding are never written
(garbage that nothing reads). ``(7, 5)`` as ``Shard(0)`` (padded 8) to ``Replicate()`` on 4
devices: device 3 sends its 1 real row, the others 2.
"""

from __future__ import annotations

import itertools
import math

import torch

from ..layout import Layout
from . import holdings
from .alternatives import plan_alternatives
from .cost import pick
from .derive import plan_layouts
from .holdings import Holdings, box_index, holdings_of, holdings_per_dim, outer
from .plans import Plan
from .steps import Transfer

__all__ = ["drop_padding", "step_holdings", "expand", "real_boxes", "pieces", "cheapest", "real_slots"]


def drop_padding(plan: Plan, held: Holdings, mesh, everywhere: bool = False) -> Plan:
    """``plan`` moving only the real elements (``held``: which slots of its first input buffers are real).

    Where a step's source layout does not factor per dim (or ``everywhere``), realness is followed
    slot by slot from what landed in the step before.
    """
    strides = mesh.strides()
    names = [a for a, _ in plan.mesh]
    position = lambda d: sum(c * strides[a] for a, c in zip(names, d))
    kept_steps, dropped, real = [], 0, held
    for i, step in enumerate(plan.steps):
        last = i + 1 == len(plan.steps)
        after = None if last or everywhere else step_holdings(plan.steps[i + 1].source, held, plan, mesh)
        out = None if last or after is not None else torch.zeros(mesh.size(), step.out_size, dtype=torch.bool)
        kept = []
        for t in step.transfers:
            box, groups = real.keep(position(t.source), t)
            count = math.prod(int(grid.sum()) for _, grid in groups)
            if out is not None and count:
                out[position(t.target), box_index([box], "target")[expand(groups, box.extents).reshape(-1)]] = True
            # local copies are cut the same way (they cost nothing, but a collective's own part must
            # line up with what it sends: an all-reduce stays an all-reduce)
            if count == t.count:
                kept.append(t)
            elif count:
                kept.extend(real_boxes(box, groups))
            dropped += 0 if t.is_local else t.count - count
        kept_steps.append(kept)
        real = after if after is not None else Holdings(step.target, (), (), step.out_size, None, dense=out)
    if not dropped:
        return plan
    return plan.with_transfers(kept_steps, note=f"padding left out: {dropped} slot(s) not sent")


def step_holdings(layout: Layout | None, held: Holdings, plan: Plan, mesh) -> Holdings | None:
    """The per-dim holdings of an intermediate layout of ``plan`` (over the first input's padded
    shape, or the plan's shape once a pending reduction is done), or None where that layout does
    not factor per dim (an element-level intermediate, a partly reduced summand dim)."""
    if layout is None:
        return None
    lead = len(held.full) - len(plan.shape)
    for full, rows in ((held.full, held.rows), (held.full[lead:], held.rows[lead:])):
        if layout.size == math.prod(full):
            return holdings_per_dim(layout, full, rows, mesh)
    return None


def expand(groups, extents) -> torch.Tensor:
    """The bool grid over the box ``extents`` that ``Holdings.keep``'s groups stand for."""
    grid = torch.ones(tuple(extents), dtype=torch.bool)
    for dims, part in groups:
        shape = [1] * len(extents)
        for k in dims:
            shape[k] = extents[k]
        grid = grid & part.reshape(shape)
    return grid


def real_boxes(t: Transfer, groups) -> list[Transfer]:
    """The real part of box ``t`` as boxes: per group of box dims, its real cells as boxes
    (``pieces``), and the product of those over the groups."""
    boxes = []
    for choice in itertools.product(*(pieces(grid) for _, grid in groups)):
        runs = [None] * len(t.extents)
        for (dims, _), piece in zip(groups, choice):
            for k, run in zip(dims, piece):
                runs[k] = run
        starts = [r[0] for r in runs]
        boxes.append(Transfer(t.source, t.target, tuple(r[1] for r in runs),
                              t.source_offset + sum(s * st for s, st in zip(starts, t.source_strides)),
                              t.source_strides,
                              t.target_offset + sum(s * st for s, st in zip(starts, t.target_strides)),
                              t.target_strides))
    return boxes


def pieces(grid: torch.Tensor) -> list[tuple[tuple[int, int], ...]]:
    """The True cells of a bool grid as boxes, ``(start, length)`` per dim: the product of each
    dim's runs when the grid is that product, else, per run of equal slices along dim 0, that
    run times the slice's boxes. ``[[1,1,0],[1,1,0],[1,0,0]]`` -> ``((0,2),(0,2))``, ``((2,1),(0,1))``."""
    if grid.dim() == 0:
        return [()] if bool(grid) else []
    if not bool(grid.any()):
        return []
    along = [grid.movedim(k, 0).reshape(grid.shape[k], -1).any(1) for k in range(grid.dim())]
    if torch.equal(outer(along), grid):
        return list(itertools.product(*(_runs_of(a) for a in along)))
    found, i, n = [], 0, grid.shape[0]
    while i < n:
        j = i + 1
        while j < n and torch.equal(grid[j], grid[i]):
            j += 1
        found += [((i, j - i),) + piece for piece in pieces(grid[i])]
        i = j
    return found


def _runs_of(flags: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of True in a 1-D bool tensor."""
    edges = torch.diff(flags.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    return list(zip(starts.tolist(), (ends - starts).tolist()))


def real_slots(layout: Layout, full, rows, mesh) -> Holdings | None:
    """Which slots of ``layout``'s buffers (over the padded ``full`` shape, true rows ``rows``) are
    real; None when nothing is padded."""
    if all(len(r) == f for r, f in zip(rows, full)):
        return None
    return holdings_of(layout, full, rows, mesh, holdings.ELEMENTWISE)


def cheapest(src: Layout, dst: Layout, full, itemsize: int, partial, held: Holdings | None, mesh) -> Plan:
    """The plan to run: ``plan_layouts``' own on even shapes; with padding (``held`` says which
    slots are real), the ``plan_alternatives`` candidate that moves least once its padding is left out.
    On a mesh that spans hosts (``mesh.network``), the fastest of the alternatives that send as
    few bytes a device as any (``cost.pick``), carrying the network."""
    network = getattr(mesh, "network", None)
    if network is None and (held is None or held.all_real):
        return plan_layouts(src, dst, mesh, full, itemsize, partial)
    inter_node = () if network is None else network.inter_node_axes
    alternatives = plan_alternatives(src, dst, mesh, full, itemsize, partial, inter_node)
    if held is not None and not held.all_real:
        alternatives = [drop_padding(p, held, mesh, holdings.ELEMENTWISE) for p in alternatives]
    return pick(alternatives, network).on(network)
