"""Which indices of a global dim a rank holds, read off the layout (shared by the nn op families).

Embedding over a vocab-sharded weight, the loss over class-sharded logits, ``argmax`` over a
sharded dim and the random ops need this rank's rows of a dim, or its piece of a whole tensor.
The layout says them (``planning.boxes.held_indices``), whatever made it: vocabulary 10 on 4
ranks as ``[Shard(0)]`` (chunks of 3) gives rank 3 the rows ``range(9, 10)``; 8 rows dealt
round-robin in pairs to 2 ranks, ``S[(2,2,2,D):(2*D,1@gpuid,D,1)]``, give rank 1 the rows
``(2, 3, 6, 7)``. Rules compute them once (rules are cached) and their local steps use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Partial, Replicate

from ..planning.boxes import held_indices
from ..tracing import outside_tracing, traced_constant
from .specs import spec_of

__all__ = ["Held", "held_along", "held_under", "box_here", "inputs_by_name", "local_piece", "named_args", "without_partial"]


@dataclass(frozen=True)
class Held:
    """This rank's indices along one dim of extent ``extent``, in local order: ``index[j]`` is the
    global index of local row ``j`` (a ``range`` where they run up by one)."""

    extent: int
    index: range | tuple[int, ...]
    _tables: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.index)

    def locate(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(here, local)`` for global indices ``g``: whether this rank holds each one, and its
        local row (0 where not held, so that it can index safely; mask with ``here``)."""
        if isinstance(self.index, range):
            start = self.index.start if self.size else 0
            here = (g >= start) & (g < start + self.size)
            return here, torch.where(here, g - start, torch.zeros_like(g))
        table = traced_constant(self._on(g.device)[0], like=g)  # local row of each global index, -1 where not held
        local = table[g.clamp(0, self.extent - 1)]
        here = (local >= 0) & (g >= 0) & (g < self.extent)
        return here, torch.where(here, local, torch.zeros_like(local))

    @outside_tracing
    def _on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The lookup table and the index as (real) tensors on ``device``, made once per device."""
        key = str(device)
        if key not in self._tables:
            index = torch.tensor(list(self.index), dtype=torch.int64)
            table = torch.full((max(self.extent, 1),), -1, dtype=torch.int64)
            table[index] = torch.arange(self.size, dtype=torch.int64)
            self._tables[key] = (table.to(device), index.to(device))
        return self._tables[key]

    def indices(self, like: torch.Tensor) -> torch.Tensor:
        """The global indices this rank holds, in local order: an int64 tensor on ``like``'s device
        (made once per device)."""
        return traced_constant(self._on(like.device)[1], like=like)

    def global_of(self, local: torch.Tensor) -> torch.Tensor:
        """The global index of local rows ``local``."""
        if isinstance(self.index, range) or not self.size:
            return local + (self.index.start if self.size else 0)
        return traced_constant(self._on(local.device)[1], like=local)[local]


def held_along(spec, dim: int) -> Held | None:
    """This rank's indices along ``dim`` of a spec without a pending sum; None where its layout
    gives this rank no grid of the tensor (the rule then asks for placements)."""
    held = held_indices(spec, spec.mesh.position())
    return None if held is None else Held(spec.shape[dim], held[dim])


def held_under(shape, mesh, placements, dim: int) -> Held | None:
    """``held_along`` for a tensor of ``shape`` laid out by ``placements`` (a ``Partial`` read as
    ``Replicate``: a pending sum's ranks hold the same indices as its sum's)."""
    return held_along(spec_of(tuple(shape), mesh, without_partial(placements)), dim)


def box_here(shape, mesh, placements) -> tuple[tuple[int, int], ...]:
    """``(start, size)`` per dim of this rank's piece of a tensor of ``shape`` laid out by
    ``placements`` (a ``Partial`` read as ``Replicate``); a rule computes it once, its local step
    cuts with it (:func:`local_piece`)."""
    spec = spec_of(tuple(shape), mesh, without_partial(placements))
    held = held_indices(spec, spec.mesh.position())
    if held is None or not all(isinstance(index, range) or not index for index in held):
        raise ValueError(f"box_here takes a layout whose pieces are boxes of the tensor, got {spec.layout}")
    return tuple((index.start if isinstance(index, range) else 0, len(index)) for index in held)


def local_piece(full: torch.Tensor, box) -> torch.Tensor:
    """This rank's piece of ``full`` (a view, no copy), ``box`` from :func:`box_here`."""
    out = full
    for d, (start, size) in enumerate(box):
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
