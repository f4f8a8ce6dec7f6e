"""The fused GEMM + reduce-scatter as a step of a route, and when a move can be one.

A product whose partial sums are reduce-scattered by rows over one mesh axis can run as one
fused kernel. ``row_scatter_axis`` says whether a move is that reduce-scatter (pure: from the
specs alone); whether the kernel runs is decided where the operands are known.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..layout import LayoutError
from ..spec import DTensorSpec, placements_of

__all__ = ["FusedStep", "row_scatter_axis"]


@dataclass(frozen=True)
class FusedStep:
    """A GEMM whose partial sums one fused kernel reduce-scatters. A route with
    ``fused=FusedStep("tp", True, "measured faster", gemm)`` prints as ``fused GEMM +
    reduce-scatter: <gemm>``; with ``fused=False``, as the GEMM, then its steps, and why not."""

    axis: str               # the mesh axis reduce-scattered
    fused: bool             # the fused kernel runs (else: the GEMM, then the route's steps)
    reason: str             # why not fused (or the kernel plan's reason)
    gemm: object = None     # collectives.GemmReduceScatterPlan, or None


@functools.lru_cache(maxsize=1024)
def row_scatter_axis(src: DTensorSpec, dst: DTensorSpec) -> str | None:
    """The mesh axis when ``src -> dst`` is a reduce-scatter of a 2-d pending sum's rows over
    one mesh axis (every other axis kept, rows even), the move a fused GEMM + RS can do.

    ``(8, 4)`` as ``[Partial()]`` to ``[Shard(0)]`` on a 4-rank ``gpuid`` mesh -> ``"gpuid"``;
    to ``[Shard(1)]`` -> None (columns), and ``(7, 4)`` -> None (uneven rows).
    """
    if src.reduce_op != "sum" or len(src.shape) != 2 or dst.reduce_op is not None or dst.mesh != src.mesh:
        return None
    try:
        ps, pd = placements_of(src), placements_of(dst)
    except LayoutError:
        return None
    partial = [i for i, p in enumerate(ps) if isinstance(p, Partial)]
    if len(partial) != 1:
        return None
    (i,) = partial
    if not (type(pd[i]) is Shard and pd[i].dim % 2 == 0):
        return None
    for j, (p, q) in enumerate(zip(ps, pd)):
        if j != i and (p != q or isinstance(p, (Shard, _StridedShard)) and p.dim % 2 == 0):
            return None  # another axis changes, or also splits the rows (then the row blocks differ)
    if src.shape[0] % src.mesh.shape[i]:
        return None      # uneven rows: torch.chunk pieces, not the equal row blocks of the kernel
    return src.mesh.axis_names[i]
