"""Which true rows each device holds along each dim, in local order.

A device's true local tensor is the product of these lists (a local tensor is row-major over
its dims), so two layouts whose lists agree everywhere hold the same true local tensors: what
a local re-pad needs. ``S[(2,4):(1@gpuid,1)]`` over ``(2, 4)`` on 2 devices with every row
true: device 0 holds ``(((0, 0),), ((0, 0), (1, 1), (2, 2), (3, 3)))`` (``(local, true)`` pairs).
"""

from __future__ import annotations

import math

import torch

from ..layout import MEMORY_AXIS, Layout
from . import holdings
from .holdings import dim_placements, offset_and_shifts

__all__ = ["held_rows", "held_rows_per_dim", "held_rows_everywhere"]


def held_rows(layout: Layout, full, rows, mesh, everywhere: bool = False) -> list[tuple[tuple[int, ...], ...]]:
    """Per mesh position, per dim: the ``(local row, true row)`` pairs it holds along that dim.

    Coordinates are sums of per-dim terms (each shard iter reads the digits of one dim), so the
    layout is evaluated on each dim's own indices only: O(sum of dims x mesh size), not
    O(elements) (a (4095, 4098) tensor took minutes the other way). everywhere=True forces the
    element-wise evaluation (the tests compare the two).
    """
    held = None if everywhere or holdings.ELEMENTWISE else held_rows_per_dim(layout, full, rows, mesh)
    return held if held is not None else held_rows_everywhere(layout, full, rows, mesh)


def held_rows_per_dim(layout: Layout, full, rows, mesh):
    """``held_rows`` from per-dim evaluations, or None where the memory offsets of a dim are not
    its row-major digit (then the element-wise route decides)."""
    placed = dim_placements(layout, full, mesh)
    if placed is None:
        return None
    device0, shifts, _, per_dim = placed
    per_dim = [(device.tolist(), local.tolist()) for device, local in per_dim]
    held = [[() for _ in full] for _ in range(mesh.size())]
    for d in range(len(full)):
        others = {0}  # every sum of the other dims' device terms
        for e in range(len(full)):
            if e != d:
                others = {o + c for o in others for c in set(per_dim[e][0])}
        true_of = {row: k for k, row in enumerate(rows[d])}
        pairs: dict[int, set] = {}
        for i, (term, local) in enumerate(zip(*per_dim[d])):
            if i in true_of:
                for o in others:
                    for shift in shifts:
                        pairs.setdefault(device0 + term + o + shift, set()).add((local, true_of[i]))
        for p, found in pairs.items():
            held[p][d] = tuple(sorted(found))
    return [tuple(row) for row in held]


def held_rows_everywhere(layout: Layout, full, rows, mesh) -> list[tuple[tuple[int, ...], ...]]:
    """``held_rows`` by evaluating the layout on every element (O(elements)): the reference, and
    the route for layouts whose memory offsets are not per-dim row-major."""
    n = math.prod(full)
    x = torch.arange(n, dtype=torch.int64)
    coords = layout.shard_coordinates(x)
    strides = mesh.strides()
    on = lambda a: coords[a] if isinstance(coords.get(a), torch.Tensor) else torch.full((n,), int(coords.get(a, 0)))
    device = sum((on(a) * strides[a] for a in mesh.axis_names), torch.zeros(n, dtype=torch.int64))
    local_padded = [math.prod(it.extent for it in block if it.axis == MEMORY_AXIS) for block in layout.blocks(full)]
    index, local, rest, m = [], [], x, on(MEMORY_AXIS)
    for extent, lp in zip(reversed(full), reversed(local_padded)):
        index.append(rest % extent)
        rest = rest // extent
        local.append(m % lp)
        m = m // lp
    index, local = index[::-1], local[::-1]
    _, shifts = offset_and_shifts(layout, mesh)
    held = [[() for _ in full] for _ in range(mesh.size())]
    for d in range(len(full)):
        true_of = torch.full((full[d],), -1, dtype=torch.int64)
        true_of[list(rows[d])] = torch.arange(len(rows[d]))
        t = true_of[index[d]]
        real = t >= 0
        # (device, local row, true row) triples, deduplicated through one int64 key: a 1-D
        # unique (a sort) is linear-time in practice where unique(dim=0) on rows was not
        span_local, span_true = local_padded[d] + 1, len(rows[d]) + 1
        for shift in shifts:
            key = ((device[real] + shift) * span_local + local[d][real]) * span_true + t[real]
            per: dict[int, list] = {}
            for code in torch.unique(key).tolist():
                rest_code, r = divmod(code, span_true)
                p, l_ = divmod(rest_code, span_local)
                per.setdefault(p, []).append((l_, r))
            for p, pairs in per.items():
                held[p][d] = tuple(sorted(pairs))
    return [tuple(row) for row in held]
