"""Naming a step from its transfers: the collective they form and the device groups it runs in.

Per group of devices that exchange data (the promise an executor relies on: equal boxes in
equal order pack equal buffers): only local transfers -> ``local``; every member sending one
identical buffer to every other and keeping it -> ``all_gather``; one sender, one buffer to
all others (3+ devices) -> ``broadcast``; at most one message out and one in per device ->
``permute``; every pair exchanging equal sizes -> ``all_to_all``. With ``reduce``: every
peer's buffer landing in the receiver's own slots -> ``reduce_scatter`` (``all_reduce`` when
each sender also sends one identical buffer); one receiver -> ``reduce``. Else ``all_to_all_v``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from .steps import Device, Mesh, Step, Transfer

__all__ = ["Context", "make_step", "classify", "mark_all_reduce", "replace_step"]


@dataclass(frozen=True)
class Context:
    """What every step of one plan shares: the mesh, the item size, the pending reduction."""

    mesh: Mesh
    itemsize: int
    partial: str | None


def make_step(transfers, reduce, src, dst, in_size: int, out_size: int, context: Context) -> Step:
    """The step of ``transfers`` from buffers of ``src`` (``in_size`` slots) to ``dst``, named by its messages."""
    kind, groups = classify(transfers, reduce)
    axes = tuple(a for i, (a, _) in enumerate(context.mesh)
                 if any(len({d[i] for d in g}) > 1 for g in groups))
    return Step(kind, axes, groups, tuple(transfers), reduce, in_size, out_size, src, dst, context.itemsize,
                mesh_axis_groups=_are_mesh_slices(groups, axes, context.mesh))


def replace_step(step: Step, **changes) -> Step:
    """``step`` with some fields changed (its cached byte counts start afresh)."""
    return dataclasses.replace(step, **changes)


def mark_all_reduce(steps: Sequence[Step]) -> tuple[Step, ...]:
    """Tag a reduce-scatter followed by an all-gather in the same groups as one all-reduce."""
    steps = list(steps)
    for i in range(len(steps) - 1):
        a, b = steps[i], steps[i + 1]
        if a.kind == "reduce_scatter" and b.kind == "all_gather" and a.groups == b.groups:
            steps[i] = replace_step(a, fused="all_reduce")
            steps[i + 1] = replace_step(b, fused="all_reduce")
    return tuple(steps)


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


def classify(transfers: Sequence[Transfer], reduce) -> tuple[str, tuple]:
    """The collective the transfers form, and its device groups (the message graph's components)."""
    messages: dict[tuple[Device, Device], list[Transfer]] = {}
    local: dict[Device, list[Transfer]] = {}
    for t in transfers:
        if t.is_local:
            local.setdefault(t.source, []).append(t)
        else:
            messages.setdefault((t.source, t.target), []).append(t)
    if not messages:
        return "local", ()
    groups = _components(messages)
    kinds = {_group_kind(g, messages, local, reduce) for g in groups}
    return (kinds.pop() if len(kinds) == 1 else "all_to_all_v"), groups


def _components(messages) -> tuple[tuple[Device, ...], ...]:
    """Connected components of the (undirected) message graph, each sorted, in sorted order."""
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
    return tuple(sorted(tuple(sorted(g)) for g in members.values()))


@dataclass(frozen=True)
class _Group:
    """One group's messages as the kind tests read them: boxes sent and landed, counts, ends."""

    members: Sequence[Device]
    sent: dict
    landed: dict
    counts: dict
    local: dict

    @property
    def senders(self) -> set:
        return {a for a, _ in self.sent}

    @property
    def receivers(self) -> set:
        return {b for _, b in self.sent}

    @property
    def complete(self) -> bool:
        return all((a, b) in self.sent for a in self.members for b in self.members if a != b)

    def one_message_per_sender(self) -> bool:
        """Each member sends the same buffer to every peer, and keeps it itself."""
        group = self.members
        return all(len({self.sent[(a, b)] for b in group if b != a}) == 1
                   and sorted(self.sent[(a, next(b for b in group if b != a))])
                   == sorted(t.source_box() for t in self.local.get(a, ()))
                   for a in group)

    def one_landing_per_receiver(self) -> bool:
        """Each member reduces every peer's buffer, box by box, into the slots of its own part."""
        group = self.members
        return all(len({self.landed[(a, b)] for a in group if a != b}) == 1
                   and self.landed[(next(a for a in group if a != b), b)]
                   == tuple(t.target_box() for t in self.local.get(b, ()))
                   for b in group)


def _group_kind(group: Sequence[Device], messages, local, reduce) -> str:
    """Name one group's exchange by the promise an executor relies on (equal boxes pack equal buffers)."""
    mine = {p: ts for p, ts in messages.items() if p[0] in group}
    g = _Group(group, {p: tuple(t.source_box() for t in ts) for p, ts in mine.items()},
               {p: tuple(t.target_box() for t in ts) for p, ts in mine.items()},
               {p: sum(t.count for t in ts) for p, ts in mine.items()}, local)
    return _reduce_kind(g) if reduce is not None else _copy_kind(g)


def _reduce_kind(g: _Group) -> str:
    if len(g.receivers) == 1 and len(g.senders) == len(g.members) - 1:
        (r,) = g.receivers
        if len({g.landed[(a, r)] for a in g.senders}) == 1:
            return "reduce"
    if g.complete and g.one_landing_per_receiver() and len(set(g.counts.values())) == 1:
        return "all_reduce" if g.one_message_per_sender() else "reduce_scatter"
    return "all_to_all_v"


def _copy_kind(g: _Group) -> str:
    if g.complete and g.one_message_per_sender():
        return "all_gather"
    if len(g.senders) == 1 and len(g.receivers) == len(g.members) - 1 > 1:
        (a,) = g.senders
        if len({g.sent[(a, b)] for b in g.receivers}) == 1:
            return "broadcast"
    out_degree = {a: sum(1 for p in g.sent if p[0] == a) for a in g.members}
    in_degree = {b: sum(1 for p in g.sent if p[1] == b) for b in g.members}
    if max(out_degree.values()) <= 1 and max(in_degree.values()) <= 1:
        return "permute"
    if g.complete and len(set(g.counts.values())) == 1:
        return "all_to_all"
    return "all_to_all_v"
