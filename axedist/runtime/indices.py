"""Gather/scatter indices of a plan's boxes on one device, and reductions into a buffer.

``Index.of(transfers, side, device)`` reads a step's boxes (``Transfer``: offset, extents,
strides) as cheaply as they allow: one contiguous run is a slice (``4:7``, no index tensor); a
few strided boxes are strided copies, one kernel a box (a vocabulary-sharded ``(8, 256, 32000)``
logits gathered on 2 ranks: two boxes, no index tensor of 65 M entries), and boxes of one shape
at a constant offset step are one box with a leading dim (``S(0) -> S(1)``'s all-to-all on W
ranks sends W - 1 column blocks: one copy kernel, not W - 1); anything else is an
``index_select`` / ``index_copy_`` index on ``device``. ``Index(torch.tensor([4, 5, 6]), device)``
takes element slots directly.
"""

from __future__ import annotations

import math

import torch

from ..planning.holdings import box_index
from ..tracing import traced_constant

__all__ = ["Index", "MAX_BOXES", "inverse", "reduce_into", "finish_avg", "identity"]

_SCATTER_OP = {"max": "amax", "min": "amin"}
MAX_BOXES = 64  # more boxes than this read as one index tensor (one kernel instead of many)


def _boxes(transfers, side: str) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``(offset, extents, strides)`` of each transfer on ``side``, extent-1 dims dropped."""
    out = []
    for t in transfers:
        offset, strides = (t.source_offset, t.source_strides) if side == "source" else (t.target_offset, t.target_strides)
        kept = [(e, s) for e, s in zip(t.extents, strides) if e != 1]
        if math.prod(t.extents):
            out.append((offset, tuple(e for e, _ in kept), tuple(s for _, s in kept)))
    return out


def _merged(boxes: list) -> list:
    """Consecutive boxes of one shape and strides at a constant positive offset step, as one box
    with a leading dim of that step: the same slots in the same order."""
    out = []   # [offset, count, step, extents, strides]
    for offset, extents, strides in boxes:
        last = out[-1] if out else None
        if last is not None and last[3] == extents and last[4] == strides:
            step = offset - last[0] if last[1] == 1 else last[2]
            if step > 0 and offset == last[0] + last[1] * step:
                last[1], last[2] = last[1] + 1, step
                continue
        out.append([offset, 1, 0, extents, strides])
    return [(o, e, s) if n == 1 else (o, (n,) + e, (step,) + s) for o, n, step, e, s in out]


def _run(boxes) -> tuple[int, int] | None:
    """``(start, stop)`` when the boxes, in order, are one contiguous run of slots; else None."""
    start = position = boxes[0][0] if boxes else 0
    for offset, extents, strides in boxes:
        step = 1
        for e, s in zip(reversed(extents), reversed(strides)):
            if s != step:
                return None
            step *= e
        if offset != position:
            return None
        position += step
    return start, position


class Index:
    """A gather/scatter index on one device: a slice, a few strided boxes, or an index tensor."""

    __slots__ = ("tensor", "start", "stop", "count", "boxes")

    def __init__(self, index: torch.Tensor, device: torch.device):
        self.count = index.numel()
        self.start = self.stop = self.boxes = None
        if self.count == 0 or torch.equal(index, torch.arange(int(index[0]), int(index[0]) + self.count)):
            self.start = int(index[0]) if self.count else 0
            self.stop = self.start + self.count
            self.tensor = None
        else:
            self.tensor = index.to(device)

    @classmethod
    def of(cls, transfers, side: str, device: torch.device) -> "Index":
        """The slots of ``transfers``' boxes on ``side`` ("source" / "target"), in order."""
        boxes = _merged(_boxes(transfers, side))
        run = _run(boxes)
        if run is None and (len(boxes) > MAX_BOXES or any(s < 0 for _, _, strides in boxes for s in strides)):
            return cls(box_index(transfers, side), device)
        index = cls.__new__(cls)
        index.tensor = index.boxes = None
        index.count = sum(math.prod(extents) for _, extents, _ in boxes)
        if run is not None:
            index.start, index.stop = run
        else:
            index.start = index.stop = None
            index.boxes = tuple(boxes)
        return index

    def _views(self, buffer: torch.Tensor):
        """Each box of ``buffer`` (a 1-D tensor) as a strided view."""
        step, base = buffer.stride(0), buffer.storage_offset()
        for offset, extents, strides in self.boxes:
            yield buffer.as_strided(extents, tuple(s * step for s in strides), base + offset * step)

    def _gathered(self, buffer: torch.Tensor) -> torch.Tensor:
        out = buffer.new_empty(self.count)
        position = 0
        for view in self._views(buffer):
            n = view.numel()
            out[position:position + n].view(view.shape).copy_(view)
            position += n
        return out

    def spans(self, start: int, stop: int) -> bool:
        """Whether this index is slots ``start .. stop`` in order (``spans(0, n)`` of an ``n``-slot
        buffer: reading or writing through it is the identity)."""
        return self.start == start and self.stop == stop

    def take(self, buffer: torch.Tensor) -> torch.Tensor:
        if self.boxes is not None:
            return self._gathered(buffer)
        return buffer[self.start:self.stop] if self.tensor is None else buffer.index_select(0, traced_constant(self.tensor))

    def fresh(self, buffer: torch.Tensor) -> torch.Tensor:
        """A new tensor (never a view of ``buffer``): collectives write into it in place."""
        if self.boxes is not None:
            return self._gathered(buffer)
        if self.tensor is None:
            return buffer[self.start:self.stop].clone()
        return buffer.index_select(0, traced_constant(self.tensor))

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        if self.boxes is not None:
            position = 0
            for view in self._views(out):
                n = view.numel()
                view.copy_(values[position:position + n].view(view.shape))
                position += n
        elif self.tensor is None:
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
