"""A device's true (unpadded) local tensor in and out of its flat padded buffer.

``(7,)`` as ``Shard(0)`` on 4 ranks (padded 8): rank 3's true local tensor ``[6.]`` sits in
the buffer ``[6., 0.]``; the slot after it is padding, never sent and never read.
"""

from __future__ import annotations

import math

import torch

from ..caches import cached
from ..planning.repad import Side
from ..tracing import outside_tracing, traced_constant

__all__ = ["to_buffer", "from_buffer", "position_index"]


@cached(maxsize=512)
@outside_tracing
def position_index(side: Side, position: int, dim: int, device: torch.device) -> torch.Tensor:
    """The local rows of ``side``'s true rows along ``dim`` at mesh ``position``, as an index
    tensor on ``device``, built once: a cached redistribute must not turn thousands of Python
    ints into a tensor and copy it to the GPU on every call (~0.4 ms per 4096 ints on the
    2-core dev machine; the cached (4095, 4098) ``[S1,S1] -> [R,S0]`` spent 1.77 ms of host
    time per call on 4x H200, of which these conversions were a part)."""
    return torch.tensor(side.positions_at(position)[dim], device=device)


def to_buffer(local: torch.Tensor, side: Side, position: int, box, size: int) -> torch.Tensor:
    """The true local tensor (``box``) placed in the padded row-major local tensor, flattened."""
    padded, positions = side.local_padded, side.positions_at(position)
    if tuple(local.shape) == padded and all(p is None for p in positions):
        return local.reshape(-1)  # nothing padded here: the local tensor is the buffer (never written to)
    out = torch.zeros(padded, dtype=local.dtype, device=local.device)
    if math.prod(box) == 0 or local.numel() == 0:
        return out.reshape(-1) if out.numel() == size else torch.zeros(size, dtype=local.dtype, device=local.device)
    t = local.reshape(box)
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
    for d, rows in enumerate(side.positions_at(position)):
        if rows is not None:
            t = t.index_select(d, traced_constant(position_index(side, position, d, t.device)))
    return t[tuple(slice(0, n) for n in box)].contiguous()
