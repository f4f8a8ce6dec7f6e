"""``fully_shard(..., shard_placement_fn=fn)`` sharding parameters on any dim (torch's ``Shard(d)``).

Each parameter's dim is drawn from the test's seed, as are the model's sizes (so dims that do not
divide by the data-parallel degree come up: padded, as dim 0 is). Against the one-process model
(fp64, rel 1e-9): losses, every gradient, ``clip_grad_norm_``, the parameters and the optimizer
state's layout after three AdamW steps, at dp = 2 and 4 (1-D), dp 2 x tp 2 (column- and row-parallel
weights, sharded over dp on their tp-local tensors) and HSDP 2 x 2. Against torch's ``fully_shard``
with the same ``shard_placement_fn`` on the same gloo ranks (sizes that divide, as torch requires on
dims > 0): the local shards (``to_local()``), the placements, losses, gradients and parameters after
the steps, fp64 and with fp32 compute (``MixedPrecisionPolicy``). A DCP checkpoint and a full state
dict written at one set of dims and degree load into a model sharded on other dims at another
degree. Bad placements are clear errors on every rank.
"""

import copy
import math
import random

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import DTensor
from axedist.layout import LayoutError
from axedist.mesh import DeviceMesh
from axedist.nn import ColwiseParallel, RowwiseParallel, checkpoint, fsdp_units, fully_shard, parallelize_module
from axedist.nn.fsdp import MixedPrecisionPolicy, data_parallel_specs
from axedist.nn.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict
from axedist.spec import placements_of, spec_from_placements
from axedist.testing import run_on_ranks
from tests.fsdp_reference import TOL64, gradients_then_step, same_after_steps
STEPS = 3


class _Ffn(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


class _Net(nn.Module):
    """An embedding, a block (a column- then a row-parallel linear under TP, biases too), a norm and
    an output projection: 2-D and 1-D parameters of sizes the test draws."""

    def __init__(self, vocab, dim, hidden):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = _Ffn(dim, hidden)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        return self.out(self.norm(self.block(self.emb(tokens))))


def _tp_plan():
    """axedist's: every other parameter becomes a replicated DTensor on tp, the activations DTensors."""
    return {"block.up": ColwiseParallel(), "block.down": RowwiseParallel()}


def _torch_tp_plan():
    """torch's: the other parameters stay plain, the activations plain tensors between the styles."""
    from torch.distributed.tensor import parallel as tp
    return {"block.up": tp.ColwiseParallel(), "block.down": tp.RowwiseParallel()}


def _value(loss) -> torch.Tensor:
    """A loss's value (a replicated DTensor's whole tensor)."""
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().clone()


def _local_shape(p) -> tuple:
    """The shape ``fully_shard`` cuts: a tensor-parallel parameter's local tensor, else the whole."""
    return tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)


def _draw_dims(model, rng: random.Random, parts: int, even: bool) -> dict:
    """A dim per parameter name, as ``shard_placement_fn`` gives it: ``None`` (dim 0), ``Shard(d)``
    or ``Shard(d - ndim)``. ``even``: only dims > 0 that divide by ``parts`` (torch refuses
    others). The embedding (odd ``dim`` unless ``even``: padded) and the row-parallel weight (on
    tp: cut on the dim tp cuts) on dim 1 always."""
    dims = {}
    for name, p in model.named_parameters():
        shape = _local_shape(p)
        allowed = [d for d in range(len(shape)) if d == 0 or not even or shape[d] % parts == 0]
        d = 1 if name in ("emb.weight", "block.down.weight") and 1 in allowed else rng.choice(allowed)
        dims[name] = rng.choice([None, Shard(d), Shard(d - len(shape))]) if d == 0 else \
            rng.choice([Shard(d), Shard(d - len(shape))])
    return dims


def _placement_fn(model, dims: dict):
    """``shard_placement_fn`` from ``dims`` (by the parameter's name in ``model``, taken now)."""
    by_id = {id(p): dims[name] for name, p in model.named_parameters()}
    return lambda param: by_id[id(param)]


def _dim_of(placement, ndim: int) -> int:
    return 0 if placement is None else placement.dim % ndim


def _setup(kind: str, world: int):
    """``(mesh, fully_shard kwargs, data axes, tp)`` of a case."""
    if kind == "1d":
        return DeviceMesh("cpu", (world,), ("dp",)), {}, ("dp",), False
    if kind == "dp_tp":
        return DeviceMesh("cpu", (2, 2), ("dp", "tp")), {}, ("dp",), True
    assert kind == "hsdp"
    return DeviceMesh("cpu", (2, 2), ("rep", "shard")), dict(dp_axes="shard", replicate_axes="rep"), \
        ("rep", "shard"), False


def _data_index(mesh, data_axes) -> int:
    index = 0
    for a in data_axes:
        index = index * mesh.size(a) + mesh.coordinates()[a]
    return index


def _shard(model, mesh, kwargs, dims, tp, **more):
    if tp:
        parallelize_module(model, mesh["tp"], _tp_plan())
    fn = _placement_fn(model, dims)
    fully_shard(model.block, mesh, shard_placement_fn=fn, **kwargs, **more)
    fully_shard(model, mesh, shard_placement_fn=fn, **kwargs, **more)
    return model


def _sizes(rng: random.Random, even_by: int | None):
    """``(vocab, dim, hidden)``: ``dim`` odd (no degree divides it), or ``dim`` and ``hidden``
    multiples of ``even_by``."""
    if even_by is None:
        return rng.randint(5, 13), 2 * rng.randint(1, 4) + 1, 2 * rng.randint(2, 6)
    return rng.randint(5, 13), even_by * rng.randint(1, 3), even_by * rng.randint(1, 3)


# ---------------------------------------------------------------------------
# Against the one-process model
# ---------------------------------------------------------------------------


def _matches_one_process(rank, world, s, kind, options):
    mesh, kwargs, data_axes, tp = _setup(kind, world)
    rng = random.Random(s)
    vocab, dim, hidden = _sizes(rng, None)
    torch.manual_seed(s)
    ref = _Net(vocab, dim, hidden).double()
    par = copy.deepcopy(ref)
    parts = math.prod(mesh.size(a) for a in data_axes)
    if tp:
        parallelize_module(par, mesh["tp"], _tp_plan())
    cut = {name: _local_shape(p) for name, p in par.named_parameters()}  # what the data axes cut
    dims = _draw_dims(par, rng, parts, even=False)
    more = {"reshard_after_forward": False} if options.get("keep") else {}
    _shard(par, mesh, kwargs, dims, tp=False, **more)
    records = {id(r.param): r for u in fsdp_units(par) for r in u.params}
    assert len(records) == len(dims), (len(records), sorted(dims))
    for name, p in par.named_parameters():
        assert isinstance(p, DTensor) and p.mesh == mesh, name
        assert records[id(p)].dim == _dim_of(dims[name], p.dim()), (name, records[id(p)].dim, dims[name])
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2, foreach=False)
    d = _data_index(mesh, data_axes)
    g = torch.Generator().manual_seed(s + 1)
    uneven = set()
    label = lambda name: f"{name} ({dims[name]})"  # noqa: E731
    for step in range(STEPS):
        tokens = torch.randint(0, vocab, (2 * parts, 5), generator=g)
        loss_ref = ref(tokens).logsumexp(-1).mean()
        loss = par(tokens[2 * d:2 * d + 2]).logsumexp(-1).mean()
        value = _value(loss)
        torch.distributed.all_reduce(value, group=mesh.group(data_axes))
        torch.testing.assert_close(value / parts, loss_ref.detach(), **TOL64, msg=lambda m: f"step {step} loss: {m}")
        loss_ref.backward()
        loss.backward()
        gradients_then_step(step, ref, par, opt_ref, opt_par, clip=0.05 if options.get("clip") else None, label=label)
    same_after_steps(ref, par, opt_ref, opt_par, STEPS, label=label)
    for name, p in par.named_parameters():
        dim = _dim_of(dims[name], p.dim())
        if dim > 0 and cut[name][dim] % mesh.size(data_axes[-1]):
            uneven.add(name)
    assert "emb.weight" in uneven, uneven  # padded on dim 1
    return {name: _dim_of(dims[name], p.dim()) for name, p in par.named_parameters()}, sorted(uneven)


CASES = {
    "dp2": (2, "1d", {}),
    "dp4-clip": (4, "1d", {"clip": True}),
    "dp2xtp2": (4, "dp_tp", {}),
    "hsdp2x2-keep": (4, "hsdp", {"keep": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_any_dim_matches_one_process(case, seed):
    """Every parameter on a drawn dim (the embedding on its odd dim 1: padded), fp64, three AdamW steps."""
    world, kind, options = CASES[case]
    out = run_on_ranks(_matches_one_process, world, args=(seed, kind, options))
    assert all(o == out[0] for o in out), "ranks disagree"


# ---------------------------------------------------------------------------
# Against torch's fully_shard with the same shard_placement_fn
# ---------------------------------------------------------------------------


def _against_torch(rank, world, s, kind, mixed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

    names = {"1d": ("dp",), "dp_tp": ("dp", "tp"), "hsdp": ("rep", "shard")}[kind]
    shape = (world,) if kind == "1d" else (2, 2)
    torch_world = init_device_mesh("cpu", shape, mesh_dim_names=names)
    where = torch_world["dp"] if kind == "dp_tp" else torch_world  # torch's spelling for both: the dp mesh
    tp = kind == "dp_tp"
    data_axes = ("dp",) if kind != "hsdp" else ("rep", "shard")
    parts = math.prod(torch_world[a].size() for a in data_axes)
    shard_parts = world // (2 if kind != "1d" else 1)
    rng = random.Random(s)
    vocab, dim, hidden = _sizes(rng, 2 * shard_parts)
    torch.manual_seed(s)
    ours = _Net(vocab, dim, hidden).double()
    theirs = copy.deepcopy(ours)
    if tp:
        parallelize_module(ours, torch_world["tp"], _tp_plan())
        torch_parallelize_module(theirs, torch_world["tp"], _torch_tp_plan())
    dims = _draw_dims(ours, rng, shard_parts, even=True)
    cut = {name: _local_shape(p) for name, p in ours.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64) if mixed else \
        MixedPrecisionPolicy()
    for model, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        fn = _placement_fn(model, dims)
        shard(model.block, mesh=where, shard_placement_fn=fn, mp_policy=policy)
        shard(model, mesh=where, shard_placement_fn=fn, mp_policy=policy)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert isinstance(q, TorchDTensor), name
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0, msg=name)
        dim = _dim_of(dims[name], p.dim())
        if cut[name][dim] % shard_parts == 0:
            assert p.to_local().shape == q.to_local().shape, (name, dims[name])
        if p.to_local().shape == q.to_local().shape:
            assert torch.equal(p.to_local(), q.to_local()), f"{name} ({dims[name]}): local shards differ"
        # torch's plain parameters live on the dp mesh only, axedist's on the whole (replicated on tp)
        expected = tuple(q.placements) + (Replicate(),) * (len(p.placements) - q.device_mesh.ndim)
        assert tuple(p.placements) == expected, (name, p.placements, q.placements)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ours, theirs)]
    d = _data_index(DeviceMesh.from_torch(torch_world), data_axes)
    g = torch.Generator().manual_seed(s + 1)
    tol = dict(rtol=1e-5, atol=1e-7) if mixed else TOL64
    for step in range(STEPS):
        tokens = torch.randint(0, vocab, (2 * parts, 5), generator=g)[2 * d:2 * d + 2]
        losses = []
        for model in (ours, theirs):
            loss = model(tokens).logsumexp(-1).mean()
            loss.backward()
            losses.append(_value(loss))
        torch.testing.assert_close(losses[0], losses[1], **tol, msg=lambda m: f"step {step} loss: {m}")
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), **tol,
                                       msg=lambda m: f"step {step}, gradient of {name} ({dims[name]}): {m}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **tol, msg=lambda m: f"{name}: {m}")
    return {name: str(p.placements) for name, p in ours.named_parameters()}


@pytest.mark.parametrize("kind, world, mixed", [("1d", 2, False), ("dp_tp", 4, False), ("hsdp", 4, False),
                                                 ("dp_tp", 4, True)],
                         ids=["dp2", "dp2xtp2", "hsdp2x2", "dp2xtp2-fp32-compute"])
def test_any_dim_matches_torch_fully_shard(kind, world, mixed, seed):
    out = run_on_ranks(_against_torch, world, args=(seed, kind, mixed))
    assert all(o == out[0] for o in out), "ranks disagree"


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


def _layouts(rank, world):
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    out = {}
    plain = data_parallel_specs(None, (8, 6), mesh, ("dp",), dim=1)[1]
    out["plain"] = (str(plain.layout), placements_of(plain))
    for name, placement in (("colwise", Shard(0)), ("rowwise", Shard(1))):
        view = spec_from_placements((8, 6), mesh["tp"], [placement])
        _, sharded = data_parallel_specs(view, (8, 6), mesh, ("dp",), dim=1)
        try:
            placements = placements_of(sharded)
        except LayoutError:  # padding inside a dim: no placements say it
            placements = None
        out[name] = (str(sharded.layout), sharded.padded, sharded.true_index, placements)
    hsdp = DeviceMesh("cpu", (2, 2), ("rep", "shard"))
    out["hsdp"] = str(data_parallel_specs(None, (4, 6), hsdp, ("shard",), ("rep",), dim=1)[1].layout)
    out["uneven-end"] = data_parallel_specs(None, (4, 5), DeviceMesh("cpu", (4,), ("dp",)), ("dp",), dim=1)[1].padded
    return out


def test_layouts_on_dim_1():
    out = run_on_ranks(_layouts, 4)
    o = out[0]
    assert o["plain"] == ("S[(8,2,3):(3,1@dp,1)] + R[2:1@tp]", (Shard(1), Replicate()))
    assert o["colwise"] == ("S[(2,4,2,3):(1@tp,3,1@dp,1)]", (8, 6), None, (Shard(1), Shard(0)))
    # (8, 6) row-parallel: 3 columns per tp rank, 2 + 1 per dp rank, padded to 8 columns
    assert o["rowwise"] == ("S[(8,2,2,2):(2,1@tp,1@dp,1)]", (8, 8), (None, (0, 1, 2, -1, 3, 4, 5, -1)), None)
    assert o["hsdp"] == "S[(4,2,3):(3,1@shard,1)] + R[2:1@rep]"
    assert o["uneven-end"] == (4, 8)  # chunks of 2: 2, 2, 1, 0 columns


# ---------------------------------------------------------------------------
# Checkpoints and full state dicts across dims and degrees
# ---------------------------------------------------------------------------


def _trained(model, vocab, mesh, data_axes, s, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    parts = math.prod(mesh.size(a) for a in data_axes)
    d = _data_index(mesh, data_axes)
    g = torch.Generator().manual_seed(s)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (2 * parts, 5), generator=g)[2 * d:2 * d + 2]
        model(tokens).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _checkpoint_round_trip(rank, world, s, path):
    rng = random.Random(s)
    vocab, dim, hidden = _sizes(rng, None)
    dp4, kwargs4, axes4, _ = _setup("1d", world)
    torch.manual_seed(s)
    first = _Net(vocab, dim, hidden).double()
    first_dims = _draw_dims(first, rng, 4, even=False)
    _shard(first, dp4, kwargs4, first_dims, tp=False)
    opt = _trained(first, vocab, dp4, axes4, s + 1)
    checkpoint.save(first, f"{path}/ckpt", optimizer=opt)
    want = {name: p.full_tensor() for name, p in first.named_parameters()}
    want_moments = {name: opt.state[p]["exp_avg"].full_tensor() for name, p in first.named_parameters()}
    out = []
    # into (dp, tp) = (2, 2) and HSDP, each parameter on another dim where it has one
    for kind in ("dp_tp", "hsdp"):
        mesh, kwargs, _, tp = _setup(kind, world)
        torch.manual_seed(s + 2)
        model = _Net(vocab, dim, hidden).double()
        if tp:
            parallelize_module(model, mesh["tp"], _tp_plan())
        other = {}
        for name, p in model.named_parameters():
            mine = _dim_of(first_dims[name], p.dim())
            other[name] = Shard((mine + 1) % p.dim())
        _shard(model, mesh, kwargs, other, tp=False)
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        checkpoint.load(model, f"{path}/ckpt", optimizer=fresh)
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), want[name]), f"{kind}: {name}"
            moment = fresh.state[p]["exp_avg"]
            assert moment._spec == p._spec, f"{kind}: {name}'s moment is not laid out like it"
            assert torch.equal(moment.full_tensor(), want_moments[name]), f"{kind}: moment of {name}"
        # a full state dict (gathered plain tensors), and the optimizer's, equal the values
        full = StateDictOptions(full_state_dict=True)
        state = get_model_state_dict(model, options=full)
        assert all(torch.equal(state[name], want[name]) for name in want), kind
        moments = get_optimizer_state_dict(model, fresh, options=full)["state"]
        assert all(torch.equal(moments[name]["exp_avg"], want_moments[name]) for name in want), kind
        out.append(kind)
    # a full state dict into a model sharded on yet other dims at dp = 4
    torch.manual_seed(s + 3)
    last = _Net(vocab, dim, hidden).double()
    _shard(last, dp4, kwargs4, _draw_dims(last, rng, 4, even=False), tp=False)
    set_model_state_dict(last, get_model_state_dict(first, options=StateDictOptions(full_state_dict=True)),
                         options=StateDictOptions(full_state_dict=True))
    for name, p in last.named_parameters():
        assert torch.equal(p.full_tensor(), want[name]), f"full state dict: {name}"
    return out


def test_checkpoint_and_full_state_dict_across_dims_and_degrees(seed, tmp_path):
    """DCP at dp = 4 on drawn dims -> dp 2 x tp 2 and HSDP 2 x 2 on other dims (parameters and AdamW
    moments, the moments laid out like their parameter); full state dicts gathered and placed."""
    assert run_on_ranks(_checkpoint_round_trip, 4, args=(seed, str(tmp_path))) == [["dp_tp", "hsdp"]] * 4


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def _errors(rank, world):
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

    mesh = DeviceMesh("cpu", (world,), ("dp",))

    def error(fn):
        try:
            fn(nn.Linear(4, 6))
        except (ValueError, TypeError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    out = {
        "dim": error(lambda m: fully_shard(m, mesh, shard_placement_fn=lambda p: Shard(p.dim()))),
        "negative": error(lambda m: fully_shard(m, mesh, shard_placement_fn=lambda p: Shard(-p.dim() - 1))),
        "replicate": error(lambda m: fully_shard(m, mesh, shard_placement_fn=lambda p: Replicate())),
        "other_mesh": error(lambda m: fully_shard(m, mesh, shard_placement_fn=lambda p: ShardPlacementResult(
            Shard(0), None))),
        "traced": error(lambda m: fully_shard(m, mesh, traced=True, shard_placement_fn=lambda p: Shard(1))),
    }
    scalar = nn.Module()
    scalar.gain = nn.Parameter(torch.ones(()))
    try:
        fully_shard(scalar, mesh, shard_placement_fn=lambda p: Shard(0))
        out["scalar"] = "no error"
    except ValueError as e:
        out["scalar"] = f"ValueError: {e}"
    fine = nn.Linear(4, 6)
    fully_shard(fine, mesh, shard_placement_fn=lambda p: None if p.dim() == 1 else Shard(-1))  # a refused one left
    out["after"] = str(fine.weight.placements)                                                # nothing behind
    return out


def test_bad_placements_are_clear_errors_on_every_rank():
    out = run_on_ranks(_errors, 2)
    assert all(o == out[0] for o in out), "ranks disagree"
    o = out[0]
    assert o["dim"].startswith("ValueError") and "Shard(dim=2)" in o["dim"] and "[-2, 2)" in o["dim"], o["dim"]
    assert "weight" in o["dim"] and "(6, 4)" in o["dim"], o["dim"]
    assert o["negative"].startswith("ValueError") and "Shard(dim=-3)" in o["negative"], o["negative"]
    assert o["replicate"].startswith("TypeError") and "Replicate()" in o["replicate"], o["replicate"]
    assert o["other_mesh"].startswith("NotImplementedError") and "another mesh" in o["other_mesh"], o["other_mesh"]
    assert o["traced"].startswith("NotImplementedError") and "shard_placement_fn" in o["traced"], o["traced"]
    assert o["scalar"].startswith("ValueError") and "scalar" in o["scalar"], o["scalar"]
    assert o["after"] == "(Shard(dim=1),)", o["after"]
