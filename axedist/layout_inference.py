"""Layout inference: the plan of collectives that moves a tensor from one layout to another.

Pure planning (DESIGN §3): no torch import, no communication. A plan is data; the
executor (``axedist.collectives``, next) runs it, ``simulate`` here runs it on Python lists.

Example, a ``(8, 6)`` tensor sharded on dim 0 over 4 devices, gathered everywhere::

    >>> mesh = (("gpuid", 4),)
    >>> src = Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")        # Shard(0)
    >>> dst = Layout.parse("S[(8,6):(6,1)] + R[4:1@gpuid]")   # Replicate()
    >>> print(plan_layouts(src, dst, mesh, (8, 6)))
    plan S[(4,2,6):(1@gpuid,6,1)] -> S[(8,6):(6,1)] + R[4:1@gpuid], shape (8, 6), mesh (gpuid=4), 4-byte items
      1. all-gather over gpuid (1 group of 4): each member sends 144 B, receives 144 B
         digits: 4:1@gpuid -> 4:12, replica R[4:1@gpuid] added
      per device at most: sent 144 B, received 144 B

Conventions
-----------
* **Mesh.** An ordered tuple of ``(axis_name, size)`` pairs, e.g. ``(("x", 2), ("y", 4))``.
  A *device* is a tuple of coordinates over those axes, in that order; ranks are the
  mesh's business (the executor maps coordinates to ranks). A layout's axes other than
  ``m`` must be mesh axis names; an axis the layout does not name is at coordinate 0
  (plus its offset), so a layout may occupy a subset of the mesh.
* **Local buffers.** Each device's local data is a flat buffer indexed by the ``m``
  coordinate, of ``buffer_size(layout)`` = largest ``m`` + 1 slots (the same on every
  device; slots a device does not hold are garbage). Uneven shapes are padded by the
  executor before planning sees them.
* **Partial sums** (DESIGN §2, the paper's Fig. 8). With ``partial=op`` (``"sum"``,
  ``"avg"``, ``"max"``, ``"min"``) the source layout admits ``(P, *shape)``: a leading
  summand dimension of ``P`` pending values per element; the destination admits
  ``shape`` and holds ``op`` over the summands.
* **Steps.** A plan is an ordered tuple of ``Step``. Every step maps each device's input
  buffer (``in_size`` slots) to a fresh output buffer (``out_size`` slots) through its
  ``transfers``: ``Transfer`` boxes ``(source device, target device, extents, source
  offset and strides, target offset and strides)`` in ``m`` coordinates. A transfer
  whose source is its target is a local copy (no bytes). In a step with ``reduce`` set,
  each output slot is ``reduce`` over every value sent to it (``avg``: their mean);
  otherwise every output slot a layout uses is written exactly once. ``kind`` names the
  collective the transfers form, ``groups`` the device groups it runs in (each group
  a process group), ``axes`` the mesh axes those groups vary along.
* **Bytes** are those of the transfers between distinct devices, times ``itemsize``:
  what a direct (pairwise) implementation moves, which is also what ring all-gather,
  reduce-scatter and all-to-all move. An all-reduce is planned as reduce-scatter then
  all-gather (the two steps carry ``fused="all_reduce"`` so an executor may issue one
  ``all_reduce``).

How plans are derived
---------------------
1. Both shard parts ``D`` (the source's data part after its summand block) are refined
   into one sequence of *digits*: iters split until both sides have the same extents
   (as ``Layout.group`` splits). Each digit then has a source ``(axis, stride)`` and a
   destination ``(axis, stride)``; summand digits have only a source.
2. Each device's holding is a box in digit space: mesh-bound digits fixed, ``m`` digits
   free. Enumerating the destination's mesh-bound digits and replicas gives every
   target device; enumerating the digits that are on a mesh axis in the source but not
   in the destination (and summand digits) gives the source devices; the digits on
   ``m`` on both sides stay free and become the extents of one strided ``Transfer``.
   A replicated source is read from one holder: the target itself if it holds the
   data, else the holder differing from it on the fewest mesh axes.
3. Without partial sums this is one step, and each device receives exactly what it
   needs and does not hold (the minimum). With partial sums the summand digits on mesh
   axes are first reduced into an intermediate layout: onto the destination's digit on
   that axis and stride when it has one (reduce-scatter straight into place), onto the
   one device the destination uses along that axis (reduce), else by scattering a
   local digit (reduce-scatter, followed by an all-gather: an all-reduce). A source
   replica axis that the target shards a local digit over is sliced before reducing
   (``[Replicate, Partial] -> [Shard(0), Shard(0)]`` on a 2x4 mesh reduces half of the
   rows in each replica, not all of them). All summand axes reduce in one step (one reduce-scatter over the product group moves
   ``(G-1)/G`` of the data, as any order of per-axis steps does). A copy step then
   moves the intermediate layout to the destination.
4. Each step is named by its messages, per group of devices that exchange data (the
   promise an executor relies on; equal boxes in equal order pack equal buffers): only
   local transfers -> ``local``; every member sending one identical buffer to every
   other and keeping those values -> ``all_gather``; one sender, one buffer to all
   others (3+ devices) -> ``broadcast``; at most one message out and one in per device
   -> ``permute`` (send/recv); every pair exchanging equal sizes -> ``all_to_all``.
   With ``reduce``: every peer's buffer landing in the receiver's own slots ->
   ``reduce_scatter`` (``all_reduce`` when each sender also sends one identical
   buffer); one receiver -> ``reduce``. Anything else is ``all_to_all_v`` over the
   explicit boxes.
5. No common refinement (blocks of 3 against blocks of 2): a copy refines what it can and
   turns each stretch of iters that does not refine into one *block* digit, enumerated
   value by value (a block of extent 6, not the whole tensor: ``method == "blocks"``).
6. Fallback, correct for any pair of valid layouts (partial sums without a common
   refinement, or a destination replicated within one device's memory): enumerate the
   elements, pick a holder per (element, target device) as above, and compress the
   element pairs into strided runs. Partial sums reduce each element at the target
   device holding most of its summands first.
7. Two paddings of one tensor (``plan_direct``: uneven dims that torch chunks differently
   on the two sides): one step sends each true element from its nearest holder straight
   into place, from per-dim runs of rows; padding is never planned, so never sent.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .layout import Iter, Layout, LayoutError

__all__ = [
    "Plan",
    "plan_alternatives",
    "plan_direct",
    "clear_plan_cache",
    "Step",
    "Transfer",
    "plan_layouts",
    "simulate",
    "buffer_size",
    "local_buffers",
    "global_values",
    "REDUCE_OPS",
]

MEMORY_AXIS = "m"
REDUCE_OPS = ("sum", "avg", "max", "min")
# The element fallback enumerates every element; past this it refuses rather than crawl.
_FALLBACK_LIMIT = 1 << 22

Device = tuple  # coordinates over the mesh's axes, in mesh order
Mesh = tuple  # ((axis_name, size), ...)


# ---------------------------------------------------------------------------
# Plan data
# ---------------------------------------------------------------------------


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

    def __repr__(self) -> str:
        return f"Transfer({self})"

    def __str__(self) -> str:
        return (f"{self.source}->{self.target}: box {self.extents} from m={self.source_offset} "
                f"strides {self.source_strides} to m={self.target_offset} strides {self.target_strides}")


@dataclass(frozen=True, repr=False)
class Step:
    """One collective (or local copy) of a plan; see the module docstring for its meaning."""

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
        name = _KIND_TEXT[self.kind]
        if self.reduce is not None and self.kind != "local":
            name += f"({self.reduce})"
        elif self.reduce is not None:
            name = f"local reduce({self.reduce})"
        if self.kind == "local":
            return name
        sizes = sorted({len(g) for g in self.groups})
        size_text = "/".join(map(str, sizes))
        count = len(self.groups)
        text = f"{name} over {','.join(self.axes)} ({count} group{'s' if count > 1 else ''} of {size_text})"
        sent, received = set(self.bytes_sent.values()), set(self.bytes_received.values())
        senders, receivers = len(self.bytes_sent), len(self.bytes_received)
        members = {d for g in self.groups for d in g}
        if len(sent) == 1 and len(received) == 1 and set(self.bytes_sent) == set(self.bytes_received) == members:
            text += f": each member sends {sent.pop()} B, receives {received.pop()} B"
        else:
            text += (f": {senders} device(s) send up to {max(sent, default=0)} B, "
                     f"{receivers} receive up to {max(received, default=0)} B")
        return text

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"Step({self.describe()}; {len(self.transfers)} transfers)"


_KIND_TEXT = {
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

    @property
    def devices(self) -> tuple[Device, ...]:
        return _devices(self.mesh)

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
        return _step_cost(self.steps)

    @functools.cached_property
    def sent_per_device(self) -> dict:
        """``{device: bytes it sends}`` as ``cost`` counts them (a direct all-reduce as a ring)."""
        return _sent_per_device(self.steps)

    def then(self, other: "Plan") -> "Plan":
        """One plan running ``self``'s steps, then ``other``'s (``other.source`` is ``self.target``'s
        buffer, e.g. a reduction in place, then a gather)."""
        if other.mesh != self.mesh or other.steps and self.steps and other.steps[0].in_size != self.steps[-1].out_size:
            raise LayoutError(f"then: {other!r} does not start where {self!r} ends")
        note = "; ".join(n for n in (self.note, other.note) if n)
        return Plan(self.source, other.target, self.mesh, other.shape, self.itemsize, self.partial or other.partial,
                    self.steps + other.steps, "digits" if self.method == other.method == "digits" else "elements",
                    note)

    def with_transfers(self, transfers: Sequence[Sequence[Transfer]], note: str) -> "Plan":
        """The same steps moving only ``transfers[i]`` in step ``i`` (each step renamed from its
        new messages). For an executor that leaves slots out (padding of uneven shapes):
        it must keep every value the target reads, which ``simulate`` checks."""
        if len(transfers) != len(self.steps):
            raise LayoutError(f"with_transfers: {len(transfers)} transfer lists for {len(self.steps)} steps")
        context = _Context(self.mesh, self.itemsize, self.partial)
        steps = [_replace(_make_step(list(ts), s.reduce, s.source, s.target, s.in_size, s.out_size, context),
                          moves=s.moves)
                 for s, ts in zip(self.steps, transfers)]
        return Plan(self.source, self.target, self.mesh, self.shape, self.itemsize, self.partial,
                    _mark_all_reduce(steps), self.method, note)

    def explain(self) -> str:
        mesh_text = "(" + ", ".join(f"{a}={n}" for a, n in self.mesh) + ")"
        head = f"plan {self.source} -> {self.target}, shape {self.shape}, mesh {mesh_text}, {self.itemsize}-byte items"
        if self.partial:
            head += f", {self.partial} over the leading summand dim"
        lines = [head]
        if not self.steps:
            lines.append("  nothing to do: same layout")
        for i, step in enumerate(self.steps, 1):
            line = f"  {i}. {step.describe()}"
            if step.fused == "all_reduce":
                line += "  [all-reduce, part " + ("1/2]" if step.kind == "reduce_scatter" else "2/2]")
            lines.append(line)
            if step.moves:
                lines.append(("     how: " if self.method == "direct" else "     digits: ") + ", ".join(step.moves))
        if self.method == "elements":
            lines.append("  (element-level fallback: the layouts share no digit refinement)")
        if self.note:
            lines.append(f"  ({self.note})")
        lines.append(f"  per device at most: sent {max(self.bytes_sent.values(), default=0)} B, "
                     f"received {max(self.bytes_received.values(), default=0)} B")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        steps = " + ".join(self.kinds) or "no steps"
        return f"Plan({self.source} -> {self.target}, shape {self.shape}: {steps})"


# ---------------------------------------------------------------------------
# Mesh, validation, buffers
# ---------------------------------------------------------------------------


def _mesh(mesh) -> Mesh:
    """``((axis, size), ...)`` from that tuple, a ``{axis: size}`` dict, or a ``DeviceMesh``
    (anything with ``axis_names`` and ``shape``; read by duck typing, so no torch import)."""
    if hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
        mesh = tuple(zip(mesh.axis_names, mesh.shape))
    pairs = tuple(mesh.items()) if isinstance(mesh, Mapping) else tuple(tuple(p) for p in mesh)
    names = [a for a, _ in pairs]
    if not pairs or len(set(names)) != len(names) or MEMORY_AXIS in names:
        raise LayoutError(f"a mesh is ((axis, size), ...) with distinct names other than 'm', got {mesh!r}")
    for axis, size in pairs:
        if not isinstance(axis, str) or not isinstance(size, int) or size <= 0:
            raise LayoutError(f"mesh axis {axis!r} needs a positive int size, got {size!r}")
    return pairs


@functools.lru_cache(maxsize=256)
def _devices(mesh: Mesh) -> tuple[Device, ...]:
    return tuple(itertools.product(*(range(n) for _, n in mesh)))


def buffer_size(layout: Layout) -> int:
    """Slots of each device's local buffer: the largest ``m`` the layout reaches, plus one."""
    return layout.bounds(MEMORY_AXIS)[1] + 1


def _validate(layout: Layout, mesh: Mesh, size: int, what: str):
    if layout.size != size:
        raise LayoutError(f"{what} layout {layout} has {layout.size} elements, expected {size}")
    names = dict(mesh)
    for axis in layout.axes:
        if axis != MEMORY_AXIS and axis not in names:
            raise LayoutError(f"{what} layout {layout} names axis {axis!r}, which mesh {mesh} does not have")
    for axis in layout.axes:
        low, high = layout.bounds(axis)
        limit = names.get(axis)
        if low < 0 or (limit is not None and high >= limit):
            where = "memory" if limit is None else f"mesh axis {axis!r} of size {limit}"
            raise LayoutError(f"{what} layout {layout} reaches [{low}, {high}] on {where}")
    if not layout.is_injective():
        raise LayoutError(f"{what} layout {layout} puts two elements in one (device, m) slot")


def _split_point(point: Mapping[str, int], mesh: Mesh) -> tuple[Device, int]:
    return tuple(point.get(a, 0) for a, _ in mesh), point.get(MEMORY_AXIS, 0)


def _slots(layout: Layout, mesh: Mesh) -> list[list[tuple[Device, int]]]:
    """``[(device, m) for every copy of element x] for every x``, by enumeration."""
    if layout.size * max(1, layout.replica_count) > _FALLBACK_LIMIT:
        raise LayoutError(f"layout {layout} is too large to enumerate for the element-level plan")
    replicas = _replica_points(layout, mesh)
    shard = Layout(layout.shard)
    result = []
    for x in range(layout.size):
        device, m = _split_point(shard.shard_coordinates(x), mesh)
        seen = []
        for r_device, r_m in replicas:
            slot = (tuple(a + b for a, b in zip(device, r_device)), m + r_m)
            if slot not in seen:
                seen.append(slot)
        result.append(seen)
    return result


def local_buffers(layout: Layout, mesh, values: Sequence) -> dict[Device, list]:
    """Each device's buffer holding the flat (row-major) ``values`` laid out by ``layout``.

    ``local_buffers(S[(2,3):(1@gpuid,1)], (("gpuid",2),), range(6))`` ->
    ``{(0,): [0, 1, 2], (1,): [3, 4, 5]}``. Unused slots are None.
    """
    mesh = _mesh(mesh)
    buffers = {d: [None] * buffer_size(layout) for d in _devices(mesh)}
    for x, slots in enumerate(_slots(layout, mesh)):
        for device, m in slots:
            buffers[device][m] = values[x]
    return buffers


def global_values(layout: Layout, mesh, buffers: Mapping[Device, Sequence]) -> list[list]:
    """For every element ``x``, the values found at each of its slots (all equal when consistent)."""
    mesh = _mesh(mesh)
    return [[buffers[device][m] for device, m in slots] for slots in _slots(layout, mesh)]


# ---------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------


def _combine(op: str, values: list):
    if op == "sum":
        return sum(values[1:], values[0])
    if op == "avg":
        return sum(values[1:], values[0]) / len(values)
    if op == "max":
        return max(values)
    if op == "min":
        return min(values)
    raise LayoutError(f"unknown reduce op {op!r}; expected one of {REDUCE_OPS}")


def simulate(plan: Plan, buffers: Mapping[Device, Sequence]) -> dict[Device, list]:
    """Run ``plan`` on per-device Python lists (``{device: buffer}``); returns the output buffers.

    The oracle the tests use: each step reads only its input buffers and writes fresh
    output buffers, exactly as the transfers say. A slot written twice in a step without
    ``reduce`` is an error (a plan bug, never silently resolved).
    """
    current = {d: list(buffers[d]) for d in plan.devices}
    for step in plan.steps:
        incoming: dict[Device, dict[int, list]] = {d: {} for d in plan.devices}
        for t in step.transfers:
            source, into = current[t.source], incoming[t.target]
            for s, m in t.pairs():
                into.setdefault(m, []).append(source[s])
        out = {}
        for d in plan.devices:
            buffer = [None] * step.out_size
            for m, values in incoming[d].items():
                if step.reduce is None:
                    if len(values) != 1:
                        raise AssertionError(f"step {step.kind} writes slot {m} of device {d} {len(values)} times")
                    buffer[m] = values[0]
                else:
                    buffer[m] = _combine(step.reduce, values)
            out[d] = buffer
        current = out
    return current


# ---------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------


def plan_layouts(src: Layout, dst: Layout, mesh, shape: Sequence[int], itemsize: int = 4,
                 partial: str | None = None) -> Plan:
    """The plan moving a tensor of ``shape`` from layout ``src`` to ``dst`` on ``mesh``.

    ``mesh`` is ``((axis, size), ...)`` (or a ``DeviceMesh``); with ``partial`` (a reduce op) ``src`` admits
    ``(P, *shape)`` and holds ``P`` summands per element. Plans are cached on
    (layouts' maps, mesh, shape, itemsize, partial). Example: a partial sum over 4
    devices into ``Shard(0)`` is one reduce-scatter::

        >>> plan_layouts(Layout.parse("S[(4,8,6):(1@gpuid,6,1)]"),
        ...              Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"), (("gpuid", 4),), (8, 6),
        ...              partial="sum").kinds
        ('reduce_scatter',)
    """
    if partial is not None and partial not in REDUCE_OPS:
        raise LayoutError(f"partial must be one of {REDUCE_OPS} or None, got {partial!r}")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise LayoutError(f"itemsize must be a positive int, got {itemsize!r}")
    return _plan_cached(src, dst, _mesh(mesh), tuple(int(s) for s in shape), itemsize, partial)


def plan_alternatives(src: Layout, dst: Layout, mesh, shape: Sequence[int], itemsize: int = 4,
                      partial: str | None = None) -> tuple[Plan, ...]:
    """``plan_layouts``' plan first, then plans that gather one mesh axis per step, in every order.

    On even shapes a gather over several axes in one step moves as many bytes as one step
    per axis, so ``plan_layouts`` keeps one step. When some slots hold padding that need not
    move (uneven shapes: the executor drops it), gathering axis by axis balances what each
    device sends: ``(5, 6)`` rows 2/1/1/1 on a 2x2 mesh all-gathered in one step send 2 real
    rows to 3 peers from device ``(0, 0)``; over ``y`` then ``x`` it sends 2 rows, then 3.
    The caller picks by its own count of bytes. Example, ``[Shard(0), Shard(1)] -> [R, R]``::

        >>> [p.kinds for p in plan_alternatives(Layout.parse("S[(2,4,2,3):(1@x,3,1@y,1)]"),
        ...     Layout.parse("S[(8,6):(6,1)] + R[(2,2):(1@x,1@y)]"), (("x", 2), ("y", 2)), (8, 6))]
        [('all_gather',), ('all_gather', 'all_gather'), ('all_gather', 'all_gather')]
    """
    first = plan_layouts(src, dst, mesh, shape, itemsize, partial)
    if first.method != "digits":
        return (first,)
    mesh, shape = _mesh(mesh), tuple(int(s) for s in shape)
    head, start = (), src
    if partial is not None:  # the reduction stays; its copy step (if any) gets the alternatives
        if len(first.steps) < 2 or first.steps[-1].reduce is not None or first.steps[-1].source is None:
            return (first,)
        head, start = tuple(_replace(s, fused=None) for s in first.steps[:-1]), first.steps[-1].source
    plans = [first]
    for plan in _gather_orders(start, dst, mesh, shape, itemsize) + _axis_orders(start, dst, mesh, shape, itemsize):
        steps = _mark_all_reduce(list(head + plan.steps))
        if all(steps != p.steps for p in plans):  # a gather order is often also an axis order
            plans.append(Plan(src, dst, mesh, shape, itemsize, partial, steps, "digits"))
    return tuple(plans)


@functools.lru_cache(maxsize=256)
def _axis_orders(src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int) -> tuple[Plan, ...]:
    """One plan per order of the mesh axes the copy changes, one step per axis (as torch's
    DTensor goes placement by placement): after the steps of axes ``done``, a digit sits at its
    target place if that is on a done axis, in local memory if it left a done axis for a place
    not yet reached, else where the source has it; replicas and offsets follow the same rule.

    With padding left out, a one-step exchange can load one device more than a chain:
    ``(7, 2)`` on 2x2, ``[Shard(1), Shard(1)] -> [Replicate, Shard(0)]`` (the devices at
    ``y = 1`` hold no column) sends 40 B from device ``(0, 0)`` in one all-to-all-v, 28 B
    as an all-to-all over ``y`` then an all-gather over ``x``.
    """
    canon_src, canon_dst = src.canonicalize(), dst.canonicalize()
    digits = _refine(canon_src.shard, canon_dst.shard)
    if digits is None or any(it.axis == MEMORY_AXIS for it in canon_src.replica + canon_dst.replica):
        return ()
    names = [a for a, _ in mesh]
    replicas = lambda layout, axis: sorted((it.extent, it.stride) for it in layout.canonicalize().replica
                                           if it.axis == axis)
    axes = [a for a in names
            if any((d.source[0] == a or d.target[0] == a) and d.source != d.target for d in digits)
            or replicas(src, a) != replicas(dst, a) or src.offset.get(a, 0) != dst.offset.get(a, 0)]
    if len(axes) < 2:
        return ()
    context = _Context(mesh, itemsize, None)
    plans = []
    for order in itertools.permutations(axes):
        chain = [(src, [d.source for d in digits])]
        for k in range(1, len(order)):
            done = set(order[:k])
            places = []
            for d in digits:
                if _on_mesh(d.target) and d.target[0] in done:
                    places.append(d.target)
                elif _on_mesh(d.source) and d.source[0] not in done:
                    places.append(d.source)
                else:
                    places.append(None)  # local memory; strides below
            stride = 1
            for i in reversed(range(len(digits))):  # compact, row-major over the local digits
                if places[i] is None:
                    places[i] = (MEMORY_AXIS, stride)
                    stride *= digits[i].extent
            replica = [it for it in src.replica if it.axis not in done] + \
                [it for it in dst.replica if it.axis in done]
            offset = {a: v for a, v in src.offset.items() if a not in done and a != MEMORY_AXIS}
            offset.update({a: v for a, v in dst.offset.items() if a in done})
            layout = Layout([Iter(d.extent, p[1], p[0]) for d, p in zip(digits, places)], replica, offset)
            try:
                _validate(layout, mesh, math.prod(shape), "intermediate")
            except LayoutError:
                break
            if _replicated_in_memory(layout, mesh):
                break
            chain.append((layout, places))
        else:
            plans.append(_chain_plan(chain, digits, src, dst, mesh, shape, context))
    return tuple(plans)


@functools.lru_cache(maxsize=256)
def _gather_orders(src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int) -> tuple[Plan, ...]:
    canon_src, canon_dst = src.canonicalize(), dst.canonicalize()
    digits = _refine(canon_src.shard, canon_dst.shard)
    if digits is None or any(it.axis == MEMORY_AXIS for it in canon_src.replica):
        return ()
    gathered = [d for d in digits if _on_mesh(d.source) and d.target[0] == MEMORY_AXIS]
    axes = list(dict.fromkeys(d.source[0] for d in gathered))
    if len(axes) < 2:
        return ()
    context = _Context(mesh, itemsize, None)
    offset = {a: v for a, v in src.offset.items() if a != MEMORY_AXIS}
    plans = []
    for order in itertools.permutations(axes):
        chain = [(src, [d.source for d in digits])]  # (layout, place of each digit)
        for k in range(1, len(order)):
            # the next intermediate: this axis' gathered digits join local memory (compact, row-major
            # over the local digits) and become replicas along the axis they came from
            done, (before, places) = set(order[:k]), chain[-1]
            new, stride = list(places), 1
            for i in reversed(range(len(digits))):
                if places[i][0] == MEMORY_AXIS or (digits[i] in gathered and places[i][0] in done):
                    new[i] = (MEMORY_AXIS, stride)
                    stride *= digits[i].extent
            replica = list(before.replica) + [Iter(d.extent, d.source[1], d.source[0])
                                              for d in gathered if d.source[0] == order[k - 1]]
            layout = Layout([Iter(d.extent, p[1], p[0]) for d, p in zip(digits, new)], replica, offset)
            try:
                _validate(layout, mesh, math.prod(shape), "intermediate")
            except LayoutError:
                break
            chain.append((layout, new))
        else:
            plans.append(_chain_plan(chain, digits, src, dst, mesh, shape, context))
    return tuple(plans)


def _chain_plan(chain, digits, src: Layout, dst: Layout, mesh: Mesh, shape, context: _Context) -> Plan:
    """The plan stepping through ``chain`` (``(layout, place of each digit)`` from ``src``), then
    into ``dst``: one copy step per pair of consecutive layouts that differ."""
    chain = chain + [(dst, [d.target for d in digits])]
    steps = [_box_step([_Digit(d.extent, p, q) for d, p, q in zip(digits, a_places, b_places)],
                       a, b, context, reduce=None)
             for (a, a_places), (b, b_places) in zip(chain, chain[1:]) if a != b]
    return Plan(src, dst, mesh, shape, context.itemsize, None, _mark_all_reduce(steps), "digits")


def plan_direct(src: Layout, src_shape: Sequence[int], src_rows: Sequence[Sequence[int]], dst: Layout,
                dst_shape: Sequence[int], dst_rows: Sequence[Sequence[int]], mesh, itemsize: int = 4,
                partial: str | None = None) -> Plan:
    """One step moving only the true elements between two padded index spaces (an all-to-all-v).

    ``src`` admits ``src_shape`` and ``dst`` admits ``dst_shape``, two paddings of one tensor;
    ``src_rows[d]`` (``dst_rows[d]``) lists the padded index of each true row of dim ``d``,
    so both lists of a dim have one entry per true row. With ``partial`` the source's first
    dim is the summand dim (every index real, no entry in ``dst_*``): each summand is sent to
    every target slot of its element and reduced there. Each element goes from the holder
    nearest its target device (the target itself when it holds it) straight into place, so
    no padding and nothing a device already holds is sent. Derived per dim: the device and
    ``m`` terms a dim's index adds are cut into runs (same devices, constant strides), and a
    box is one run per dim, so the work is the product of the runs, not the element count.

    Example, ``(3, 6)`` on a 2x2 mesh ``(x, y)``, torch's ``[Shard(1), Shard(1)]`` (columns
    chunked by x, then by y: 2 + 1 per x, padded to 8) to ``[Shard(1), Shard(0)]`` (rows
    chunked by y: 2 + 1, padded to 4): each device sends the 2 values its y-peer lacks::

        >>> src = Layout.parse("S[(3,2,2,2):(2,1@x,1@y,1)]")
        >>> dst = Layout.parse("S[(2,2,2,3):(1@y,3,1@x,1)]")
        >>> plan = plan_direct(src, (3, 8), [range(3), (0, 1, 2, 4, 5, 6)],
        ...                    dst, (4, 6), [(0, 1, 2), range(6)], (("x", 2), ("y", 2)))
        >>> plan.kinds, max(plan.bytes_sent.values())
        (('permute',), 8)
    """
    mesh = _mesh(mesh)
    src_shape, dst_shape = tuple(int(n) for n in src_shape), tuple(int(n) for n in dst_shape)
    src_rows = tuple(tuple(int(i) for i in r) for r in src_rows)
    dst_rows = tuple(tuple(int(i) for i in r) for r in dst_rows)
    if partial is not None and partial not in REDUCE_OPS:
        raise LayoutError(f"partial must be one of {REDUCE_OPS} or None, got {partial!r}")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise LayoutError(f"itemsize must be a positive int, got {itemsize!r}")
    return _plan_direct_cached(src, src_shape, src_rows, dst, dst_shape, dst_rows, mesh, itemsize, partial)


@functools.lru_cache(maxsize=256)
def _plan_direct_cached(src, src_shape, src_rows, dst, dst_shape, dst_rows, mesh: Mesh, itemsize, partial) -> Plan:
    lead = 1 if partial is not None else 0
    if len(src_shape) != len(dst_shape) + lead or len(src_rows) != len(src_shape) or len(dst_rows) != len(dst_shape):
        raise LayoutError(f"plan_direct: shapes {src_shape} -> {dst_shape} and their row lists do not match"
                          + (" (the source leads with a summand dim)" if lead else ""))
    for what, shape, rows in (("source", src_shape, src_rows), ("target", dst_shape, dst_rows)):
        for d, (n, r) in enumerate(zip(shape, rows)):
            if len(set(r)) != len(r) or any(not 0 <= i < n for i in r):
                raise LayoutError(f"plan_direct: {what} rows of dim {d} must be distinct indices below {n}, got {r}")
    if lead and src_rows[0] != tuple(range(src_shape[0])):
        raise LayoutError(f"plan_direct: the summand dim is never padded, got rows {src_rows[0]}")
    for d, (a, b) in enumerate(zip(src_rows[lead:], dst_rows)):
        if len(a) != len(b):
            raise LayoutError(f"plan_direct: dim {d} has {len(a)} true rows in the source, {len(b)} in the target")
    _validate(src, mesh, math.prod(src_shape), "source")
    _validate(dst, mesh, math.prod(dst_shape), "target")
    true_shape = tuple(len(r) for r in dst_rows)
    src_terms = _dim_terms(src, src_shape, src_rows, mesh)
    dst_terms = _dim_terms(dst, dst_shape, dst_rows, mesh)
    zero = ((0,) * len(mesh), 0)
    # per dim: runs of true rows with the same device terms on both sides and constant m strides
    per_dim = [_term_runs(a, b) for a, b in zip(src_terms, [[zero] * src_shape[0]] * lead + dst_terms)]
    src_points, dst_points = _replica_points(src, mesh), _replica_points(dst, mesh)
    aligned = _replica_digits(src, mesh)
    transfers = []
    for choice in itertools.product(*per_dim):
        src_device = [sum(c) for c in zip(*(run[0] for run in choice))] or [0] * len(mesh)
        dst_device = [sum(c) for c in zip(*(run[1] for run in choice))] or [0] * len(mesh)
        src_m, dst_m = sum(run[2] for run in choice), sum(run[3] for run in choice)
        kept = [k for k, run in enumerate(choice) if run[6] > 1] or [0]
        extents = tuple(choice[k][6] for k in kept)
        source_strides, target_strides = tuple(choice[k][4] for k in kept), tuple(choice[k][5] for k in kept)
        for r_device, r_m in dst_points:
            target = tuple(a + b for a, b in zip(dst_device, r_device))
            holders = [(tuple(a + b for a, b in zip(src_device, p_device)), src_m + p_m) for p_device, p_m in src_points]
            source, source_m = _nearest(holders, target, aligned)
            transfers.append(Transfer(source, target, extents, source_m, source_strides, dst_m + r_m, target_strides))
    context = _Context(mesh, itemsize, partial)
    step = _make_step(transfers, partial, src, dst, buffer_size(src), buffer_size(dst), context)
    moves = (f"each true element from its nearest holder straight into place ({math.prod(true_shape)} real of "
             f"{math.prod(dst_shape)} padded target elements; padding never sent)",)
    return Plan(src, dst, mesh, true_shape, itemsize, partial, _mark_all_reduce([_replace(step, moves=moves)]), "direct",
                f"direct between paddings: source admits {src_shape}, target admits {dst_shape}")


def _dim_terms(layout: Layout, shape, rows, mesh: Mesh) -> list[list[tuple[Device, int]]]:
    """Per dim, per true row (``rows[d]`` gives its padded index): the (device, m) that dim's
    iters add. A grouped layout's iters each belong to one dim, so an element's place is the
    sum of its dims' terms plus the offset (and a replica)."""
    index = {a: i for i, (a, _) in enumerate(mesh)}
    terms = []
    for block, dim_rows in zip(layout.blocks(shape), rows):
        row_terms = []
        for i in dim_rows:
            device, m, rest = [0] * len(mesh), 0, i
            for it in reversed(block):  # row-major within the block: the last iter is fastest
                digit, rest = rest % it.extent, rest // it.extent
                if it.axis == MEMORY_AXIS:
                    m += digit * it.stride
                else:
                    device[index[it.axis]] += digit * it.stride
            row_terms.append((tuple(device), m))
        terms.append(row_terms)
    return terms


def _term_runs(src_terms, dst_terms) -> list[tuple]:
    """Consecutive rows with equal device terms on both sides and constant ``m`` steps, as
    ``(src device, dst device, src m, dst m, src stride, dst stride, length)``."""
    runs, i, n = [], 0, len(src_terms)
    while i < n:
        j, (sd, sm), (dd, dm) = i + 1, src_terms[i], dst_terms[i]
        ss = st = 1
        if j < n and src_terms[j][0] == sd and dst_terms[j][0] == dd:
            ss, st = src_terms[j][1] - sm, dst_terms[j][1] - dm
            while j < n and src_terms[j][0] == sd and dst_terms[j][0] == dd \
                    and src_terms[j][1] - src_terms[j - 1][1] == ss and dst_terms[j][1] - dst_terms[j - 1][1] == st:
                j += 1
        runs.append((sd, dd, sm, dm, ss, st, j - i))
        i = j
    return runs


def clear_plan_cache() -> None:
    """Forget every cached plan (``plan_layouts``, ``plan_alternatives``); for cold-planning benchmarks."""
    _plan_cached.cache_clear()
    _gather_orders.cache_clear()
    _axis_orders.cache_clear()
    _plan_direct_cached.cache_clear()


@functools.lru_cache(maxsize=1024)
def _plan_cached(src: Layout, dst: Layout, mesh: Mesh, shape, itemsize: int, partial) -> Plan:
    size = math.prod(shape)
    if partial is not None and (size == 0 or src.size % size):
        raise LayoutError(f"partial source {src} has {src.size} elements, not a multiple of shape {shape}")
    summands = src.size // size if partial is not None else 1
    _validate(src, mesh, summands * size, "source")
    _validate(dst, mesh, size, "target")
    context = _Context(mesh, itemsize, partial)
    steps, method = _plan_by_digits(src, dst, summands, size, context)
    if steps is None:
        steps = _plan_by_elements(src, dst, summands, size, context)
        method = "elements"
    return Plan(src, dst, mesh, shape, itemsize, partial, _mark_all_reduce(steps), method)


@dataclass(frozen=True)
class _Context:
    mesh: Mesh
    itemsize: int
    partial: str | None


def _mark_all_reduce(steps: list[Step]) -> tuple[Step, ...]:
    """Tag a reduce-scatter followed by an all-gather in the same groups as one all-reduce."""
    steps = list(steps)
    for i in range(len(steps) - 1):
        a, b = steps[i], steps[i + 1]
        if a.kind == "reduce_scatter" and b.kind == "all_gather" and a.groups == b.groups:
            steps[i] = _replace(a, fused="all_reduce")
            steps[i + 1] = _replace(b, fused="all_reduce")
    return tuple(steps)


def _replace(step: Step, **changes) -> Step:
    fields = {name: getattr(step, name) for name in step.__dataclass_fields__}
    fields.update(changes)
    return Step(**fields)


# -- digits ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Digit:
    """One digit of the common refinement: where it sits in the source and in the target."""

    extent: int
    source: tuple[str, int]  # (axis, stride)
    target: tuple[str, int] | None  # None: a summand digit (reduced away)

    def contribution(self, value: int, side: int) -> tuple[tuple[str, int], ...]:
        """``((axis, delta),)`` this digit adds at ``value`` on ``side`` (0 source, 1 target)."""
        place = self.source if side == 0 else self.target
        return () if place is None or not value else ((place[0], value * place[1]),)

    def split(self, outer: int) -> tuple["_Digit", "_Digit"]:
        """``(outer, e/outer)`` digits whose product is this one (outer digit first)."""
        inner = self.extent // outer
        scale = lambda p: None if p is None else (p[0], p[1] * inner)
        return _Digit(outer, scale(self.source), scale(self.target)), _Digit(inner, self.source, self.target)


def _refine(a: Sequence[Iter], b: Sequence[Iter]) -> list[_Digit] | None:
    """Split both iter sequences until their extents agree, outermost first; None if impossible.

    ``(8:6, 6:1)`` and ``(4:1@gpuid, 2:6, 6:1)`` -> digits of extents ``(4, 2, 6)``.
    """
    a, b = list(a), list(b)
    digits = []
    while a and b:
        x, y = a.pop(0), b.pop(0)
        e = math.gcd(x.extent, y.extent)
        if e not in (x.extent, y.extent):
            return None
        if x.extent > e:
            a.insert(0, Iter(x.extent // e, x.stride, x.axis))
        if y.extent > e:
            b.insert(0, Iter(y.extent // e, y.stride, y.axis))
        digits.append(_Digit(e, (x.axis, x.stride * (x.extent // e)), (y.axis, y.stride * (y.extent // e))))
    return digits if not a and not b else None


@dataclass(frozen=True)
class _Block:
    """Consecutive iters with no common refinement, enumerated value by value.

    ``(2,3):(3,1@gpuid)`` in the source against ``(3,2):(2,1@gpuid)`` in the target is one
    block of extent 6: value 4 is source digits (1, 1) and target digits (2, 0).
    """

    extent: int
    source_iters: tuple[Iter, ...]
    target_iters: tuple[Iter, ...]

    def contribution(self, value: int, side: int) -> tuple[tuple[str, int], ...]:
        iters = self.source_iters if side == 0 else self.target_iters
        digits = []
        for it in reversed(iters):
            digits.append(value % it.extent)
            value //= it.extent
        return tuple((it.axis, d * it.stride) for it, d in zip(iters, reversed(digits)) if d)

    def touches_mesh(self, side: int) -> bool:
        return any(it.axis != MEMORY_AXIS for it in (self.source_iters if side == 0 else self.target_iters))

    def __str__(self) -> str:
        return f"block {Layout(self.source_iters)} -> {Layout(self.target_iters)}"


# Blocks are enumerated value by value; past this extent the element fallback is as good.
_BLOCK_LIMIT = 1 << 12


def _refine_blocks(a: Sequence[Iter], b: Sequence[Iter]) -> list | None:
    """Like ``_refine``, but a stretch with no common refinement becomes one ``_Block``.

    The stretch grows (splitting iters where a divisor allows) until both sides cover
    the same extent; None if a block would exceed ``_BLOCK_LIMIT``.
    """
    a, b = list(a), list(b)
    digits: list = []
    while a and b:
        e = math.gcd(a[0].extent, b[0].extent)
        if e > 1 or a[0].extent == b[0].extent == 1:  # a common outer factor: split as _refine does
            x, y = a.pop(0), b.pop(0)
            if x.extent > e:
                a.insert(0, Iter(x.extent // e, x.stride, x.axis))
            if y.extent > e:
                b.insert(0, Iter(y.extent // e, y.stride, y.axis))
            digits.append(_Digit(e, (x.axis, x.stride * (x.extent // e)), (y.axis, y.stride * (y.extent // e))))
            continue
        taken_a, taken_b = [a.pop(0)], [b.pop(0)]
        pa, pb = taken_a[0].extent, taken_b[0].extent
        while pa != pb:
            side, other, taken, product = (a, pb, taken_a, pa) if pa < pb else (b, pa, taken_b, pb)
            it = side.pop(0)
            need = other // product if other % product == 0 else None
            if need is not None and it.extent > need and it.extent % need == 0:  # take just enough of it
                taken.append(Iter(need, it.stride * (it.extent // need), it.axis))
                side.insert(0, Iter(it.extent // need, it.stride, it.axis))
                product *= need
            else:
                taken.append(it)
                product *= it.extent
            if pa < pb:
                pa = product
            else:
                pb = product
        if pa > _BLOCK_LIMIT:
            return None
        digits.append(_Block(pa, tuple(taken_a), tuple(taken_b)))
    return digits if not a and not b else None


def _on_mesh(place) -> bool:
    return place is not None and place[0] != MEMORY_AXIS


def _plan_by_digits(src: Layout, dst: Layout, summands: int, size: int,
                    context: _Context) -> tuple[list[Step] | None, str]:
    """Steps from the digits (module doc, 1.-3.) and ``"digits"`` or ``"blocks"``; None if none exist."""
    canon_src, canon_dst = src.canonicalize(), dst.canonicalize()
    try:
        summand_iters, data_iters = canon_src.blocks((summands, size))
    except LayoutError:
        return None, ""
    if _replicated_in_memory(dst, context.mesh):
        return None, ""
    digits = _refine(data_iters, canon_dst.shard)
    if context.partial is None:
        if src == dst:
            return [], "digits"
        method = "digits"
        if digits is None:
            digits, method = _refine_blocks(data_iters, canon_dst.shard), "blocks"
            if digits is None:
                return None, ""
        return [_box_step(digits, src, dst, context, reduce=None)], method
    if digits is None:
        return None, ""
    summand_digits = [_Digit(it.extent, (it.axis, it.stride), None) for it in summand_iters]
    middle, reduced_digits, copy_digits, late = _reduction_target(summand_digits, digits, src, dst, context.mesh)
    steps = [_box_step(summand_digits + reduced_digits, src, middle, context, reduce=context.partial)]
    scattering = [u for u in summand_digits if _on_mesh(u.source) and u not in late]
    if late and scattering:
        # Summands with no data digit to scatter become replicas (every device reduces all of its
        # part): reducing them in the same step as the scattering ones sends every piece across the
        # whole product group. Reduce the scattering axes first, then the rest on the smaller piece.
        split = _reduce_late(summand_digits, late, reduced_digits, src, middle, context)
        if _step_cost(split) < _step_cost(steps):
            steps = split
    if middle != dst:
        steps.append(_box_step(copy_digits, middle, dst, context, reduce=None))
    return steps, "digits"


def _reduce_late(summand_digits, late, reduced_digits, src: Layout, middle: Layout, context: _Context) -> list[Step]:
    """Two reduce steps: ``src -> pending`` reduces every summand digit but ``late`` (those stay a
    leading summand block on their mesh axes), ``pending -> middle`` reduces ``late``.

    ``[Partial, Partial] -> [Shard(1), Replicate]`` of ``(5, 6)`` on 2x2 (x, y): the x summand
    reduce-scatters the 6 columns into place (15 elements a device stay), the y summand (no
    local digit of 5 or 3 splits by 2) then all-reduces those 15: 60 + 60 B a device with
    4-byte items, where one step over the 4-group sends 3 x 15 x 4 = 180 B.
    """
    late_iters = [Iter(u.extent, u.source[1], u.source[0]) for u in late]
    replica = list(middle.replica)
    for it in late_iters:
        replica.remove(it)
    pending = Layout(late_iters + list(middle.shard), replica, middle.offset)
    early = [u for u in summand_digits if u not in late]
    kept = [_Digit(u.extent, u.source, u.source) for u in late]
    same = [_Digit(it.extent, (it.axis, it.stride), (it.axis, it.stride)) for it in middle.shard]
    return [_box_step(early + kept + reduced_digits, src, pending, context, reduce=context.partial),
            _box_step(list(late) + same, pending, middle, context, reduce=context.partial)]


def _step_cost(steps: Sequence[Step]) -> tuple[int, int, int]:
    """(most bytes a device sends, bytes all devices send, steps) as the executor moves them:
    a direct all-reduce step runs as a ring ``all_reduce``, ``2 (g-1)/g`` of its buffer."""
    sent = _sent_per_device(steps)
    return (max(sent.values(), default=0), sum(sent.values()), len(steps))


def _sent_per_device(steps: Sequence[Step]) -> dict:
    """``{device: bytes sent}`` over ``steps``, a direct all-reduce counted as a ring ``all_reduce``."""
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


def _replicated_in_memory(layout: Layout, mesh: Mesh) -> bool:
    """Whether two replicas land on one device (at two ``m``): the element fallback handles those."""
    devices = [_split_point(r, mesh)[0] for r in layout.replica_offsets]
    return len(set(devices)) != len(devices)


def _reduction_target(summand_digits, digits, src: Layout, dst: Layout, mesh: Mesh):
    """The layout the reduce step lands in, and the digits of (src -> it) and (it -> dst).

    Each summand digit on a mesh axis ``(a, s)`` gives its place to a data digit: the one
    the target puts at ``(a, s)`` (reduce-scatter into place); or, when the target does
    not vary along ``a``, none (reduce onto one device); or a local digit split off the
    front (reduce-scatter, then all-gather). If no local digit divides, the summand digit
    becomes a replica (each device reduces everything: a direct all-reduce).
    """
    # pieces: [digit (src->dst), place in the middle layout]
    pieces = [[d, d.source] for d in digits]
    target_axes = {it.axis for it in dst.canonicalize().shard + dst.canonicalize().replica}
    offset = {a: v for a, v in src.offset.items() if a != MEMORY_AXIS}
    replica = [it for it in src.replica if it.axis != MEMORY_AXIS]
    mesh_summands = [u for u in summand_digits if u.source[0] != MEMORY_AXIS]  # local ones reduce in place
    waiting, late = [], []
    for u in mesh_summands:  # first: reduce-scatter straight into the target's place
        axis, stride = u.source
        match = next((i for i, (d, place) in enumerate(pieces)
                      if place[0] == MEMORY_AXIS and d.target == (axis, stride) and d.extent % u.extent == 0), None)
        if match is None:
            waiting.append(u)
            continue
        d = pieces[match][0]
        if d.extent > u.extent:
            outer, inner = d.split(d.extent // u.extent)
            pieces[match:match + 1] = [[outer, outer.source], [inner, (axis, stride)]]
        else:
            pieces[match][1] = (axis, stride)
    # slice early: a source replica axis the target shards a local digit over keeps only that part
    for r in list(replica):
        match = next((i for i, (d, place) in enumerate(pieces) if place[0] == MEMORY_AXIS
                      and d.target == (r.axis, r.stride) and d.extent % r.extent == 0), None)
        if match is None or r.stride < 0:
            continue
        d = pieces[match][0]
        if d.extent > r.extent:
            outer, inner = d.split(d.extent // r.extent)
            pieces[match:match + 1] = [[outer, outer.source], [inner, (r.axis, r.stride)]]
        else:
            pieces[match][1] = (r.axis, r.stride)
        replica.remove(r)
    for u in waiting:
        axis, stride = u.source
        if axis not in target_axes:  # reduce onto the one device the target uses along this axis
            here = offset.get(axis, 0)
            want = dst.offset.get(axis, 0) - here
            if want % stride == 0 and 0 <= want // stride < u.extent:
                offset[axis] = here + want
            continue
        # reduce-scatter a local digit (one the target keeps local, if any); the copy step gathers it
        candidates = [i for i, (d, place) in enumerate(pieces) if place[0] == MEMORY_AXIS and d.extent % u.extent == 0]
        candidates.sort(key=lambda i: _on_mesh(pieces[i][0].target))
        if candidates:
            split = candidates[0]
            outer, inner = pieces[split][0].split(u.extent)
            pieces[split:split + 1] = [[outer, (axis, stride)], [inner, inner.source]]
            continue
        replica.append(Iter(u.extent, stride, axis))  # every device reduces everything
        late.append(u)
    # the middle layout's memory is compact, row-major over its local digits
    stride = 1
    places = [None] * len(pieces)
    for i in reversed(range(len(pieces))):
        d, place = pieces[i]
        if place[0] == MEMORY_AXIS:
            places[i] = (MEMORY_AXIS, stride)
            stride *= d.extent
        else:
            places[i] = place
    middle = Layout([Iter(d.extent, p[1], p[0]) for (d, _), p in zip(pieces, places)], replica, offset)
    reduced = [_Digit(d.extent, d.source, p) for (d, _), p in zip(pieces, places)]
    copied = [_Digit(d.extent, p, d.target) for (d, _), p in zip(pieces, places)]
    return middle, reduced, copied, late


def _replica_points(layout: Layout, mesh: Mesh) -> list[tuple[Device, int]]:
    """``R + O`` as (device, m) points: where the element at digit zero sits, per replica."""
    offset = layout.offset
    points = []
    for r in layout.replica_offsets or ({},):
        point = dict(offset)
        for a, v in r.items():
            point[a] = point.get(a, 0) + v
        points.append(_split_point(point, mesh))
    return points


def _nearest(candidates: Sequence[tuple[Device, int]], target: Device, aligned=None) -> tuple[Device, int]:
    """The holder to read from: the target itself, else the one differing on the fewest axes.

    Ties go to the holder whose replica digits (``aligned(device)``) equal the target's:
    with ``R[2:2@gpuid]`` device 2 reads from 3, not 1, so the copies form the two
    groups ``{0,1}, {2,3}`` (one collective each) rather than one irregular exchange.
    """
    def key(c):
        device = c[0]
        return (sum(a != b for a, b in zip(device, target)),
                0 if aligned is None else sum(a != b for a, b in zip(aligned(device), aligned(target))),
                sum(abs(a - b) for a, b in zip(device, target)), device)
    return min(candidates, key=key)


def _replica_digits(layout: Layout, mesh: Mesh):
    """``device -> (replica digit per mesh replica iter)``: which copy a device would hold."""
    index = {a: i for i, (a, _) in enumerate(mesh)}
    iters = [(index[it.axis], abs(it.stride), it.extent) for it in layout.replica if it.axis in index]
    return lambda device: tuple((device[i] // s) % e for i, s, e in iters)


def _box_step(digits: Sequence[_Digit], src: Layout, dst: Layout, context: _Context, reduce) -> Step:
    """One step from ``src`` to ``dst`` whose transfers are boxes in digit space (module doc, 2.)."""
    mesh = context.mesh
    index = {a: i for i, (a, _) in enumerate(mesh)}
    def targets_mesh(d):
        return d.touches_mesh(1) if isinstance(d, _Block) else _on_mesh(d.target)

    def is_free(d):  # on m on both sides, affine: one dim of every box
        return isinstance(d, _Digit) and d.source[0] == MEMORY_AXIS and d.target is not None \
            and d.target[0] == MEMORY_AXIS

    fixed = [d for d in digits if targets_mesh(d)]
    free = [d for d in digits if is_free(d)]
    moving = [d for d in digits if not targets_mesh(d) and not is_free(d)]
    extents, source_strides, target_strides = _merge_free(free)
    source_points = _replica_points(src, mesh)
    aligned = _replica_digits(src, mesh)

    def walk(chosen, values, device, m, side):
        """Add each chosen digit's contribution on ``side`` (0 source, 1 target) to (device, m)."""
        device = list(device)
        for d, v in zip(chosen, values):
            for axis, delta in d.contribution(v, side):
                if axis == MEMORY_AXIS:
                    m += delta
                else:
                    device[index[axis]] += delta
        return device, m

    zero = [0] * len(mesh)
    moving_values = list(itertools.product(*(range(d.extent) for d in moving)))
    transfers = []
    for fixed_values in itertools.product(*(range(d.extent) for d in fixed)):
        src_device, src_m = walk(fixed, fixed_values, zero, 0, 0)
        dst_device, dst_m = walk(fixed, fixed_values, zero, 0, 1)  # dst_m: only blocks mix m into mesh digits
        for r_device, r_m in _replica_points(dst, mesh):
            target = tuple(a + b for a, b in zip(dst_device, r_device))
            for values in moving_values:
                device, m = walk(moving, values, src_device, src_m, 0)
                _, target_m = walk(moving, values, zero, r_m + dst_m, 1)
                holders = [(tuple(a + b for a, b in zip(device, p_device)), m + p_m) for p_device, p_m in source_points]
                source, source_m = _nearest(holders, target, aligned)
                transfers.append(Transfer(source, target, extents, source_m, source_strides, target_m, target_strides))
    step = _make_step(transfers, reduce, src, dst, buffer_size(src), buffer_size(dst), context)
    return _replace(step, moves=_moves(digits, src, dst))


def _moves(digits: Sequence[_Digit], src: Layout, dst: Layout) -> tuple[str, ...]:
    """Digits whose axis changes (``"4:1@gpuid -> 4:12"``, ``"4:1@gpuid reduced"``), replicas gained or lost."""
    text = lambda extent, place: str(Iter(extent, place[1], place[0]))
    moves = []
    for d in digits:
        if d.extent == 1:
            continue
        if isinstance(d, _Block):
            moves.append(str(d))
        elif d.target is None:
            moves.append(f"{text(d.extent, d.source)} reduced")
        elif d.source[0] != d.target[0]:
            moves.append(f"{text(d.extent, d.source)} -> {text(d.extent, d.target)}")
    before = {it for it in src.canonicalize().replica if it.axis != MEMORY_AXIS}
    after = {it for it in dst.canonicalize().replica if it.axis != MEMORY_AXIS}
    moves += [f"replica R[{it}] added" for it in sorted(after - before, key=str)]
    moves += [f"replica R[{it}] dropped" for it in sorted(before - after, key=str)]
    return tuple(moves)


def _merge_free(free: Sequence[_Digit]):
    """Extents and strides of the box over the free digits, merging neighbours that are contiguous on both sides."""
    dims: list[list[int]] = []
    for d in free:
        e, s, t = d.extent, d.source[1], d.target[1]
        if dims and dims[-1][1] == e * s and dims[-1][2] == e * t:
            dims[-1] = [dims[-1][0] * e, s, t]
        else:
            dims.append([e, s, t])
    return tuple(x[0] for x in dims), tuple(x[1] for x in dims), tuple(x[2] for x in dims)


# -- the element-level fallback ---------------------------------------------------


def _plan_by_elements(src: Layout, dst: Layout, summands: int, size: int, context: _Context) -> list[Step]:
    """Correct for any pair of valid layouts: per-element holders, compressed into runs."""
    mesh = context.mesh
    src_slots, dst_slots = _slots(src, mesh), _slots(dst, mesh)
    out_size = buffer_size(dst)
    steps = []
    if context.partial is not None:
        # reduce each element at one of its target devices (its first slot there), then copy
        owners, pairs = [], {}
        for x in range(size):
            # the target device holding the most summands already; ties spread over the replicas
            held = [sum(any(d == slot[0] for d, _ in src_slots[p * size + x]) for p in range(summands))
                    for slot in dst_slots[x]]
            best = [i for i, h in enumerate(held) if h == max(held)]
            owner = dst_slots[x][best[(x * 7919) % len(best)]]
            owners.append([owner])
            for p in range(summands):
                source, source_m = _nearest(src_slots[p * size + x], owner[0])
                pairs.setdefault((source, owner[0]), []).append((source_m, owner[1]))
        steps.append(_make_step(_runs(pairs), context.partial, src, None, buffer_size(src), out_size, context))
        src_slots, src, in_size = owners, None, out_size
    else:
        in_size = buffer_size(src)
    # copy: each target device receives each element once, into its first slot, then fans out locally
    pairs, fan_out = {}, {}
    for x in range(size):
        by_device: dict[Device, list[int]] = {}
        for device, m in dst_slots[x]:
            by_device.setdefault(device, []).append(m)
        for device, ms in by_device.items():
            source, source_m = _nearest(src_slots[x], device)
            pairs.setdefault((source, device), []).append((source_m, ms[0]))
            fan_out.setdefault((device, device), []).extend((ms[0], m) for m in ms)
    needs_fan_out = any(a != b for runs in fan_out.values() for a, b in runs)
    steps.append(_make_step(_runs(pairs), None, src, None if needs_fan_out else dst, in_size, out_size, context))
    if needs_fan_out:
        steps.append(_make_step(_runs(fan_out), None, None, dst, out_size, out_size, context))
    return steps


def _runs(pairs: Mapping[tuple[Device, Device], list[tuple[int, int]]]) -> list[Transfer]:
    """Compress ``(source slot, target slot)`` lists into strided 1-D transfers."""
    transfers = []
    for (source, target), items in sorted(pairs.items()):
        items = sorted(items, key=lambda p: p[1])
        i = 0
        while i < len(items):
            j = i + 1
            if j < len(items):
                ds, dt = items[j][0] - items[i][0], items[j][1] - items[i][1]
                while j + 1 < len(items) and items[j + 1][0] - items[j][0] == ds and items[j + 1][1] - items[j][1] == dt:
                    j += 1
                j += 1
            else:
                ds = dt = 1
            transfers.append(Transfer(source, target, (j - i,), items[i][0], (ds,), items[i][1], (dt,)))
            i = j
    return transfers


# -- naming a step from its transfer graph -----------------------------------------


def _make_step(transfers, reduce, src, dst, in_size, out_size, context: _Context) -> Step:
    kind, groups = _classify(transfers, reduce)
    axes = tuple(a for i, (a, _) in enumerate(context.mesh)
                 if any(len({d[i] for d in g}) > 1 for g in groups))
    return Step(kind, axes, groups, tuple(transfers), reduce, in_size, out_size, src, dst, context.itemsize,
                mesh_axis_groups=_are_mesh_slices(groups, axes, context.mesh))


def _are_mesh_slices(groups, axes, mesh: Mesh) -> bool:
    """Whether every group is all devices that agree off ``axes`` (the mesh's own sub-mesh groups).

    On a 2x4 ``(x, y)`` mesh, groups ``((0,0),(0,1),(0,2),(0,3))`` and ``((1,0),...,(1,3))``
    are the slices along ``y``; ``((0,0),(0,1))`` alone is not.
    """
    if not groups:
        return False
    inside = [i for i, (a, _) in enumerate(mesh) if a in axes]
    size = math.prod(mesh[i][1] for i in inside)
    for group in groups:
        if len(group) != size or len({tuple(d[i] for i in range(len(mesh)) if i not in inside) for d in group}) != 1:
            return False
    return True


def _classify(transfers: Sequence[Transfer], reduce) -> tuple[str, tuple]:
    """The collective the transfers form (module doc, 4.), and its device groups."""
    messages: dict[tuple[Device, Device], list[Transfer]] = {}
    local: dict[Device, list[Transfer]] = {}
    for t in transfers:
        if t.is_local:
            local.setdefault(t.source, []).append(t)
        else:
            messages.setdefault((t.source, t.target), []).append(t)
    if not messages:
        return "local", ()
    # groups: connected components of the (undirected) message graph
    parent: dict[Device, Device] = {}

    def root(d):
        while parent.setdefault(d, d) != d:
            d = parent[d]
        return d

    for a, b in messages:
        parent[root(a)] = root(b)
    members: dict[Device, list[Device]] = {}
    for d in list(parent):
        members.setdefault(root(d), []).append(d)
    groups = tuple(sorted(tuple(sorted(g)) for g in members.values()))
    kinds = {_group_kind(g, messages, local, reduce) for g in groups}
    return (kinds.pop() if len(kinds) == 1 else "all_to_all_v"), groups


def _target_box(t: Transfer) -> tuple:
    return (t.target_offset, t.extents, t.target_strides)


def _group_kind(group: Sequence[Device], messages, local, reduce) -> str:
    """Name one group's exchange by the promise an executor relies on (equal boxes pack equal buffers)."""
    pairs = [(a, b) for a in group for b in group if a != b]
    complete = all(p in messages for p in pairs)
    sent = {p: tuple(t.source_box() for t in ts) for p, ts in messages.items() if p[0] in group}
    landed = {p: tuple(_target_box(t) for t in ts) for p, ts in messages.items() if p[0] in group}
    counts = {p: sum(t.count for t in ts) for p, ts in messages.items() if p[0] in group}
    senders, receivers = {a for a, _ in sent}, {b for _, b in sent}

    def one_message_per_sender():  # a sends the same buffer to every peer, and keeps it itself
        return all(len({sent[(a, b)] for b in group if b != a}) == 1
                   and sorted(sent[(a, next(b for b in group if b != a))]) == sorted(t.source_box() for t in local.get(a, ()))
                   for a in group)

    def one_landing_per_receiver():  # b reduces every peer's buffer, box by box, into the slots of its own part
        return all(len({landed[(a, b)] for a in group if a != b}) == 1
                   and landed[(next(a for a in group if a != b), b)] == tuple(_target_box(t) for t in local.get(b, ()))
                   for b in group)

    if reduce is not None:
        if len(receivers) == 1 and len(senders) == len(group) - 1:
            (r,) = receivers
            if len({landed[(a, r)] for a in senders}) == 1:
                return "reduce"
        if complete and one_landing_per_receiver() and len(set(counts.values())) == 1:
            return "all_reduce" if one_message_per_sender() else "reduce_scatter"
        return "all_to_all_v"
    if complete and one_message_per_sender():
        return "all_gather"
    if len(senders) == 1 and len(receivers) == len(group) - 1 > 1:
        (a,) = senders
        if len({sent[(a, b)] for b in receivers}) == 1:
            return "broadcast"
    out_degree = {a: sum(1 for p in sent if p[0] == a) for a in group}
    in_degree = {b: sum(1 for p in sent if p[1] == b) for b in group}
    if max(out_degree.values()) <= 1 and max(in_degree.values()) <= 1:
        return "permute"
    if complete and len(set(counts.values())) == 1:
        return "all_to_all"
    return "all_to_all_v"
