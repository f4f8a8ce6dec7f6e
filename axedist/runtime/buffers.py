"""A device's true (unpadded) local tensor in and out of its flat padded buffer.

``(7,)`` as ``Shard(0)`` on 4 ranks (padded 8): rank 3's true local tensor ``[6.]`` sits in
the buffer ``[6., 0.]``; the slot after it is padding, never sent and never read.
"""

from __future__ import annotations

import itertools
import math

import torch

from ..caches import cached
from ..planning.repad import Side
from ..tracing import outside_tracing, traced_constant

__all__ = ["to_buffer", "from_buffer", "position_index", "position_runs", "MAX_COPIES"]

MAX_COPIES = 16  # a true local tensor in more pieces than this moves as one gather through an index tensor


@cached(maxsize=512)
@outside_tracing
def position_index(side: Side, position: int, dim: int, device: torch.device) -> torch.Tensor:
    """The local rows of ``side``'s true rows along ``dim`` at mesh ``position``, as an index
    tensor on ``device``, built once: a cached redistribute must not turn thousands of Python
    ints into a tensor and copy it to the GPU on every call (~0.4 ms per 4096 ints on the
    2-core dev machine; the cached (4095, 4098) ``[S1,S1] -> [R,S0]`` spent 1.77 ms of host
    time per call on 4x H200, of which these conversions were a part)."""
    return torch.tensor(side.positions_at(position)[dim], device=device)


@cached(maxsize=512)
@outside_tracing
def position_runs(side: Side, position: int, dim: int) -> tuple[tuple[int, int, int], ...]:
    """The local rows of ``side``'s true rows along ``dim`` at mesh ``position`` as runs
    ``(true start, padded start, length)`` of consecutive padded rows: ``(0, 0, 1025), (1025, 1026, 1024)``
    where one padded row sits between two pieces. Built once per side (vectorised: a flat FSDP
    buffer's rows run to millions)."""
    rows = torch.tensor(side.positions_at(position)[dim], dtype=torch.int64)
    if rows.numel() == 0:
        return ()
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(rows.diff() != 1).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([rows.numel()])])
    return tuple((int(a), int(rows[a]), int(b - a)) for a, b in zip(starts, ends))


@cached(maxsize=512)
def _pieces(side: Side, position: int, box: tuple[int, ...]) -> tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...] | None:
    """``(true slices, padded slices)`` of each piece of the true local tensor ``box`` in the
    padded one: the product over dims of each dim's runs (a dim whose true rows lead: one run).
    None when there are more than ``MAX_COPIES`` pieces."""
    per_dim = []
    for d, rows in enumerate(side.positions_at(position)):
        if rows is None:
            per_dim.append(((0, 0, box[d]),))
            continue
        runs, left = [], box[d]
        for true, padded, n in position_runs(side, position, d):
            if left <= 0:
                break
            runs.append((true, padded, min(n, left)))
            left -= n
        per_dim.append(runs)
    if math.prod(len(runs) for runs in per_dim) > MAX_COPIES:
        return None
    return tuple((tuple(slice(t, t + n) for t, _, n in piece), tuple(slice(p, p + n) for _, p, n in piece))
                 for piece in itertools.product(*per_dim))


def to_buffer(local: torch.Tensor, side: Side, position: int, box, size: int) -> torch.Tensor:
    """The true local tensor (``box``) placed in the padded row-major local tensor, flattened."""
    padded, positions = side.local_padded, side.positions_at(position)
    if tuple(local.shape) == padded and all(p is None for p in positions):
        return local.reshape(-1)  # nothing padded here: the local tensor is the buffer (never written to)
    out = torch.zeros(padded, dtype=local.dtype, device=local.device)
    if math.prod(box) == 0 or local.numel() == 0:
        return out.reshape(-1) if out.numel() == size else torch.zeros(size, dtype=local.dtype, device=local.device)
    t = local.reshape(box)
    pieces = _pieces(side, position, tuple(box))
    if pieces is not None:  # a copy per piece (a few pieces: the uneven chunks of a dim)
        for true, padded_at in pieces:
            out[padded_at] = t[true]
        return out.reshape(-1)
    for d, rows in enumerate(positions):
        if rows is not None:
            grown = list(t.shape)
            grown[d] = padded[d]
            t = torch.zeros(grown, dtype=t.dtype, device=t.device).index_copy_(
                d, traced_constant(position_index(side, position, d, t.device)), t)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out.reshape(-1)


def from_buffer(buffer: torch.Tensor, side: Side, position: int, box) -> torch.Tensor:
    """The true local tensor (``box``) read out of the flat padded buffer."""
    if math.prod(box) == 0:
        return buffer.new_empty(box)
    t = buffer.reshape(side.local_padded)
    positions = side.positions_at(position)
    if any(rows is not None for rows in positions):
        pieces = _pieces(side, position, tuple(box))
        if pieces is not None:  # a copy per piece into the true local tensor, not a gather through an index
            out = buffer.new_empty(box)
            for true, padded_at in pieces:
                out[true] = t[padded_at]
            return out
        for d, rows in enumerate(positions):
            if rows is not None:
                t = t.index_select(d, traced_constant(position_index(side, position, d, t.device)))
    return t[tuple(slice(0, n) for n in box)].contiguous()
