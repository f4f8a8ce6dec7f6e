"""``plan_layouts``: the steps that move a tensor from one layout to another, from their digits.

Without partial sums one step does it, and each device receives exactly what it needs and
does not hold. With partial sums (``partial=op``: the source admits ``(P, *shape)``, ``P``
summands per element) the summand digits on mesh axes are first reduced into an
intermediate layout (straight into the target's place when it has one: a reduce-scatter),
then a copy step moves that layout to the target. No common refinement: blocks, else the
element-level fallback.

    >>> plan_layouts(Layout.parse("S[(4,8,6):(1@gpuid,6,1)]"),
    ...              Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"), (("gpuid", 4),), (8, 6), partial="sum").kinds
    ('reduce_scatter',)
"""

from __future__ import annotations

import math
from typing import Sequence

from ..caches import cached
from ..layout import MEMORY_AXIS, Iter, Layout, LayoutError
from ..spec import REDUCE_OPS
from .classify import Context, mark_all_reduce
from .digits import Digit, box_step, on_mesh, refine, refine_blocks
from .elements import plan_by_elements
from .plans import Plan, step_cost
from .points import as_mesh, replicated_in_memory, validate
from .steps import Mesh, Step

__all__ = ["plan_layouts", "staged_reduction", "check_options", "clear_derive_cache"]


def check_options(partial, itemsize) -> None:
    """Raise a LayoutError for a reduce op other than ``REDUCE_OPS`` or a bad item size."""
    if partial is not None and partial not in REDUCE_OPS:
        raise LayoutError(f"partial must be one of {REDUCE_OPS} or None, got {partial!r}")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise LayoutError(f"itemsize must be a positive int, got {itemsize!r}")


def plan_layouts(src: Layout, dst: Layout, mesh, shape: Sequence[int], itemsize: int = 4,
                 partial: str | None = None) -> Plan:
    """The plan moving a tensor of ``shape`` from layout ``src`` to ``dst`` on ``mesh``.

    ``mesh`` is ``((axis, size), ...)`` (or a ``DeviceMesh``); with ``partial`` (a reduce op) ``src`` admits
    ``(P, *shape)`` and holds ``P`` summands per element. Plans are cached on
    (layouts' maps, mesh, shape, itemsize, partial). Example: a partial sum over 4
    devices into ``Shard(0)`` is one reduce-scatter (the module's example).
    """
    check_options(partial, itemsize)
    return _plan_cached(src, dst, as_mesh(mesh), tuple(int(s) for s in shape), itemsize, partial)


def clear_derive_cache() -> None:
    _plan_cached.cache_clear()
    _staged_cached.cache_clear()


def staged_reduction(src: Layout, dst: Layout, mesh, shape: Sequence[int], itemsize: int, partial: str,
                     inter_node: Sequence[str]) -> Plan | None:
    """``plan_layouts``' reduction in two stages: the summands on intra-node axes first, then those
    on the ``inter_node`` axes, then the copy to ``dst``; None where there is no such split.

    The first stage reduce-scatters, so the second (across hosts) reduces a smaller piece. Partial
    sums of ``(8, 6)`` over 2x2 ``(dp, tp)`` to ``Replicate`` on both, ``dp`` inter-node: a
    reduce-scatter over ``tp`` (each device keeps 24 of 48 elements), a reduce-scatter over ``dp``
    (12), then the all-gather back: 96 B of a device's 288 B cross hosts, where one reduce-scatter
    over all 4 devices sends 192 B across. Same total bytes.
    """
    plan_layouts(src, dst, mesh, shape, itemsize, partial)  # checks the arguments, as there
    return _staged_cached(src, dst, as_mesh(mesh), tuple(int(s) for s in shape), itemsize, partial,
                          tuple(inter_node))


@cached(maxsize=1024)
def _plan_cached(src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int, partial) -> Plan:
    size = math.prod(shape)
    if partial is not None and (size == 0 or src.size % size):
        raise LayoutError(f"partial source {src} has {src.size} elements, not a multiple of shape {shape}")
    summands = src.size // size if partial is not None else 1
    validate(src, mesh, summands * size, "source")
    validate(dst, mesh, size, "target")
    context = Context(mesh, itemsize, partial)
    steps, method = _plan_by_digits(src, dst, summands, size, context)
    if steps is None:
        steps = plan_by_elements(src, dst, summands, size, context)
        method = "elements"
    return Plan(src, dst, mesh, shape, itemsize, partial, mark_all_reduce(steps), method)


def _plan_by_digits(src: Layout, dst: Layout, summands: int, size: int,
                    context: Context) -> tuple[list[Step] | None, str]:
    """Steps from the digits and ``"digits"`` or ``"blocks"``; None if none exist."""
    canon_src, canon_dst = src.canonicalize(), dst.canonicalize()
    try:
        summand_iters, data_iters = canon_src.blocks((summands, size))
    except LayoutError:
        return None, ""
    if replicated_in_memory(dst, context.mesh):
        return None, ""
    digits = refine(data_iters, canon_dst.shard)
    if context.partial is None:
        return _copy_steps(digits, data_iters, src, dst, context)
    if digits is None:
        return None, ""
    summand_digits = [Digit(it.extent, (it.axis, it.stride), None) for it in summand_iters]
    return _reduce_steps(summand_digits, digits, src, dst, context), "digits"


def _copy_steps(digits, data_iters, src: Layout, dst: Layout, context: Context):
    if src == dst:
        return [], "digits"
    method = "digits"
    if digits is None:
        digits, method = refine_blocks(data_iters, dst.canonicalize().shard), "blocks"
        if digits is None:
            return None, ""
    return [box_step(digits, src, dst, context, reduce=None)], method


def _reduce_steps(summand_digits, digits, src: Layout, dst: Layout, context: Context) -> list[Step]:
    """All summand axes reduce in one step (over the product group: ``(G-1)/G`` of the data, as any
    order of per-axis steps moves), unless some cannot scatter; then a copy step to ``dst``."""
    middle, reduced_digits, copy_digits, late = _reduction_target(summand_digits, digits, src, dst, context.mesh)
    steps = [box_step(summand_digits + reduced_digits, src, middle, context, reduce=context.partial)]
    scattering = [u for u in summand_digits if on_mesh(u.source) and u not in late]
    if late and scattering:
        # Summands with no data digit to scatter become replicas (every device reduces all of its
        # part): reducing them in the same step as the scattering ones sends every piece across the
        # whole product group. Reduce the scattering axes first, then the rest on the smaller piece.
        split = _reduce_late(summand_digits, late, reduced_digits, src, middle, context)
        if step_cost(split) < step_cost(steps):
            steps = split
    if middle != dst:
        steps.append(box_step(copy_digits, middle, dst, context, reduce=None))
    return steps


@cached(maxsize=256)
def _staged_cached(src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int, partial, inter_node) -> Plan | None:
    size = math.prod(shape)
    canon_src, canon_dst = src.canonicalize(), dst.canonicalize()
    try:
        summand_iters, data_iters = canon_src.blocks((src.size // size, size))
    except LayoutError:
        return None
    digits = refine(data_iters, canon_dst.shard)
    if digits is None or replicated_in_memory(dst, mesh):
        return None
    summand_digits = [Digit(it.extent, (it.axis, it.stride), None) for it in summand_iters]
    late = [u for u in summand_digits if u.source[0] in inter_node]
    if not late or not any(on_mesh(u.source) and u not in late for u in summand_digits):
        return None  # one class of summand axes: nothing to stage
    # the intra-node summands take their places first, so where the data is too small to scatter
    # over every summand axis, the inter-node ones are those left to all-reduce (a smaller piece)
    intra_first = [u for u in summand_digits if u not in late] + late
    middle, reduced_digits, copy_digits, replicas = _reduction_target(intra_first, digits, src, dst, mesh)
    context = Context(mesh, itemsize, partial)
    if replicas:
        if not set(replicas) <= set(late):
            return None
        steps = _reduce_late(intra_first, replicas, reduced_digits, src, middle, context)
        if middle != dst:
            steps.append(box_step(copy_digits, middle, dst, context, reduce=None))
        return Plan(src, dst, mesh, shape, itemsize, partial, mark_all_reduce(steps), "digits")
    pending = _pending(late, reduced_digits, src, middle, inter_node)
    if pending is None:
        return None
    layout, places = pending
    try:
        validate(layout, mesh, math.prod(u.extent for u in late) * size, "intermediate")
    except LayoutError:
        return None
    if replicated_in_memory(layout, mesh):
        return None
    early = [u for u in summand_digits if u not in late]
    kept = [Digit(u.extent, u.source, u.source) for u in late]
    steps = [box_step(early + kept + [Digit(d.extent, d.source, p) for d, p in zip(reduced_digits, places)],
                      src, layout, context, reduce=partial),
             box_step(late + [Digit(d.extent, p, d.target) for d, p in zip(reduced_digits, places)],
                      layout, middle, context, reduce=partial)]
    if middle != dst:
        steps.append(box_step(copy_digits, middle, dst, context, reduce=None))
    return Plan(src, dst, mesh, shape, itemsize, partial, mark_all_reduce(steps), "digits")


def _pending(late, reduced_digits, src: Layout, middle: Layout, inter_node):
    """The layout between the stages: the ``late`` summands still on their axes (a leading summand
    block), every data digit at its place in ``middle`` except those bound for an inter-node axis,
    which stay in local memory (compact, row-major); and each data digit's place there. None where
    a digit would leave another mesh axis for an inter-node one (not a two-stage reduction)."""
    places = []
    for d in reduced_digits:
        if on_mesh(d.target) and d.target[0] in inter_node and d.target != d.source:
            if on_mesh(d.source):
                return None
            places.append(None)
        else:
            places.append(d.target)
    stride = 1
    for i in reversed(range(len(places))):
        if places[i] is None or places[i][0] == MEMORY_AXIS:
            places[i] = (MEMORY_AXIS, stride)
            stride *= reduced_digits[i].extent
    late_axes = {u.source[0] for u in late}
    offset = {a: v for a, v in middle.offset.items() if a not in late_axes}
    offset.update({a: v for a, v in src.offset.items() if a in late_axes})
    replica = list(middle.replica) + [it for it in src.replica if it.axis in inter_node and it not in middle.replica]
    shard = [Iter(u.extent, u.source[1], u.source[0]) for u in late]
    shard += [Iter(d.extent, p[1], p[0]) for d, p in zip(reduced_digits, places)]
    return Layout(shard, replica, offset), places


def _reduce_late(summand_digits, late, reduced_digits, src: Layout, middle: Layout, context: Context) -> list[Step]:
    """Two reduce steps: ``src -> pending`` reduces every summand digit but ``late`` (those stay a
    leading summand block on their mesh axes), ``pending -> middle`` reduces ``late``.

    ``[Partial, Partial] -> [Shard(1), Replicate]`` of ``(5, 6)`` on 2x2 (x, y): the x summand
    reduce-scatters the 6 columns into place (15 elements a device stay), the y summand (no
    local digit of 5 or 3 splits by 2) then all-reduces those 15: 60 + 60 B a device with
    4-byte items, where one step over the 4-group sends 3 x 15 x 4 = 180 B.
    """
    late_iters = [Iter(u.extent, u.source[1], u.source[0]) for u in late]
    replica = list(middle.replica)
    for it in late_iters:
        replica.remove(it)
    pending = Layout(late_iters + list(middle.shard), replica, middle.offset)
    early = [u for u in summand_digits if u not in late]
    kept = [Digit(u.extent, u.source, u.source) for u in late]
    same = [Digit(it.extent, (it.axis, it.stride), (it.axis, it.stride)) for it in middle.shard]
    return [box_step(early + kept + reduced_digits, src, pending, context, reduce=context.partial),
            box_step(list(late) + same, pending, middle, context, reduce=context.partial)]


def _reduction_target(summand_digits, digits, src: Layout, dst: Layout, mesh: Mesh):
    """The layout the reduce step lands in, and the digits of (src -> it) and (it -> dst), and
    the summand digits that became replicas.

    Each summand digit on a mesh axis ``(a, s)`` gives its place to a data digit: the one
    the target puts at ``(a, s)`` (reduce-scatter into place); or, when the target does
    not vary along ``a``, none (reduce onto one device); or a local digit split off the
    front (reduce-scatter, then all-gather). If no local digit divides, the summand digit
    becomes a replica (each device reduces everything: a direct all-reduce).
    """
    pieces = [[d, d.source] for d in digits]  # [digit (src->dst), place in the middle layout]
    offset = {a: v for a, v in src.offset.items() if a != MEMORY_AXIS}
    replica = [it for it in src.replica if it.axis != MEMORY_AXIS]
    mesh_summands = [u for u in summand_digits if u.source[0] != MEMORY_AXIS]  # local ones reduce in place
    waiting = [u for u in mesh_summands if not _take_place(pieces, u.source, u.extent)]
    for r in list(replica):  # slice early: a source replica axis the target shards a local digit over
        if r.stride >= 0 and _take_place(pieces, (r.axis, r.stride), r.extent):
            replica.remove(r)
    late = _place_waiting(waiting, pieces, offset, replica, dst)
    return _middle(pieces, replica, offset) + (late,)


def _take_place(pieces, place: tuple[str, int], extent: int) -> bool:
    """Give ``place`` to the local piece the target puts there (split to ``extent`` if larger)."""
    match = next((i for i, (d, where) in enumerate(pieces)
                  if where[0] == MEMORY_AXIS and d.target == place and d.extent % extent == 0), None)
    if match is None:
        return False
    d = pieces[match][0]
    if d.extent > extent:
        outer, inner = d.split(d.extent // extent)
        pieces[match:match + 1] = [[outer, outer.source], [inner, place]]
    else:
        pieces[match][1] = place
    return True


def _place_waiting(waiting, pieces, offset: dict, replica: list, dst: Layout) -> list:
    """Summand digits with no target place: reduce onto one device, scatter a local digit, or
    (returned) become replicas that every device reduces."""
    target_axes = {it.axis for it in dst.canonicalize().shard + dst.canonicalize().replica}
    late = []
    for u in waiting:
        axis, stride = u.source
        if axis not in target_axes:  # reduce onto the one device the target uses along this axis
            here = offset.get(axis, 0)
            want = dst.offset.get(axis, 0) - here
            if want % stride == 0 and 0 <= want // stride < u.extent:
                offset[axis] = here + want
            continue
        # reduce-scatter a local digit (one the target keeps local, if any); the copy step gathers it
        candidates = [i for i, (d, place) in enumerate(pieces) if place[0] == MEMORY_AXIS and d.extent % u.extent == 0]
        candidates.sort(key=lambda i: on_mesh(pieces[i][0].target))
        if candidates:
            split = candidates[0]
            outer, inner = pieces[split][0].split(u.extent)
            pieces[split:split + 1] = [[outer, (axis, stride)], [inner, inner.source]]
            continue
        replica.append(Iter(u.extent, stride, axis))  # every device reduces everything
        late.append(u)
    return late


def _middle(pieces, replica, offset) -> tuple[Layout, list[Digit], list[Digit]]:
    """The middle layout (its memory compact, row-major over its local digits) and the digits into and out of it."""
    stride = 1
    places = [None] * len(pieces)
    for i in reversed(range(len(pieces))):
        d, place = pieces[i]
        if place[0] == MEMORY_AXIS:
            places[i] = (MEMORY_AXIS, stride)
            stride *= d.extent
        else:
            places[i] = place
    middle = Layout([Iter(d.extent, p[1], p[0]) for (d, _), p in zip(pieces, places)], replica, offset)
    reduced = [Digit(d.extent, d.source, p) for (d, _), p in zip(pieces, places)]
    copied = [Digit(d.extent, p, d.target) for (d, _), p in zip(pieces, places)]
    return middle, reduced, copied
