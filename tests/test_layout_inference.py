"""Plans between layouts, executed by the pure-Python simulator, checked against brute force.

The reference here is written from the definition alone (``L(x) = {D(x) + r + O}``, digits
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
from hypothesis import given, settings
from hypothesis import strategies as st

from axedist.layout import Iter, Layout, LayoutError
from reference import brute_points
from axedist.layout_inference import Plan, Transfer, buffer_size, plan_alternatives, plan_direct, plan_layouts, simulate

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


# -- named cases ---------------------------------------------------------------------

G4 = (("gpuid", 4),)
XY = (("x", 2), ("y", 2))


def test_shard_to_replicate_is_one_all_gather():
    src, dst = placements(G4, (8, 6), ["S0"]), placements(G4, (8, 6), ["R"])
    assert str(src) == "S[(4,2,6):(1@gpuid,6,1)]"
    plan = check_plan(src, dst, G4, (8, 6))
    assert plan.kinds == ("all_gather",) and plan.steps[0].axes == ("gpuid",)
    assert plan.steps[0].groups == (((0,), (1,), (2,), (3,)),)
    assert "all-gather over gpuid (1 group of 4)" in str(plan)
    assert "digits: 4:1@gpuid -> 4:12, replica R[4:1@gpuid] added" in str(plan)
    assert set(plan.bytes_received.values()) == {3 * 12 * 4}


def test_partial_to_shard_is_one_reduce_scatter():
    src, dst = placements(G4, (8, 6), ["P"]), placements(G4, (8, 6), ["S0"])
    plan = check_plan(src, dst, G4, (8, 6), partial="sum")
    assert plan.kinds == ("reduce_scatter",) and plan.steps[0].reduce == "sum"
    assert "reduce-scatter(sum) over gpuid" in str(plan)
    assert set(plan.bytes_sent.values()) == {3 * 12 * 4}  # (g-1)/g of the local partial


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_partial_to_replicate_is_an_all_reduce(op):
    src, dst = placements(G4, (8, 6), ["P"]), placements(G4, (8, 6), ["R"])
    plan = check_plan(src, dst, G4, (8, 6), partial=op)
    assert plan.kinds == ("reduce_scatter", "all_gather")
    assert all(s.fused == "all_reduce" for s in plan.steps)
    assert "all-reduce, part 1/2" in str(plan)
    assert set(plan.bytes_sent.values()) == {2 * 3 * 12 * 4}  # 2 (g-1)/g n: a ring all-reduce


def test_partial_onto_one_device_is_a_reduce():
    src = placements(G4, (8, 6), ["P"])
    dst = Layout.parse("S[(8,6):(6,1)] + 2@gpuid")
    plan = check_plan(src, dst, G4, (8, 6), partial="sum")
    assert plan.kinds == ("reduce",)
    assert plan.bytes_received[(2,)] == 3 * 48 * 4 and plan.bytes_received[(0,)] == 0


def test_partial_on_two_axes_reduces_in_one_step_then_gathers():
    mesh = (("x", 2), ("y", 4))
    src, dst = placements(mesh, (8, 6), ["P", "P"]), placements(mesh, (8, 6), ["R", "S0"])
    plan = check_plan(src, dst, mesh, (8, 6), partial="sum")
    assert plan.kinds == ("reduce_scatter", "all_gather")
    assert plan.steps[0].axes == ("x", "y") and plan.steps[1].axes == ("x",)
    # one reduce-scatter over 8 devices, then gather halves along x: n total per device
    assert set(plan.bytes_sent.values()) == {(48 * 7 // 8 + 6) * 4}


def test_partial_with_replicated_axis_reduces_within_rows():
    src, dst = placements(XY, (4, 6), ["P", "R"]), placements(XY, (4, 6), ["S0", "R"])
    plan = check_plan(src, dst, XY, (4, 6), partial="sum")
    assert plan.kinds == ("reduce_scatter",) and plan.steps[0].axes == ("x",)


def test_transposed_shards_on_2x2_move_less_than_gather_then_slice():
    src, dst = placements(XY, (4, 4), ["S0", "S1"]), placements(XY, (4, 4), ["S1", "S0"])
    plan = check_plan(src, dst, XY, (4, 4))
    assert plan.kinds == ("permute",)
    gather = plan_layouts(src, placements(XY, (4, 4), ["R", "R"]), XY, (4, 4))
    assert sum(plan.bytes_received.values()) < sum(gather.bytes_received.values())
    assert max(plan.bytes_received.values()) < max(gather.bytes_received.values())
    assert plan.bytes_received[(0, 0)] == 0 and plan.bytes_received[(0, 1)] == 16


def test_shard_to_other_dim_is_an_all_to_all():
    plan = check_plan(placements(G4, (8, 4), ["S0"]), placements(G4, (8, 4), ["S1"]), G4, (8, 4))
    assert plan.kinds == ("all_to_all",)
    assert set(plan.bytes_sent.values()) == {3 * 2 * 4}


def test_replicate_to_shard_is_local():
    plan = check_plan(placements(G4, (8, 8), ["R"]), placements(G4, (8, 8), ["S1"]), G4, (8, 8))
    assert plan.kinds == ("local",) and set(plan.bytes_received.values()) == {0}
    assert "local copy" in str(plan)


def test_same_layout_is_no_step():
    L = placements(G4, (8, 6), ["S0"])
    plan = check_plan(L, Layout.parse(str(L)), G4, (8, 6))
    assert plan.steps == () and "nothing to do" in str(plan)


def test_reversed_device_order_is_a_permutation():
    src = Layout.parse("S[(4,6):(1@gpuid,1)]")
    dst = Layout.parse("S[(4,6):(-1@gpuid,1)] + 3@gpuid")
    plan = check_plan(src, dst, G4, (4, 6))
    assert plan.kinds == ("permute",) and "send/recv permutation" in str(plan)


def test_moving_to_another_subset_of_the_mesh_is_a_permutation():
    src = Layout.parse("S[(2,6):(1@gpuid,1)]")  # devices 0, 1
    dst = Layout.parse("S[(2,6):(1@gpuid,1)] + 2@gpuid")  # devices 2, 3
    plan = check_plan(src, dst, G4, (2, 6))
    assert plan.kinds == ("permute",)
    assert plan.bytes_sent == {(0,): 24, (1,): 24, (2,): 0, (3,): 0}


def test_one_device_to_all_is_a_broadcast():
    src = Layout.parse("S[(8,6):(6,1)] + 1@gpuid")
    plan = check_plan(src, placements(G4, (8, 6), ["R"]), G4, (8, 6))
    assert plan.kinds == ("broadcast",)


def test_no_common_refinement_enumerates_one_block():
    # block-cyclic with blocks of 3 vs 2: no digit refinement exists; the 12 values form one block
    src = Layout.parse("S[(2,2,3):(3,1@gpuid,1)]")
    dst = Layout.parse("S[(3,2,2):(2,1@gpuid,1)]")
    plan = check_plan(src, dst, (("gpuid", 2),), (12,))
    assert plan.method == "blocks" and "digits: block S[(2,2,3):(3,1@gpuid,1)] -> S[(3,2,2):(2,1@gpuid,1)]" in str(plan)
    # rows on top of it are ordinary digits: still 12 transfers, each a column of rows
    rows = check_plan(Layout.parse("S[(64,2,2,3):(6,3,1@gpuid,1)]"), Layout.parse("S[(64,3,2,2):(6,2,1@gpuid,1)]"),
                      (("gpuid", 2),), (64, 12))
    assert rows.method == "blocks" and len(rows.steps[0].transfers) == 12


def test_large_layouts_without_refinement_need_no_element_enumeration():
    rows = 1 << 20  # 12M elements: past the element fallback's limit
    src = Layout.parse(f"S[({rows},2,2,3):(6,3,1@gpuid,1)]")
    dst = Layout.parse(f"S[({rows},3,2,2):(6,2,1@gpuid,1)]")
    plan = plan_layouts(src, dst, (("gpuid", 2),), (rows, 12))
    assert plan.method == "blocks" and plan.bytes_received == {(0,): 12 * rows, (1,): 12 * rows}


def test_partial_without_common_refinement_falls_back_to_elements():
    dst = Layout.parse("S[(3,2,2):(2,1@gpuid,1)]")
    partial = Layout.parse("S[(2,2,2,3):(1@gpuid,3,1@gpuid,1)]")  # not valid: gpuid twice
    with pytest.raises(LayoutError):
        plan_layouts(partial, dst, (("gpuid", 2),), (12,), partial="sum")
    src_p = Layout.parse("S[(2,2,2,3):(1@gpuid,3,2@gpuid,1)]")
    plan = check_plan(src_p, dst, (("gpuid", 4),), (12,), partial="sum")
    assert plan.method == "elements" and "fallback" in str(plan)


def test_replicas_in_one_device_memory():
    src = placements(G4, (8,), ["S0"])
    dst = Layout.parse("S[8:1] + R[(4,2):(1@gpuid,8)]")  # every device holds two copies
    plan = check_plan(src, dst, G4, (8,))
    assert plan.kinds[-1] == "local"


def test_plans_are_cached_by_map():
    src, dst = placements(G4, (8, 6), ["S0"]), placements(G4, (8, 6), ["R"])
    a = plan_layouts(src, dst, G4, (8, 6))
    b = plan_layouts(Layout.parse(str(src)), Layout.parse(str(dst)), [("gpuid", 4)], [8, 6])
    assert a is b
    assert plan_layouts(src, dst, G4, (8, 6), itemsize=2) is not a

    class MeshLike:  # what a DeviceMesh offers the planner
        axis_names, shape = ("gpuid",), (4,)

    assert plan_layouts(src, dst, MeshLike(), (8, 6)) is a and plan_layouts(src, dst, {"gpuid": 4}, (8, 6)) is a


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(LayoutError, match="does not have"):
        plan_layouts(Layout.parse("S[4:1@tp]"), Layout.parse("S[4:1]"), G4, (4,))
    with pytest.raises(LayoutError, match="reaches"):
        plan_layouts(Layout.parse("S[4:1@gpuid] + 1@gpuid"), Layout.parse("S[4:1]"), G4, (4,))
    with pytest.raises(LayoutError, match="one"):
        plan_layouts(Layout.parse("S[(2,2):(1@gpuid,1@gpuid)]"), Layout.parse("S[4:1]"), G4, (4,))
    with pytest.raises(LayoutError, match="elements"):
        plan_layouts(Layout.parse("S[4:1]"), Layout.parse("S[8:1]"), G4, (4,))
    with pytest.raises(LayoutError, match="partial"):
        plan_layouts(Layout.parse("S[4:1]"), Layout.parse("S[4:1]"), G4, (4,), partial="prod")


# -- random layouts on every small mesh ---------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(str(n) for _, n in m))
@settings(max_examples=150)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_layouts(mesh, seed):
    rng = random.Random(seed)
    shape = random_shape(rng, mesh)
    src = random_layout(rng, mesh, shape, memory_replica=rng.random() < 0.1)
    dst = random_layout(rng, mesh, shape, memory_replica=rng.random() < 0.1)
    plan = check_plan(src, dst, mesh, shape)
    assert len(plan.steps) <= 2


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(str(n) for _, n in m))
@settings(max_examples=100)
@given(seed=st.integers(0, 2**32 - 1), op=st.sampled_from(["sum", "max", "avg", "min"]))
def test_random_partial_sums(mesh, seed, op):
    rng = random.Random(seed)
    shape = random_shape(rng, mesh)
    src = random_layout(rng, mesh, shape, partial=True, memory_replica=rng.random() < 0.1)
    dst = random_layout(rng, mesh, shape, memory_replica=rng.random() < 0.1)
    check_plan(src, dst, mesh, shape, partial=op)


PLACEMENTS_1D = ["S0", "S1", "R"]


@pytest.mark.parametrize("mesh", [G4, (("gpuid", 2),), XY, (("x", 2), ("y", 4))],
                         ids=lambda m: "x".join(str(n) for _, n in m))
def test_every_placement_pair(mesh):
    """Exhaustive over placements (Partial sources included) for one even shape."""
    shape = (8, 8)
    options = list(itertools.product(PLACEMENTS_1D + ["P"], repeat=len(mesh)))
    for src_spec in options:
        for dst_spec in options:
            if "P" in dst_spec:
                continue
            partial = "sum" if "P" in src_spec else None
            plan = check_plan(placements(mesh, shape, src_spec), placements(mesh, shape, dst_spec),
                              mesh, shape, partial=partial)
            assert plan.method == "digits"
            if partial is None:
                assert len(plan.steps) <= 1
            elif all(s in ("P", "R") for s in src_spec) and all(s == "R" for s in dst_spec):
                assert plan.kinds == ("reduce_scatter", "all_gather")


def test_plan_prints_its_layouts_and_steps():
    plan = plan_layouts(placements(G4, (8, 4), ["S0"]), placements(G4, (8, 4), ["S1"]), G4, (8, 4))
    text = str(plan)
    assert text.startswith("plan S[(4,2,4):(1@gpuid,4,1)] -> ")
    assert "all-to-all over gpuid" in text and "per device at most" in text
    assert "digits: 4:1@gpuid -> 4:2, 4:1 -> 4:1@gpuid" in text  # dim 0 into memory, dim 1 onto devices
    assert isinstance(plan, Plan) and len(text.splitlines()) == 4
    assert repr(plan) == "Plan(S[(4,2,4):(1@gpuid,4,1)] -> S[(8,4,1):(1,1@gpuid,1)], shape (8, 4): all_to_all)"


def test_replication_on_part_of_an_axis_gathers_in_pairs():
    src = Layout.parse("S[(2,4,6):(1@gpuid,6,1)] + R[2:2@gpuid]")  # halves on {0,1}, copied to {2,3}
    plan = check_plan(src, placements(G4, (8, 6), ["R"]), G4, (8, 6))
    assert plan.kinds == ("all_gather",)
    assert plan.steps[0].groups == (((0,), (1,)), ((2,), (3,)))


@pytest.mark.parametrize("g", [2, 3, 4, 8])
def test_one_dim_placements_never_move_more_than_dtensor_collectives(g):
    """Per device bytes received <= what DTensor's collective for the transition receives.

    The reference is the textbook per-rank cost of the collective DTensor issues on a
    1-D mesh (all-gather, all-to-all, reduce-scatter, all-reduce); the CommDebugMode
    comparison runs with the executor.
    """
    mesh, shape = (("gpuid", g),), (g, g * 2)
    n = 4 * math.prod(shape)  # bytes of the whole tensor
    dtensor = {
        ("S0", "R"): (g - 1) * n // g,
        ("S0", "S1"): (g - 1) * n // g // g,
        ("S1", "S0"): (g - 1) * n // g // g,
        ("R", "S0"): 0,
        ("P", "S0"): (g - 1) * n // g,
        ("P", "R"): 2 * (g - 1) * n // g,
    }
    for (a, b), cost in dtensor.items():
        plan = check_plan(placements(mesh, shape, [a]), placements(mesh, shape, [b]), mesh, shape,
                          partial="sum" if a == "P" else None)
        assert max(plan.bytes_received.values()) <= cost, (a, b, str(plan))


def test_all_gather_messages_pack_one_buffer_per_sender():
    plan = plan_layouts(placements(XY, (4, 6), ["S0", "S1"]), placements(XY, (4, 6), ["R", "R"]), XY, (4, 6))
    (step,) = plan.steps
    assert step.kind == "all_gather" and step.axes == ("x", "y")
    for a in devices(XY):
        sent = {tuple(t.source_box() for t in step.messages[(a, b)]) for b in devices(XY) if b != a}
        assert len(sent) == 1
        assert sum(t.count for t in step.receives(a)) == 18 and sum(t.count for t in step.local(a)) == 6


def test_local_buffers_round_trip():
    from axedist.layout_inference import global_values, local_buffers
    L = Layout.parse("S[(2,3):(1@gpuid,1)] + R[2:2@gpuid]")
    buffers = local_buffers(L, G4, list(range(6)))
    assert buffers == {(0,): [0, 1, 2], (1,): [3, 4, 5], (2,): [0, 1, 2], (3,): [3, 4, 5]}
    assert global_values(L, G4, buffers) == [[x, x] for x in range(6)]


def test_module_examples():
    import doctest

    import axedist.layout_inference as module
    assert doctest.testmod(module, extraglobs={"Layout": Layout}).failed == 0


def test_mesh_axis_groups_flag_tells_the_executor_which_groups_exist():
    mesh = (("x", 2), ("y", 4))
    plan = plan_layouts(placements(mesh, (8, 8), ["R", "S0"]), placements(mesh, (8, 8), ["R", "R"]), mesh, (8, 8))
    assert plan.kinds == ("all_gather",) and plan.steps[0].axes == ("y",) and plan.steps[0].mesh_axis_groups
    pairs = plan_layouts(Layout.parse("S[(2,4,6):(1@gpuid,6,1)] + R[2:2@gpuid]"), placements(G4, (8, 6), ["R"]),
                         G4, (8, 6))
    assert pairs.steps[0].groups == (((0,), (1,)), ((2,), (3,))) and not pairs.steps[0].mesh_axis_groups


def test_replicated_partial_is_sliced_before_reducing():
    mesh = (("x", 2), ("y", 4))
    plan = check_plan(placements(mesh, (8, 8), ["R", "P"]), placements(mesh, (8, 8), ["S0", "S0"]), mesh, (8, 8),
                      partial="sum")
    assert plan.kinds == ("reduce_scatter",) and plan.steps[0].axes == ("y",)
    assert set(plan.bytes_sent.values()) == {3 * 8 * 4}  # 3 peers x 8 elements: half the rows, not all


# -- ordering per-axis work by bytes ------------------------------------------------------


def test_partial_over_two_axes_reduces_the_scattering_axis_first():
    """No local digit of 5 or 3 splits by 2 for y: reduce-scatter over x, then all-reduce the half over y."""
    src, dst = placements(XY, (5, 6), ["P", "P"]), placements(XY, (5, 6), ["S1", "R"])
    plan = check_plan(src, dst, XY, (5, 6), partial="sum")
    assert plan.kinds == ("reduce_scatter", "all_reduce")
    assert [s.axes for s in plan.steps] == [("x",), ("y",)]
    # 15 of 30 values stay after the x step: 60 B, then a ring all-reduce of 15 over 2: 60 B
    assert plan.cost[0] == 120 and set(plan.bytes_sent.values()) == {120}
    replicated = check_plan(src, placements(XY, (5, 6), ["R", "R"]), XY, (5, 6), partial="sum")
    assert replicated.kinds == ("reduce_scatter", "all_reduce", "all_gather") and replicated.cost[0] == 180


@pytest.mark.parametrize("mesh", [XY, (("x", 2), ("y", 4))], ids=["2x2", "2x4"])
@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1))
def test_alternatives_gather_one_axis_per_step_and_stay_correct(mesh, seed):
    rng = random.Random(seed)
    shape = random_shape(rng, mesh)
    src, dst = random_layout(rng, mesh, shape), random_layout(rng, mesh, shape)
    plans = plan_alternatives(src, dst, mesh, shape)
    assert plans[0] is plan_layouts(src, dst, mesh, shape)
    for plan in plans[1:]:
        check_plan(src, dst, mesh, shape, one_step_minimum=False, plan=plan)
        assert 1 <= len(plan.steps) <= len({a for a, _ in mesh})  # at most one step per mesh axis
        # moving in stages never receives less than one step does (it never beats the minimum)
        assert sum(plan.bytes_received.values()) >= sum(plans[0].bytes_received.values())


def test_alternatives_for_a_two_axis_gather():
    src, dst = placements(XY, (4, 6), ["S0", "S1"]), placements(XY, (4, 6), ["R", "R"])
    one, x_first, y_first = plan_alternatives(src, dst, XY, (4, 6))
    assert one.kinds == ("all_gather",) and one.steps[0].axes == ("x", "y")
    assert [s.axes for s in x_first.steps] == [("x",), ("y",)] and [s.axes for s in y_first.steps] == [("y",), ("x",)]
    assert one.cost[:2] == x_first.cost[:2] == y_first.cost[:2]  # even shapes: equal bytes, one step fewer
    assert one.cost < x_first.cost


def test_with_transfers_leaves_slots_out_and_renames_the_step():
    """What the executor does with padding: rows 7 of an (8, 6) Shard(0) -> Replicate are padding."""
    src, dst = placements(G4, (8, 6), ["S0"]), placements(G4, (8, 6), ["R"])
    plan = plan_layouts(src, dst, G4, (8, 6))
    kept = []
    for t in plan.steps[0].transfers:
        if t.source == (3,) and not t.is_local:  # device 3 holds rows 6 and 7: send row 6 only
            kept.append(Transfer(t.source, t.target, (6,), t.source_offset, (1,), t.target_offset, (1,)))
        else:
            kept.append(t)
    pruned = plan.with_transfers([kept], note="padding left out: 18 slot(s) not sent")
    assert pruned.kinds == ("all_to_all_v",)  # members send different sizes now: no longer an all-gather
    assert pruned.bytes_sent[(3,)] == 3 * 6 * 4 and pruned.bytes_sent[(0,)] == 3 * 12 * 4
    assert "padding left out: 18 slot(s) not sent" in str(pruned)
    values = list(range(48))
    out = simulate(pruned, scatter(src, G4, values))
    for d in devices(G4):  # device 3 keeps its own row 7; the others never receive it
        assert out[d][:42] == values[:42] and out[d][42:] == (values[42:] if d == (3,) else [None] * 6)
    with pytest.raises(LayoutError, match="transfer lists"):
        plan.with_transfers([], note="")


def test_then_runs_one_plan_after_another():
    """An all-reduce in place over y, then an all-gather over x: one plan, simulated end to end."""
    src = placements(XY, (4, 6), ["S0", "P"])  # rows split over x, partial values over y
    reduced = Layout.parse("S[(2,2,6):(1@x,6,1)] + R[2:1@y]")
    dst = placements(XY, (4, 6), ["R", "R"])
    first = plan_layouts(src, reduced, XY, (4, 6), partial="sum")
    both = first.then(plan_layouts(reduced, dst, XY, (4, 6)))
    assert both.kinds == first.kinds + ("all_gather",) and both.partial == "sum"
    check_plan(src, dst, XY, (4, 6), partial="sum", plan=both)
    assert both.sent_per_device == {d: first.sent_per_device[d] + 12 * 4 for d in devices(XY)}
    with pytest.raises(LayoutError, match="does not start where"):
        first.then(plan_layouts(placements(XY, (8, 8), ["S0", "S1"]), placements(XY, (8, 8), ["R", "R"]), XY, (8, 8)))


# -- direct plans between two paddings of one tensor (uneven shapes) -------------------


def _padding(rng, true_shape):
    """A padded shape >= ``true_shape`` and, per dim, the padded index of each true row (any positions)."""
    padded = tuple(n + rng.choice([0, 0, 1, 2, 3]) for n in true_shape)
    rows = tuple(tuple(sorted(rng.sample(range(p), n))) for p, n in zip(padded, true_shape))
    return padded, rows


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(str(n) for _, n in m))
@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), op=st.sampled_from([None, None, "sum", "max", "avg", "min"]))
def test_direct_plan_moves_only_true_elements_into_place(mesh, seed, op):
    """Random layouts of two different paddings of one tensor: every true element lands in every
    target slot of it (reduced over its summands), nothing else is sent, and without a pending
    reduction each device receives exactly the true elements it needs and does not hold."""
    rng = random.Random(seed)
    true_shape = tuple(rng.randint(1, 5) for _ in range(rng.choice([1, 2, 2, 3])))
    src_shape, src_rows = _padding(rng, true_shape)
    dst_shape, dst_rows = _padding(rng, true_shape)
    src = random_layout(rng, mesh, src_shape, partial=op is not None)
    dst = random_layout(rng, mesh, dst_shape)
    padded_size = math.prod(src_shape)
    summands = src.size // padded_size
    lead = ((summands,), (tuple(range(summands)),)) if op else ((), ())
    plan = plan_direct(src, lead[0] + src_shape, lead[1] + src_rows, dst, dst_shape, dst_rows, mesh, partial=op)
    index = lambda shape, rows, t: sum(rows[d][t[d]] * math.prod(shape[d + 1:]) for d in range(len(shape)))
    trues = list(itertools.product(*(range(n) for n in true_shape)))
    values = [None] * (summands * padded_size)  # padding stays None: sending it would poison a sum
    for k, t in enumerate(trues):
        for p in range(summands):
            values[p * padded_size + index(src_shape, src_rows, t)] = 1 + k * 16 + p
    out = simulate(plan, scatter(src, mesh, values))
    src_slots, dst_slots = brute_slots(src, mesh), brute_slots(dst, mesh)
    missing = dict.fromkeys(devices(mesh), 0)
    for k, t in enumerate(trues):
        want = REDUCE[op]([1 + k * 16 + p for p in range(summands)]) if op else 1 + k * 16
        x = index(dst_shape, dst_rows, t)
        for d, m in dst_slots[x]:
            assert out[d][m] == pytest.approx(want), (str(plan), t, d, m)
        held = {dev for p in range(summands) for dev, _ in src_slots[p * padded_size + index(src_shape, src_rows, t)]}
        for d in {dev for dev, _ in dst_slots[x]} - held:
            missing[d] += 1
    assert sum(plan.bytes_sent.values()) == sum(plan.bytes_received.values())
    if op is None:
        assert plan.bytes_received == {d: 4 * missing[d] for d in devices(mesh)}, str(plan)
    assert plan.method == "direct" and len(plan.steps) == 1
    check_kind(plan.steps[0])


def test_direct_plan_of_an_uneven_digit_swap():
    """(3, 6) on 2x2, torch's [Shard(1), Shard(1)] -> [Shard(1), Shard(0)]: each device sends its
    y-peer the 2 values it lacks (8 B), where gathering the inner column chunks sends 24 B."""
    src = placements(XY, (3, 8), ["S1", "S1"])  # columns padded 6 -> 8: 2 + 1 per x chunk
    dst = placements(XY, (4, 6), ["S1", "S0"])  # rows padded 3 -> 4: 2 + 1
    plan = plan_direct(src, (3, 8), [range(3), (0, 1, 2, 4, 5, 6)], dst, (4, 6), [range(3), range(6)], XY)
    assert plan.steps[0].axes == ("y",) and plan.bytes_sent == dict.fromkeys(devices(XY), 8)
    assert "padding never sent" in str(plan) and plan.shape == (3, 6)
    with pytest.raises(LayoutError, match="true rows"):
        plan_direct(src, (3, 8), [range(3), range(5)], dst, (4, 6), [range(3), range(6)], XY)
    with pytest.raises(LayoutError, match="distinct indices below 8"):
        plan_direct(src, (3, 8), [range(3), (0, 1, 2, 4, 5, 9)], dst, (4, 6), [range(3), range(6)], XY)


@pytest.mark.parametrize("mesh", [XY, (("x", 2), ("y", 4))], ids=["2x2", "2x4"])
@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), op=st.sampled_from(["sum", "max", "avg", "min"]))
def test_alternatives_of_partial_sums_keep_the_reduction_and_stay_correct(mesh, seed, op):
    rng = random.Random(seed)
    shape = random_shape(rng, mesh)
    src, dst = random_layout(rng, mesh, shape, partial=True), random_layout(rng, mesh, shape)
    plans = plan_alternatives(src, dst, mesh, shape, partial=op)
    assert plans[0] is plan_layouts(src, dst, mesh, shape, partial=op)
    for plan in plans[1:]:
        check_plan(src, dst, mesh, shape, partial=op, plan=plan)
        assert plan.steps[0].reduce == op and plan.steps[0].kind == plans[0].steps[0].kind
