"""``plan_alternatives``: plans that move one mesh axis per step, each correct by the simulator."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from axedist.planning import plan_alternatives, plan_layouts
from tests.planning_cases import XY, check_plan, placements, random_layout, random_shape


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

