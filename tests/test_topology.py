"""Meshes over several hosts: topology, per-axis links, backends per group, plans that spare the network.

A simulated topology (``host_size=2`` / ``AXEDIST_HOST_SIZE=2``: 2 "hosts" of 2 ranks on 4 gloo
processes) is what a job under ``torchrun --nnodes 2 --nproc-per-node 2`` finds
(tests/test_topology_torchrun.py runs that for real). Checks: the mesh says which axes leave a
host; multi-axis plans put fewer bytes on the inter-host axis than the one-host plans (never
more bytes a device); printed plans name each step's link and backend; the p2p kernels are
refused for groups across hosts; values equal torch DTensor's, bytes never above its.
"""

import os
import random
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import axedist as ax
from axedist.collectives import plan_gemm_reduce_scatter
from axedist.collectives.backend import one_host, p2p_possible, select_backend
from axedist.mesh import DeviceMesh, MeshError, TopologyWarning, group_hosts, init_mesh, job_topology
from axedist.planning import plan_alternatives, plan_layouts, plan_redistribute
from axedist.planning.cost import pick, sent_per_axis, step_time_us, steps_time_us
from axedist.runtime import execution_bytes, explain_execution, record
from axedist.spec import spec_from_placements
from axedist.testing import run_on_ranks, torch_comm_bytes
from axedist.topology import INTER_NODE, INTRA_NODE, AxisLink, Link, Network, Topology
from tests.planning_cases import check_plan, placements, random_layout, random_shape

DP_TP = (("dp", 2), ("tp", 2))
NETWORK = Network((AxisLink("dp", 2, INTER_NODE, True), AxisLink("tp", 2, INTRA_NODE, False)), "cpu")
PLACEMENT = {"R": Replicate(), "P": Partial(), "S0": Shard(0), "S1": Shard(1)}

# (global shape, source, target) on (dp, tp) = (2, 2), dp across the 2 hosts
TRANSITIONS = [
    ((8, 6), "P P", "R R"), ((8, 6), "P P", "S0 S0"), ((8, 6), "P P", "S0 R"), ((8, 6), "P P", "R S0"),
    ((8, 6), "P P", "S1 S0"), ((8, 6), "S0 S0", "R R"), ((8, 6), "S0 S1", "R R"), ((8, 6), "S1 S0", "R R"),
    ((8, 6), "S0 S1", "S1 S0"), ((8, 6), "R P", "S0 S0"),
    ((5, 6), "P P", "R R"), ((5, 6), "S0 S0", "R R"), ((7, 4), "S0 S1", "R R"), ((5, 6), "P P", "S1 R"),
]
# of those, the ones where the one-host plan sends more across hosts than the two-host plan must
FEWER_ACROSS = {0, 1, 2, 3, 4, 5, 6, 7, 10}


# -- records and the cost model (one process) ------------------------------------------------


def test_topology_link_and_network_records():
    assert Topology.from_keys(["a", "a", "b", "b"]).hosts == (0, 0, 1, 1)
    assert Topology.from_keys([("h", "1"), ("h", "0"), ("h", "1")]).hosts == (0, 1, 0)
    assert Topology.of_host_size(6, 3) == Topology((0, 0, 0, 1, 1, 1), simulated=True)
    assert str(Topology.of_host_size(4, 2)) == "2 hosts of 2 rank(s) (simulated)"
    assert Link(25.0, 20.0).time_us(1_000_000) == pytest.approx(60.0)
    assert Link(150.0, 5.0).time_us(300_000, messages=3) == pytest.approx(17.0)
    assert str(NETWORK) == "dp=2 (inter-node, 25 GB/s, 20 us) x tp=2 (intra-node, 150 GB/s, 5 us)"
    assert NETWORK.link_between((0, 0), (0, 1)).axis == "tp"
    assert NETWORK.link_between((0, 0), (1, 1)).axis == "dp"  # differing on both: the slower link
    assert NETWORK.link_between((1, 0), (1, 0)) is None
    assert NETWORK.inter_node_axes == ("dp",) and NETWORK.crosses_hosts(("dp", "tp"))
    assert NETWORK.backend(("tp",)) == "gloo"
    gpu = Network(NETWORK.axes, "cuda")
    assert gpu.backend(("dp", "tp")) == "nccl" and gpu.backend(("tp",)) == "nccl or p2p kernels"


def test_time_model_counts_messages_by_their_link():
    """(8, 6) fp32 all-gathered over (dp, tp) in one step: each device sends its 48 B to 3 peers,
    2 of them across hosts; over dp first, then tp, 48 B cross and 96 B stay inside."""
    src, dst = placements(DP_TP, (8, 6), ["S0", "S0"]), placements(DP_TP, (8, 6), ["R", "R"])
    flat, *orders = plan_alternatives(src, dst, DP_TP, (8, 6))
    assert flat.kinds == ("all_gather",)
    assert sent_per_axis(flat.steps, NETWORK) == {"dp": 96, "tp": 48}
    assert step_time_us(flat.steps[0], NETWORK) == pytest.approx(2 * INTER_NODE.time_us(48) + INTRA_NODE.time_us(48))
    dp_first = next(p for p in orders if p.steps[0].axes == ("dp",))
    assert sent_per_axis(dp_first.steps, NETWORK) == {"dp": 48, "tp": 96}
    assert steps_time_us(dp_first.steps, NETWORK) == pytest.approx(INTER_NODE.time_us(48) + INTRA_NODE.time_us(96))
    assert pick([flat, *orders], NETWORK).steps == dp_first.steps
    assert pick([flat, *orders], None) is flat  # without a network: the first of the fewest bytes


def test_pick_never_buys_time_with_bytes():
    """Of two plans, the one sending fewer bytes a device wins however slow its link is."""
    slow = Network((AxisLink("dp", 2, Link(0.001, 1000.0), True), AxisLink("tp", 2, INTRA_NODE, False)), "cpu")
    across = plan_layouts(placements(DP_TP, (8, 6), ["S0", "R"]), placements(DP_TP, (8, 6), ["R", "R"]), DP_TP, (8, 6))
    inside = plan_layouts(placements(DP_TP, (16, 6), ["R", "S0"]), placements(DP_TP, (16, 6), ["R", "R"]), DP_TP,
                          (16, 6))
    assert across.cost[0] == 96 < inside.cost[0] == 192
    assert steps_time_us(inside.steps, slow) < steps_time_us(across.steps, slow)
    assert pick([inside, across], slow) is across
    same = plan_layouts(placements(DP_TP, (8, 6), ["R", "S0"]), placements(DP_TP, (8, 6), ["R", "R"]), DP_TP, (8, 6))
    assert pick([across, same], slow) is same  # equal bytes: the faster


@pytest.mark.parametrize("mesh", [DP_TP, (("dp", 2), ("tp", 4)), (("x", 2), ("y", 4))])
def test_staged_reductions_are_correct_and_never_move_more(mesh):
    """Every candidate (staged reductions and their gather orders included) gives the reference's
    values (simulated on lists, against the definition); the pick never sends more a device."""
    rng = random.Random(str(mesh))
    staged = 0
    for _ in range(80):
        shape = random_shape(rng, mesh)
        partial = rng.choice(["sum", "max", "avg"])
        src = random_layout(rng, mesh, shape, partial=True)
        dst = random_layout(rng, mesh, shape)
        inter = (rng.choice(mesh)[0],)
        network = Network(tuple(AxisLink(a, n, INTER_NODE if a in inter else INTRA_NODE, a in inter)
                                for a, n in mesh), "cpu")
        candidates = plan_alternatives(src, dst, mesh, shape, 4, partial, inter)
        for plan in candidates:
            check_plan(src, dst, mesh, shape, partial, plan=plan)
        staged += len(candidates) > len(plan_alternatives(src, dst, mesh, shape, 4, partial))
        assert pick(candidates, network).cost[0] <= candidates[0].cost[0]
    assert staged >= 5  # the staged reduction was among the candidates often enough to count


# -- a simulated topology on 4 gloo ranks ---------------------------------------------------


def _mesh_and_hosts(rank, world):
    out = {}
    mesh = init_mesh((2, 2), ("dp", "tp"), host_size=2)
    out["describe"], out["repr"] = mesh.describe(), repr(mesh)
    out["inter"], out["hosts"], out["simulated"] = mesh.inter_node_axes, mesh.hosts, mesh.topology.simulated
    out["network"] = str(mesh.network)
    out["sub"] = (mesh["tp"].describe(), mesh["dp"].describe(), mesh["dp"].inter_node_axes)
    os.environ["AXEDIST_HOST_SIZE"] = "2"
    try:
        by_env = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    finally:
        del os.environ["AXEDIST_HOST_SIZE"]
    out["env_equal"] = by_env == mesh and by_env.group("dp") is mesh.group("dp")
    one = DeviceMesh("cpu", (2, 2), ("dp", "tp"))  # the pool's real topology: one host
    out["one"] = (one.describe(), one.network, one.inter_node_axes, repr(one), one == mesh)
    # tp across the hosts: allowed, warned about once (on the mesh's first rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        across = DeviceMesh("cpu", (2, 2), ("dp", "tp"), ranks=[[0, 2], [1, 3]], host_size=2)
        DeviceMesh("cpu", (2, 2), ("dp", "tp"), ranks=[[0, 2], [1, 3]], host_size=2)
        DeviceMesh("cpu", (2, 2), ("dp", "tp"), host_size=2, intra_node_axes=("dp",))
    out["across"] = (across.describe(), [str(w.message) for w in caught if w.category is TopologyWarning])
    out["links"] = str(DeviceMesh("cpu", (2, 2), ("dp", "tp"), host_size=2, links={"dp": Link(12.5, 30.0)}).network)
    out["one_host_links"] = str(DeviceMesh("cpu", (2, 2), ("dp", "tp"), links={"tp": Link(100.0, 2.0)}).network)
    errors = []
    for kwargs in ({"host_size": 3}, {"host_size": 0}, {"links": {"pp": Link(1.0, 1.0)}},
                   {"links": {"dp": (25.0, 20.0)}}, {"intra_node_axes": ("pp",)}):
        with pytest.raises(MeshError) as info:
            DeviceMesh("cpu", (2, 2), ("dp", "tp"), **kwargs)
        errors.append(str(info.value))
    out["errors"] = errors
    return out


def test_mesh_knows_which_axes_leave_a_host():
    results = run_on_ranks(_mesh_and_hosts, 4)
    for rank, out in enumerate(results):
        assert out["describe"] == "dp=2 (inter-node) x tp=2 (intra-node)"
        assert out["repr"] == ("DeviceMesh('cpu', [[0, 1], [2, 3]], axes=('dp', 'tp'), dp=2 (inter-node) x "
                               "tp=2 (intra-node), 2 hosts of 2 rank(s) (simulated))")
        assert out["inter"] == ("dp",) and out["hosts"] == (0, 0, 1, 1) and out["simulated"]
        assert out["network"] == "dp=2 (inter-node, 25 GB/s, 20 us) x tp=2 (intra-node, 150 GB/s, 5 us)"
        assert out["sub"] == ("tp=2 (one host)", "dp=2 (inter-node)", ("dp",))
        assert out["env_equal"]
        describe, network, inter, text, equal = out["one"]
        assert (describe, network, inter, equal) == ("dp=2 x tp=2 (one host)", None, (), False)
        assert text == "DeviceMesh('cpu', [[0, 1], [2, 3]], axes=('dp', 'tp'))"  # one host: as before
        describe, warned = out["across"]
        assert describe == "dp=2 (intra-node) x tp=2 (inter-node)"
        if rank == 0:
            assert len(warned) == 2 and "axis 'tp' spans hosts" in warned[0] and "axis 'dp'" in warned[1]
        else:
            assert warned == []
        assert out["links"] == "dp=2 (inter-node, 12.5 GB/s, 30 us) x tp=2 (intra-node, 150 GB/s, 5 us)"
        assert out["one_host_links"] == "dp=2 (intra-node, 150 GB/s, 5 us) x tp=2 (intra-node, 100 GB/s, 2 us)"
        errors = out["errors"]
        assert "host size 3 must be positive and divide the world of 4" in errors[0]
        assert "host size 0" in errors[1]
        assert "links names axis 'pp'" in errors[2]
        assert "must be a Link" in errors[3]
        assert "intra_node_axes names 'pp'" in errors[4]


def _backends(rank, world):
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"), host_size=2)
    x = torch.ones(8)
    out = {"one_host": (one_host(mesh.group("dp")), one_host(mesh.group("tp")), one_host(mesh.group()))}
    out["possible"] = p2p_possible(x, mesh.group("dp"))
    out["auto"] = select_backend("all_reduce", x, mesh.group("dp"))
    with pytest.raises(ValueError) as info:
        select_backend("all_reduce", x, mesh.group("dp"), "p2p")
    out["pinned"] = str(info.value)
    out["tp_possible"] = p2p_possible(x, mesh.group("tp"))
    out["physical"] = one_host(DeviceMesh("cpu", (2, 2), ("dp", "tp")).group("dp"))
    # groups no mesh made: the job's found hosts, or the declared host size
    out["found"] = job_topology()
    middle = dist.new_group([1, 2])
    if rank in (1, 2):
        out["outside"] = group_hosts(middle)
        os.environ["AXEDIST_HOST_SIZE"] = "2"
        try:
            out["outside_simulated"] = (group_hosts(middle), one_host(middle)[0])
        finally:
            del os.environ["AXEDIST_HOST_SIZE"]
    out["fused"] = plan_gemm_reduce_scatter(torch.ones(4, 2, dtype=torch.bfloat16),
                                                  torch.ones(2, 3, dtype=torch.bfloat16), mesh.group("dp")).reason
    src = spec_from_placements((8, 6), mesh, [Partial(), Partial()])
    route = plan_redistribute(src, spec_from_placements((8, 6), mesh, [Replicate(), Replicate()]))
    out["explain"] = explain_execution(route, mesh)
    return out


def test_p2p_kernels_refused_across_hosts():
    for rank, out in enumerate(run_on_ranks(_backends, 4)):
        dp, tp, both = out["one_host"]
        assert not dp[0] and "group spans 2 hosts" in dp[1] and tp == (True, "one host") and not both[0]
        assert out["possible"][0] is False and "spans 2 hosts" in out["possible"][1]
        assert out["auto"] == "torch"
        assert "backend 'p2p' cannot run: group spans 2 hosts" in out["pinned"]
        assert out["tp_possible"] == (False, "tensor is not on a CUDA device")  # past the host check
        assert out["physical"] == (True, "one host")
        assert out["found"] == Topology((0, 0, 0, 0))
        if rank in (1, 2):  # the members of a group made outside any mesh
            assert out["outside"] == (0, 0) and out["outside_simulated"] == ((0, 1), False)
        assert "fused kernel unavailable: group spans 2 hosts" in out["fused"]
        lines = [ln for ln in out["explain"].splitlines() if re.match(r"    \d+(-\d+)?\. ", ln)]
        assert [ln.rsplit("; ", 1)[-1] for ln in lines] == ["gloo (one host)", "gloo (crosses hosts)",
                                                             "gloo (one host)"], out["explain"]


def _multi_axis(rank, world, cases):
    """Per transition: values and bytes against torch DTensor, bytes per axis on two hosts vs one."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import distribute_tensor

    two = DeviceMesh("cpu", (2, 2), ("dp", "tp"), host_size=2)
    one = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    out = []
    for i, (shape, s, d) in enumerate(cases):
        src_pl, dst_pl = [PLACEMENT[p] for p in s.split()], [PLACEMENT[p] for p in d.split()]
        routes = [plan_redistribute(spec_from_placements(shape, m, src_pl), spec_from_placements(shape, m, dst_pl))
                  for m in (two, one)]
        per_axis = [sent_per_axis([st for plan in r.plans for st in plan.steps], two.network) for r in routes]
        torch_mesh = two.to_torch()
        full = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(i)).float()
        if "P" in s:  # integer parts: every order of summation is exact
            offset = sum((k + 1) * two.coordinates()[a] for k, (a, p) in enumerate(zip(("dp", "tp"), s.split()))
                         if p == "P")
            torch_src = TorchDTensor.from_local(full + offset, torch_mesh,
                                                [p if isinstance(p, Partial) else Replicate() for p in src_pl],
                                                run_check=False).redistribute(torch_mesh, src_pl)
        else:
            torch_src = distribute_tensor(full, torch_mesh, src_pl)
        want, torch_bytes = torch_comm_bytes(lambda: torch_src.redistribute(torch_mesh, dst_pl).full_tensor())
        ours = ax.DTensor.from_local(torch_src.to_local(), two, src_pl, shape=shape)
        with record() as ran:
            got = ours.redistribute(dst_pl).full_tensor()
        out.append(dict(equal=torch.equal(got, want), ours=execution_bytes(ran[0], two), torch=torch_bytes,
                        routes_match=ran[0] is routes[0], per_axis=per_axis, cost=[r.cost for r in routes],
                        text=str(routes[0]), one_text=str(routes[1]), time=routes[0].time_us))
    return out


def test_multi_axis_plans_spare_the_inter_host_axis():
    results = run_on_ranks(_multi_axis, 4, args=(TRANSITIONS,), timeout_s=300)
    for i, (shape, s, d) in enumerate(TRANSITIONS):
        name = f"{shape} [{s}] -> [{d}]"
        for out in (r[i] for r in results):
            assert out["equal"], name
            assert out["ours"] <= out["torch"], (name, out["ours"], out["torch"])
            assert out["routes_match"], name
            two, one = out["per_axis"]
            assert two["dp"] <= one["dp"], (name, two, one)
            if i in FEWER_ACROSS:
                assert two["dp"] < one["dp"], (name, two, one, out["text"])
            assert out["cost"][0][0] <= out["cost"][1][0], name  # never more bytes a device
            # printed: the network, and each step's link, backend and time; one host prints as before
            text = out["text"]
            assert "network: dp=2 (inter-node, 25 GB/s, 20 us) x tp=2 (intra-node, 150 GB/s, 5 us)" in text
            steps = [ln for ln in text.splitlines() if ln[:4].strip().rstrip(".").isdigit()]
            links = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("inter-node", "intra-node"))]
            assert len(links) == len(steps) > 0, text
            assert all(": gloo, " in ln and ln.endswith(" us") for ln in links), text
            assert f"modeled time {out['time']:.1f} us" in text
            assert "network:" not in out["one_text"] and "modeled time" not in out["one_text"]


def test_reduce_over_two_axes_in_three_stages():
    """The issue's example, printed: reduce-scatter on tp, all-reduce of the half across hosts,
    all-gather on tp."""
    text = run_on_ranks(_multi_axis, 4, args=([((8, 6), "P P", "R R")],))[0][0]["text"]
    assert "\n".join(ln for ln in text.splitlines() if not ln.startswith("     digits")) == """\
plan S[(2,2,8,6):(1@dp,1@tp,6,1)] -> S[(8,6):(6,1)] + R[(2,2):(1@dp,1@tp)], shape (8, 6), mesh (dp=2, tp=2), \
4-byte items, sum over the leading summand dim
  network: dp=2 (inter-node, 25 GB/s, 20 us) x tp=2 (intra-node, 150 GB/s, 5 us)
  1. reduce-scatter(sum) over tp (2 groups of 2): each member sends 96 B, receives 96 B
     intra-node (tp): gloo, 5.0 us
  2. reduce-scatter(sum) over dp (2 groups of 2): each member sends 48 B, receives 48 B  [all-reduce, part 1/2]
     inter-node (dp): gloo, 20.0 us
  3. all-gather over dp (2 groups of 2): each member sends 48 B, receives 48 B  [all-reduce, part 2/2]
     inter-node (dp): gloo, 20.0 us
  4. all-gather over tp (2 groups of 2): each member sends 96 B, receives 96 B
     intra-node (tp): gloo, 5.0 us
  per device at most: sent 288 B, received 288 B
  per device and axis at most: dp 96 B, tp 192 B; modeled time 50.0 us"""
