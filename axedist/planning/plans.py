"""A plan: the ordered steps that move a tensor from one layout to another; it prints and costs itself.

    >>> print(plan_layouts(Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"),
    ...                    Layout.parse("S[(8,6):(6,1)] + R[4:1@gpuid]"), (("gpuid", 4),), (8, 6)))
    plan S[(4,2,6):(1@gpuid,6,1)] -> S[(8,6):(6,1)] + R[4:1@gpuid], shape (8, 6), mesh (gpuid=4), 4-byte items
      1. all-gather over gpuid (1 group of 4): each member sends 144 B, receives 144 B
         digits: 4:1@gpuid -> 4:12, replica R[4:1@gpuid] added
      per device at most: sent 144 B, received 144 B

A plan chosen for a mesh that spans hosts (``plan_redistribute``) carries the mesh's
``Network``; it then prints each step's link and backend and its modeled time (``cost.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Sequence

from ..caches import cached
from ..layout import MEMORY_AXIS, Layout, LayoutError
from ..topology import Network
from .classify import Context, make_step, mark_all_reduce, replace_step
from .cost import sent_per_axis, step_time_us, steps_time_us
from .steps import Device, Mesh, Step, Transfer

__all__ = ["Plan", "buffer_size", "devices", "step_cost", "sent_per_device"]


@cached(maxsize=256)
def devices(mesh: Mesh) -> tuple[Device, ...]:
    """Every device of ``mesh``, row-major: ``devices((("x", 2), ("y", 2)))`` -> ``((0,0),(0,1),(1,0),(1,1))``."""
    return tuple(itertools.product(*(range(n) for _, n in mesh)))


def buffer_size(layout: Layout) -> int:
    """Slots of each device's local buffer: the largest ``m`` the layout reaches, plus one."""
    return layout.bounds(MEMORY_AXIS)[1] + 1


def sent_per_device(steps: Sequence[Step]) -> dict:
    """``{device: bytes sent}`` over ``steps``, a direct all-reduce counted as a ring ``all_reduce``
    (``2 (g-1)/g`` of its buffer, as an executor moves it, not ``g-1`` copies)."""
    sent: dict[Device, float] = {}
    for step in steps:
        if step.kind == "all_reduce":
            for group in step.groups:
                g = len(group)
                for a in group:
                    peer = next(b for b in group if b != a)
                    count = sum(t.count for t in step.messages[(a, peer)])
                    sent[a] = sent.get(a, 0) + 2 * (g - 1) * count * step.itemsize / g
        else:
            for d, b in step.bytes_sent.items():
                sent[d] = sent.get(d, 0) + b
    return sent


def step_cost(steps: Sequence[Step]) -> tuple[float, float, int]:
    """(most bytes a device sends, bytes all devices send, steps), as ``sent_per_device`` counts them."""
    sent = sent_per_device(steps)
    return (max(sent.values(), default=0), sum(sent.values()), len(steps))


@dataclass(frozen=True, repr=False)
class Plan:
    """Ordered steps moving a tensor from ``source`` to ``target`` on ``mesh``; ``str`` explains it."""

    source: Layout
    target: Layout
    mesh: Mesh
    shape: tuple[int, ...]
    itemsize: int
    partial: str | None
    steps: tuple[Step, ...]
    method: str  # "digits" (from the layouts' digits), "blocks" (some enumerated digit blocks), "elements",
    # or "direct" (``plan_direct``: true elements between two paddings of one tensor)
    note: str = ""  # what was changed after planning (e.g. padding left out by the executor)
    network: Network | None = None  # the links it was chosen for (None: one host, chosen by bytes)

    @property
    def devices(self) -> tuple[Device, ...]:
        return devices(self.mesh)

    @property
    def in_size(self) -> int:
        return buffer_size(self.source)

    @property
    def out_size(self) -> int:
        return buffer_size(self.target)

    @functools.cached_property
    def bytes_sent(self) -> dict[Device, int]:
        """Bytes each device sends over the whole plan (every device listed)."""
        return {d: sum(s.bytes_sent.get(d, 0) for s in self.steps) for d in self.devices}

    @functools.cached_property
    def bytes_received(self) -> dict[Device, int]:
        return {d: sum(s.bytes_received.get(d, 0) for s in self.steps) for d in self.devices}

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps)

    @functools.cached_property
    def cost(self) -> tuple[float, float, int]:
        """(most bytes one device sends, bytes all devices send, steps), as an executor moves them:
        a direct all-reduce step runs as a ring ``all_reduce`` (``2 (g-1)/g`` of its buffer, not
        ``g-1`` copies). Plans are compared by this tuple, smallest first."""
        return step_cost(self.steps)

    @functools.cached_property
    def sent_per_device(self) -> dict:
        """``{device: bytes it sends}`` as ``cost`` counts them (a direct all-reduce as a ring)."""
        return sent_per_device(self.steps)

    @functools.cached_property
    def time_us(self) -> float | None:
        """Modeled microseconds on ``network`` (None without one)."""
        return None if self.network is None else steps_time_us(self.steps, self.network)

    def on(self, network: Network | None) -> "Plan":
        """The same plan, costed and printed for ``network``."""
        return self if network == self.network else dataclasses.replace(self, network=network)

    def then(self, other: "Plan") -> "Plan":
        """One plan running ``self``'s steps, then ``other``'s (``other.source`` is ``self.target``'s
        buffer, e.g. a reduction in place, then a gather)."""
        if other.mesh != self.mesh or other.steps and self.steps and other.steps[0].in_size != self.steps[-1].out_size:
            raise LayoutError(f"then: {other!r} does not start where {self!r} ends")
        note = "; ".join(n for n in (self.note, other.note) if n)
        return Plan(self.source, other.target, self.mesh, other.shape, self.itemsize, self.partial or other.partial,
                    self.steps + other.steps, "digits" if self.method == other.method == "digits" else "elements",
                    note, self.network or other.network)

    def with_transfers(self, transfers: Sequence[Sequence[Transfer]], note: str) -> "Plan":
        """The same steps moving only ``transfers[i]`` in step ``i`` (each step renamed from its
        new messages). For an executor that leaves slots out (padding of uneven shapes):
        it must keep every value the target reads, which ``simulate`` checks."""
        if len(transfers) != len(self.steps):
            raise LayoutError(f"with_transfers: {len(transfers)} transfer lists for {len(self.steps)} steps")
        context = Context(self.mesh, self.itemsize, self.partial)
        steps = [replace_step(make_step(list(ts), s.reduce, s.source, s.target, s.in_size, s.out_size, context),
                              moves=s.moves)
                 for s, ts in zip(self.steps, transfers)]
        return Plan(self.source, self.target, self.mesh, self.shape, self.itemsize, self.partial,
                    mark_all_reduce(steps), self.method, note, self.network)

    def explain(self) -> str:
        lines = [self._head()]
        if self.network is not None:
            lines.append(f"  network: {self.network}")
        if not self.steps:
            lines.append("  nothing to do: same layout")
        for i, step in enumerate(self.steps, 1):
            line = f"  {i}. {step.describe()}"
            if step.fused == "all_reduce":
                line += "  [all-reduce, part " + ("1/2]" if step.kind == "reduce_scatter" else "2/2]")
            lines.append(line)
            if step.moves:
                lines.append(("     how: " if self.method == "direct" else "     digits: ") + ", ".join(step.moves))
            if self.network is not None and step.kind != "local":
                lines.append(f"     {self._link_text(step)}")
        if self.method == "elements":
            lines.append("  (element-level fallback: the layouts share no digit refinement)")
        if self.note:
            lines.append(f"  ({self.note})")
        lines.append(f"  per device at most: sent {max(self.bytes_sent.values(), default=0)} B, "
                     f"received {max(self.bytes_received.values(), default=0)} B")
        if self.network is not None:
            per_axis = ", ".join(f"{a} {b:g} B" for a, b in sent_per_axis(self.steps, self.network).items())
            lines.append(f"  per device and axis at most: {per_axis}; modeled time {self.time_us:.1f} us")
        return "\n".join(lines)

    def _link_text(self, step: Step) -> str:
        """``inter-node (dp): nccl, 21.3 us``: where the step's groups run, what carries it, how long."""
        where = "inter-node" if self.network.crosses_hosts(step.axes) else "intra-node"
        return f"{where} ({','.join(step.axes)}): {self.network.backend(step.axes)}, " \
            f"{step_time_us(step, self.network):.1f} us"

    def _head(self) -> str:
        mesh_text = "(" + ", ".join(f"{a}={n}" for a, n in self.mesh) + ")"
        head = f"plan {self.source} -> {self.target}, shape {self.shape}, mesh {mesh_text}, {self.itemsize}-byte items"
        return head + (f", {self.partial} over the leading summand dim" if self.partial else "")

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        steps = " + ".join(self.kinds) or "no steps"
        return f"Plan({self.source} -> {self.target}, shape {self.shape}: {steps})"
