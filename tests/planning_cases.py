"""Shared by the planning and runtime tests: a brute-force reference, plan checks, layouts.

The reference is written from the definition alone (``L(x) = {D(x) + r + O}``, digits
last-fastest; a device is the tuple of mesh coordinates, ``m`` the slot in its buffer),
independently of the planner's own enumeration. Random layouts cover DTensor placements
(Shard/Replicate/Partial per mesh axis) and what placements cannot say: block-cyclic
sharding, reversed and interleaved device orders, a subset of the mesh (an offset on a
mesh axis), replication on part of an axis, transposed and padded local memory, summands
held in local memory.
"""

import itertools
import math
import random

import pytest

from axedist.layout import Iter, Layout
from axedist.planning import buffer_size, plan_layouts, simulate
from tests.reference import brute_points

MESHES = [
    (("gpuid", 2),),
    (("gpuid", 3),),
    (("gpuid", 4),),
    (("gpuid", 8),),
    (("x", 2), ("y", 2)),
    (("x", 2), ("y", 4)),
]


# -- the reference -------------------------------------------------------------------


def brute_slots(layout: Layout, mesh) -> list[set]:
    """``{(device, m)}`` for every element, from the definition."""
    names = [a for a, _ in mesh]
    return [
        {(tuple(p.get(a, 0) for a in names), p.get("m", 0)) for p in points}
        for points in brute_points(layout)
    ]


def devices(mesh):
    return list(itertools.product(*(range(n) for _, n in mesh)))


def scatter(layout, mesh, values):
    slots_of = brute_slots(layout, mesh)
    size = max(m for slots in slots_of for _, m in slots) + 1
    buffers = {d: [None] * size for d in devices(mesh)}
    for x, slots in enumerate(slots_of):
        for d, m in slots:
            buffers[d][m] = values[x]
    return buffers


REDUCE = {"sum": sum, "max": max, "min": min, "avg": lambda v: sum(v) / len(v)}


def check_plan(src, dst, mesh, shape, partial=None, one_step_minimum=True, plan=None):
    """Simulate the plan (default: ``plan_layouts``') and compare every destination slot with the global tensor."""
    plan = plan_layouts(src, dst, mesh, shape, partial=partial) if plan is None else plan
    size = math.prod(shape)
    summands = src.size // size if partial else 1
    values = [(x % size) * 16 + x // size + 1 for x in range(summands * size)]  # element x, summand p
    out = simulate(plan, scatter(src, mesh, values))
    for x, slots in enumerate(brute_slots(dst, mesh)):
        column = [values[p * size + x] for p in range(summands)]
        want = REDUCE[partial](column) if partial else column[0]
        for d, m in slots:
            assert out[d][m] == pytest.approx(want), (str(plan), x, d, m)
    for d in devices(mesh):
        assert len(out[d]) == buffer_size(dst)
    if partial is None and one_step_minimum:
        # bytes received: exactly what each device needs and does not hold (4-byte items)
        missing = dict.fromkeys(devices(mesh), 0)
        for have, need in zip(brute_slots(src, mesh), brute_slots(dst, mesh)):
            for d in {dev for dev, _ in need} - {dev for dev, _ in have}:
                missing[d] += 1
        for d in devices(mesh):
            assert plan.bytes_received[d] == 4 * missing[d], (str(plan), d)
    assert sum(plan.bytes_sent.values()) == sum(plan.bytes_received.values())
    for step in plan.steps:
        check_kind(step)
    return plan


def check_kind(step):
    """What an executor may rely on for each kind, checked on the element slots the messages move."""
    messages = {}
    for t in step.transfers:
        if t.source != t.target:
            messages.setdefault((t.source, t.target), []).extend(t.pairs())
    reads = {p: [s for s, _ in v] for p, v in messages.items()}
    writes = {p: [m for _, m in v] for p, v in messages.items()}
    kept = {}
    for t in step.transfers:
        if t.source == t.target:
            kept.setdefault(t.source, []).extend(t.pairs())
    if step.kind == "local":
        assert not messages and step.groups == ()
        return
    group_of = {d: g for g in step.groups for d in g}
    assert all(group_of[a] is group_of[b] for a, b in messages), "a message leaves its group"
    for group in step.groups:
        pairs = [(a, b) for a in group for b in group if a != b]
        inside = [p for p in messages if p[0] in group]
        if step.kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
            assert all(p in messages for p in pairs), step.kind
        if step.kind in ("all_gather", "all_reduce"):
            for a in group:  # one buffer to every peer, and the sender keeps those values
                assert len({tuple(reads[(a, b)]) for b in group if b != a}) == 1
                peer = next(b for b in group if b != a)
                assert sorted(reads[(a, peer)]) == sorted(s for s, _ in kept.get(a, []))
        if step.kind in ("reduce_scatter", "all_reduce"):
            assert step.reduce is not None
            for b in group:  # every peer's buffer reduces, in order, into the receiver's own slots
                assert len({tuple(writes[(a, b)]) for a in group if a != b}) == 1
                assert writes[(next(a for a in group if a != b), b)] == [m for _, m in kept.get(b, [])]
        if step.kind == "all_to_all":
            assert len({len(reads[p]) for p in pairs}) == 1
        if step.kind == "broadcast":
            assert len({a for a, _ in inside}) == 1 and len(inside) == len(group) - 1
            assert len({tuple(reads[p]) for p in inside}) == 1
        if step.kind == "permute":
            assert all(sum(1 for p in inside if p[0] == d) <= 1 and sum(1 for p in inside if p[1] == d) <= 1
                       for d in group)
        if step.kind == "reduce":
            assert step.reduce is not None and len({b for _, b in inside}) == 1


# -- layouts: placements and beyond -------------------------------------------------


def placements(mesh, shape, spec) -> Layout:
    """DTensor placements as a layout (even shapes): ``spec`` per mesh axis is ``S<dim>``, ``R`` or ``P``.

    ``placements((("x",2),("y",2)), (4,6), ["S0", "S1"])`` -> ``S[(2,2,2,3):(1@x,3,1@y,1)]``;
    ``P`` axes form the leading summand dim, in mesh order.
    """
    dims = [[] for _ in shape]
    local = list(shape)
    replica, summand = [], []
    for (axis, n), p in zip(mesh, spec):
        if p == "R":
            replica.append(Iter(n, 1, axis))
        elif p == "P":
            summand.append(Iter(n, 1, axis))
        else:
            dim = int(p[1:])
            dims[dim].append(Iter(n, 1, axis))
            local[dim] //= n
    shard, stride = [], math.prod(local)
    for dim, iters in enumerate(dims):
        stride //= local[dim]
        shard += iters + [Iter(local[dim], stride)]
    return Layout(summand + shard, replica)


def factorizations(n, rng):
    """A random ordered factorization of ``n`` into factors > 1."""
    factors = []
    while n > 1:
        f = rng.choice([d for d in range(2, n + 1) if n % d == 0])
        factors.append(f)
        n //= f
    return factors


def random_layout(rng: random.Random, mesh, shape, partial=False, memory_replica=False) -> Layout:
    """A valid layout of ``shape`` (``(P, *shape)`` with ``partial``) on ``mesh``, from many families."""
    local = list(shape)
    device_iters = [[] for _ in shape]
    replica, summand, offset = [], [], {}
    for axis, n in mesh:
        factors = factorizations(n, rng)
        strides = [math.prod(factors[i + 1:]) for i in range(len(factors))]
        reverse = rng.random() < 0.2
        for f, s in zip(factors, strides):
            it = Iter(f, s, axis)
            if reverse:  # devices in reverse order along this factor
                it = Iter(f, -s, axis)
                offset[axis] = offset.get(axis, 0) + (f - 1) * s
            role = rng.choice(["shard", "shard", "replicate", "unused"] + ["summand", "summand"] * partial)
            if role == "shard":
                dims = [i for i in range(len(shape)) if local[i] % f == 0]
                if dims:
                    i = rng.choice(dims)
                    local[i] //= f
                    device_iters[i].insert(rng.randrange(len(device_iters[i]) + 1), it)
                    continue
                role = "replicate"
            if role == "summand":
                summand.append(it)
            elif role == "replicate":
                replica.append(it)
            else:  # a subset of the mesh: this factor sits at one coordinate
                offset[axis] = offset.get(axis, 0) + rng.randrange(f) * it.stride
    if partial and rng.random() < 0.3:
        summand.append("local2")  # two summands in each device's memory
    rng.shuffle(summand)
    # each dim: local outer block, device iters, local inner block (block-cyclic when both > 1)
    slots = []  # per dim, a list of Iter or a local-extent placeholder
    for i in range(len(shape)):
        divisors = [d for d in range(1, local[i] + 1) if local[i] % d == 0]
        outer = rng.choice(divisors)
        slots.append([("local", outer)] + device_iters[i] + [("local", local[i] // outer)])
    # memory: local digits in a random order, compact row-major over it, sometimes padded/offset/reversed
    local_digits = [s for dim in slots for s in dim if isinstance(s, tuple) and s[1] > 1]
    local_digits += [s for s in summand if s == "local2"]
    order = list(range(len(local_digits)))
    rng.shuffle(order)
    strides, stride = {}, 1
    m_offset = rng.choice([0, 0, 0, 1])
    for k in reversed(order):
        extent = 2 if local_digits[k] == "local2" else local_digits[k][1]
        stride *= rng.choice([1, 1, 1, 2]) if stride > 1 else 1  # a gap in memory
        s = stride
        if rng.random() < 0.1:
            s = -stride
            m_offset += (extent - 1) * stride
        strides[id(local_digits[k])] = s
        stride *= extent
    if memory_replica:
        replica.append(Iter(2, stride + m_offset + 1, "m"))
    if m_offset:
        offset["m"] = m_offset

    def as_iter(s):
        if isinstance(s, Iter):
            return s
        extent = 2 if s == "local2" else s[1]
        return Iter(extent, strides.get(id(s), 1))

    shard = [as_iter(s) for s in summand] + [as_iter(s) for dim in slots for s in dim]
    rng.shuffle(replica)
    layout = Layout(shard, replica, offset)
    assert layout.is_injective(), layout
    return layout


def random_shape(rng, mesh):
    n = math.prod(size for _, size in mesh)
    rank = rng.choice([1, 2, 2, 3])
    shape = [rng.choice([1, 2, 3, 4, 6, 8]) for _ in range(rank)]
    shape[rng.randrange(rank)] *= rng.choice([1, 2, n])  # often divisible by the mesh
    while math.prod(shape) > 96:
        shape[shape.index(max(shape))] //= 2
    return tuple(max(1, s) for s in shape)


G4 = (("gpuid", 4),)
XY = (("x", 2), ("y", 2))


class StubMesh:
    """What the padding planner reads of a mesh: axis names, shape, row-major strides, size."""

    def __init__(self, mesh_spec):
        self.axis_names = tuple(a for a, _ in mesh_spec)
        self.shape = tuple(n for _, n in mesh_spec)

    def size(self):
        return math.prod(self.shape)

    def strides(self):
        out, stride = {}, 1
        for name, extent in zip(reversed(self.axis_names), reversed(self.shape)):
            out[name] = stride
            stride *= extent
        return out
