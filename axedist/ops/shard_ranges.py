"""Which slice of a global dim a rank holds under torch placements (shared by the nn op families).

Embedding over a vocab-sharded weight, the loss over class-sharded logits and the random
ops all need this rank's rows of one dim: placements split a dim with ``torch.chunk``,
once per mesh axis that shards it (outer axis first). Vocabulary 10 on 4 ranks,
``[Shard(0)]``: chunks of ``ceil(10/4) = 3``, so ranks hold rows ``[0,3) [3,6) [6,9) [9,10)``
and ``dim_range(10, 0, mesh, [Shard(0)])`` is ``(9, 1)`` on rank 3.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..mesh import DeviceMesh
from ..spec import nested_chunk

__all__ = ["dim_range", "inputs_by_name", "local_piece", "named_args", "sharding_axes", "without_partial"]


def sharding_axes(mesh: DeviceMesh, placements, dim: int, ndim: int) -> list[tuple[str, int]]:
    """``[(axis, size)]`` of the mesh axes whose placement is ``Shard(dim)``, in mesh order."""
    return [(axis, k) for axis, k, p in zip(mesh.axis_names, mesh.shape, placements)
            if type(p) is Shard and p.dim % max(ndim, 1) == dim]


def dim_range(n: int, dim: int, mesh: DeviceMesh, placements, ndim: int | None = None) -> tuple[int, int]:
    """``(start, size)`` of this rank's piece of a dim of extent ``n`` (torch.chunk, nested per axis)."""
    coords = mesh.coordinates()
    axes = sharding_axes(mesh, placements, dim, dim + 1 if ndim is None else ndim)
    return nested_chunk(n, [(k, coords[axis]) for axis, k in axes])


def local_piece(full: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """This rank's local tensor of ``full`` under placements without ``Partial`` (a view, no copy)."""
    if any(not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and type(p) is not Shard)
           for p in placements):
        raise ValueError(f"local_piece takes Shard/Replicate placements, got {list(placements)}")
    out = full
    for d in range(full.dim()):
        start, size = dim_range(full.shape[d], d, mesh, placements, full.dim())
        if (start, size) != (0, full.shape[d]):
            out = out.narrow(d, start, size)
    return out


def without_partial(placements) -> tuple:
    """The placements with every ``Partial`` replaced by ``Replicate`` (the reduced value's)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def named_args(call) -> dict:
    """``{schema argument name: value}`` of a call (positional and keyword arguments)."""
    names = [a.name for a in call.func._schema.arguments]
    out = dict(zip(names, call.args))
    out.update(call.kwargs)
    return out


def inputs_by_name(call, wanted: dict, default=None) -> tuple:
    """``Sharding.inputs`` from ``{argument name: placements}``, in ``OpCall.specs`` order
    (arguments, then keywords); an ArgSpec not named gets ``default``."""
    from .registry import ArgSpec

    names = [a.name for a in call.func._schema.arguments]
    out = []
    for name, value in list(zip(names, call.args)) + list(call.kwargs.items()):
        for item in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, ArgSpec):
                out.append(wanted.get(name, default))
    return tuple(out)
