"""Where a mesh position's local tensor sits in the global tensor: per dim, the global index of
each local row (``held_indices``), and the box those make where they run up by one (``global_box``).

Checkpoints (``torch.distributed.checkpoint``) store each rank's piece by its global offset and
size. ``(10, 6)`` as ``S[(2,2,3,6):(1@tp,1@dp,6,1)]`` on ``(dp, tp) = (2, 2)`` over the padded
``(12, 6)`` with true rows ``0..4, -, 5..9, -`` (5 rows per tp rank, 3 + 2 per dp rank): position
``(dp=1, tp=0)`` holds true rows 3, 4, so its box is offsets ``(3, 0)``, sizes ``(2, 6)``.
"""

from __future__ import annotations

from ..spec import DTensorSpec
from .holdings import dim_placements, position_choices

__all__ = ["global_box", "held_indices"]


def held_indices(spec: DTensorSpec, position: int) -> tuple[tuple[int, ...] | range, ...] | None:
    """Per dim, the true (global) index of each row of mesh ``position``'s local tensor along that
    dim, when the position holds a grid of the global tensor (one set of indices per dim, every
    combination held): ``range`` where the indices run up by one, else a tuple. Empty in every dim
    where the layout puts nothing there (empty in one dim where an uneven split leaves it none of
    that dim: its local tensor is empty along that dim only); None where the layout does not say a grid per position (its memory is
    not per-dim row-major, a pending sum) or padding sits between true rows.

    ``(8, 6)`` with rows dealt round-robin in pairs to 2 devices, ``S[(2,2,2,6):(12,1@gpuid,6,1)]``:
    position 1 holds rows ``(2, 3, 6, 7)`` and columns ``range(0, 6)``."""
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
    nothing = ((),) * len(spec.shape)
    if position not in at:
        return nothing
    out = []
    for d, ((device, local), term) in enumerate(zip(per_dim, at[position])):
        maps = spec.true_index[d] if spec.true_index else None
        held = sorted((int(local[i]), maps[i] if maps is not None else (i if i < spec.shape[d] else -1))
                      for i in (device == term).nonzero().flatten().tolist())
        true = [(row, t) for row, t in held if t >= 0]
        if [row for row, _ in true] != list(range(len(true))):
            return None  # padding before a true row: the local tensor's rows are not these
        index = tuple(t for _, t in true)
        out.append(range(index[0], index[0] + len(index)) if index and index == tuple(
            range(index[0], index[0] + len(index))) else index)
    return tuple(out)


def global_box(spec: DTensorSpec, position: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(offsets, sizes)`` of the true elements mesh ``position`` holds, when they are one box of
    the global tensor laid out row-major in the local tensor (sizes 0 where it holds nothing);
    None where they are not (block-cyclic layouts, a pending sum)."""
    held = held_indices(spec, position)
    if held is not None and any(len(index) == 0 for index in held):
        return ((0,) * len(held),) * 2
    if held is None or not all(isinstance(index, range) for index in held):
        return None
    return tuple(index.start if len(index) else 0 for index in held), tuple(len(index) for index in held)
