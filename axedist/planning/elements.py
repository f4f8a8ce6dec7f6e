"""The element-level fallback: correct for any pair of valid layouts, by enumeration.

Each (element, target device) reads from its nearest holder; the element pairs are then
compressed into strided runs. Partial sums first reduce each element on the target device
holding most of its summands. Used where the layouts share no digit refinement (with
partial sums) or the target is replicated within one device's memory.
"""

from __future__ import annotations

from typing import Mapping

from ..layout import Layout
from .classify import Context, make_step
from .plans import buffer_size
from .points import nearest, slots
from .steps import Device, Step, Transfer

__all__ = ["plan_by_elements"]


def plan_by_elements(src: Layout, dst: Layout, summands: int, size: int, context: Context) -> list[Step]:
    """Steps moving every element of ``src`` (``summands`` per element when pending) to ``dst``."""
    src_slots, dst_slots = slots(src, context.mesh), slots(dst, context.mesh)
    steps = []
    in_size = buffer_size(src)
    if context.partial is not None:
        owners, reduce_step = _reduce_at_owners(src, dst, summands, size, src_slots, dst_slots, context)
        steps.append(reduce_step)
        src_slots, src, in_size = owners, None, buffer_size(dst)
    return steps + _copy(src, dst, size, src_slots, dst_slots, in_size, context)


def _reduce_at_owners(src, dst, summands, size, src_slots, dst_slots, context: Context):
    """Reduce each element at one of its target devices (its first slot there): (owners, step)."""
    owners, pairs = [], {}
    for x in range(size):
        # the target device holding the most summands already; ties spread over the replicas
        held = [sum(any(d == slot[0] for d, _ in src_slots[p * size + x]) for p in range(summands))
                for slot in dst_slots[x]]
        best = [i for i, h in enumerate(held) if h == max(held)]
        owner = dst_slots[x][best[(x * 7919) % len(best)]]
        owners.append([owner])
        for p in range(summands):
            source, source_m = nearest(src_slots[p * size + x], owner[0])
            pairs.setdefault((source, owner[0]), []).append((source_m, owner[1]))
    step = make_step(_runs(pairs), context.partial, src, None, buffer_size(src), buffer_size(dst), context)
    return owners, step


def _copy(src, dst, size, src_slots, dst_slots, in_size: int, context: Context) -> list[Step]:
    """Each target device receives each element once, into its first slot, then fans out locally."""
    out_size = buffer_size(dst)
    pairs, fan_out = {}, {}
    for x in range(size):
        by_device: dict[Device, list[int]] = {}
        for device, m in dst_slots[x]:
            by_device.setdefault(device, []).append(m)
        for device, ms in by_device.items():
            source, source_m = nearest(src_slots[x], device)
            pairs.setdefault((source, device), []).append((source_m, ms[0]))
            fan_out.setdefault((device, device), []).extend((ms[0], m) for m in ms)
    needs_fan_out = any(a != b for runs in fan_out.values() for a, b in runs)
    steps = [make_step(_runs(pairs), None, src, None if needs_fan_out else dst, in_size, out_size, context)]
    if needs_fan_out:
        steps.append(make_step(_runs(fan_out), None, None, dst, out_size, out_size, context))
    return steps


def _runs(pairs: Mapping[tuple[Device, Device], list[tuple[int, int]]]) -> list[Transfer]:
    """Compress ``(source slot, target slot)`` lists into strided 1-D transfers."""
    transfers = []
    for (source, target), items in sorted(pairs.items()):
        items = sorted(items, key=lambda p: p[1])
        i = 0
        while i < len(items):
            j = i + 1
            if j < len(items):
                ds, dt = items[j][0] - items[i][0], items[j][1] - items[i][1]
                while j + 1 < len(items) and items[j + 1][0] - items[j][0] == ds and items[j + 1][1] - items[j][1] == dt:
                    j += 1
                j += 1
            else:
                ds = dt = 1
            transfers.append(Transfer(source, target, (j - i,), items[i][0], (ds,), items[i][1], (dt,)))
            i = j
    return transfers
