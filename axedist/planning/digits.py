"""Digits: both layouts' shard iters refined into one sequence, and the step they give.

Each digit of the common refinement has a source place ``(axis, stride)`` and a target place
(none for a summand digit, reduced away). ``(8:6, 6:1)`` against ``(4:1@gpuid, 2:6, 6:1)``
refines to digits of extents ``(4, 2, 6)``. A device's holding is a box in digit space: the
digits on a mesh axis in the target fix the target device, those on a mesh axis only in the
source pick the source devices, and the digits on ``m`` on both sides are the box's extents.
Where no refinement exists, a stretch of iters becomes one *block* digit enumerated value by
value (blocks of 3 against blocks of 2: one block of extent 6).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from ..layout import MEMORY_AXIS, Iter, Layout
from .classify import Context, make_step, replace_step
from .plans import buffer_size
from .points import nearest, replica_digits, replica_points
from .steps import Step, Transfer

__all__ = ["Digit", "Block", "BLOCK_LIMIT", "refine", "refine_blocks", "on_mesh", "box_step"]

# Blocks are enumerated value by value; past this extent the element fallback is as good.
BLOCK_LIMIT = 1 << 12


@dataclass(frozen=True)
class Digit:
    """One digit of the common refinement: where it sits in the source and in the target."""

    extent: int
    source: tuple[str, int]  # (axis, stride)
    target: tuple[str, int] | None  # None: a summand digit (reduced away)

    def contribution(self, value: int, side: int) -> tuple[tuple[str, int], ...]:
        """``((axis, delta),)`` this digit adds at ``value`` on ``side`` (0 source, 1 target)."""
        place = self.source if side == 0 else self.target
        return () if place is None or not value else ((place[0], value * place[1]),)

    def split(self, outer: int) -> tuple["Digit", "Digit"]:
        """``(outer, e/outer)`` digits whose product is this one (outer digit first)."""
        inner = self.extent // outer
        scale = lambda p: None if p is None else (p[0], p[1] * inner)
        return Digit(outer, scale(self.source), scale(self.target)), Digit(inner, self.source, self.target)


@dataclass(frozen=True)
class Block:
    """Consecutive iters with no common refinement, enumerated value by value.

    ``(2,3):(3,1@gpuid)`` in the source against ``(3,2):(2,1@gpuid)`` in the target is one
    block of extent 6: value 4 is source digits (1, 1) and target digits (2, 0).
    """

    extent: int
    source_iters: tuple[Iter, ...]
    target_iters: tuple[Iter, ...]

    def contribution(self, value: int, side: int) -> tuple[tuple[str, int], ...]:
        iters = self.source_iters if side == 0 else self.target_iters
        digits = []
        for it in reversed(iters):
            digits.append(value % it.extent)
            value //= it.extent
        return tuple((it.axis, d * it.stride) for it, d in zip(iters, reversed(digits)) if d)

    def touches_mesh(self, side: int) -> bool:
        return any(it.axis != MEMORY_AXIS for it in (self.source_iters if side == 0 else self.target_iters))

    def __str__(self) -> str:
        return f"block {Layout(self.source_iters)} -> {Layout(self.target_iters)}"


def on_mesh(place) -> bool:
    return place is not None and place[0] != MEMORY_AXIS


def _common_digit(a: list[Iter], b: list[Iter], e: int) -> Digit:
    """Pop the outer ``e`` of ``a[0]`` and ``b[0]`` (both divisible by ``e``) as one digit."""
    x, y = a.pop(0), b.pop(0)
    if x.extent > e:
        a.insert(0, Iter(x.extent // e, x.stride, x.axis))
    if y.extent > e:
        b.insert(0, Iter(y.extent // e, y.stride, y.axis))
    return Digit(e, (x.axis, x.stride * (x.extent // e)), (y.axis, y.stride * (y.extent // e)))


def refine(a: Sequence[Iter], b: Sequence[Iter]) -> list[Digit] | None:
    """Split both iter sequences until their extents agree, outermost first; None if impossible.

    ``(8:6, 6:1)`` and ``(4:1@gpuid, 2:6, 6:1)`` -> digits of extents ``(4, 2, 6)``.
    """
    a, b = list(a), list(b)
    digits = []
    while a and b:
        e = math.gcd(a[0].extent, b[0].extent)
        if e not in (a[0].extent, b[0].extent):
            return None
        digits.append(_common_digit(a, b, e))
    return digits if not a and not b else None


def refine_blocks(a: Sequence[Iter], b: Sequence[Iter]) -> list | None:
    """Like ``refine``, but a stretch with no common refinement becomes one ``Block``.

    The stretch grows (splitting iters where a divisor allows) until both sides cover
    the same extent; None if a block would exceed ``BLOCK_LIMIT``.
    """
    a, b = list(a), list(b)
    digits: list = []
    while a and b:
        e = math.gcd(a[0].extent, b[0].extent)
        if e > 1 or a[0].extent == b[0].extent == 1:  # a common outer factor: split as refine does
            digits.append(_common_digit(a, b, e))
            continue
        block = _block(a, b)
        if block.extent > BLOCK_LIMIT:
            return None
        digits.append(block)
    return digits if not a and not b else None


def _block(a: list[Iter], b: list[Iter]) -> Block:
    """Pop iters off both sides until they cover the same extent (splitting one where a divisor allows)."""
    taken_a, taken_b = [a.pop(0)], [b.pop(0)]
    pa, pb = taken_a[0].extent, taken_b[0].extent
    while pa != pb:
        side, other, taken, product = (a, pb, taken_a, pa) if pa < pb else (b, pa, taken_b, pb)
        it = side.pop(0)
        need = other // product if other % product == 0 else None
        if need is not None and it.extent > need and it.extent % need == 0:  # take just enough of it
            taken.append(Iter(need, it.stride * (it.extent // need), it.axis))
            side.insert(0, Iter(it.extent // need, it.stride, it.axis))
            product *= need
        else:
            taken.append(it)
            product *= it.extent
        if pa < pb:
            pa = product
        else:
            pb = product
    return Block(pa, tuple(taken_a), tuple(taken_b))


def _merge_free(free: Sequence[Digit]):
    """Extents and strides of the box over the free digits, merging neighbours that are contiguous on both sides."""
    dims: list[list[int]] = []
    for d in free:
        e, s, t = d.extent, d.source[1], d.target[1]
        if dims and dims[-1][1] == e * s and dims[-1][2] == e * t:
            dims[-1] = [dims[-1][0] * e, s, t]
        else:
            dims.append([e, s, t])
    return tuple(x[0] for x in dims), tuple(x[1] for x in dims), tuple(x[2] for x in dims)


def _walk(chosen, values, device, m: int, side: int, index) -> tuple[list[int], int]:
    """``(device, m)`` plus each chosen digit's contribution on ``side`` (0 source, 1 target)."""
    device = list(device)
    for d, v in zip(chosen, values):
        for axis, delta in d.contribution(v, side):
            if axis == MEMORY_AXIS:
                m += delta
            else:
                device[index[axis]] += delta
    return device, m


def _is_free(d) -> bool:
    """On ``m`` on both sides and affine: one dim of every box."""
    return isinstance(d, Digit) and d.source[0] == MEMORY_AXIS and d.target is not None \
        and d.target[0] == MEMORY_AXIS


def _targets_mesh(d) -> bool:
    return d.touches_mesh(1) if isinstance(d, Block) else on_mesh(d.target)


def box_step(digits: Sequence, src: Layout, dst: Layout, context: Context, reduce) -> Step:
    """One step from ``src`` to ``dst`` whose transfers are boxes in digit space.

    Every target device (the target's mesh digits, each replica) gets one box per value of the
    digits that leave a mesh axis, read from the nearest source holder.
    """
    mesh = context.mesh
    index = {a: i for i, (a, _) in enumerate(mesh)}
    fixed = [d for d in digits if _targets_mesh(d)]
    moving = [d for d in digits if not _targets_mesh(d) and not _is_free(d)]
    extents, source_strides, target_strides = _merge_free([d for d in digits if _is_free(d)])
    source_points, aligned = replica_points(src, mesh), replica_digits(src, mesh)
    zero = [0] * len(mesh)
    moving_values = list(itertools.product(*(range(d.extent) for d in moving)))
    transfers = []
    for fixed_values in itertools.product(*(range(d.extent) for d in fixed)):
        src_device, src_m = _walk(fixed, fixed_values, zero, 0, 0, index)
        dst_device, dst_m = _walk(fixed, fixed_values, zero, 0, 1, index)  # dst_m: only blocks mix m into mesh digits
        for r_device, r_m in replica_points(dst, mesh):
            target = tuple(a + b for a, b in zip(dst_device, r_device))
            for values in moving_values:
                device, m = _walk(moving, values, src_device, src_m, 0, index)
                _, target_m = _walk(moving, values, zero, r_m + dst_m, 1, index)
                holders = [(tuple(a + b for a, b in zip(device, p_device)), m + p_m) for p_device, p_m in source_points]
                source, source_m = nearest(holders, target, aligned)
                transfers.append(Transfer(source, target, extents, source_m, source_strides, target_m, target_strides))
    step = make_step(transfers, reduce, src, dst, buffer_size(src), buffer_size(dst), context)
    return replace_step(step, moves=_moves(digits, src, dst))


def _moves(digits: Sequence, src: Layout, dst: Layout) -> tuple[str, ...]:
    """Digits whose axis changes (``"4:1@gpuid -> 4:12"``, ``"4:1@gpuid reduced"``), replicas gained or lost."""
    text = lambda extent, place: str(Iter(extent, place[1], place[0]))
    moves = []
    for d in digits:
        if d.extent == 1:
            continue
        if isinstance(d, Block):
            moves.append(str(d))
        elif d.target is None:
            moves.append(f"{text(d.extent, d.source)} reduced")
        elif d.source[0] != d.target[0]:
            moves.append(f"{text(d.extent, d.source)} -> {text(d.extent, d.target)}")
    before = {it for it in src.canonicalize().replica if it.axis != MEMORY_AXIS}
    after = {it for it in dst.canonicalize().replica if it.axis != MEMORY_AXIS}
    moves += [f"replica R[{it}] added" for it in sorted(after - before, key=str)]
    moves += [f"replica R[{it}] dropped" for it in sorted(before - after, key=str)]
    return tuple(moves)
