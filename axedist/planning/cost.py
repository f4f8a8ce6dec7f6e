"""What a plan costs: bytes a device sends, and on a ``Network`` (per-axis links) the time it takes.

The time model, per step: each device sends its messages one after the other; a message to a
device that differs on several mesh axes moves at the slowest of their links (a hop across
hosts is as slow as the network), costing that link's latency plus its bytes over the link's
bandwidth; the step takes as long as its busiest device. A direct all-reduce step counts as a
ring (``2 (g-1)`` messages of ``1/g`` of the buffer over the group's slowest link), as it runs.

Reduce ``(8, 6)`` fp32 partial sums over a 2x2 ``(dp, tp)`` mesh, ``dp`` across hosts, into
``Replicate`` on both: one reduce-scatter + all-gather over all 4 devices sends 2 x 3 x 48 B a
device, 2 x 2 x 48 B of it across hosts; reduce-scattering over ``tp`` first, all-reducing the
96 B halves over ``dp``, then all-gathering over ``tp`` sends as many bytes (288 B) but only
96 B across hosts, so ``pick`` takes it.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from ..topology import Network
from .steps import Step

__all__ = ["route_cost", "step_sends", "step_time_us", "steps_time_us", "sent_per_axis", "pick", "placement_move_elements"]


def route_cost(plans) -> tuple:
    """(most bytes one device sends, all bytes, steps) over consecutive plans."""
    sent: dict = {}
    for plan in plans:
        for d, b in plan.sent_per_device.items():
            sent[d] = sent.get(d, 0) + b
    return (max(sent.values(), default=0), sum(sent.values()), sum(len(p.steps) for p in plans))


def step_sends(step: Step, network: Network) -> dict:
    """``{device: {axis: (bytes, messages)}}``: what each device sends in ``step``, by the axis
    whose link carries it."""
    out: dict = {}
    ring = step.kind == "all_reduce"
    for (a, b), transfers in step.messages.items():
        count = sum(t.count for t in transfers) * step.itemsize
        if ring:  # as a ring: 2 (g-1) messages of 1/g of the buffer, over the group's slowest link
            if (a, b) != (a, next(d for d in _group(step, a) if d != a)):
                continue
            g = len(_group(step, a))
            axis, nbytes, messages = network.slowest(step.axes).axis, 2 * (g - 1) * count / g, 2 * (g - 1)
        else:
            axis, nbytes, messages = network.link_between(a, b).axis, count, 1
        per_axis = out.setdefault(a, {})
        old = per_axis.get(axis, (0, 0))
        per_axis[axis] = (old[0] + nbytes, old[1] + messages)
    return out


def _group(step: Step, device) -> tuple:
    return next(g for g in step.groups if device in g)


def step_time_us(step: Step, network: Network) -> float:
    """Microseconds ``step`` takes on ``network``: its busiest device's messages, one after the other."""
    times = [sum(network.axis(axis).link.time_us(nbytes, messages) for axis, (nbytes, messages) in sends.items())
             for sends in step_sends(step, network).values()]
    return max(times, default=0.0)


def steps_time_us(steps: Sequence[Step], network: Network) -> float:
    """Microseconds the steps take one after the other."""
    return sum(step_time_us(step, network) for step in steps)


def sent_per_axis(steps: Sequence[Step], network: Network) -> dict[str, float]:
    """``{axis: most bytes one device sends over that axis's link}`` over ``steps`` (every axis listed)."""
    totals: dict = {}
    for step in steps:
        for device, sends in step_sends(step, network).items():
            for axis, (nbytes, _) in sends.items():
                totals[(device, axis)] = totals.get((device, axis), 0) + nbytes
    return {a.axis: max((b for (d, axis), b in totals.items() if axis == a.axis), default=0) for a in network.axes}


def pick(candidates: Sequence, network: Network | None, plans_of: Callable = lambda c: (c,)):
    """The candidate to run (each a plan, or a route: ``plans_of`` gives its plans).

    Without a network: the fewest bytes (``route_cost``; the first of equals). With one: of the
    candidates whose busiest device sends no more than the fewest, the fastest on the network
    (then the fewest bytes), so time never buys more bytes a device.
    """
    costs = [route_cost(plans_of(c)) for c in candidates]
    if network is None:
        return candidates[min(range(len(candidates)), key=lambda i: costs[i])]
    least = min(c[0] for c in costs)
    eligible = [i for i, c in enumerate(costs) if c[0] <= least]

    def seconds(i):
        return sum(steps_time_us(plan.steps, network) for plan in plans_of(candidates[i]))

    return candidates[min(eligible, key=lambda i: (seconds(i), costs[i]))]


def placement_move_elements(current, wanted, numel: int, size: int) -> float:
    """Elements one device sends when one mesh axis of ``size`` devices takes a tensor of ``numel``
    elements from placement ``current`` to ``wanted`` (None: a layout with no placement form,
    priced as sending it whole), what the planner's route for that move sends: an all-gather
    ``numel (size-1)/size``, a reduce-scatter as much, an all-reduce twice that, an all-to-all
    ``numel (size-1)/size**2``, a slice of a replicated tensor nothing; a pending sum is made by
    products, never by moving data (infinite). What a sharding rule weighs its candidates with
    before any plan exists (the matrix products' strategies);
    ``test_the_rules_move_cost_is_what_the_planned_route_sends`` checks it against
    ``plan_redistribute`` on every pair of placements.

    ``(8, 6)`` on 4 devices, ``Shard(0) -> Replicate``: 48 x 3/4 = 36 elements a device."""
    if current == wanted:
        return 0.0
    if current is None:
        return float(numel)
    # by class name: planning imports no torch (placements are torch's classes)
    have, want = type(current).__name__, type(wanted).__name__
    if want == "Partial":
        return math.inf
    gathered = numel * (size - 1) / size
    if have == "Partial":
        return gathered * (2.0 if want == "Replicate" else 1.0)
    if have == "Replicate":
        return 0.0  # a local slice
    return gathered if want == "Replicate" else gathered / size
