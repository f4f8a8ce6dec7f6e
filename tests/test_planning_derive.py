"""``plan_layouts``: plans between layouts, run by the simulator, checked against brute force."""

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axedist.layout import Layout, LayoutError
from axedist.planning import Plan, plan_layouts
from tests.planning_cases import G4, MESHES, XY, check_plan, devices, placements, random_layout, random_shape




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


