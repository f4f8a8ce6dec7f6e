"""Where a layout puts its elements on a mesh: (device, m) points, holders, validation.

A mesh here is ``((axis, size), ...)``; an axis a layout does not name is at coordinate 0
(plus its offset), so a layout may occupy part of the mesh. ``slots(S[(2,3):(1@gpuid,1)],
(("gpuid", 2),))[4]`` is ``[((1,), 1)]``: element 4 sits at ``m = 1`` on device 1.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..layout import MEMORY_AXIS, Layout, LayoutError
from .steps import Device, Mesh

__all__ = ["FALLBACK_LIMIT", "as_mesh", "validate", "split_point", "slots", "replica_points", "nearest",
           "replica_digits", "replicated_in_memory"]

# The element fallback enumerates every element; past this it refuses rather than crawl.
FALLBACK_LIMIT = 1 << 22


def as_mesh(mesh) -> Mesh:
    """``((axis, size), ...)`` from that tuple, a ``{axis: size}`` dict, or a ``DeviceMesh``
    (anything with ``axis_names`` and ``shape``; read by duck typing, so no torch import)."""
    if hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
        mesh = tuple(zip(mesh.axis_names, mesh.shape))
    pairs = tuple(mesh.items()) if isinstance(mesh, Mapping) else tuple(tuple(p) for p in mesh)
    names = [a for a, _ in pairs]
    if not pairs or len(set(names)) != len(names) or MEMORY_AXIS in names:
        raise LayoutError(f"a mesh is ((axis, size), ...) with distinct names other than 'm', got {mesh!r}")
    for axis, size in pairs:
        if not isinstance(axis, str) or not isinstance(size, int) or size <= 0:
            raise LayoutError(f"mesh axis {axis!r} needs a positive int size, got {size!r}")
    return pairs


def validate(layout: Layout, mesh: Mesh, size: int, what: str) -> None:
    """Raise a LayoutError unless ``layout`` maps ``size`` elements injectively onto ``mesh``."""
    if layout.size != size:
        raise LayoutError(f"{what} layout {layout} has {layout.size} elements, expected {size}")
    names = dict(mesh)
    for axis in layout.axes:
        if axis != MEMORY_AXIS and axis not in names:
            raise LayoutError(f"{what} layout {layout} names axis {axis!r}, which mesh {mesh} does not have")
    for axis in layout.axes:
        low, high = layout.bounds(axis)
        limit = names.get(axis)
        if low < 0 or (limit is not None and high >= limit):
            where = "memory" if limit is None else f"mesh axis {axis!r} of size {limit}"
            raise LayoutError(f"{what} layout {layout} reaches [{low}, {high}] on {where}")
    if not layout.is_injective():
        raise LayoutError(f"{what} layout {layout} puts two elements in one (device, m) slot")


def split_point(point: Mapping[str, int], mesh: Mesh) -> tuple[Device, int]:
    """``{"x": 1, "m": 5}`` on mesh ``(("x", 2), ("y", 2))`` -> ``((1, 0), 5)``."""
    return tuple(point.get(a, 0) for a, _ in mesh), point.get(MEMORY_AXIS, 0)


def replica_points(layout: Layout, mesh: Mesh) -> list[tuple[Device, int]]:
    """``R + O`` as (device, m) points: where the element at digit zero sits, per replica."""
    offset = layout.offset
    points = []
    for r in layout.replica_offsets or ({},):
        point = dict(offset)
        for a, v in r.items():
            point[a] = point.get(a, 0) + v
        points.append(split_point(point, mesh))
    return points


def slots(layout: Layout, mesh: Mesh) -> list[list[tuple[Device, int]]]:
    """``[(device, m) for every copy of element x] for every x``, by enumeration."""
    if layout.size * max(1, layout.replica_count) > FALLBACK_LIMIT:
        raise LayoutError(f"layout {layout} is too large to enumerate for the element-level plan")
    replicas = replica_points(layout, mesh)
    shard = Layout(layout.shard)
    result = []
    for x in range(layout.size):
        device, m = split_point(shard.shard_coordinates(x), mesh)
        seen = []
        for r_device, r_m in replicas:
            slot = (tuple(a + b for a, b in zip(device, r_device)), m + r_m)
            if slot not in seen:
                seen.append(slot)
        result.append(seen)
    return result


def nearest(candidates: Sequence[tuple[Device, int]], target: Device, aligned=None) -> tuple[Device, int]:
    """The holder to read from: the target itself, else the one differing on the fewest axes.

    Ties go to the holder whose replica digits (``aligned(device)``) equal the target's:
    with ``R[2:2@gpuid]`` device 2 reads from 3, not 1, so the copies form the two
    groups ``{0,1}, {2,3}`` (one collective each) rather than one irregular exchange.
    """
    def key(c):
        device = c[0]
        return (sum(a != b for a, b in zip(device, target)),
                0 if aligned is None else sum(a != b for a, b in zip(aligned(device), aligned(target))),
                sum(abs(a - b) for a, b in zip(device, target)), device)
    return min(candidates, key=key)


def replica_digits(layout: Layout, mesh: Mesh):
    """``device -> (replica digit per mesh replica iter)``: which copy a device would hold."""
    index = {a: i for i, (a, _) in enumerate(mesh)}
    iters = [(index[it.axis], abs(it.stride), it.extent) for it in layout.replica if it.axis in index]
    return lambda device: tuple((device[i] // s) % e for i, s, e in iters)


def replicated_in_memory(layout: Layout, mesh: Mesh) -> bool:
    """Whether two replicas land on one device (at two ``m``): the element fallback handles those."""
    devices = [split_point(r, mesh)[0] for r in layout.replica_offsets]
    return len(set(devices)) != len(devices)
