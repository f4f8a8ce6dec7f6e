"""The fused GEMM + collective kernels as steps of a route, and when a move can be one.

A product whose partial sums are reduce-scattered by rows (or all-reduced) over one mesh axis
can run as one fused kernel, and so can a product whose left operand's rows are first
all-gathered. ``row_scatter_axis``, ``all_reduce_axis`` and ``row_gather_axis`` say whether a
move is that collective (pure: from the specs alone); whether a kernel runs is decided where
the operands are known.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..caches import cached
from ..layout import LayoutError
from ..spec import DTensorSpec, placements_of

__all__ = ["FusedStep", "all_reduce_axis", "row_gather_axis", "row_scatter_axis"]


@dataclass(frozen=True)
class FusedStep:
    """A GEMM whose partial sums one fused kernel reduce-scatters (or all-reduces). A route
    with ``fused=FusedStep("tp", True, "measured faster", gemm)`` prints as ``fused GEMM +
    reduce-scatter: <gemm>``; with ``fused=False``, as the GEMM, then its steps, and why not."""

    axis: str               # the mesh axis reduce-scattered / all-reduced
    fused: bool             # the fused kernel runs (else: the GEMM, then the route's steps)
    reason: str             # why not fused (or the kernel plan's reason)
    gemm: object = None     # collectives.GemmReduceScatterPlan / FusedPlan, or None
    collective: str = "reduce-scatter"  # or "all-reduce"
    products: int = 1       # products summed (several: one GEMM over their operands concatenated along K)


@cached(maxsize=1024)
def row_scatter_axis(src: DTensorSpec, dst: DTensorSpec) -> str | None:
    """The mesh axis when ``src -> dst`` reduce-scatters dim 0 of a pending sum of 2 or more
    dims over one mesh axis (every other axis kept, none of them splitting dim 0, dim 0 even):
    for a product ``[S * B, N]`` seen as ``[S, B, N]`` that is the rows of the product, the move
    a fused GEMM + RS can do.

    ``(8, 4)`` as ``[Partial()]`` to ``[Shard(0)]`` on a 4-rank ``gpuid`` mesh -> ``"gpuid"``, and
    ``(8, 3, 4)`` too; to ``[Shard(1)]`` -> None (columns), and ``(7, 4)`` -> None (uneven rows).
    """
    ndim = len(src.shape)
    if src.reduce_op != "sum" or ndim < 2 or dst.reduce_op is not None or dst.mesh != src.mesh:
        return None
    try:
        ps, pd = placements_of(src), placements_of(dst)
    except LayoutError:
        return None
    partial = [i for i, p in enumerate(ps) if isinstance(p, Partial)]
    if len(partial) != 1:
        return None
    (i,) = partial
    if not (type(pd[i]) is Shard and pd[i].dim % ndim == 0):
        return None
    for j, (p, q) in enumerate(zip(ps, pd)):
        if j != i and (p != q or isinstance(p, (Shard, _StridedShard)) and p.dim % ndim == 0):
            return None  # another axis changes, or also splits the rows (then the row blocks differ)
    if src.shape[0] % src.mesh.shape[i]:
        return None      # uneven rows: torch.chunk pieces, not the equal row blocks of the kernel
    return src.mesh.axis_names[i]


@cached(maxsize=1024)
def all_reduce_axis(src: DTensorSpec, dst: DTensorSpec) -> str | None:
    """The mesh axis when ``src -> dst`` all-reduces a pending sum of 2 or more dims over one
    mesh axis (every other axis kept), the move a fused GEMM + all-reduce can do.

    ``(4, 8)`` as ``[Partial()]`` to ``[Replicate()]`` on a 4-rank ``gpuid`` mesh -> ``"gpuid"``;
    to ``[Shard(0)]`` -> None (that is row_scatter_axis's reduce-scatter).
    """
    if src.reduce_op != "sum" or len(src.shape) < 2 or dst.reduce_op is not None or dst.mesh != src.mesh:
        return None
    try:
        ps, pd = placements_of(src), placements_of(dst)
    except LayoutError:
        return None
    partial = [i for i, p in enumerate(ps) if isinstance(p, Partial)]
    if len(partial) != 1 or not isinstance(pd[partial[0]], Replicate):
        return None
    if any(p != q for j, (p, q) in enumerate(zip(ps, pd)) if j != partial[0]):
        return None
    return src.mesh.axis_names[partial[0]]


@cached(maxsize=1024)
def row_gather_axis(src: DTensorSpec, dst: DTensorSpec) -> str | None:
    """The mesh axis when ``src -> dst`` all-gathers dim 0 of a tensor of 2 or more dims over
    one mesh axis (every other axis kept, none of them splitting dim 0, dim 0 even): for a
    sequence-first ``[S, B, H]`` that gathers the rows of its ``[S * B, H]`` matrix, the move a
    fused all-gather + GEMM does before multiplying by column-sharded weights.

    ``(8, 4)`` as ``[Shard(0)]`` to ``[Replicate()]`` on a 4-rank ``gpuid`` mesh -> ``"gpuid"``;
    ``[Shard(1)]`` -> None (columns), ``(7, 4)`` -> None (uneven rows).
    """
    ndim = len(src.shape)
    if src.reduce_op is not None or dst.reduce_op is not None or ndim < 2 or dst.mesh != src.mesh:
        return None
    try:
        ps, pd = placements_of(src), placements_of(dst)
    except LayoutError:
        return None
    changed = [i for i, (p, q) in enumerate(zip(ps, pd)) if p != q]
    if len(changed) != 1:
        return None
    (i,) = changed
    if not (type(ps[i]) is Shard and ps[i].dim % ndim == 0 and isinstance(pd[i], Replicate)):
        return None
    if any(isinstance(p, (Shard, _StridedShard)) and p.dim % ndim == 0 for j, p in enumerate(ps) if j != i):
        return None  # another axis splits the rows too: the gathered rows would interleave
    if src.shape[0] % src.mesh.shape[i]:
        return None
    return src.mesh.axis_names[i]
