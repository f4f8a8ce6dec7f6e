"""Drop-in for torch's tensor-parallel API: what a torch TP script relies on, on axedist.

``parallelize_module(module=, device_mesh=, parallelize_plan=)`` with a torch mesh (1-D, and
the ``"tp"`` sub-mesh of a 2x2 ``("dp", "tp")`` mesh, whose two sub-meshes hold different
ranks) and torch's style objects: outputs and gradients equal torch's ``parallelize_module``
and one process; buffers and modules the plan does not name stay plain, local outputs are
plain tensors. A plain tensor meeting DTensors is an error as in torch, except under
``implicit_replication()`` / ``loss_parallel()`` (axedist's and torch's), where ranks that
pass different tensors get an error instead of a silent wrong result.
"""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import parallel as torch_tp
from torch.distributed.tensor.experimental import implicit_replication as torch_implicit_replication

import axedist as ax
from axedist.dtensor import distribute, DTensor
from axedist.nn import ColwiseParallel, implicit_replication, loss_parallel, parallelize_module
from axedist.ops import DispatchError
from axedist.testing import run_on_ranks

TOL = dict(rtol=1e-10, atol=1e-12)


class _Block(nn.Module):
    """Column- then row-parallel, a position table as a buffer (torchtitan's freqs_cis is one)
    applied to the local output in between, and a module no plan names."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 12, dtype=torch.float64)
        self.down = nn.Linear(12, 6, dtype=torch.float64)
        self.unused = nn.Linear(2, 2, dtype=torch.float64)
        self.register_buffer("table", torch.linspace(0.5, 2.0, 5, dtype=torch.float64)[:, None])

    def forward(self, x):                       # x [B, S, 6]
        h = F.gelu(self.up(x)) * self.table[: x.shape[1]]
        return self.down(h)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _torch_meshes(rank, world, seed, which):
    torch.manual_seed(seed)
    if which == "1d":
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))["tp"]
    ref = _Block()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    plan = lambda: {"up": torch_tp.ColwiseParallel(), "down": torch_tp.RowwiseParallel()}  # noqa: E731
    torch_tp.parallelize_module(theirs, mesh, plan())
    out = parallelize_module(module=ours, device_mesh=mesh, parallelize_plan=plan())
    assert out is ours
    assert isinstance(ours.up.weight, DTensor) and ours.up.weight.placements == (Shard(0),)
    assert ours.up.weight.mesh.ranks == tuple(mesh.mesh.flatten().tolist())
    # what the plan does not name stays as it was, as torch leaves it
    assert type(ours.table) is torch.Tensor and type(ours.unused.weight) is nn.Parameter
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    y_ref, y_ours, y_theirs = ref(x), ours(x), theirs(x)
    assert type(y_ours) is torch.Tensor  # RowwiseParallel's local output (use_local_output=True)
    for y in (y_ours, y_theirs):
        torch.testing.assert_close(y, y_ref, **TOL)
    weight = torch.randn(2, 5, 6, dtype=torch.float64)
    for model, y in ((ref, y_ref), (ours, y_ours), (theirs, y_theirs)):
        (y * weight).sum().backward()
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        for model in (ours, theirs):
            got = dict(model.named_parameters())[name].grad
            torch.testing.assert_close(_full(got), p.grad, **TOL, msg=lambda m: f"{which}: grad of {name}: {m}")
    # axedist's own style on the same mesh: everything becomes a DTensor, buffers replicated
    again = _Block()
    parallelize_module(again, mesh, {"up": ColwiseParallel()})
    assert isinstance(again.table, DTensor) and again.table.placements == (Replicate(),)
    return True


@pytest.mark.parametrize("which", ["1d", "tp_of_2x2"])
def test_parallelize_module_takes_torch_meshes_and_keeps_torch_semantics(which):
    assert run_on_ranks(_torch_meshes, 4, args=(random.randrange(2**31), which)) == [True] * 4


def _sub_meshes(rank, world):
    """A 2-D sub-mesh of a 3-D torch mesh comes from its root; a 1-D one runs on torch's group."""
    root = init_device_mesh("cpu", (1, 2, world // 2), mesh_dim_names=("pp", "dp", "tp"))
    two = ax.DeviceMesh.from_torch(root["dp", "tp"])
    assert (two.axis_names, two.shape, two.ranks) == (("dp", "tp"), (2, world // 2), tuple(range(world)))
    assert ax.DeviceMesh.from_torch(root["dp", "tp"]) is two     # made once
    tp = ax.DeviceMesh.from_torch(root["tp"])
    assert tp.ranks == tuple(root["tp"].mesh.tolist()) and tp.axis_names == ("tp",)
    x = distribute(torch.arange(8.0).reshape(4, 2), two, [Shard(0), Shard(1)])
    return x.redistribute([Replicate(), Replicate()]).to_local().tolist() == torch.arange(8.0).reshape(4, 2).tolist()


def test_torch_sub_meshes():
    assert run_on_ranks(_sub_meshes, 4) == [True] * 4


def _errors(fn):
    try:
        fn()
    except DispatchError as e:
        return str(e)
    return None


def _mixed(rank, world, seed):
    mesh = ax.DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x, b = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, generator=g, dtype=torch.float64)
    xd = distribute(x, mesh, [Shard(0)])
    # torch: "got mixed torch.Tensor and DTensor" unless the plain tensor is a scalar
    theirs = distribute_tensor(x, mesh.to_torch(), [Shard(0)])
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        theirs + b
    assert "plain torch.Tensor" in _errors(lambda: xd + b)
    torch.testing.assert_close((xd * torch.tensor(2.0)).full_tensor(), x * 2)
    for context in (implicit_replication, torch_implicit_replication):
        with context():
            torch.testing.assert_close((xd + b).full_tensor(), x + b)
            assert (xd + b).placements == (Shard(0),)
            # ranks that pass different tensors: an error on every rank, not a silent wrong result
            assert "differs" in _errors(lambda: xd + (b + rank))
            assert "requires grad" in _errors(lambda: xd + b.clone().requires_grad_())
    assert "plain torch.Tensor" in _errors(lambda: xd + b)  # the context is closed again
    return True


def test_plain_tensors_meet_dtensors_as_in_torch():
    assert run_on_ranks(_mixed, 4, args=(random.randrange(2**31),)) == [True] * 4


def _losses(rank, world, seed):
    mesh = ax.DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 10, generator=g, dtype=torch.float64)     # 10 classes: 3, 3, 3, 1 on 4 ranks
    labels = torch.randint(0, 10, (6,), generator=g)
    for reduction in ("mean", "sum"):
        ref = logits.clone().requires_grad_()
        loss_ref = F.cross_entropy(ref, labels, reduction=reduction)
        loss_ref.backward()
        for context in (loss_parallel, torch_tp.loss_parallel):
            xd = distribute(logits, mesh, [Shard(1)]).requires_grad_()
            assert "plain torch.Tensor" in _errors(lambda: F.cross_entropy(xd, labels))
            with context():
                loss = F.cross_entropy(xd, labels, reduction=reduction)
                loss.backward()
                assert "differs" in _errors(lambda: F.cross_entropy(xd, (labels + rank) % 10))
            torch.testing.assert_close(loss.full_tensor(), loss_ref, **TOL)
            torch.testing.assert_close(xd.grad.full_tensor(), ref.grad, **TOL)
            assert xd.grad.placements == (Shard(1),)
    return True


def test_loss_parallel_takes_plain_labels_as_replicated():
    assert run_on_ranks(_losses, 4, args=(random.randrange(2**31),)) == [True] * 4



def _dtensor_calls(api, mesh, seed):
    """A torch DTensor script's calls, written once; ``api`` supplies ``distribute_tensor`` and
    ``DTensor`` (torch's or axedist's). Returns every tensor it reads back."""
    Sh, R = Shard, Replicate
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(8, 6, generator=g, dtype=torch.float64)
    x = api.distribute_tensor(full, mesh, [Sh(0)])
    out = [x.to_local(), x.full_tensor()]
    assert x.device_mesh is not None and tuple(x.placements) == (Sh(0),)
    y = x.redistribute(x.device_mesh, [Sh(1)])                  # positional mesh, placements
    out += [y.to_local(), y.redistribute(device_mesh=mesh, placements=[R()]).to_local()]
    local = torch.randn(2, 6, generator=g, dtype=torch.float64)  # every rank draws the same
    z = api.DTensor.from_local(local, device_mesh=mesh, placements=[Sh(0)], shape=(8, 6), stride=(6, 1))
    out += [z.full_tensor(), z.redistribute(placements=[R()]).to_local()]
    w = api.DTensor.from_local(local, mesh)                     # no placements: Replicate
    out += [w.to_local(), torch.tensor([p == R() for p in w.placements])]
    v = api.distribute_tensor(full, mesh)                        # no placements: Replicate
    out += [v.to_local()]
    return out


def _grad_placements_calls(api, mesh, seed, rank):
    """``to_local(grad_placements=)``: gradients of local pieces read back in other placements."""
    Sh, R = Shard, Replicate
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(8, 6, generator=g, dtype=torch.float64)
    weights = torch.randn(mesh.size(), 8, 6, generator=g, dtype=torch.float64)   # one per rank
    x = api.distribute_tensor(full, mesh, [R()]).requires_grad_()
    (x.to_local(grad_placements=[Partial()]) * weights[rank]).sum().backward()   # each rank's a summand
    y = api.distribute_tensor(full, mesh, [Sh(0)]).requires_grad_()
    (y.to_local(grad_placements=[Sh(0)]) * 2).sum().backward()                   # its own placements
    z = api.distribute_tensor(full, mesh, [Sh(0)]).requires_grad_()
    r = z.redistribute(mesh, [R()])                                               # through a move back
    (r.to_local(grad_placements=[Partial()]) * weights[rank]).sum().backward()
    return [x.grad.full_tensor(), y.grad.full_tensor(), z.grad.full_tensor(), z.grad.to_local()]


def _gradient_placement_calls(api, seed):
    """``from_local(grad_placements=)`` (a gradient brought to other placements whose pieces have
    the local tensor's shape) and ``full_tensor(grad_placements=)`` on a 2x2 mesh."""
    Sh, R = Shard, Replicate
    mesh = init_device_mesh("cpu", (2, 2))
    row, col = mesh.get_coordinate()
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(4, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64)
    weights = torch.randn(4, 4, 8, generator=g, dtype=torch.float64)   # one per rank
    local = full[2 * row:2 * row + 2].clone().requires_grad_()
    d = api.DTensor.from_local(local, mesh, [Sh(0), R()], grad_placements=[R(), Sh(0)])
    (d.full_tensor() * w).sum().backward()          # the piece of w at rows 2*col.. (the [R, S0] piece)
    x = api.distribute_tensor(full, mesh, [Sh(0), Sh(1)]).requires_grad_()
    (x.full_tensor(grad_placements=[Partial(), Partial()]) * weights[2 * row + col]).sum().backward()
    return [local.grad, x.grad.full_tensor()], (w[2 * col:2 * col + 2], weights.sum(0))


def _dtype_calls(api, mesh, seed, rank):
    """``redistribute(forward_dtype=, backward_dtype=)``: the move in one dtype, the gradient's in another."""
    Sh, R = Shard, Replicate
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(8, 6, generator=g)
    w = torch.randn(8, 6, generator=g)                                # the same on every rank
    weights = torch.randn(mesh.size(), 8, 6, generator=g)             # one per rank
    x = api.distribute_tensor(full, mesh, [Sh(0)]).requires_grad_()
    y = x.redistribute(mesh, [R()], forward_dtype=torch.bfloat16, backward_dtype=torch.bfloat16)
    (y.to_local().float() * w).sum().backward()
    z = api.distribute_tensor(full, mesh, [Sh(1)]).requires_grad_()
    r = z.redistribute(mesh, [R()], backward_dtype=torch.bfloat16)   # the summed gradient moves in bf16
    (r.to_local(grad_placements=[Partial()]) * weights[rank]).sum().backward()
    dtypes = torch.tensor([y.dtype == torch.bfloat16, x.grad.dtype == torch.float32, r.dtype == torch.float32,
                           z.grad.dtype == torch.float32])
    return [y.to_local(), x.grad.to_local(), dtypes], z.grad.to_local(), weights.sum(0)


def _torch_dtensor_api(rank, world, seed):
    import types

    import torch.distributed.tensor as torch_dtensor

    mesh = init_device_mesh("cpu", (world,))
    want = _dtensor_calls(torch_dtensor, mesh, seed)
    got = _dtensor_calls(types.SimpleNamespace(distribute_tensor=ax.distribute_tensor, DTensor=DTensor), mesh, seed)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    want = _grad_placements_calls(torch_dtensor, mesh, seed, rank)
    got = _grad_placements_calls(types.SimpleNamespace(distribute_tensor=ax.distribute_tensor), mesh, seed, rank)
    g = torch.Generator().manual_seed(seed)
    torch.randn(8, 6, generator=g, dtype=torch.float64)
    summed = torch.randn(world, 8, 6, generator=g, dtype=torch.float64).sum(0)
    for a, b, brute in zip(got, want, [summed, torch.full((8, 6), 2.0, dtype=torch.float64), summed]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a, brute, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[3], want[3], rtol=1e-12, atol=1e-12)
    (want, _), (got, brute) = (_gradient_placement_calls(torch_dtensor, seed), _gradient_placement_calls(
        types.SimpleNamespace(distribute_tensor=ax.distribute_tensor, DTensor=DTensor), seed))
    for a, b, c in zip(got, want, brute):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    (want, want_summed, _), (got, got_summed, brute) = (
        _dtype_calls(torch_dtensor, mesh, seed, rank),
        _dtype_calls(types.SimpleNamespace(distribute_tensor=ax.distribute_tensor), mesh, seed, rank))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert bool(got[2].all())
    # summed in bf16 (each value a bf16 number), where torch's gloo order may round differently
    assert torch.equal(got_summed, got_summed.bfloat16().float()) and torch.equal(want_summed, want_summed.bfloat16().float())
    # each of the W - 1 additions in bf16 rounds by at most half an ulp of a partial sum (2^-8 relative),
    # a partial sum at most the sum of the magnitudes: bound the error by that, not by a fixed tolerance
    g = torch.Generator().manual_seed(seed)
    torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    magnitude = torch.randn(world, 8, 6, generator=g).abs().sum(0)
    bound = (world * 2 ** -8 * magnitude + 2 ** -8 * brute.abs()).chunk(world, 1)
    pieces = brute.chunk(world, 1)   # torch's Shard(1): 6 columns on 4 ranks are 2, 2, 2, 0
    for summed in (got_summed, want_summed):
        expected = pieces[rank] if rank < len(pieces) else brute[:, :0]
        slack = bound[rank] if rank < len(bound) else brute[:, :0]
        assert summed.shape == expected.shape and bool(((summed - expected).abs() <= slack).all()), (summed, expected)
    # what axedist refuses where torch would differ or guess
    x = ax.distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)])
    for call, text in ((lambda: DTensor.from_local(torch.zeros(2, 6), mesh, [Shard(0)], shape=(8, 6), stride=(1, 8)),
                        "contiguous stride"),
                       (lambda: x.redistribute(ax.DeviceMesh("cpu", (world,), ("other",)), [Replicate()]), "within its mesh"),
                       (lambda: x.redistribute([Replicate()], placements=[Replicate()]), "given twice"),
                       (lambda: DTensor.from_local(torch.zeros(2, 6), None, [Shard(0)]), "needs a mesh"),
                       (lambda: x.to_local(grad_placements=[Replicate()]), "piece of shape \\(8, 6\\)"),
                       (lambda: DTensor.from_local(torch.zeros(2, 6), mesh, [Shard(0)], grad_placements=[Replicate()]),
                        "piece of shape \\(8, 6\\)"),
                       (lambda: DTensor.from_local(torch.zeros(8, 6), mesh, [Replicate()], grad_placements=[Partial()]),
                        "without Partial")):
        with pytest.raises((TypeError, ValueError), match=text):
            call()
    return True


def test_torch_dtensor_api_spelled_as_torch():
    """distribute_tensor, DTensor.from_local(device_mesh=, placements=, shape=, stride=),
    redistribute(mesh, placements) / (device_mesh=, placements=), .device_mesh: the same values
    as torch's DTensor for the same calls on a torch mesh."""
    assert run_on_ranks(_torch_dtensor_api, 4, args=(random.randrange(2**31),)) == [True] * 4


class _Scaled(nn.Module):
    """Linear -> ReLU -> Linear, times a buffer."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
        self.register_buffer("scale", torch.randn(6))

    def forward(self, x):
        return self.net(x) * self.scale


def _distributed_module(api, mesh, seed, rank):
    """torch's distribute_module recipe: shard the first Linear's weight, replicate the rest,
    inputs made replicated DTensors, outputs read back whole."""
    torch.manual_seed(seed + rank)   # every rank starts from other values: the first rank's win
    model = _Scaled().double()

    def partition(name, sub, device_mesh):
        if name == "net.0":
            sub.register_parameter("weight", nn.Parameter(api.distribute_tensor(sub.weight, device_mesh, [Shard(0)])))

    api.distribute_module(model, mesh, partition,
                          input_fn=lambda mod, inputs, device_mesh: tuple(
                              api.DTensor.from_local(x, device_mesh, [Replicate()]) for x in inputs),
                          output_fn=lambda mod, outputs, device_mesh: outputs.full_tensor())
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y = model(x)
    y.sum().backward()
    return y.detach(), model.net[0].weight.grad.full_tensor(), tuple(model.net[0].weight.placements), \
        tuple(model.net[2].weight.placements)


def _factories(rank, world, seed):
    import types

    import torch.distributed.tensor as torch_dtensor

    mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for m, size, placements in [(mesh, (8, 6), [Shard(0)]), (mesh, (5, 3), [Shard(1)]), (mesh, (7,), [Replicate()]),
                                (mesh, (6, 4), None), (grid, (5, 7), [Shard(0), Shard(1)]),
                                (grid, (4, 3), [Replicate(), Shard(0)])]:
        for name in ("zeros", "ones", "empty", "full"):
            args = (size, 2.5) if name == "full" else size
            ours = getattr(ax, name)(*args, dtype=torch.float64, device_mesh=m, placements=placements)
            theirs = getattr(torch_dtensor, name)(*args, dtype=torch.float64, device_mesh=m, placements=placements)
            what = (name, size, placements)
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, what
            assert ours.placements == tuple(theirs.placements) and ours.to_local().shape == theirs.to_local().shape, what
            if name != "empty":
                assert torch.equal(ours.to_local(), theirs.to_local()), what
        # random: the global tensor is torch's draw of the whole, and the generator moves as it would
        for name in ("rand", "randn"):
            torch.manual_seed(seed)
            ours = getattr(ax, name)(*size, dtype=torch.float64, device_mesh=m, placements=placements)
            after = torch.rand(2)
            torch.manual_seed(seed)
            want = getattr(torch, name)(*size, dtype=torch.float64)
            assert torch.equal(ours.full_tensor(), want) and torch.equal(after, torch.rand(2)), (name, size)
    assert ax.full((2, 3), 7, device_mesh=mesh).dtype == torch.int64
    leaf = ax.zeros(4, 6, requires_grad=True, device_mesh=mesh, placements=[Shard(0)])
    (leaf * 3).sum().backward()
    assert leaf.is_leaf and torch.equal(leaf.grad.full_tensor(), torch.full((4, 6), 3.0))
    for call, error, text in [(lambda: ax.zeros(4, device_mesh=mesh, placements=[Partial()]), ax.LayoutError, "Partial"),
                              (lambda: ax.ones(4, 2), TypeError, "needs a mesh"),
                              (lambda: ax.zeros(-1, device_mesh=mesh), TypeError, "non-negative")]:
        with pytest.raises(error, match=text):
            call()
    # distribute_module
    want = _distributed_module(torch_dtensor, mesh, seed, rank)
    got = _distributed_module(types.SimpleNamespace(distribute_tensor=ax.distribute_tensor, DTensor=DTensor,
                                                    distribute_module=ax.distribute_module), mesh, seed, rank)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    assert got[2:] == want[2:] == ((Shard(0),), (Replicate(),)), (got[2:], want[2:])
    torch.manual_seed(seed)
    first = _Scaled().double()   # rank 0's values
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.testing.assert_close(got[0], first(x).detach(), rtol=1e-12, atol=1e-12)
    return True


def test_torch_factories_placements_and_distribute_module():
    """zeros/ones/empty/full/rand/randn(..., device_mesh=, placements=), the placements imported
    from axedist, and distribute_module (partition_fn, input_fn, output_fn): as torch's on the same
    calls (random factories: torch's draw of the whole tensor), on 1-D and 2-D meshes."""
    assert ax.Shard is Shard and ax.Replicate is Replicate and ax.Partial is Partial
    assert run_on_ranks(_factories, 4, args=(random.randrange(2**31),)) == [True] * 4


def _clip_with_empty_shards(rank, world, seed):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(5, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g, dtype=torch.float64)]
    grads[0][1] = grads[1][2, 0] = 0.0   # zeros: the 0-norm counts the others
    for norm_type in (2.0, 1.0, 0.0, float("inf"), float("-inf")):
        for foreach in (True, False):
            what = (norm_type, foreach)
            ref = [nn.Parameter(torch.zeros_like(x)) for x in grads]
            ours = [nn.Parameter(ax.distribute_tensor(torch.zeros_like(x), mesh, [Shard(0)])) for x in grads]
            for r, p, x in zip(ref, ours, grads):
                r.grad = x.clone()
                p.grad = ax.distribute_tensor(x, mesh, [Shard(0)])
            want = torch.nn.utils.clip_grad_norm_(ref, max_norm=0.5, norm_type=norm_type, foreach=foreach)
            got = torch.nn.utils.clip_grad_norm_(ours, max_norm=0.5, norm_type=norm_type, foreach=foreach)
            torch.testing.assert_close(got.full_tensor(), want, **TOL, msg=lambda m: f"{what}: {m}")
            for r, p in zip(ref, ours):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, **TOL, msg=lambda m: f"{what}: {m}")
    return [p.grad.to_local().numel() for p in ours]


def test_clip_grad_norm_with_empty_shards():
    """clip_grad_norm_ (foreach or not; norms 2, 1, 0, inf, -inf) of gradients that some rank holds
    none of (5 and 3 rows Shard(0) on 4 ranks: 2, 2, 1, 0 and 1, 1, 1, 0): the total norm and the
    clipped gradients of one process, on every rank (none raises while the others wait)."""
    held = run_on_ranks(_clip_with_empty_shards, 4, args=(random.randrange(2**31),))
    assert held[3] == [0, 0], held


def _backward_dtype_without_move(rank, world, seed):
    import torch.distributed.tensor as torch_dtensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(5, 3, generator=g, dtype=torch.float64)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)
    for src, dst in (([Replicate()], [Shard(1)]), ([Shard(0)], [Replicate()]), ([Shard(0)], [Shard(1)])):
        grads = []
        for distribute_tensor_ in (ax.distribute_tensor, torch_dtensor.distribute_tensor):
            x = distribute_tensor_(full, mesh, src).requires_grad_()
            y = x.redistribute(mesh, dst, backward_dtype=torch.float32)
            (y * distribute_tensor_(w, mesh, [Replicate()])).sum().backward()
            grads.append(x.grad)
        ours, theirs = grads
        assert ours.dtype == theirs.dtype == torch.float64 and ours.placements == tuple(theirs.placements), (src, dst)
        assert torch.equal(ours.to_local(), theirs.to_local()), (src, dst)
        assert torch.equal(ours.full_tensor(), w.float().double()), (src, dst)   # rounded through fp32
    return True


def test_redistribute_backward_dtype_when_the_gradient_needs_no_move():
    """``redistribute(..., backward_dtype=torch.float32)`` of a float64 tensor: the gradient comes
    back rounded through float32 (torch's DTensor's values), also where it arrives already in the
    input's layout (Replicate -> Shard(1): the gradient is replicated)."""
    assert run_on_ranks(_backward_dtype_without_move, 4, args=(random.randrange(2**31),)) == [True] * 4


# --------------------------------------------------------------------------- styles of one's own; torch's rarer ones


class _ScaledColwise(torch_tp.ColwiseParallel):
    """A subclass with behaviour of its own (as torchtitan's Float8ColwiseParallel): its output doubled."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = outputs * 2.0
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs


class _LocalColwise(torch_tp.ColwiseParallel):
    """A subclass with other defaults only: translated as torch's class."""

    def __init__(self):
        super().__init__(output_layouts=Replicate(), use_local_output=False)


class _TorchNoParallel(torch_tp.ParallelStyle):
    """torchtitan's NoParallel: replicated parameters, the input read as Replicate, a local output."""

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import DTensor as TorchDTensor
        from torch.distributed.tensor import distribute_module as torch_distribute_module

        def inputs(mod, args, mesh):
            return (TorchDTensor.from_local(args[0], mesh, (Replicate(),), run_check=False), *args[1:])

        return torch_distribute_module(module, device_mesh, None, inputs,
                                       lambda mod, out, mesh: out.redistribute(placements=(Replicate(),)).to_local())


class _NoParallel(ax.nn.ParallelStyle):
    """Its port to axedist, written to ParallelStyle's contract."""

    def apply(self, module, mesh, name, shared, src_rank):
        module.register_forward_pre_hook(
            lambda mod, args: (DTensor.from_local(args[0], mesh, [Replicate()]),) + args[1:])
        module.register_forward_hook(lambda mod, args, out: out.redistribute([Replicate()]).to_local())


class _OldSignature(ax.nn.ParallelStyle):
    def apply(self, module, mesh, name, shared):
        pass


class _OnlyTorchApply(ax.nn.ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


def _custom_styles(rank, world, seed):
    from axedist.nn import from_torch_style

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    linear = nn.Linear(6, 8, dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64)
    # a subclass's own methods are never dropped silently: refused, naming them and the way to port it
    with pytest.raises(TypeError, match=r"_ScaledColwise subclasses torch's ColwiseParallel and replaces "
                                        r"_prepare_output_fn.*axedist\.nn\.ParallelStyle subclass.*distribute_module"):
        parallelize_module(copy.deepcopy(linear), mesh, _ScaledColwise())
    with pytest.raises(TypeError, match="replaces _prepare_input_arg"):
        from_torch_style(type("Float8Input", (torch_tp.PrepareModuleInput,),
                              {"_prepare_input_arg": lambda self, *args: args[0]})())
    # torchtitan's NoParallel (only _apply): refused, pointing to its axedist port
    with pytest.raises(TypeError, match=r"_TorchNoParallel is a torch ParallelStyle of its own.*"
                                        r"apply\(module, mesh, name, shared, src_rank\)"):
        parallelize_module(copy.deepcopy(linear), mesh, _TorchNoParallel())
    # a subclass with other defaults only: as torch's run
    theirs, ours = copy.deepcopy(linear), copy.deepcopy(linear)
    torch_tp.parallelize_module(theirs, mesh, _LocalColwise())
    parallelize_module(ours, mesh, _LocalColwise())
    torch.testing.assert_close(ours(x).full_tensor(), theirs(x).full_tensor(), **TOL)
    torch.testing.assert_close(ours(x).full_tensor(), linear(x), **TOL)
    # the port: a column-parallel layer's replicated output into a NoParallel layer; values and
    # gradients as torch's NoParallel and one process
    ref = nn.Sequential(copy.deepcopy(linear), nn.Tanh(), nn.Linear(8, 4, dtype=torch.float64))
    theirs, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    torch_tp.parallelize_module(theirs, mesh, {"0": torch_tp.ColwiseParallel(output_layouts=Replicate()),
                                               "2": _TorchNoParallel()})
    parallelize_module(ours, mesh, {"0": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
                                    "2": _NoParallel()})
    weight = torch.randn(3, 4, dtype=torch.float64)
    for model in (ref, theirs, ours):
        y = model(x)
        assert type(y) is torch.Tensor
        torch.testing.assert_close(y, ref(x), **TOL)
        (y * weight).sum().backward()
    for name, p in ref.named_parameters():
        for model in (theirs, ours):
            torch.testing.assert_close(_full(dict(model.named_parameters())[name].grad), p.grad, **TOL)
    with pytest.raises(TypeError, match=r"_OldSignature\.apply\(module, mesh, name, shared\) does not take what "
                                        r"parallelize passes: apply\(module, mesh, name, shared, src_rank\)"):
        parallelize_module(copy.deepcopy(linear), mesh, _OldSignature())
    with pytest.raises(NotImplementedError, match="_OnlyTorchApply does not override ParallelStyle.apply"):
        parallelize_module(copy.deepcopy(linear), mesh, _OnlyTorchApply())
    return True


def test_styles_of_ones_own_and_torch_subclasses():
    assert run_on_ranks(_custom_styles, 2, args=(random.randrange(2**31),)) == [True] * 2


class _PartialSums(nn.Module):
    """Given the whole input (local), returns this rank's partial sum of ``x @ W^T`` (the input
    features of rank r's share): a ``Partial`` output, as torchtitan's MoE experts give."""

    def __init__(self, rank, world):
        super().__init__()
        self.lin = nn.Linear(8, 6, bias=False, dtype=torch.float64)
        self.rank, self.world = rank, world

    def forward(self, x):
        assert type(x) is torch.Tensor   # use_local_input=True
        cols = torch.arange(8).chunk(self.world)[self.rank]
        return F.linear(x[..., cols], self.lin.weight[:, cols])


class _Pair(nn.Module):
    def forward(self, a, b):
        self.seen = type(b)
        return (a.to_local() + b,)


def _prepare_input_output(rank, world, seed):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    ref = _PartialSums(0, 1)
    theirs, ours = _PartialSums(rank, world), _PartialSums(rank, world)
    theirs.load_state_dict(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    style = lambda: torch_tp.PrepareModuleInputOutput(  # noqa: E731
        input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_input=True,
        output_layouts=Partial(), desired_output_layouts=Shard(0))
    torch_tp.parallelize_module(theirs, mesh, style())
    parallelize_module(ours, mesh, style())
    x = torch.randn(4 * world, 8, dtype=torch.float64)
    weight = torch.randn(4 * world, 6, dtype=torch.float64)
    y_ref = ref(x)
    (y_ref * weight).sum().backward()
    grads = []
    for model in (theirs, ours):
        x_piece = x.chunk(world)[rank].clone().requires_grad_()
        y = model(x_piece)
        assert type(y) is torch.Tensor   # use_local_output=True
        torch.testing.assert_close(y, y_ref.chunk(world)[rank], **TOL)
        (y * weight.chunk(world)[rank]).sum().backward()
        grads.append((x_piece.grad, model.lin.weight.grad))
    torch.testing.assert_close(grads[1], grads[0], **TOL)
    # one output returned as (y,): handed out bare, as torch's; an input whose input_layouts entry is None
    # is left alone, whatever its desired layout, as torch's
    a, b = torch.randn(2 * world, 3, dtype=torch.float64), torch.randn(2 * world, 3, dtype=torch.float64)
    outs = []
    for parallelize in (torch_tp.parallelize_module, parallelize_module):
        pair = _Pair()
        parallelize(pair, mesh, torch_tp.PrepareModuleInput(input_layouts=(Shard(0), None),
                                                            desired_input_layouts=(Replicate(), Replicate())))
        parallelize(pair, mesh, torch_tp.PrepareModuleOutput(output_layouts=Replicate(),
                                                             desired_output_layouts=Shard(0)))
        outs.append(pair(a.chunk(world)[rank], b))
        assert pair.seen is torch.Tensor
    for out in outs:
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, (a + b).chunk(world)[rank], **TOL)
    return True


def test_prepare_module_input_output_as_torch():
    assert run_on_ranks(_prepare_input_output, 2, args=(random.randrange(2**31),)) == [True] * 2


def _src_data_rank_out_of_range(rank, world):
    from axedist.mesh import MeshError

    mesh = init_device_mesh("cpu", (world,))
    for src in (world, -1, 1.0):
        with pytest.raises(MeshError, match=rf"src_data_rank={src!r} is not a rank of mesh .* 0 to {world - 1}"):
            parallelize_module(nn.Linear(4, 4), mesh, {"": ColwiseParallel()}, src_data_rank=src)
    return True


def test_src_data_rank_outside_the_mesh_is_an_error():
    assert run_on_ranks(_src_data_rank_out_of_range, 2) == [True] * 2


def _collectives_on_dtensors(rank, world):
    """Every torch.distributed call given an axedist DTensor raises the same TypeError on every
    rank (torch's DTensor has no rule for them either); the DTensor is unchanged and the ranks go on."""
    import torch.distributed as dist

    mesh = ax.init_mesh((world,), ("tp",))
    whole = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    errors = []
    for grad in (False, True):
        x = ax.distribute_tensor(whole.clone(), mesh, [Shard(0)]).requires_grad_(grad)
        calls = [lambda: dist.all_reduce(x), lambda: dist.broadcast(x, 0), lambda: dist.reduce(x, 0),
                 lambda: dist.all_gather([torch.zeros(2, 3) for _ in range(world)], x),
                 lambda: dist.all_to_all_single(torch.zeros(2, 3), x),
                 # no peer posts a receive: the sender raises before sending anything
                 lambda: dist.send(x, dst=(rank + 1) % world), lambda: dist.isend(x, dst=(rank + 1) % world)]
        for call in calls:
            with pytest.raises(TypeError, match=r"torch.distributed's \w+ \(c10d::\w+\) got an axedist DTensor"):
                call()
            errors.append(True)
        torch.testing.assert_close(x.full_tensor(), whole, rtol=0, atol=0)
    ones = torch.ones(2)
    dist.all_reduce(ones)  # the ranks still meet
    return len(errors), ones.tolist()


def test_torch_distributed_calls_on_a_dtensor_are_refused():
    for count, summed in run_on_ranks(_collectives_on_dtensors, 2):
        assert count == 14 and summed == [2.0, 2.0]
