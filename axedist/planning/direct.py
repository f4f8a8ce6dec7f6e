"""``plan_direct``: one step moving only the true elements between two paddings of one tensor.

Where torch chunks a dim differently on the two sides (uneven shapes), each true element goes
from its nearest holder straight into place; padding is never planned, so never sent.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

from ..caches import cached
from ..layout import MEMORY_AXIS, Layout, LayoutError
from .classify import Context, make_step, mark_all_reduce, replace_step
from .derive import check_options
from .holdings import true_rows
from .plans import Plan, buffer_size
from .points import as_mesh, nearest, replica_digits, replica_points, validate
from .steps import Device, Mesh, Transfer

__all__ = ["plan_direct", "clear_direct_cache"]


def plan_direct(src: Layout, src_shape: Sequence[int], src_rows: Sequence[Sequence[int]], dst: Layout,
                dst_shape: Sequence[int], dst_rows: Sequence[Sequence[int]], mesh, itemsize: int = 4,
                partial: str | None = None) -> Plan:
    """One step moving only the true elements between two padded index spaces (an all-to-all-v).

    ``src`` admits ``src_shape`` and ``dst`` admits ``dst_shape``, two paddings of one tensor;
    ``src_rows[d]`` (``dst_rows[d]``) lists the padded index of each true row of dim ``d``,
    so both lists of a dim have one entry per true row. With ``partial`` the source's first
    dim is the summand dim (every index real, no entry in ``dst_*``): each summand is sent to
    every target slot of its element and reduced there. Each element goes from the holder
    nearest its target device (the target itself when it holds it) straight into place, so
    no padding and nothing a device already holds is sent. Derived per dim: the device and
    ``m`` terms a dim's index adds are cut into runs (same devices, constant strides), and a
    box is one run per dim, so the work is the product of the runs, not the element count.

    Example, ``(3, 6)`` on a 2x2 mesh ``(x, y)``, torch's ``[Shard(1), Shard(1)]`` (columns
    chunked by x, then by y: 2 + 1 per x, padded to 8) to ``[Shard(1), Shard(0)]`` (rows
    chunked by y: 2 + 1, padded to 4): each device sends the 2 values its y-peer lacks::

        >>> src = Layout.parse("S[(3,2,2,2):(2,1@x,1@y,1)]")
        >>> dst = Layout.parse("S[(2,2,2,3):(1@y,3,1@x,1)]")
        >>> plan = plan_direct(src, (3, 8), [range(3), (0, 1, 2, 4, 5, 6)],
        ...                    dst, (4, 6), [(0, 1, 2), range(6)], (("x", 2), ("y", 2)))
        >>> plan.kinds, max(plan.bytes_sent.values())
        (('permute',), 8)
    """
    mesh = as_mesh(mesh)
    src_shape, dst_shape = tuple(int(n) for n in src_shape), tuple(int(n) for n in dst_shape)
    src_rows = tuple(true_rows(r) for r in src_rows)
    dst_rows = tuple(true_rows(r) for r in dst_rows)
    check_options(partial, itemsize)
    return _plan_direct_cached(src, src_shape, src_rows, dst, dst_shape, dst_rows, mesh, itemsize, partial)


def clear_direct_cache() -> None:
    _plan_direct_cached.cache_clear()


class TermRun(NamedTuple):
    """Consecutive true rows of one dim with equal device terms on both sides and constant ``m`` steps."""

    src_device: Device
    dst_device: Device
    src_m: int
    dst_m: int
    src_stride: int
    dst_stride: int
    length: int


@cached(maxsize=256)
def _plan_direct_cached(src, src_shape, src_rows, dst, dst_shape, dst_rows, mesh: Mesh, itemsize, partial) -> Plan:
    lead = 1 if partial is not None else 0
    _check_rows(src_shape, src_rows, dst_shape, dst_rows, lead)
    validate(src, mesh, math.prod(src_shape), "source")
    validate(dst, mesh, math.prod(dst_shape), "target")
    true_shape = tuple(len(r) for r in dst_rows)
    zero = ((0,) * len(mesh), 0)
    dst_terms = [[zero] * src_shape[0]] * lead + _dim_terms(dst, dst_shape, dst_rows, mesh)
    # per dim: runs of true rows with the same device terms on both sides and constant m strides
    per_dim = [_term_runs(a, b) for a, b in zip(_dim_terms(src, src_shape, src_rows, mesh), dst_terms)]
    transfers = _transfers(per_dim, src, dst, mesh)
    context = Context(mesh, itemsize, partial)
    step = make_step(transfers, partial, src, dst, buffer_size(src), buffer_size(dst), context)
    moves = (f"each true element from its nearest holder straight into place ({math.prod(true_shape)} real of "
             f"{math.prod(dst_shape)} padded target elements; padding never sent)",)
    return Plan(src, dst, mesh, true_shape, itemsize, partial, mark_all_reduce([replace_step(step, moves=moves)]),
                "direct", f"direct between paddings: source admits {src_shape}, target admits {dst_shape}")


def _check_rows(src_shape, src_rows, dst_shape, dst_rows, lead: int) -> None:
    if len(src_shape) != len(dst_shape) + lead or len(src_rows) != len(src_shape) or len(dst_rows) != len(dst_shape):
        raise LayoutError(f"plan_direct: shapes {src_shape} -> {dst_shape} and their row lists do not match"
                          + (" (the source leads with a summand dim)" if lead else ""))
    for what, shape, rows in (("source", src_shape, src_rows), ("target", dst_shape, dst_rows)):
        for d, (n, r) in enumerate(zip(shape, rows)):
            distinct_below_n = len(r) <= n if isinstance(r, range) else \
                len(set(r)) == len(r) and all(0 <= i < n for i in r)
            if not distinct_below_n:
                raise LayoutError(f"plan_direct: {what} rows of dim {d} must be distinct indices below {n}, got {r}")
    if lead and src_rows[0] != range(src_shape[0]):
        raise LayoutError(f"plan_direct: the summand dim is never padded, got rows {src_rows[0]}")
    for d, (a, b) in enumerate(zip(src_rows[lead:], dst_rows)):
        if len(a) != len(b):
            raise LayoutError(f"plan_direct: dim {d} has {len(a)} true rows in the source, {len(b)} in the target")


def _transfers(per_dim: list[list[TermRun]], src: Layout, dst: Layout, mesh: Mesh) -> list[Transfer]:
    """One box per choice of a run in every dim (and target replica), from the nearest holder."""
    src_points, dst_points = replica_points(src, mesh), replica_points(dst, mesh)
    aligned = replica_digits(src, mesh)
    transfers = []
    for choice in itertools.product(*per_dim):
        src_device = [sum(c) for c in zip(*(run.src_device for run in choice))] or [0] * len(mesh)
        dst_device = [sum(c) for c in zip(*(run.dst_device for run in choice))] or [0] * len(mesh)
        src_m, dst_m = sum(run.src_m for run in choice), sum(run.dst_m for run in choice)
        kept = [run for run in choice if run.length > 1] or [choice[0]]
        extents = tuple(run.length for run in kept)
        source_strides, target_strides = tuple(r.src_stride for r in kept), tuple(r.dst_stride for r in kept)
        for r_device, r_m in dst_points:
            target = tuple(a + b for a, b in zip(dst_device, r_device))
            holders = [(tuple(a + b for a, b in zip(src_device, p_device)), src_m + p_m) for p_device, p_m in src_points]
            source, source_m = nearest(holders, target, aligned)
            transfers.append(Transfer(source, target, extents, source_m, source_strides, dst_m + r_m, target_strides))
    return transfers


def _dim_terms(layout: Layout, shape, rows, mesh: Mesh) -> list[list[tuple[Device, int]]]:
    """Per dim, per true row (``rows[d]`` gives its padded index): the (device, m) that dim's
    iters add. A grouped layout's iters each belong to one dim, so an element's place is the
    sum of its dims' terms plus the offset (and a replica)."""
    index = {a: i for i, (a, _) in enumerate(mesh)}
    terms = []
    for block, dim_rows in zip(layout.blocks(shape), rows):
        row_terms = []
        for i in dim_rows:
            device, m, rest = [0] * len(mesh), 0, i
            for it in reversed(block):  # row-major within the block: the last iter is fastest
                digit, rest = rest % it.extent, rest // it.extent
                if it.axis == MEMORY_AXIS:
                    m += digit * it.stride
                else:
                    device[index[it.axis]] += digit * it.stride
            row_terms.append((tuple(device), m))
        terms.append(row_terms)
    return terms


def _term_runs(src_terms, dst_terms) -> list[TermRun]:
    """Consecutive rows with equal device terms on both sides and constant ``m`` steps."""
    runs, i, n = [], 0, len(src_terms)
    while i < n:
        j, (sd, sm), (dd, dm) = i + 1, src_terms[i], dst_terms[i]
        ss = st = 1
        if j < n and src_terms[j][0] == sd and dst_terms[j][0] == dd:
            ss, st = src_terms[j][1] - sm, dst_terms[j][1] - dm
            while j < n and src_terms[j][0] == sd and dst_terms[j][0] == dd \
                    and src_terms[j][1] - src_terms[j - 1][1] == ss and dst_terms[j][1] - dst_terms[j - 1][1] == st:
                j += 1
        runs.append(TermRun(sd, dd, sm, dm, ss, st, j - i))
        i = j
    return runs
