"""Where a mesh position's local tensor sits in the global tensor, when it is one box.

Checkpoints (``torch.distributed.checkpoint``) store each rank's piece by its global offset and
size. ``(10, 6)`` as ``S[(2,2,3,6):(1@tp,1@dp,6,1)]`` on ``(dp, tp) = (2, 2)`` over the padded
``(12, 6)`` with true rows ``0..4, -, 5..9, -`` (5 rows per tp rank, 3 + 2 per dp rank): position
``(dp=1, tp=0)`` holds true rows 3, 4, so its box is offsets ``(3, 0)``, sizes ``(2, 6)``.
"""

from __future__ import annotations

from ..spec import DTensorSpec
from .holdings import dim_placements, position_choices

__all__ = ["global_box"]


def global_box(spec: DTensorSpec, position: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(offsets, sizes)`` of the true elements mesh ``position`` holds, when they are one box of
    the global tensor laid out row-major in the local tensor (sizes 0 where it holds nothing);
    None where they are not (block-cyclic layouts, a pending sum)."""
    if spec.reduce_op:
        return None
    placed = dim_placements(spec.layout, spec.padded, spec.mesh)
    if placed is None:
        return None
    device0, shifts, _, per_dim = placed
    terms = [sorted(set(device.tolist())) for device, _ in per_dim]
    at = position_choices(device0, shifts, terms, spec.mesh)
    if at is None:
        return None
    if position not in at:
        return (0,) * len(spec.shape), (0,) * len(spec.shape)
    offsets, sizes = [], []
    for d, ((device, local), term) in enumerate(zip(per_dim, at[position])):
        maps = spec.true_index[d] if spec.true_index else None
        held = sorted((int(local[i]), maps[i] if maps is not None else (i if i < spec.shape[d] else -1))
                      for i in (device == term).nonzero().flatten().tolist())
        true = [(row, t) for row, t in held if t >= 0]
        if [row for row, _ in true] != list(range(len(true))) or \
                [t for _, t in true] != list(range(true[0][1], true[0][1] + len(true)) if true else []):
            return None
        offsets.append(true[0][1] if true else 0)
        sizes.append(len(true))
    if 0 in sizes:
        return (0,) * len(spec.shape), (0,) * len(spec.shape)
    return tuple(offsets), tuple(sizes)
