"""axedist DTensor on layouts placements cannot express, checked against brute force.

The oracle here is ``Layout.apply`` element by element (pure Python), never the
vectorized tables that dtensor.py builds: for every rank, the local tensor must
hold exactly the global elements the layout sends to that rank, at the row-major
position of their ``m`` coordinate.
"""

import math

import pytest
import torch
import torch.distributed as dist

from axedist.dtensor import DTensor, distribute, placements_from_layout
from axedist.layout import Layout, LayoutError
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks


def global_tensor(shape, seed=0):
    """Distinct, exactly representable values (so a misplaced element is always seen)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    return (torch.randperm(n, generator=g).to(torch.float64) + 1).reshape(shape)


def expected_local(layout: Layout, mesh: DeviceMesh, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Brute force: walk every element, keep those whose point lands on ``rank``'s device."""
    shape = tuple(full.shape)
    local_shape = tuple(math.prod(it.extent for it in block if it.axis == "m") for block in layout.blocks(shape))
    here = mesh.coordinates(rank)
    out = torch.full(local_shape, float("nan"), dtype=full.dtype)
    flat_out, flat_in, hits = out.reshape(-1), full.reshape(-1), 0
    for x in range(full.numel()):
        for point in layout.apply(x):
            if all(point.get(a, 0) == v for a, v in here.items()):
                assert math.isnan(flat_out[point.get("m", 0)]), "two elements in one slot"
                flat_out[point.get("m", 0)] = flat_in[x]
                hits += 1
    if hits == 0:
        return torch.empty((0,) * len(shape), dtype=full.dtype)
    assert hits == out.numel(), "local tensor not fully covered"
    return out


# Layouts that placements cannot express, each with the mesh it lives on (W = 4 unless said).
CASES = {
    # rows of an (8,6) tensor dealt round-robin to 4 devices
    "cyclic_rows": ((4,), ("gpuid",), None, (8, 6), "S[(2,4,6):(6,1@gpuid,1)]"),
    # a (16,) vector in blocks of 2, dealt cyclically
    "block_cyclic": ((4,), ("gpuid",), None, (16,), "S[(2,4,2):(2,1@gpuid,1)]"),
    # only devices 2 and 3 hold the tensor (offset on gpuid); 0 and 1 hold (0,0) tensors
    "subset_of_mesh": ((4,), ("gpuid",), None, (8, 6), "S[(2,4,6):(1@gpuid,6,1)] + 2@gpuid"),
    # device order reversed, on a mesh whose rank order is permuted too
    "permuted_devices": ((4,), ("gpuid",), [2, 0, 3, 1], (8, 6), "S[(4,2,6):(-1@gpuid,6,1)] + 3@gpuid"),
    # replicated on devices 0 and 1 only
    "partial_axis_replica": ((4,), ("gpuid",), None, (8, 6), "S[(8,6):(6,1)] + R[2:1@gpuid]"),
    # the same kinds on 2 devices (these also run on 2 GPUs)
    "block_cyclic_2": ((2,), ("gpuid",), None, (12,), "S[(3,2,2):(2,1@gpuid,1)]"),
    "subset_of_mesh_2": ((2,), ("gpuid",), None, (4, 3), "S[(4,3):(3,1)] + 1@gpuid"),
    "permuted_devices_2": ((2,), ("gpuid",), [1, 0], (4, 3), "S[(2,2,3):(-1@gpuid,3,1)] + 1@gpuid"),
    "cyclic_columns_2": ((2,), ("gpuid",), None, (3, 8), "S[(3,2,2,2):(4,2,1@gpuid,1)]"),
    # sharded over x, replicated on y in {0, 2} of a 2x4 mesh
    "partial_axis_replica_2d": ((2, 4), ("x", "y"), None, (8, 6), "S[(2,4,6):(1@x,6,1)] + R[2:2@y]"),
    # x and y both shard dim 0, with a memory digit between them
    "interleaved_axes": ((2, 2), ("x", "y"), None, (16, 3), "S[(2,2,2,2,3):(1@x,6,1@y,3,1)]"),
    # 8 devices: dim 0 over x, dim 1 block-cyclic over y
    "two_dims_block_cyclic": ((2, 4), ("x", "y"), None, (4, 16), "S[(2,2,2,4,2):(1@x,4,2,1@y,1)]"),
}


def roundtrip(rank, world_size, name, src_rank, device_type="cpu"):
    mesh_shape, names, ranks, shape, text = CASES[name]
    mesh = DeviceMesh(device_type, mesh_shape, names, ranks)
    layout = Layout.parse(text)
    full = global_tensor(shape, seed=len(name))
    sent = full if rank == src_rank else torch.full(shape, -1.0, dtype=full.dtype)  # not read
    dt = distribute(sent.to(mesh.device), mesh, layout, src_rank=src_rank)
    want = expected_local(layout, mesh, full, rank)
    assert torch.equal(dt.to_local().cpu(), want), (dt.to_local(), want)
    assert dt.shape == torch.Size(shape) and dt.dtype == torch.float64 and dt.axe_layout == layout
    assert dt.device == mesh.device and dt.to_local().device == mesh.device
    assert torch.equal(dt.full_tensor().cpu(), full)
    # from_local on the same pieces, checked across ranks
    again = DTensor.from_local(want.to(mesh.device), mesh, layout, shape, run_check=True)
    assert torch.equal(again.full_tensor().cpu(), full)
    # to every other case on the same mesh and back
    for other_name, (m2, n2, r2, s2, t2) in CASES.items():
        if (m2, n2, r2, s2) != (mesh_shape, names, ranks, shape):
            continue
        other = Layout.parse(t2)
        moved = dt.redistribute(other)
        assert torch.equal(moved.to_local().cpu(), expected_local(other, mesh, full, rank)), other_name
        assert torch.equal(moved.redistribute(layout).to_local().cpu(), want)
    # and to a plain row-major layout on one device
    on_one = Layout.parse(f"S[{math.prod(shape)}:1] + 1@{names[0]}")
    assert torch.equal(dt.redistribute(on_one).to_local().cpu(), expected_local(on_one, mesh, full, rank))
    with pytest.raises(LayoutError, match="no placement form"):
        placements_from_layout(layout, mesh, shape)
    return True


@pytest.mark.parametrize("name", sorted(CASES))
def test_layouts_placements_cannot_express(name):
    world = math.prod(CASES[name][0])
    assert run_on_ranks(roundtrip, world, args=(name, world - 1)) == [True] * world


def figure_8(rank, world_size, device_type="cpu"):
    """The paper's Fig. 8: with W = 4, summing a (4,64,64) input over dim 0 into
    ``S[(4,16,64):(1@gpuid,64,1)]`` is a reduce-scatter. Any W dividing 64 works the same."""
    w, rows = world_size, 64 // world_size
    mesh = DeviceMesh(device_type, (w,))
    full = torch.randint(-100, 100, (w, 64, 64), generator=torch.Generator().manual_seed(8)).to(torch.float32)
    summands = Layout.parse(f"S[({w},64,64):(1@gpuid,64,1)]")
    x = distribute(full.to(mesh.device), mesh, summands)
    assert torch.equal(x.to_local().cpu(), full[rank:rank + 1])
    out = Layout.parse(f"S[({w},{rows},64):(1@gpuid,64,1)]")
    y = x.to_partial("sum").redistribute(out)
    assert y.shape == (64, 64) and y.axe_layout == out and y.reduce_op is None
    assert torch.equal(y.to_local().cpu(), full.sum(0)[rows * rank:rows * (rank + 1)])
    # the same pending sum built from local pieces; and max/min/avg reduce the same way
    partial = DTensor.from_local(full[rank:rank + 1].to(mesh.device), mesh, summands, (w, 64, 64), reduce_op="sum")
    assert partial.shape == (64, 64) and partial.to_local().shape == (64, 64)
    assert torch.equal(partial.full_tensor().cpu(), full.sum(0))
    for op, reduce in [("max", full.amax(0)), ("min", full.amin(0)), ("avg", full.mean(0))]:
        got = x.to_partial(op).redistribute(out).to_local().cpu()
        assert torch.allclose(got, reduce[rows * rank:rows * (rank + 1)]), op
    # two summands per device (an m iter in the summand dim), reduced on the way to Shard(1)
    two = Layout.parse(f"S[(2,{w},8,8):(64,1@gpuid,8,1)]")     # summand 2*... : j*W + gpuid, j local
    z = distribute(full[:, :8, :8].repeat(2, 1, 1).to(mesh.device), mesh, two)
    assert z.to_local().shape == (2, 8, 8)
    cols = 8 // w
    shard1 = Layout.parse(f"S[(8,{w},{cols}):({cols},1@gpuid,1)]")
    got = z.to_partial("sum").redistribute(shard1).to_local().cpu()
    assert torch.equal(got, (2 * full[:, :8, :8].sum(0))[:, cols * rank:cols * (rank + 1)])
    return True


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_figure_8_partial_sum_reduce_scatter(world_size):
    assert run_on_ranks(figure_8, world_size) == [True] * world_size


def _error(fn):
    try:
        fn()
    except (LayoutError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _errors(rank, world_size):
    mesh = DeviceMesh("cpu", (4,))
    full = global_tensor((8, 6))
    L = Layout.parse
    messages = {
        "not_admitted": _error(lambda: distribute(full, mesh, L("S[(4,2,5):(1@gpuid,5,1)]"))),
        "foreign_axis": _error(lambda: distribute(full, mesh, L("S[(4,2,6):(1@tp,6,1)]"))),
        "not_injective": _error(lambda: distribute(full, mesh, L("S[(2,4,6):(1@gpuid,6,1)] + R[2:1@gpuid]"))),
        "outside_mesh": _error(lambda: distribute(full, mesh, L("S[(4,2,6):(1@gpuid,6,1)] + 1@gpuid"))),
        "not_row_major": _error(lambda: distribute(full, mesh, L("S[(4,2,6):(1@gpuid,1,2)]"))),
        "replica_on_m": _error(lambda: distribute(full, mesh, L("S[(4,2,6):(1@gpuid,6,1)] + R[2:12]"))),
        # one rank passes a different shape: every rank must raise, none may hang
        "shapes_differ": _error(lambda: distribute(full if rank else full[:4], mesh, L("S[(4,2,6):(1@gpuid,6,1)]"))),
        # rank 2 passes a wrong local shape: with run_check every rank says which rank was wrong
        "from_local_checked": _error(lambda: DTensor.from_local(
            torch.zeros(3 if rank == 2 else 2, 6, dtype=torch.float64), mesh, L("S[(4,2,6):(1@gpuid,6,1)]"), (8, 6),
            run_check=True)),
        "from_local_dtype": _error(lambda: DTensor.from_local(
            torch.zeros(2, 6, dtype=torch.float32 if rank == 1 else torch.float64), mesh,
            L("S[(4,2,6):(1@gpuid,6,1)]"), (8, 6), run_check=True)),
        "layout_needs_shape": _error(lambda: DTensor.from_local(torch.zeros(2, 6), mesh, L("S[(4,2,6):(1@gpuid,6,1)]"))),
        "partial_from_full": _error(lambda: distribute(full, mesh, L("S[(4,2,6):(1@gpuid,6,1)]")).redistribute(
            L("S[(4,2,6):(1@gpuid,6,1)]"), reduce_op="sum")),
    }
    pair = DeviceMesh("cpu", (2,), ranks=[0, 1])  # every rank builds it; ranks 0 and 1 use it
    if rank < 2:
        messages["src_outside"] = _error(lambda: distribute(full, pair, L("S[(2,4,6):(1@gpuid,6,1)]"), src_rank=3))
    dist.barrier()
    return messages


def test_errors_are_clear_on_every_rank():
    results = run_on_ranks(_errors, 4)
    for rank, messages in enumerate(results):
        for name, message in messages.items():
            assert message is not None, f"{name} raised nothing on rank {rank}"
        assert "does not admit the shape (8, 6)" in messages["not_admitted"]
        assert "uses axis 'tp'" in messages["foreign_axis"]
        assert "two elements in one (device, m) slot" in messages["not_injective"]
        assert "outside the mesh axis gpuid of size 4" in messages["outside_mesh"]
        assert "row-major" in messages["not_row_major"]
        assert "not on 'm'" in messages["replica_on_m"]
        assert "same shape and dtype" in messages["shapes_differ"] and "rank 0: (4, 6)" in messages["shapes_differ"]
        assert "rank 2: local (3, 6)" in messages["from_local_checked"]
        assert "rank 1: local (2, 6) torch.float32" in messages["from_local_dtype"]
        assert "needs shape=" in messages["layout_needs_shape"]
        assert "pending sum" in messages["partial_from_full"]
    assert "src_rank 3 is not in mesh" in results[0]["src_outside"]


def _tensor_behaviour(rank, world_size):
    from torch.distributed.tensor import Shard

    mesh = DeviceMesh("cpu", (world_size,))
    local = torch.full((2, 3), float(rank), requires_grad=True)
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    facts = {
        "shape": tuple(dt.shape), "dtype": dt.dtype, "device": str(dt.device), "requires_grad": dt.requires_grad,
        "repr": repr(dt), "detached": dt.detach().requires_grad, "same_local": dt.to_local().data_ptr() == local.data_ptr(),
    }
    dt.to_local().sum().backward()  # from_local/to_local are differentiable: the grad reaches local
    facts["grad"] = local.grad.sum().item()
    facts["op"] = (dt + 1).full_tensor().tolist()  # torch ops run through axedist.ops
    # with placements and no shape, the global shape is inferred per rank; run_check compares it
    try:
        DTensor.from_local(torch.zeros(3 if rank == 0 else 2, 3), mesh, [Shard(0)], run_check=True)
    except LayoutError as e:
        facts["inferred"] = str(e)
    # a rank whose own arguments are invalid still joins the check: both ranks raise, neither hangs
    try:
        DTensor.from_local(torch.zeros(2, 3) if rank == 0 else torch.zeros(4), mesh, [Shard(1)], run_check=True)
    except LayoutError as e:
        facts["invalid_here"] = str(e)
    return facts


def test_tensor_behaviour():
    facts = run_on_ranks(_tensor_behaviour, 2)
    for f in facts:
        assert f["shape"] == (4, 3) and f["dtype"] == torch.float32 and f["device"] == "cpu"
        assert f["requires_grad"] and not f["detached"] and f["same_local"] and f["grad"] == 6.0
        assert f["repr"] == "DTensor(float32[4, 3] S[(2,2,3):(1@gpuid,3,1)], mesh=DeviceMesh('cpu', [0, 1], axes=('gpuid',)))"
        assert f["op"] == [[1.0] * 3] * 2 + [[2.0] * 3] * 2
        assert "rank 1: local (2, 3) torch.float32 (global (4, 3))" in f["inferred"]  # differs from rank 0
        assert "rank 1: local (4,) torch.float32 (global ())" in f["invalid_here"]


# (mesh shape, placements) for from_local(run_check=True): torch broadcasts along each Replicate axis
RUN_CHECK_CASES = [((4,), "R"), ((4,), "S0"), ((2, 2), "S0,R"), ((2, 2), "R,S1"), ((2, 2), "R,R"), ((2, 2), "P,R")]


def _from_local_checked(rank, world, mesh_shape, names):
    """Each rank's own values (rank r holds r * 100 + arange) through ``from_local(run_check=True)``,
    by axedist and by torch's DTensor on the same ranks: (to_local, full_tensor, the caller's
    local tensor afterwards) of each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial, Replicate, Shard

    parse = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "P": Partial()}
    placements = [parse[n] for n in names.split(",")]
    out = {}
    for name, make, mesh in (("axedist", DTensor.from_local, DeviceMesh("cpu", mesh_shape)),
                             ("torch", TorchDTensor.from_local, init_device_mesh("cpu", mesh_shape))):
        local = torch.arange(6.0).reshape(2, 3) + 100 * rank
        d = make(local, mesh, placements, run_check=True)
        out[name] = (d.to_local().tolist(), d.full_tensor().tolist(), local.tolist())
    dist.barrier()
    return out


@pytest.mark.parametrize("mesh_shape, names", RUN_CHECK_CASES)
def test_from_local_run_check_makes_replicas_agree_as_torch(mesh_shape, names):
    """torch's from_local(run_check=True) broadcasts the data of coordinate 0 along every
    Replicate axis (each rank once kept its own, so one "replicated" tensor differed by rank)."""
    for rank, out in enumerate(run_on_ranks(_from_local_checked, 4, args=(mesh_shape, names))):
        assert out["axedist"] == out["torch"], (rank, out)
