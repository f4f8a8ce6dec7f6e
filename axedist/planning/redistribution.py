"""``plan_redistribute``: the whole route that moves a DTensor from one spec to another.

Uneven shapes pad their dims (``torch.chunk``); a route pads each device's true local tensor
into its source buffer, runs its plans (padding left out), and reads the true local tensor
back out. When the two specs pad a dim differently it is two plans with a local re-pad
between them, or one direct plan of the true elements, whichever moves fewer bytes. A
pending reduction may keep part of its summands (``[Partial, Partial] -> [Replicate,
Partial]``): the dropped ones are reduced, the kept ones stay in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..caches import cached
from ..layout import LayoutError
from ..spec import DTensorSpec
from ..tracing import outside_tracing
from . import holdings
from .alternatives import clear_alternatives_cache
from .cost import pick, route_cost, steps_time_us
from .derive import clear_derive_cache
from .direct import clear_direct_cache, plan_direct
from .fused import FusedStep
from .holdings import true_boxes
from .padding import cheapest, real_slots
from .plans import Plan, devices
from .repad import RepadRoute, Side, common_sides, reduced_in_place, repad_route, side_of, split_summands
from .steps import Device, Step

__all__ = ["Redistribution", "Repad", "plan_redistribute", "clear_plan_cache"]


@dataclass(frozen=True)
class Repad:
    """Between a route's two plans: each device's true local tensor (``boxes[position]``) is read
    off ``gathered`` and written into ``repadded`` (no communication)."""

    gathered: Side
    repadded: Side
    boxes: tuple[tuple[int, ...], ...]

    @property
    def sides(self) -> tuple[Side, Side]:
        return self.gathered, self.repadded


@dataclass(frozen=True, eq=False, repr=False)
class Redistribution:
    """How a DTensor moves from spec ``src`` to spec ``dst``: every step of every plan, in order.

    ``first``/``last`` are the buffers the route starts and ends in (each position's true local
    shape in ``src_boxes``/``dst_boxes``); ``repad`` the local re-pad between two plans, if any;
    ``fused`` a fused GEMM + reduce-scatter that may replace the steps. Example, ``(7,)`` on 4
    ranks, ``Shard(0)`` (padded to 8: true sizes 2, 2, 2, 1) to ``Replicate()``: one step;
    rank 3 sends its 1 real value, the others 2 (``bytes_sent``: 24, 24, 24, 12 B with 4-byte items).
    """

    src: DTensorSpec
    dst: DTensorSpec
    plans: tuple[Plan, ...]
    first: Side
    last: Side
    src_boxes: tuple[tuple[int, ...], ...]
    dst_boxes: tuple[tuple[int, ...], ...]
    reduce_op: str | None  # the reduction the route runs (None: a copy)
    repad: Repad | None = None
    fused: FusedStep | None = None

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(step for plan in self.plans for step in plan.steps)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(step.kind for step in self.steps)

    @property
    def devices(self) -> tuple[Device, ...]:
        return devices(self.plans[0].mesh)

    @functools.cached_property
    def bytes_sent(self) -> dict[Device, int]:
        """Bytes each device sends over every step (the plans' direct count; every device listed)."""
        return {d: sum(p.bytes_sent[d] for p in self.plans) for d in self.devices}

    @functools.cached_property
    def bytes_received(self) -> dict[Device, int]:
        return {d: sum(p.bytes_received[d] for p in self.plans) for d in self.devices}

    @functools.cached_property
    def sent_per_device(self) -> dict:
        """``{device: bytes it sends}`` as ``cost`` counts them (a direct all-reduce as a ring)."""
        sent: dict = {}
        for plan in self.plans:
            for d, b in plan.sent_per_device.items():
                sent[d] = sent.get(d, 0) + b
        return sent

    @property
    def cost(self) -> tuple:
        """(most bytes one device sends, bytes all devices send, steps) over the whole route."""
        return route_cost(self.plans)

    @property
    def time_us(self) -> float | None:
        """Modeled microseconds over every plan on the mesh's network (None on one host)."""
        network = self.plans[0].network
        return None if network is None else sum(steps_time_us(p.steps, network) for p in self.plans)

    def explain(self) -> str:
        text = self._route_text()
        if self.fused is None:
            return text
        kind, products = self.fused.collective, self.fused.products
        if self.fused.fused:
            summed = "" if products == 1 else f" of {products} summed products (operands concatenated along K)"
            return f"fused GEMM + {kind}{summed}: {self.fused.gemm}"
        gemm = "GEMM" if products == 1 else f"{products} GEMMs, summed"
        return f"{gemm}, then {text}\n(fused GEMM + {kind} not used: {self.fused.reason})"

    def _route_text(self) -> str:
        if self.repad is None and len(self.plans) == 1:
            return str(self.plans[0])
        lines = [f"redistribute {self.src} -> {self.dst}: {len(self.plans)} plans"
                 + (", a local re-pad between them" if self.repad else "")]
        for i, plan in enumerate(self.plans):
            lines.append(str(plan))
            if i == 0 and self.repad is not None:
                a, b = self.repad.sides
                lines.append(f"then each device re-pads its true local tensor: {a.layout} over {list(a.full)} -> "
                             f"{b.layout} over {list(b.full)} (no communication)")
        lines.append(f"in all: {len(self.steps)} step(s); per device at most: sent "
                     f"{max(self.bytes_sent.values(), default=0)} B, "
                     f"received {max(self.bytes_received.values(), default=0)} B"
                     + ("" if self.time_us is None else f"; modeled time {self.time_us:.1f} us"))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        kinds = " | ".join(" + ".join(p.kinds) or "local" for p in self.plans)
        return f"Redistribution({self.first.layout} -> {self.last.layout}: {kinds})"


def plan_redistribute(src: DTensorSpec, dst: DTensorSpec, itemsize: int = 4) -> Redistribution:
    """The route moving a DTensor from spec ``src`` to spec ``dst`` (``itemsize`` bytes an element);
    nothing moves. Cached per (specs, item size).

    ``(8, 6)`` as ``[Shard(0)]`` to ``[Replicate()]`` on 4 ranks: one plan of one all-gather,
    144 B a device; ``(5, 6)`` on 2x2, ``[Shard(0), Shard(0)] -> [Shard(0), Replicate()]``: an
    all-gather over ``y``, then a local re-pad (the two specs pad dim 0 differently).
    """
    return _route(src, dst, itemsize, holdings.ELEMENTWISE)


def clear_plan_cache() -> None:
    """Forget every cached plan and route (``plan_layouts``, ``plan_alternatives``, ``plan_direct``,
    ``plan_redistribute``); for cold-planning benchmarks."""
    clear_derive_cache()
    clear_alternatives_cache()
    clear_direct_cache()
    _route.cache_clear()


@cached(maxsize=512)
@outside_tracing
def _route(src: DTensorSpec, dst: DTensorSpec, itemsize: int, elementwise: bool) -> Redistribution:
    if src.mesh != dst.mesh or src.shape != dst.shape:
        raise LayoutError(f"redistribute keeps the mesh and shape: {src} -> {dst}")
    mesh = src.mesh
    source, target = side_of(src), side_of(dst)
    reduce = src.reduce_op is not None and dst.reduce_op is None
    if dst.reduce_op is not None and (src.reduce_op, src.summands) != (dst.reduce_op, dst.summands):
        if src.reduce_op != dst.reduce_op or src.summands % dst.summands:
            raise LayoutError(f"cannot redistribute to a pending {dst.reduce_op} over {dst.summands} summands from "
                              f"{src}; a pending reduction can keep part of its summands (the same op, a divisor of "
                              f"their count), else use to_partial() on a tensor whose leading dim holds the summands")
        # reduce some summands, keep the others pending: [Partial, Partial] -> [Replicate, Partial]
        source, reduce = split_summands(source, target), True
    partial = src.reduce_op if reduce else None
    route = functools.partial(Redistribution, src, dst, src_boxes=true_boxes(source.layout, source.full, source.rows, mesh),
                              dst_boxes=true_boxes(target.layout, target.full, target.rows, mesh), reduce_op=partial)
    lead = 1 if reduce else 0  # a reduced summand dim has no counterpart in the target
    sides = common_sides(source, target, mesh.size(), lead)
    if sides is not None:
        first, last = sides
        plan = cheapest(first.layout, last.layout, last.full, itemsize, partial,
                        real_slots(first.layout, first.full, first.rows, mesh), mesh)
        return route((plan,), first, last)
    # no common padding (torch chunks a dim two different ways): gather, re-pad locally, go on; or
    # every true element straight from its holder into place, whichever moves fewer bytes
    best = _cheapest_repad(source, target, lead, partial, itemsize, mesh)
    # the direct plan: an all-to-all-v with no padding (an uneven digit swap: (3, 6) [S1, S1] -> [S1, S0]
    # on 2x2 sends 8 B a device where gathering the inner chunks over y sends 24 B)
    network = mesh.network
    direct = plan_direct(source.layout, source.full, source.rows, target.layout, target.full, target.rows, mesh,
                         itemsize, partial).on(network)
    if pick([best, direct], network, _plans_of) is direct:
        return route((direct,), source, target)
    return route(best.plans, source, best.last, repad=Repad(best.gathered, best.middle, best.boxes))


def _plans_of(candidate) -> tuple[Plan, ...]:
    return candidate.plans if isinstance(candidate, RepadRoute) else (candidate,)


def _cheapest_repad(source: Side, target: Side, lead: int, partial, itemsize: int, mesh) -> RepadRoute:
    """The re-pad route that moves least (or runs fastest: ``cost.pick``); with a pending reduction,
    reduce first or last."""
    candidates = [repad_route(source, target, lead, partial, itemsize, mesh)]
    if lead:
        reduced = reduced_in_place(source)
        in_place = cheapest(source.layout, reduced.layout, reduced.full, itemsize, partial,
                            real_slots(source.layout, source.full, source.rows, mesh), mesh)
        after = repad_route(reduced, target, 0, None, itemsize, mesh)
        candidates.append(after._replace(plans=(in_place.then(after.plans[0]), after.plans[1])))
    return pick(candidates, mesh.network, _plans_of)
