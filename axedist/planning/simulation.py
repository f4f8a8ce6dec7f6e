"""Run a plan on per-device Python lists: the oracle the tests check plans and executors with.

``local_buffers(S[(2,3):(1@gpuid,1)], (("gpuid",2),), range(6))`` is ``{(0,): [0, 1, 2], (1,):
[3, 4, 5]}``; ``simulate(plan, buffers)`` returns each device's buffer after the plan.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..layout import Layout, LayoutError
from ..spec import REDUCE_OPS
from .plans import Plan, buffer_size, devices
from .points import as_mesh, slots
from .steps import Device, Step

__all__ = ["simulate", "local_buffers", "global_values"]


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

    Each step reads only its input buffers and writes fresh output buffers, exactly as the
    transfers say. A slot written twice in a step without ``reduce`` is an error (a plan bug,
    never silently resolved).
    """
    current = {d: list(buffers[d]) for d in plan.devices}
    for step in plan.steps:
        current = _run_step(step, current, plan.devices)
    return current


def _run_step(step: Step, current: dict, every: Sequence[Device]) -> dict[Device, list]:
    incoming: dict[Device, dict[int, list]] = {d: {} for d in every}
    for t in step.transfers:
        source, into = current[t.source], incoming[t.target]
        for s, m in t.pairs():
            into.setdefault(m, []).append(source[s])
    out = {}
    for d in every:
        buffer = [None] * step.out_size
        for m, values in incoming[d].items():
            if step.reduce is None:
                if len(values) != 1:
                    raise AssertionError(f"step {step.kind} writes slot {m} of device {d} {len(values)} times")
                buffer[m] = values[0]
            else:
                buffer[m] = _combine(step.reduce, values)
        out[d] = buffer
    return out


def local_buffers(layout: Layout, mesh, values: Sequence) -> dict[Device, list]:
    """Each device's buffer holding the flat (row-major) ``values`` laid out by ``layout``.

    ``local_buffers(S[(2,3):(1@gpuid,1)], (("gpuid",2),), range(6))`` ->
    ``{(0,): [0, 1, 2], (1,): [3, 4, 5]}``. Unused slots are None.
    """
    mesh = as_mesh(mesh)
    buffers = {d: [None] * buffer_size(layout) for d in devices(mesh)}
    for x, where in enumerate(slots(layout, mesh)):
        for device, m in where:
            buffers[device][m] = values[x]
    return buffers


def global_values(layout: Layout, mesh, buffers: Mapping[Device, Sequence]) -> list[list]:
    """For every element ``x``, the values found at each of its slots (all equal when consistent)."""
    mesh = as_mesh(mesh)
    return [[buffers[device][m] for device, m in where] for where in slots(layout, mesh)]
