"""One step of a plan: ``Transfer`` boxes between device buffers, and the ``Step`` they form.

A device is a tuple of mesh coordinates; each device's data is a flat buffer indexed by the
``m`` coordinate. ``Transfer((0,), (1,), (2, 6), 12, (6, 1), 0, (6, 1))`` copies the 12
slots from 12 on device 0 into slots 0..11 on device 1; a ``Step`` of such transfers is one
collective (its ``kind``), every device's output a fresh buffer of ``out_size`` slots.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Iterable

from ..layout import Layout

__all__ = ["Device", "Mesh", "Transfer", "Step", "KIND_TEXT"]

Device = tuple  # coordinates over the mesh's axes, in mesh order
Mesh = tuple  # ((axis_name, size), ...)

# How each step kind reads in a printed plan.
KIND_TEXT = {
    "local": "local copy",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "reduce": "reduce",
    "all_to_all": "all-to-all",
    "broadcast": "broadcast",
    "permute": "send/recv permutation",
    "all_to_all_v": "all-to-all-v",
}


@dataclass(frozen=True, repr=False)
class Transfer:
    """A strided box of values from ``source``'s buffer into ``target``'s buffer.

    Element ``i`` (row-major over ``extents``) goes from ``source_offset + sum i_k*source_strides_k``
    to ``target_offset + sum i_k*target_strides_k``. ``Transfer((0,), (1,), (2, 6), 12, (6, 1), 0, (6, 1))``
    copies 12 contiguous slots starting at 12 on device 0 to slots 0..11 on device 1.
    Strides may be negative (a layout may walk memory backwards).
    """

    source: Device
    target: Device
    extents: tuple[int, ...]
    source_offset: int
    source_strides: tuple[int, ...]
    target_offset: int
    target_strides: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.extents)

    @property
    def is_local(self) -> bool:
        return self.source == self.target

    def pairs(self) -> Iterable[tuple[int, int]]:
        """``(source slot, target slot)`` for every element of the box, row-major."""
        for digits in itertools.product(*(range(e) for e in self.extents)):
            yield (
                self.source_offset + sum(d * s for d, s in zip(digits, self.source_strides)),
                self.target_offset + sum(d * s for d, s in zip(digits, self.target_strides)),
            )

    def source_box(self) -> tuple:
        """What is read, as ``(offset, extents, strides)``; equal boxes read equal data."""
        return (self.source_offset, self.extents, self.source_strides)

    def target_box(self) -> tuple:
        """What is written, as ``(offset, extents, strides)``."""
        return (self.target_offset, self.extents, self.target_strides)

    def __repr__(self) -> str:
        return f"Transfer({self})"

    def __str__(self) -> str:
        return (f"{self.source}->{self.target}: box {self.extents} from m={self.source_offset} "
                f"strides {self.source_strides} to m={self.target_offset} strides {self.target_strides}")


@dataclass(frozen=True, repr=False)
class Step:
    """One collective (or local copy) of a plan.

    Every device's input buffer (``in_size`` slots) maps to a fresh output buffer (``out_size``
    slots) through ``transfers``; with ``reduce`` set each output slot is ``reduce`` over every
    value sent to it (``avg``: their mean), else each slot a layout uses is written once.
    ``kind`` names the collective, ``groups`` its device groups (a process group each),
    ``axes`` the mesh axes those groups vary along.
    """

    kind: str
    axes: tuple[str, ...]
    groups: tuple[tuple[Device, ...], ...]
    transfers: tuple[Transfer, ...]
    reduce: str | None
    in_size: int
    out_size: int
    source: Layout | None  # layout of the input buffers (None: an element-level intermediate)
    target: Layout | None
    itemsize: int
    mesh_axis_groups: bool = False  # each group is a whole slice of the mesh along ``axes``
    moves: tuple[str, ...] = ()  # digits that change axis, e.g. "4:1@gpuid -> 4:12" (digit path only)
    fused: str | None = None  # "all_reduce" on a reduce-scatter + all-gather pair

    @functools.cached_property
    def bytes_sent(self) -> dict[Device, int]:
        sent: dict[Device, int] = {}
        for t in self.transfers:
            if not t.is_local:
                sent[t.source] = sent.get(t.source, 0) + t.count * self.itemsize
        return sent

    @functools.cached_property
    def bytes_received(self) -> dict[Device, int]:
        received: dict[Device, int] = {}
        for t in self.transfers:
            if not t.is_local:
                received[t.target] = received.get(t.target, 0) + t.count * self.itemsize
        return received

    @functools.cached_property
    def messages(self) -> dict[tuple[Device, Device], tuple[Transfer, ...]]:
        """``{(source, target): transfers}`` between distinct devices, in plan order.

        One message per pair: the sender packs its boxes in this order, the receiver
        unpacks them in the same order (both read it from the same plan).
        """
        messages: dict[tuple[Device, Device], list[Transfer]] = {}
        for t in self.transfers:
            if not t.is_local:
                messages.setdefault((t.source, t.target), []).append(t)
        return {pair: tuple(ts) for pair, ts in messages.items()}

    @functools.cached_property
    def _by_device(self) -> dict:
        index: dict[tuple[str, Device], list[Transfer]] = {}
        for t in self.transfers:
            if t.is_local:
                index.setdefault(("local", t.target), []).append(t)
            else:
                index.setdefault(("sends", t.source), []).append(t)
                index.setdefault(("receives", t.target), []).append(t)
        return {key: tuple(ts) for key, ts in index.items()}

    def sends(self, device: Device) -> tuple[Transfer, ...]:
        """The transfers ``device`` sends to other devices (what its executor packs), in plan order."""
        return self._by_device.get(("sends", device), ())

    def receives(self, device: Device) -> tuple[Transfer, ...]:
        """The transfers other devices send to ``device`` (what its executor unpacks), in plan order."""
        return self._by_device.get(("receives", device), ())

    def local(self, device: Device) -> tuple[Transfer, ...]:
        """The copies ``device`` makes from its own input buffer into its output buffer."""
        return self._by_device.get(("local", device), ())

    def describe(self) -> str:
        """``all-gather over gpuid (1 group of 4): each member sends 144 B, receives 144 B``."""
        if self.kind == "local":
            return KIND_TEXT["local"] if self.reduce is None else f"local reduce({self.reduce})"
        name = KIND_TEXT[self.kind] + (f"({self.reduce})" if self.reduce is not None else "")
        sizes = "/".join(map(str, sorted({len(g) for g in self.groups})))
        count = len(self.groups)
        return f"{name} over {','.join(self.axes)} ({count} group{'s' if count > 1 else ''} of {sizes}): " \
            + self._traffic_text()

    def _traffic_text(self) -> str:
        sent, received = set(self.bytes_sent.values()), set(self.bytes_received.values())
        members = {d for g in self.groups for d in g}
        if len(sent) == 1 and len(received) == 1 and set(self.bytes_sent) == set(self.bytes_received) == members:
            return f"each member sends {sent.pop()} B, receives {received.pop()} B"
        return (f"{len(self.bytes_sent)} device(s) send up to {max(sent, default=0)} B, "
                f"{len(self.bytes_received)} receive up to {max(received, default=0)} B")

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"Step({self.describe()}; {len(self.transfers)} transfers)"
