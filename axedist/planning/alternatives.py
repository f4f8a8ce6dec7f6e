"""``plan_alternatives``: ``plan_layouts``' plan, then plans that move one mesh axis per step.

On even shapes one step moves as few bytes as any chain; with padding left out (uneven
shapes) a chain can balance what each device sends, so the caller picks by its own count.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from ..caches import cached
from ..layout import MEMORY_AXIS, Iter, Layout, LayoutError
from .classify import Context, mark_all_reduce, replace_step
from .derive import plan_layouts, staged_reduction
from .digits import Digit, box_step, on_mesh, refine
from .plans import Plan
from .points import as_mesh, replicated_in_memory, validate
from .steps import Mesh

__all__ = ["plan_alternatives", "clear_alternatives_cache"]


def plan_alternatives(src: Layout, dst: Layout, mesh, shape: Sequence[int], itemsize: int = 4,
                      partial: str | None = None, inter_node: Sequence[str] = ()) -> tuple[Plan, ...]:
    """``plan_layouts``' plan first, then plans that gather one mesh axis per step, in every order
    (and with ``inter_node`` axes, the ``staged_reduction`` and its orders).

    On even shapes a gather over several axes in one step moves as many bytes as one step
    per axis, so ``plan_layouts`` keeps one step. When some slots hold padding that need not
    move (uneven shapes: the executor drops it), gathering axis by axis balances what each
    device sends: ``(5, 6)`` rows 2/1/1/1 on a 2x2 mesh all-gathered in one step send 2 real
    rows to 3 peers from device ``(0, 0)``; over ``y`` then ``x`` it sends 2 rows, then 3.
    The caller picks by its own count of bytes. Example, ``[Shard(0), Shard(1)] -> [R, R]``::

        >>> [p.kinds for p in plan_alternatives(Layout.parse("S[(2,4,2,3):(1@x,3,1@y,1)]"),
        ...     Layout.parse("S[(8,6):(6,1)] + R[(2,2):(1@x,1@y)]"), (("x", 2), ("y", 2)), (8, 6))]
        [('all_gather',), ('all_gather', 'all_gather'), ('all_gather', 'all_gather')]
    """
    first = plan_layouts(src, dst, mesh, shape, itemsize, partial)
    if first.method != "digits":
        return (first,)
    mesh, shape = as_mesh(mesh), tuple(int(s) for s in shape)
    plans = [first]
    _add_copy_orders(plans, first.steps, src, dst, mesh, shape, itemsize, partial)
    staged = staged_reduction(src, dst, mesh, shape, itemsize, partial, inter_node) if partial and inter_node \
        else None
    if staged is not None and all(staged.steps != p.steps for p in plans):
        plans.append(Plan(src, dst, mesh, shape, itemsize, partial, staged.steps, "digits"))
        _add_copy_orders(plans, staged.steps, src, dst, mesh, shape, itemsize, partial)
    return tuple(plans)


def _add_copy_orders(plans: list, steps, src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int,
                     partial) -> None:
    """Append to ``plans`` the variants of the plan of ``steps`` whose last copy runs axis by axis
    (a reduction before it stays), each unless ``plans`` has its steps already."""
    head, start = (), src
    if partial is not None:  # the reduction stays; its copy step (if any) gets the alternatives
        if len(steps) < 2 or steps[-1].reduce is not None or steps[-1].source is None:
            return
        head, start = tuple(replace_step(s, fused=None) for s in steps[:-1]), steps[-1].source
    for chain in _gather_orders(start, dst, mesh, shape, itemsize) + _axis_orders(start, dst, mesh, shape, itemsize):
        ordered = mark_all_reduce(list(head + chain.steps))
        if all(ordered != p.steps for p in plans):  # a gather order is often also an axis order
            plans.append(Plan(src, dst, mesh, shape, itemsize, partial, ordered, "digits"))


def clear_alternatives_cache() -> None:
    _gather_orders.cache_clear()
    _axis_orders.cache_clear()


def _replicas_on(layout: Layout, axis: str) -> list:
    return sorted((it.extent, it.stride) for it in layout.canonicalize().replica if it.axis == axis)


@cached(maxsize=256)
def _axis_orders(src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int) -> tuple[Plan, ...]:
    """One plan per order of the mesh axes the copy changes, one step per axis (as torch's
    DTensor goes placement by placement).

    With padding left out, a one-step exchange can load one device more than a chain:
    ``(7, 2)`` on 2x2, ``[Shard(1), Shard(1)] -> [Replicate, Shard(0)]`` (the devices at
    ``y = 1`` hold no column) sends 40 B from device ``(0, 0)`` in one all-to-all-v, 28 B
    as an all-to-all over ``y`` then an all-gather over ``x``.
    """
    canon_src, canon_dst = src.canonicalize(), dst.canonicalize()
    digits = refine(canon_src.shard, canon_dst.shard)
    if digits is None or any(it.axis == MEMORY_AXIS for it in canon_src.replica + canon_dst.replica):
        return ()
    axes = [a for a, _ in mesh
            if any((d.source[0] == a or d.target[0] == a) and d.source != d.target for d in digits)
            or _replicas_on(src, a) != _replicas_on(dst, a) or src.offset.get(a, 0) != dst.offset.get(a, 0)]
    if len(axes) < 2:
        return ()
    context = Context(mesh, itemsize, None)
    plans = []
    for order in itertools.permutations(axes):
        chain = _axis_chain(order, digits, src, dst, mesh, math.prod(shape))
        if chain is not None:
            plans.append(_chain_plan(chain, digits, src, dst, mesh, shape, context))
    return tuple(plans)


def _axis_chain(order, digits, src: Layout, dst: Layout, mesh: Mesh, size: int):
    """The layouts after the steps of each prefix of ``order``: after the axes ``done``, a digit
    sits at its target place if that is on a done axis, in local memory if it left a done axis
    for a place not yet reached, else where the source has it; replicas and offsets likewise.
    None where an intermediate is no valid layout."""
    chain = [(src, [d.source for d in digits])]
    for k in range(1, len(order)):
        done = set(order[:k])
        places = []
        for d in digits:
            if on_mesh(d.target) and d.target[0] in done:
                places.append(d.target)
            elif on_mesh(d.source) and d.source[0] not in done:
                places.append(d.source)
            else:
                places.append(None)  # local memory; strides below
        stride = 1
        for i in reversed(range(len(digits))):  # compact, row-major over the local digits
            if places[i] is None:
                places[i] = (MEMORY_AXIS, stride)
                stride *= digits[i].extent
        replica = [it for it in src.replica if it.axis not in done] + [it for it in dst.replica if it.axis in done]
        offset = {a: v for a, v in src.offset.items() if a not in done and a != MEMORY_AXIS}
        offset.update({a: v for a, v in dst.offset.items() if a in done})
        layout = Layout([Iter(d.extent, p[1], p[0]) for d, p in zip(digits, places)], replica, offset)
        if not _valid(layout, mesh, size) or replicated_in_memory(layout, mesh):
            return None
        chain.append((layout, places))
    return chain


def _valid(layout: Layout, mesh: Mesh, size: int) -> bool:
    try:
        validate(layout, mesh, size, "intermediate")
    except LayoutError:
        return False
    return True


@cached(maxsize=256)
def _gather_orders(src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int) -> tuple[Plan, ...]:
    """One plan per order of the mesh axes the copy gathers from, one all-gather per axis."""
    canon_src, canon_dst = src.canonicalize(), dst.canonicalize()
    digits = refine(canon_src.shard, canon_dst.shard)
    if digits is None or any(it.axis == MEMORY_AXIS for it in canon_src.replica):
        return ()
    gathered = [d for d in digits if on_mesh(d.source) and d.target[0] == MEMORY_AXIS]
    axes = list(dict.fromkeys(d.source[0] for d in gathered))
    if len(axes) < 2:
        return ()
    context = Context(mesh, itemsize, None)
    plans = []
    for order in itertools.permutations(axes):
        chain = _gather_chain(order, digits, gathered, src, mesh, math.prod(shape))
        if chain is not None:
            plans.append(_chain_plan(chain, digits, src, dst, mesh, shape, context))
    return tuple(plans)


def _gather_chain(order, digits, gathered, src: Layout, mesh: Mesh, size: int):
    """``(layout, place of each digit)`` after each prefix of ``order``: the gathered digits of the
    axes done join local memory (compact, row-major over the local digits) and become replicas
    along the axis they came from. None where an intermediate is no valid layout."""
    offset = {a: v for a, v in src.offset.items() if a != MEMORY_AXIS}
    chain = [(src, [d.source for d in digits])]
    for k in range(1, len(order)):
        done, (before, places) = set(order[:k]), chain[-1]
        new, stride = list(places), 1
        for i in reversed(range(len(digits))):
            if places[i][0] == MEMORY_AXIS or (digits[i] in gathered and places[i][0] in done):
                new[i] = (MEMORY_AXIS, stride)
                stride *= digits[i].extent
        replica = list(before.replica) + [Iter(d.extent, d.source[1], d.source[0])
                                          for d in gathered if d.source[0] == order[k - 1]]
        layout = Layout([Iter(d.extent, p[1], p[0]) for d, p in zip(digits, new)], replica, offset)
        if not _valid(layout, mesh, size):
            return None
        chain.append((layout, new))
    return chain


def _chain_plan(chain, digits, src: Layout, dst: Layout, mesh: Mesh, shape, context: Context) -> Plan:
    """The plan stepping through ``chain`` (``(layout, place of each digit)`` from ``src``), then
    into ``dst``: one copy step per pair of consecutive layouts that differ."""
    chain = chain + [(dst, [d.target for d in digits])]
    steps = [box_step([Digit(d.extent, p, q) for d, p, q in zip(digits, a_places, b_places)],
                      a, b, context, reduce=None)
             for (a, a_places), (b, b_places) in zip(chain, chain[1:]) if a != b]
    return Plan(src, dst, mesh, shape, context.itemsize, None, mark_all_reduce(steps), "digits")
