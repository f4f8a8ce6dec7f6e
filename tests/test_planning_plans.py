"""Plan records: printing, ``with_transfers``, ``then``; buffers in and out of the simulator; the
planning modules' docstring examples."""

import doctest
import importlib

import pytest

from axedist.layout import Layout, LayoutError
from axedist.planning import Transfer, global_values, local_buffers, plan_layouts, simulate
from tests.planning_cases import G4, XY, check_plan, devices, placements, scatter


def test_local_buffers_round_trip():
    L = Layout.parse("S[(2,3):(1@gpuid,1)] + R[2:2@gpuid]")
    buffers = local_buffers(L, G4, list(range(6)))
    assert buffers == {(0,): [0, 1, 2], (1,): [3, 4, 5], (2,): [0, 1, 2], (3,): [3, 4, 5]}
    assert global_values(L, G4, buffers) == [[x, x] for x in range(6)]


@pytest.mark.parametrize("name", ["plans", "derive", "alternatives", "direct"])
def test_module_examples(name):
    module = importlib.import_module(f"axedist.planning.{name}")
    extras = {"Layout": Layout, "plan_layouts": plan_layouts}
    result = doctest.testmod(module, extraglobs=extras)
    assert result.attempted > 0 and result.failed == 0


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


