"""DeviceMesh on real gloo process groups (2, 4 and 8 ranks)."""

import os
import re

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from axedist.dtensor import distribute
from axedist.mesh import DeviceMesh, MeshError
from axedist.testing import run_on_ranks


def coordinates_and_groups(rank, world_size, device_type="cpu"):
    mesh = DeviceMesh(device_type, (2, world_size // 2), ("dp", "tp"), ranks=list(reversed(range(world_size))))
    coords = mesh.coordinates()
    assert mesh.rank_at(coords) == rank
    tp, dp = mesh["tp"], mesh["dp"]
    # the group over tp really connects exactly this rank's row, in mesh order
    t = torch.tensor([float(rank)], device=mesh.device)
    dist.all_reduce(t, group=mesh.group("tp"))
    assert t.item() == sum(tp.ranks)
    t = torch.tensor([float(rank)], device=mesh.device)
    dist.all_reduce(t, group=mesh.group(("dp", "tp")))
    assert t.item() == sum(range(world_size))
    assert mesh.group() is mesh.group(("dp", "tp"))
    # a sub-mesh reuses the parent's groups
    assert tp.group() is mesh.group("tp") and dp.group() is mesh.group("dp")
    assert tp.coordinates() == {"tp": coords["tp"]}
    again = DeviceMesh(device_type, (2, world_size // 2), ("dp", "tp"), ranks=list(reversed(range(world_size))))
    assert again == mesh and hash(again) == hash(mesh) and again.group("tp") is mesh.group("tp")
    # torch logs a traced graph's inputs by repr while its fake mode is on: no tensor work there
    # (torch 2.11 turned a fake .tolist() into unbacked symbols, which broke Inductor's compile)
    x = distribute(torch.randn(4, 2), mesh, [Shard(0), Replicate()])
    shapes = ShapeEnv()
    with FakeTensorMode(shape_env=shapes):
        traced = repr(mesh), repr(x)
    assert traced == (repr(mesh), repr(x)) and not shapes.pending_fresh_unbacked_symbols, shapes
    return coords, tp.ranks, dp.ranks, repr(mesh)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_coordinates_groups_submeshes(world_size):
    results = run_on_ranks(coordinates_and_groups, world_size)
    half = world_size // 2
    for rank, (coords, tp_ranks, dp_ranks, text) in enumerate(results):
        position = world_size - 1 - rank  # ranks listed in reverse
        assert coords == {"dp": position // half, "tp": position % half}
        assert tp_ranks == tuple(world_size - 1 - (coords["dp"] * half + j) for j in range(half))
        assert dp_ranks == tuple(world_size - 1 - (i * half + coords["tp"]) for i in range(2))
        grid = [list(range(world_size - 1 - i * half, world_size - 1 - (i + 1) * half, -1)) for i in range(2)]
        assert text == f"DeviceMesh('cpu', {grid}, axes=('dp', 'tp'))", text


def _errors(rank, world_size):
    messages = []
    for args, kwargs in [
        (("cpu", (3,)), {}),                                   # shape != world
        (("cpu", (2, world_size // 2), ("a", "a")), {}),       # duplicate names
        (("cpu", (2,), ("gpuid",)), {"ranks": [0, world_size]}),  # rank outside the world
        (("cpu", (2,), ("gpuid",)), {"ranks": [1, 1]}),        # repeated rank
        (("cpu", (2, 2), ("x",)), {}),                         # names vs shape
        (("cpu", (world_size,), ("m",)), {}),                  # the memory axis name
    ]:
        with pytest.raises(MeshError) as info:
            DeviceMesh(*args, **kwargs)
        messages.append(str(info.value))
    # a mesh on a subset of the world: the other ranks build it too, and get clear errors when asking it
    sub = DeviceMesh("cpu", (2,), ("gpuid",), ranks=[1, 0])
    if rank in (0, 1):
        assert sub.coordinates() == {"gpuid": 1 - rank}
    else:
        with pytest.raises(MeshError, match=f"rank {rank} is not in mesh"):
            sub.coordinates()
    with pytest.raises(MeshError, match="no axis 'tp'"):
        DeviceMesh("cpu", (world_size,))["tp"]
    return messages


def test_errors_name_the_problem():
    messages = run_on_ranks(_errors, 4)[0]
    assert "has 3 devices but the world has 4 ranks" in messages[0]
    assert "distinct" in messages[1]
    assert "[4] are not in the world" in messages[2]
    assert "distinct" in messages[3]
    assert "2 axes but 1 names" in messages[4]
    assert "other than 'm'" in messages[5]


def _torch_form(rank, world_size):
    """torch's DeviceMesh(device_type, rank ids[, mesh_dim_names]) on axedist's DeviceMesh: the
    same shape, ranks, coordinates and local pieces as torch's mesh built from the same call."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    full = torch.randn(8, 6)
    out = {}
    for name, mesh, kwargs in [
        ("tensor", torch.arange(world_size), {}),
        ("list", list(range(world_size)), {}),
        ("permuted", torch.tensor([[0, 2], [1, 3]]), {"mesh_dim_names": ("dp", "tp")}),
        ("nested", [[3, 2], [1, 0]], {"mesh_dim_names": ("dp", "tp")}),
    ]:
        ours, theirs = DeviceMesh("cpu", mesh, **kwargs), TorchMesh("cpu", mesh, **kwargs)
        grid = torch.as_tensor(mesh)
        assert ours == DeviceMesh("cpu", tuple(grid.shape), kwargs.get("mesh_dim_names"), ranks=grid.flatten().tolist())
        coords = ours.coordinates()
        assert [coords[axis] for axis in ours.axis_names] == list(theirs.get_coordinate()), (name, coords)
        placements = [Shard(d % 2) for d in range(grid.dim())]
        mine = distribute(full, ours, placements).to_local()
        piece = full
        for d, axis in enumerate(ours.axis_names):  # the brute-force piece at this rank's coordinates
            piece = piece.chunk(ours.size(axis), dim=d % 2)[coords[axis]]
        assert torch.equal(mine, piece), name
        if all(bool((grid.diff(dim=d) > 0).all()) for d in range(grid.dim())):
            # torch's scatter follows group-rank order, the mesh's only where every axis ascends
            assert torch.equal(mine, distribute_tensor(full, theirs, placements).to_local()), name
        out[name] = (ours.shape, ours.axis_names, ours.ranks)
    messages = []
    for args, kwargs in [(("cpu", torch.arange(world_size)), {"ranks": list(range(world_size))}),
                         (("cpu", torch.arange(world_size), ("x",)), {"mesh_dim_names": ("y",)}),
                         (("cpu", torch.ones(world_size)), {}),
                         (("cpu", [[0, 1], [2]]), {})]:
        with pytest.raises(MeshError) as info:
            DeviceMesh(*args, **kwargs)
        messages.append(str(info.value))
    return out, messages


def test_torchs_form_of_the_constructor_is_the_same_mesh_as_torchs():
    results = run_on_ranks(_torch_form, 4)
    meshes, messages = results[0]
    assert meshes["tensor"] == meshes["list"] == ((4,), ("gpuid",), (0, 1, 2, 3))
    assert meshes["permuted"] == ((2, 2), ("dp", "tp"), (0, 2, 1, 3))
    assert meshes["nested"] == ((2, 2), ("dp", "tp"), (3, 2, 1, 0))
    assert "pass no ranks=" in messages[0] and "name the axes once" in messages[1]
    assert "must be integers" in messages[2] and "rectangular array of ints" in messages[3]


def _torch_surface(rank, world_size):
    """torch's DeviceMesh methods on axedist's mesh give what torch's mesh built from the same
    call gives: sizes, rank grid, names, local ranks, coordinates and the ranks of each group."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    def group_ranks(group):
        return dist.get_process_group_ranks(group)

    def same(ours, theirs, label):
        assert ours.ndim == theirs.ndim and tuple(ours.shape) == tuple(theirs.shape), label
        assert ours.size() == theirs.size() and torch.equal(ours.mesh, theirs.mesh), label
        assert ours.mesh_dim_names == theirs.mesh_dim_names and ours.device_type == theirs.device_type, label
        assert ours.get_coordinate() == (None if theirs.get_coordinate() is None else tuple(theirs.get_coordinate()))
        assert ours.get_rank() == theirs.get_rank() == rank, label
        if theirs.get_coordinate() is None:
            return
        for d, name in enumerate(theirs.mesh_dim_names):
            for key in (d, name, d - ours.ndim):
                assert ours.size(key) == theirs.size(d), (label, key)
                assert ours.get_local_rank(key) == theirs.get_local_rank(d), (label, key)
                assert group_ranks(ours.get_group(key)) == group_ranks(theirs.get_group(d)), (label, key)
        assert [group_ranks(g) for g in ours.get_all_groups()] == [group_ranks(g) for g in theirs.get_all_groups()]
        if ours.ndim == 1:
            assert ours.get_local_rank() == theirs.get_local_rank(), label
            assert group_ranks(ours.get_group()) == group_ranks(theirs.get_group()), label

    grid = torch.arange(world_size).reshape(2, world_size // 2).flip(1)  # ranks not in order along tp
    ours, theirs = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp")), TorchMesh("cpu", grid, mesh_dim_names=("dp", "tp"))
    same(ours, theirs, "2-D")
    same(ours["tp"], theirs["tp"], "tp sub-mesh")
    same(ours["dp"], theirs["dp"], "dp sub-mesh")
    line = torch.tensor([0, 2])  # a mesh that leaves out some ranks
    same(DeviceMesh("cpu", line, mesh_dim_names=("x",)), TorchMesh("cpu", line, mesh_dim_names=("x",)), "subset")
    messages = []
    for call in (lambda: ours.get_group(), lambda: ours.get_local_rank(), lambda: ours.size(2),
                 lambda: ours.get_group("pp"), lambda: ours.size(-3)):
        with pytest.raises(MeshError) as info:
            call()
        messages.append(str(info.value))
    return messages


def test_torchs_mesh_methods_answer_as_torchs_mesh():
    messages = run_on_ranks(_torch_surface, 4)[0]
    assert "has 2 axes: name one of ('dp', 'tp')" in messages[0] and "name one of" in messages[1]
    assert "out of range for a 2-D mesh" in messages[2] and "out of range" in messages[4]
    assert "no axis 'pp'" in messages[3]


def _from_group(rank, world_size):
    """``DeviceMesh.from_group`` gives the mesh torch's ``from_group`` gives for the same groups."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    grid = torch.arange(world_size).reshape(2, world_size // 2)
    dp = [dist.new_group(grid[:, j].tolist()) for j in range(grid.shape[1])]  # every rank makes every group
    tp = [dist.new_group(grid[i].tolist()) for i in range(grid.shape[0])]
    here = (grid == rank).nonzero()[0].tolist()
    my_dp, my_tp = dp[here[1]], tp[here[0]]
    found = {}
    for label, args, kwargs in [("tp", (my_tp, "cpu"), {}), ("dp", (my_dp, "cpu"), {"mesh_dim_names": ("dp",)}),
                                ("2-D", ([my_dp, my_tp], "cpu", grid), {"mesh_dim_names": ("dp", "tp")})]:
        ours, theirs = DeviceMesh.from_group(*args, **kwargs), TorchMesh.from_group(*args, **kwargs)
        assert torch.equal(ours.mesh, theirs.mesh) and ours.get_coordinate() == tuple(theirs.get_coordinate()), label
        for d in range(ours.ndim):
            assert dist.get_process_group_ranks(ours.get_group(d)) == dist.get_process_group_ranks(theirs.get_group(d))
        if ours.ndim == 1:  # the group given, or one over the same ranks converted before
            assert dist.get_process_group_ranks(ours.get_group()) == dist.get_process_group_ranks(args[0]), label
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=ours.group())  # the whole mesh's group connects exactly its ranks
        found[label] = (ours.ranks, ours.axis_names, t.item())
    return found


def test_from_group_is_torchs_from_group():
    for rank, found in enumerate(run_on_ranks(_from_group, 4)):
        row, column = divmod(rank, 2)
        assert found["tp"] == ((2 * row, 2 * row + 1), ("gpuid",), float(4 * row + 1))
        assert found["dp"] == ((column, column + 2), ("dp",), float(2 * column + 2))
        assert found["2-D"] == ((0, 1, 2, 3), ("dp", "tp"), 6.0)


def _ambiguous(rank, world_size):
    with pytest.raises(MeshError) as info:
        DeviceMesh("cpu", [2, 3])
    # a tuple, or a list with axis names, is a shape; a tensor is rank ids
    assert DeviceMesh("cpu", (2, 3)).shape == DeviceMesh("cpu", [2, 3], ("x", "y")).shape == (2, 3)
    assert DeviceMesh("cpu", torch.tensor([2, 3])).ranks == (2, 3)
    return str(info.value)


def test_a_list_that_reads_as_shape_and_as_rank_ids_is_an_error():
    message = run_on_ranks(_ambiguous, 6)[0]
    assert "ambiguous" in message and "Pass a tuple for a shape" in message and "torch.tensor([2, 3])" in message


def test_init_mesh_outside_torchrun(monkeypatch):
    from axedist.mesh import init_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(MeshError, match="run under torchrun"):
        init_mesh((2,), device_type="cpu")


def _init_mesh_in_job(rank, world_size):
    from axedist.mesh import init_mesh

    mesh = init_mesh((2, world_size // 2), ("dp", "tp"))  # joins the existing process group
    return mesh.device_type, mesh.shape, mesh.coordinates()


def test_init_mesh_in_a_job():
    results = run_on_ranks(_init_mesh_in_job, 4)
    assert results[3] == ("cpu", (2, 2), {"dp": 1, "tp": 1})


def _mesh_in_a_second_job(rank, world, store_path):
    """A 2 x 2 mesh, then destroy_process_group() and a second init: the new mesh's groups are
    the new job's (torch knows their ranks), and a move over both axes is right in both jobs."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    import axedist as ax

    seen = []
    for job in range(2):
        if job:
            dist.barrier()
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        mesh = ax.init_mesh((2, 2), ("dp", "tp"))
        ranks = {axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in ("dp", "tp")}
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(job))
        moved = ax.distribute_tensor(x, mesh, [Shard(0), Shard(1)]).redistribute(mesh, [Replicate(), Replicate()])
        seen.append((ranks, torch.equal(moved.to_local(), x)))
    return seen


def test_a_mesh_after_destroy_and_a_new_init_uses_the_new_jobs_groups(tmp_path):
    from axedist.testing.ranks import run_fresh_ranks

    outcomes = run_fresh_ranks(_mesh_in_a_second_job, 4, args=(str(tmp_path / "store"),), collective_timeout_s=30,
                               deadline_s=120)
    for o in outcomes:
        assert o.status == "ok", o
        rank = o.rank
        expected = {"dp": [rank % 2, rank % 2 + 2], "tp": [rank // 2 * 2, rank // 2 * 2 + 1]}
        assert o.value == [(expected, True), (expected, True)], o


_EXIT_SCRIPT = '''
import atexit, os, sys

def gloo_workers():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))

def at_exit():
    print(f"rank {os.environ['RANK']} gloo workers at exit: {gloo_workers()}", flush=True)
    if sys.argv[1] == "destroy":
        try:
            mesh.get_group("tp")
        except ax.MeshError as error:
            print(f"rank {os.environ['RANK']} mesh after exit hook: {error}", flush=True)

# registered before axedist is imported, so it runs after axedist's own exit hook (atexit is LIFO)
atexit.register(at_exit)

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import axedist as ax

mesh = ax.init_mesh((2, 2), ("dp", "tp"))  # kept, with its DTensors, as a script's globals
x = ax.distribute_tensor(torch.arange(24.0).reshape(4, 6), mesh, [Shard(0), Shard(1)])
y = x.redistribute(mesh, [Replicate(), Replicate()])
assert torch.equal(y.to_local(), torch.arange(24.0).reshape(4, 6))
print(f"rank {os.environ['RANK']} gloo workers running: {gloo_workers()}", flush=True)
dist.barrier()
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
'''


@pytest.mark.parametrize("end", ["destroy", "keep"])
def test_a_job_ended_by_destroy_process_group_has_no_gloo_worker_left_at_exit(tmp_path, end):
    """The package holds no process group past destroy_process_group(): a mesh and its DTensors
    kept as a script's globals hold their groups weakly, and at exit the plans' groups are
    dropped while the interpreter still runs, so no gloo worker thread is left for interpreter
    finalization to end mid-work (it aborted the rank: "terminate called without an active
    exception", the 2 x 2 demo on two torchrun agents, about 1 run in 100). A job still running
    at exit (no destroy_process_group) keeps its groups: torch holds them, nothing is dropped."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_EXIT_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(script), end], capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for rank in range(4):
        running = int(re.search(rf"rank {rank} gloo workers running: (\d+)", out).group(1))
        at_exit = int(re.search(rf"rank {rank} gloo workers at exit: (\d+)", out).group(1))
        assert running >= 6, out  # 2 workers for each of the world, dp and tp groups
        if end == "destroy":
            assert at_exit == 0, out
            assert re.search(rf"rank {rank} mesh after exit hook: DeviceMesh.*were destroyed", out), out
        else:
            assert at_exit == running, out


def _pickled(rank, world):
    import copy
    import io

    mesh = DeviceMesh("cpu", (world,))
    dt = distribute(torch.arange(8.0), mesh, [Shard(0)])
    assert torch.equal(copy.deepcopy(dt).full_tensor(), torch.arange(8.0))  # a copy keeps the mesh
    layer = torch.nn.Linear(4, 4)
    layer.weight = torch.nn.Parameter(distribute(layer.weight.detach(), mesh, [Shard(0)]))
    out = []
    for what in (dt, layer.state_dict()):
        try:
            torch.save(what, io.BytesIO())
            out.append("saved")
        except TypeError as e:
            out.append(str(e))
    return out


def test_pickling_a_dtensor_is_refused_with_the_ways_that_work():
    """torch.save of an axedist DTensor (or a state_dict holding them) raises a TypeError that names
    DCP, the plain-tensor ways and axedist.nn.state_dict (torch's full state dict leaves axedist
    DTensors as they are), on every rank; deepcopy still works."""
    for out in run_on_ranks(_pickled, 2):
        assert len(out) == 2 and all("cannot be pickled" in o and "checkpoint" in o and "full_tensor" in o
                                     and "axedist.nn.state_dict" in o for o in out), out
