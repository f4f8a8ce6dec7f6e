"""``plan_direct``: the true elements only, between two paddings of one tensor."""

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axedist.layout import LayoutError
from axedist.planning import plan_direct, simulate
from tests.planning_cases import MESHES, REDUCE, XY, brute_slots, check_kind, devices, placements, random_layout, scatter


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


