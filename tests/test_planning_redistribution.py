"""``plan_redistribute``: the whole route of a DTensor move, as data; what the executor runs is it.

Each rank plans the route from the specs alone (the same route on every rank), runs it with
``redistribute``, and checks that the executor ran exactly the route's steps, plan by plan, with
the bytes the route counts; ``str(route)`` lists every step. Also the fused step's printing and
``row_scatter_axis``.
"""

import dataclasses
import re

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import axedist as ax
from axedist.dtensor import distribute
from axedist.layout import LayoutError
from axedist.mesh import DeviceMesh
from axedist.planning import FusedStep, Redistribution, plan_redistribute, row_scatter_axis
from axedist.runtime import execution_bytes, explain_execution, record
from axedist.spec import element_table, spec_from_placements
from axedist.testing import run_on_ranks

P = {"R": Replicate(), "P": Partial(), "Pmax": Partial("max"), "S0": Shard(0), "S1": Shard(1)}

# (mesh shape, shape, source, target): uneven shapes, partial sums, both kinds of re-pad route
ROUTES = [
    ((4,), (7, 5), "S0", "R"),           # one plan, padding left out
    ((4,), (7, 5), "P", "S0"),           # a reduce-scatter of padded rows
    ((4,), (6, 5), "Pmax", "S1"),
    ((2, 2), (5, 6), "S0 S0", "S0 R"),   # two plans, a local re-pad between (inner gather)
    ((2, 2), (5, 6), "S0 S0", "R R"),
    ((2, 2), (3, 6), "S1 S1", "S1 S0"),  # the direct plan: true elements only
    ((2, 2), (5, 6), "P P", "S1 R"),     # two reduce steps
    ((2, 2), (9, 9), "S0 S0", "S1 S1"),
    ((2, 2), (5, 6), "S0 S1", "S0 S0"),  # nothing gathered: a re-pad, then a plan with steps
    ((2, 2), (5, 6), "S0 P", "S0 S0"),   # ... that reduces after the re-pad
]


def _spec(mesh, shape, text):
    return spec_from_placements(shape, mesh, [P[p] for p in text.split()])


def _executed(text: str) -> list[tuple[range, str]]:
    """Per executed program (``explain_execution``'s lines): the plan steps it covers and their kind."""
    out = []
    for first, last, kind in re.findall(r"^    (\d+)(?:-(\d+))?\. (\w+):", text, re.M):
        out.append((range(int(first), int(last or first) + 1), kind))
    return out


def _route_checks(rank, world, cases):
    out = []
    for mesh_shape, shape, s, d in cases:
        mesh = DeviceMesh("cpu", mesh_shape, ("gpuid",) if len(mesh_shape) == 1 else ("x", "y"))
        src, dst = _spec(mesh, shape, s), _spec(mesh, shape, d)
        route = plan_redistribute(src, dst, 4)
        torch.manual_seed(0)
        x = ax.DTensor(torch.randn(element_table(src).local_shapes[mesh.position()]), src)
        with record() as ran:
            x.redistribute([P[p] for p in d.split()])
        me = tuple(mesh.coordinates()[a] for a in mesh.axis_names)
        # what ran, plan by plan: every step of the route once, in order, as its kind
        covered = []
        for plan, text in zip(route.plans, explain_execution(route, mesh).split("\n  executed on ")[1:]):
            steps = _executed(text)
            covered.append([i for r, _ in steps for i in r] == list(range(1, len(plan.steps) + 1))
                           and all(plan.steps[r[0] - 1].kind == kind for r, kind in steps))
        padded_gather = "pieces padded" in explain_execution(route, mesh)
        out.append(dict(
            case=(mesh_shape, shape, s, d), text=str(route), same_object=len(ran) == 1 and ran[0] is route,
            steps=route.steps == tuple(step for plan in route.plans for step in plan.steps), covered=all(covered),
            bytes=execution_bytes(route, mesh) == sum(execution_bytes(p, mesh) for p in route.plans)
            and (padded_gather or execution_bytes(route, mesh) == route.sent_per_device.get(me, 0)),
            boxes=route.src_boxes == element_table(src).local_shapes
            and route.dst_boxes == element_table(dst).local_shapes,
            plans=len(route.plans), repad=route.repad is not None, kinds=route.kinds))
    return out


def test_the_route_is_what_runs():
    """Every rank plans the same route; the executor runs each of its steps once, in order; its
    bytes are the route's; the true local shapes it pads and unpads are the specs' own."""
    cases_2x2 = [c for c in ROUTES if c[0] == (2, 2)]
    cases_4 = [c for c in ROUTES if c[0] == (4,)]
    results = run_on_ranks(_route_checks, 4, args=(cases_4 + cases_2x2,), timeout_s=120)
    for i in range(len(ROUTES)):
        per_rank = [r[i] for r in results]
        first = per_rank[0]
        assert all(r["text"] == first["text"] for r in per_rank), first["case"]  # rank-independent
        for key in ("same_object", "steps", "covered", "bytes", "boxes"):
            assert all(r[key] for r in per_rank), (key, first["case"], first["text"])
    by_case = {r["case"]: r for r in results[0]}
    assert by_case[((2, 2), (5, 6), "S0 S0", "S0 R")]["repad"]  # both route shapes are covered
    assert by_case[((2, 2), (5, 6), "S0 S0", "S0 R")]["plans"] == 2
    assert by_case[((2, 2), (3, 6), "S1 S1", "S1 S0")]["kinds"] == ("permute",)
    assert by_case[((2, 2), (5, 6), "S0 P", "S0 S0")]["repad"]
    assert by_case[((2, 2), (5, 6), "S0 P", "S0 S0")]["kinds"] == ("all_to_all_v",)  # the second plan's step
    assert "re-pad" in by_case[((2, 2), (5, 6), "S0 S0", "S0 R")]["text"]


def _printing(rank, world):
    mesh = DeviceMesh("cpu", (2, 2), ("x", "y"))
    out = {}
    for s, d in (("S0 S0", "S0 R"), ("P P", "S1 R"), ("S0 R", "R R"), ("S0 P", "S0 S0")):
        route = plan_redistribute(_spec(mesh, (5, 6), s), _spec(mesh, (5, 6), d), 4)
        text = str(route)
        numbered = re.findall(r"^  (\d+)\. (.*)$", text, re.M)
        out[(s, d)] = dict(
            every_step=all(step.describe() in line for (_, line), step in zip(numbered, route.steps)),
            count=len(numbered) == len(route.steps),
            bytes=all(" B" in line for _, line in numbered),
            total=f"sent {max(route.bytes_sent.values())} B" in text, text=text, plans=len(route.plans))
    return out


def test_str_lists_every_step_with_bytes():
    results = run_on_ranks(_printing, 4, timeout_s=60)
    for case, r in results[0].items():
        assert r["every_step"] and r["count"] and r["bytes"] and r["total"], (case, r["text"])
    assert results[0][("S0 S0", "S0 R")]["plans"] == results[0][("S0 P", "S0 S0")]["plans"] == 2
    assert results[0][("S0 R", "R R")]["text"].startswith("plan S[")  # one plan: printed as the plan


def _huge_flat(rank, world):
    # an FSDP gradient: a flat buffer summed over dp, scattered over both axes; 2**40 elements,
    # so anything built per element (a tuple of rows, an index of landing slots) fails at once
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    n = 2 ** 40
    route = plan_redistribute(_spec(mesh, (n,), "P S0"), _spec(mesh, (n,), "S0 S0"), 4)
    return route.kinds, route.dst_boxes[0], explain_execution(route, mesh)


def test_planning_and_programs_of_a_flat_buffer_are_not_per_element():
    kinds, box, text = run_on_ranks(_huge_flat, 4, timeout_s=60)[0]
    assert kinds[0] == "reduce_scatter" and box == (2 ** 38,)
    assert "1. reduce_scatter" in text


def _move_costs(rank, world):
    from axedist.planning.cost import placement_move_elements

    mesh = DeviceMesh("cpu", (world,))
    out = []
    for s in ("R", "S0", "S1", "P"):
        for d in ("R", "S0", "S1"):
            route = plan_redistribute(_spec(mesh, (8, 12), s), _spec(mesh, (8, 12), d), 4)
            sent = max(route.bytes_sent.values(), default=0) / 4
            out.append((s, d, sent, placement_move_elements(P[s], P[d], 96, world)))
    return out


def test_the_rules_move_cost_is_what_the_planned_route_sends():
    """planning.cost.placement_move_elements (what a rule weighs before any plan exists) against
    the elements a device sends on the planned route, every pair of placements on 4 ranks."""
    for s, d, sent, estimate in run_on_ranks(_move_costs, 4, timeout_s=60)[0]:
        assert sent == estimate, (s, d, sent, estimate)


def _fused(rank, world):
    mesh = DeviceMesh("cpu", (4,))
    src, dst = _spec(mesh, (8, 4), "P"), _spec(mesh, (8, 4), "S0")
    route = plan_redistribute(src, dst, 2)
    fused = dataclasses.replace(route, fused=FusedStep("gpuid", True, "measured faster", gemm="GemmRS(p2p)"))
    unfused = dataclasses.replace(route, fused=FusedStep("gpuid", False, "operands on cpu (CUDA-only)"))
    return str(route), str(fused), str(unfused), fused.steps == route.steps, unfused.kinds


def test_fused_step_prints_as_the_fused_gemm_plan_does():
    plain, fused, unfused, same_steps, kinds = run_on_ranks(_fused, 4, timeout_s=60)[0]
    assert fused == "fused GEMM + reduce-scatter: GemmRS(p2p)"
    assert unfused == f"GEMM, then {plain}\n(fused GEMM + reduce-scatter not used: operands on cpu (CUDA-only))"
    assert same_steps and kinds == ("reduce_scatter",)


def _scatter_axes(rank, world):
    g4, xy = DeviceMesh("cpu", (4,)), DeviceMesh("cpu", (2, 2), ("x", "y"))
    cases = {
        "P -> S0": (g4, (8, 4), "P", "S0"), "P -> S1": (g4, (8, 4), "P", "S1"), "uneven": (g4, (7, 4), "P", "S0"),
        "max": (g4, (8, 4), "Pmax", "S0"), "R P -> R S0": (xy, (8, 4), "R P", "R S0"),
        "S1 P -> S1 S0": (xy, (8, 4), "S1 P", "S1 S0"), "S0 P -> S0 S0": (xy, (8, 4), "S0 P", "S0 S0"),
        "P P -> S0 S0": (xy, (8, 4), "P P", "S0 S0"), "R P -> S1 S0": (xy, (8, 4), "R P", "S1 S0"),
    }
    return {name: row_scatter_axis(_spec(m, shape, s), _spec(m, shape, d)) for name, (m, shape, s, d) in cases.items()}


def test_row_scatter_axis():
    """The mesh axis of a 2-d pending sum's rows reduce-scattered over one axis, else None."""
    got = run_on_ranks(_scatter_axes, 4, timeout_s=60)[0]
    assert got == {"P -> S0": "gpuid", "P -> S1": None, "uneven": None, "max": None, "R P -> R S0": "y",
                   "S1 P -> S1 S0": "y", "S0 P -> S0 S0": None, "P P -> S0 S0": None, "R P -> S1 S0": None}


def _entry_points(rank, world):
    mesh = DeviceMesh("cpu", (4,))
    x = distribute(torch.arange(35.0).reshape(7, 5), mesh, [Shard(0)])
    shown = ax.plan(x, [Replicate()])
    route = plan_redistribute(x._spec, _spec(mesh, (7, 5), "R"), x.element_size())
    try:
        plan_redistribute(x._spec, _spec(mesh, (5, 7), "R"))
        refused = False
    except LayoutError as e:
        refused = "keeps the mesh and shape" in str(e)
    return isinstance(shown, Redistribution) and shown is route, refused


def test_ax_plan_returns_the_route():
    assert run_on_ranks(_entry_points, 4, timeout_s=60) == [(True, True)] * 4


def test_plan_redistribute_needs_no_torch_at_import():
    import subprocess
    import sys

    code = "import sys, axedist.planning as p\nassert 'torch' not in sys.modules\nprint(p.Plan.__name__)\n"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "Plan\n"


@pytest.mark.parametrize("name", ["plan_layouts", "plan_redistribute", "Redistribution", "simulate"])
def test_lazy_names_resolve(name):
    import axedist.planning

    assert getattr(axedist.planning, name).__name__ == name
