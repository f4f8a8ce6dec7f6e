"""Gather/scatter indices of a plan's boxes on one device, and reductions into a buffer.

``Index(torch.tensor([4, 5, 6]), device)`` is the slice ``4:7`` (no index tensor); any other
slot list is an ``index_select`` / ``index_copy_`` index on ``device``.
"""

from __future__ import annotations

import torch

from ..tracing import traced_constant

__all__ = ["Index", "inverse", "reduce_into", "finish_avg", "identity"]

_SCATTER_OP = {"max": "amax", "min": "amin"}


class Index:
    """A gather/scatter index on one device: a slice when the slots are one contiguous run."""

    __slots__ = ("tensor", "start", "stop", "count")

    def __init__(self, index: torch.Tensor, device: torch.device):
        self.count = index.numel()
        self.start = self.stop = None
        if self.count == 0 or torch.equal(index, torch.arange(int(index[0]), int(index[0]) + self.count)):
            self.start = int(index[0]) if self.count else 0
            self.stop = self.start + self.count
            self.tensor = None
        else:
            self.tensor = index.to(device)

    def take(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.start:self.stop] if self.tensor is None else buffer.index_select(0, traced_constant(self.tensor))

    def fresh(self, buffer: torch.Tensor) -> torch.Tensor:
        """A new tensor (never a view of ``buffer``): collectives write into it in place."""
        if self.tensor is None:
            return buffer[self.start:self.stop].clone()
        return buffer.index_select(0, traced_constant(self.tensor))

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        if self.tensor is None:
            out[self.start:self.stop] = values
        else:
            out.index_copy_(0, traced_constant(self.tensor), values)


def inverse(index: torch.Tensor, size: int) -> torch.Tensor | None:
    """``slot -> position in index`` (-1 elsewhere); None when a slot repeats."""
    if index.numel() and torch.unique(index).numel() != index.numel():
        return None
    out = torch.full((size,), -1, dtype=torch.int64)
    out[index] = torch.arange(index.numel())
    return out


def reduce_into(out_size: int, values: torch.Tensor, slots: torch.Tensor, op: str, count: torch.Tensor | None,
                like: torch.Tensor) -> torch.Tensor:
    """Each slot = ``op`` over the values sent to it (``avg``: their sum / ``count``)."""
    slots = traced_constant(slots)
    count = None if count is None else traced_constant(count)
    if op in ("sum", "avg"):
        out = torch.zeros(out_size, dtype=like.dtype, device=like.device)
        out.index_add_(0, slots, values)
        if op == "avg":
            out = out / count if out.is_floating_point() or out.is_complex() else out.div_(count, rounding_mode="floor")
        return out
    out = torch.empty(out_size, dtype=like.dtype, device=like.device)
    return out.scatter_reduce_(0, slots, values, _SCATTER_OP[op], include_self=False)


def finish_avg(values: torch.Tensor, divisor) -> torch.Tensor:
    if values.is_floating_point() or values.is_complex():
        return values / divisor
    return torch.div(values, divisor, rounding_mode="floor")


def identity(op: str, dtype: torch.dtype) -> float:
    """The value that leaves ``op`` unchanged: 0 for sum, the dtype's lowest for max."""
    if op in ("sum", "avg"):
        return 0
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.min if op == "max" else info.max
