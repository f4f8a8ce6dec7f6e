"""torch 2.13's FSDP2 names on axedist (``from axedist.nn import ...`` in place of
``from torch.distributed.fsdp import ...``), on gloo ranks, in fp64.

``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(...))`` on the whole mesh: a dp x tp model
whose parameters are DTensors on the whole mesh (Replicate on dp) against axedist's own spelling
(the same model tensor parallel on ``mesh["tp"]``, the same sharded layouts), the one-process model
and torch's ``fully_shard`` with the same call; the batch read per rank (each dp rank's own, torch's
averaging) and sharded over dp (the gradient a pending sum over dp, divide factor 1); HSDP,
a tuple of shard dims and DDP (replicate only); the refusals. ``register_fsdp_forward_method``
(a ``generate`` that calls submodules and uses the root's parameters) against one process and
torch's; ``share_comm_ctx``, ``UnshardHandle``, and torch's ``FSDPModule`` methods.
"""

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import DTensor, distribute_tensor
from axedist.mesh import DeviceMesh
from axedist.nn import (DataParallelMeshDims, FSDPModule, UnshardHandle, fsdp_units, fully_shard,
                        register_fsdp_forward_method, share_comm_ctx)
from axedist.testing import run_on_ranks

TOL64 = dict(rtol=1e-9, atol=1e-11)
STEPS = 3


# ---------------------------------------------------------------------------
# A dp x tp model written for DTensors on any mesh (plain tensors: the one-process model)
# ---------------------------------------------------------------------------


class _MLP(nn.Module):
    """Column-parallel ``w1``/``b1``, row-parallel ``w2``, a replicated ``gain``; dims that split
    unevenly over dp (10 rows: 5 per tp rank, 3 + 2 per dp rank)."""

    def __init__(self, dim=6, hidden=10):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)
        self.b1 = nn.Parameter(torch.randn(hidden) / 4)
        self.w2 = nn.Parameter(torch.randn(dim, hidden) / hidden**0.5)
        self.gain = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        y = torch.relu(x @ self.w1.t() + self.b1) @ self.w2.t()
        if isinstance(y, (DTensor, TorchDTensor)):  # pending a sum over tp
            y = y.redistribute(placements=[Replicate()] * y.device_mesh.ndim)
        return x + torch.tanh(y) * self.gain


class _Stack(nn.Module):
    """Two blocks and a root parameter; ``lift`` makes the input the DTensor the blocks compute with
    (None: plain tensors)."""

    def __init__(self, lift=None):
        super().__init__()
        self.blocks = nn.ModuleList([_MLP(), _MLP()])
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.lift = lift

    def forward(self, x):
        h = self.lift(x) if self.lift is not None else x
        for block in self.blocks:
            h = block(h)
        return h * self.scale


TP_PLACEMENT = {"w1": Shard(0), "b1": Shard(0), "w2": Shard(1), "gain": Replicate(), "scale": Replicate()}


def _distribute(model, make, mesh, lead=(), tp=True):
    """Every parameter as ``make(value, mesh, placements)``: ``lead`` placements first (the data
    axes of a whole mesh), then the tensor-parallel one (``tp``) or none."""
    for sub in model.modules():
        for name, p in list(sub._parameters.items()):
            placements = list(lead) + ([TP_PLACEMENT[name]] if tp else [])
            sub._parameters[name] = nn.Parameter(make(p.detach().clone(), mesh, placements))
    return model


def _axedist_make(value, mesh, placements):
    return distribute_tensor(value, mesh, placements)


def _torch_make(value, mesh, placements):
    return torch.distributed.tensor.distribute_tensor(value, mesh, placements)


def _lift(cls, mesh, batch_placement=Replicate()):
    """The input as a DTensor on ``mesh``: the data axis ``batch_placement`` (Replicate: each dp rank's
    own batch, as FSDP reads it; Shard(0): the global batch), replicated on the others."""
    def lift(x):
        placements = [batch_placement] + [Replicate()] * (mesh.ndim - 1)
        parts = mesh.size(0) if isinstance(batch_placement, Shard) else 1
        shape = (x.shape[0] * parts,) + tuple(x.shape[1:])
        return cls.from_local(x, mesh, placements, shape=shape, stride=tuple(torch.empty(shape).stride()))
    return lift


@functools.cache
def _torch_world(shape, names):
    """One torch mesh per shape in a rank process: torch's fully_shard with dp_mesh_dims wants the
    parameters' mesh to be the very object it is given, and torch's DTensor caches specs (meshes
    included) across calls, so a second equal mesh made in a later test of the same rank process
    met parameters on the first (torch 2.13)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _plain(t):
    return t.full_tensor() if isinstance(t, (DTensor, TorchDTensor)) else t


def _train(models, ref, steps, batch_of, loss_of, seed):
    """``steps`` AdamW steps of every model and of ``ref`` on the same random batches (``batch_of``
    gives a model its part): each model's loss (this rank's), gradients (whole) per step and the
    parameters (whole) after, as plain floats, the one-process model's first."""
    g = torch.Generator().manual_seed(seed)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in models + [ref]]
    record = []
    for _ in range(steps):
        x, target = (torch.randn(8, 6, generator=g, dtype=torch.float64) for _ in range(2))
        ref_loss = ((ref(x) - target) ** 2).mean()
        ref_loss.backward()
        row = [[float(ref_loss.detach())] + [float(v) for p in ref.parameters() for v in p.grad.flatten()]]
        for model in models:
            loss = loss_of(model, *batch_of(model, x, target))
            loss.backward()
            row.append([float(_plain(loss))] + [float(v) for p in model.parameters() for v in _plain(p.grad).flatten()])
        record.append(row)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    after = [[float(v) for p in m.parameters() for v in _plain(p).detach().flatten()] for m in [ref] + models]
    return record, after


def _f64(values):
    return torch.tensor(values, dtype=torch.float64)


def _same(record, after, names):
    """Every model's losses, gradients and parameters equal the one-process model's (column 0)."""
    for step, row in enumerate(record):
        for name, values in zip(names, row[1:]):
            torch.testing.assert_close(_f64(values), _f64(row[0]), **TOL64,
                                       msg=lambda m: f"step {step}, {name} (loss, then gradients): {m}")
    for name, values in zip(names, after[1:]):
        torch.testing.assert_close(_f64(values), _f64(after[0]), **TOL64,
                                   msg=lambda m: f"{name}: parameters after {len(record)} steps: {m}")


def _mean_over(value, group, parts):
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value / parts


def _shard_each(model, shard):
    for block in model.blocks:
        shard(block)
    shard(model)
    return model


def _dp_tp(rank, world, s, batch_on_dp):
    """(dp, tp) = (2, 2): torch's spelling with dp_mesh_dims on axedist, axedist's own spelling, and
    torch's fully_shard with dp_mesh_dims, each against the one-process model."""
    torch_world = _torch_world((2, 2), ("dp", "tp"))
    mesh = DeviceMesh.from_torch(torch_world)
    torch.manual_seed(s)
    ref = _Stack().double()
    batch = Shard(0) if batch_on_dp else Replicate()
    named = _distribute(copy.deepcopy(ref), _axedist_make, torch_world, [Replicate()])
    named.lift = _lift(DTensor, torch_world, batch)
    theirs = _distribute(copy.deepcopy(ref), _torch_make, torch_world, [Replicate()])
    theirs.lift = _lift(TorchDTensor, torch_world, batch)
    dims = DataParallelMeshDims(shard="dp")
    _shard_each(named, lambda m: fully_shard(m, mesh=torch_world, dp_mesh_dims=dims))
    _shard_each(theirs, lambda m: torch_fsdp.fully_shard(m, mesh=torch_world, dp_mesh_dims=dims))
    for p, q in zip(named.parameters(), theirs.parameters()):  # torch's pieces: the same local shards
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0)
    models, names = [named, theirs], ["dp_mesh_dims", "torch's dp_mesh_dims"]
    d = mesh.coordinates()["dp"]
    mine = slice(4 * d, 4 * d + 4)
    if batch_on_dp:  # the global batch, the loss its mean: gradients pending a sum over dp, summed (factor 1)
        for model in models:
            for m in model.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(1.0)

        def batch_of(model, x, target):
            return x[mine], (named if model is named else theirs).lift(target[mine].contiguous())
    else:  # each dp rank's own batch and loss (its mean over dp is the one-process loss)
        own = _distribute(copy.deepcopy(ref), _axedist_make, mesh["tp"])
        own.lift = _lift(DTensor, mesh["tp"])
        _shard_each(own, lambda m: fully_shard(m, mesh))  # axedist's spelling: the whole mesh, its "dp" axis
        for p, q in zip(own.parameters(), named.parameters()):  # the same sharded layouts
            assert p._spec == q._spec, (p._spec, q._spec)
        models, names = [own] + models, ["own spelling"] + names

        def batch_of(model, x, target):
            return x[mine], target[mine]

    def loss_of(model, x, target):
        out = model(x)
        if batch_on_dp:  # the global mean, as a plain scalar on every rank
            return ((out - target) ** 2).mean().full_tensor()
        if isinstance(out, (DTensor, TorchDTensor)):
            out = out.to_local()
        return ((out - target) ** 2).mean()

    record, after = _train(models, ref, STEPS, batch_of, loss_of, s + 1)
    if not batch_on_dp:
        for row in record:
            for column in row[1:]:
                column[0] = float(_mean_over(torch.tensor(column[0], dtype=torch.float64), mesh.group("dp"), 2))
    _same(record, after, names)
    return True


@pytest.mark.parametrize("batch_on_dp", [False, True], ids=["batch-per-rank", "batch-sharded-on-dp"])
def test_dp_mesh_dims_dp_x_tp_matches_own_spelling_one_process_and_torch(batch_on_dp, seed):
    """A dp x tp model (mesh (2, 2), parameters DTensors on the whole mesh, Replicate on dp, column /
    row parallel on tp, uneven over dp) sharded with ``fully_shard(block, mesh=world_mesh,
    dp_mesh_dims=DataParallelMeshDims(shard="dp"))``: the sharded layouts of axedist's own spelling,
    torch's local shards; the losses, gradients (full_tensor) and parameters after three AdamW steps
    of the one-process model, as axedist's spelling and torch's fully_shard with the same call give.
    With the batch sharded over dp and the loss its global mean (gradients pending a sum over dp,
    divide factor 1) too."""
    assert run_on_ranks(_dp_tp, 4, args=(seed, batch_on_dp)) == [True] * 4


DATA_DIMS = {  # dp_mesh_dims on a (rep, dp) = (2, 2) mesh; the same in axedist's spelling (None: none)
    "hsdp": (DataParallelMeshDims(shard="dp", replicate="rep"), dict(dp_axes="dp", replicate_axes="rep")),
    "shard-tuple": (DataParallelMeshDims(shard=("rep", "dp")), dict(dp_axes=("rep", "dp"))),
    "ddp": (DataParallelMeshDims(replicate=("rep", "dp")), None),
}


def _data_dims(rank, world, s, case):
    """Data parallel only, 4 ranks on (rep, dp) = (2, 2), each its own batch: dp_mesh_dims against
    axedist's spelling (same layouts), the one-process model and torch's fully_shard."""
    dims, spelling = DATA_DIMS[case]
    torch_world = _torch_world((2, 2), ("rep", "dp"))
    mesh = DeviceMesh.from_torch(torch_world)
    torch.manual_seed(s)
    ref = _Stack().double()
    named = _distribute(copy.deepcopy(ref), _axedist_make, mesh, [Replicate()] * 2, tp=False)
    theirs = _distribute(copy.deepcopy(ref), _torch_make, torch_world, [Replicate()] * 2, tp=False)
    named.lift, theirs.lift = _lift(DTensor, mesh), _lift(TorchDTensor, torch_world)
    _shard_each(named, lambda m: fully_shard(m, mesh=mesh, dp_mesh_dims=dims))
    _shard_each(theirs, lambda m: torch_fsdp.fully_shard(m, mesh=torch_world, dp_mesh_dims=dims))
    models, names = [named, theirs], ["dp_mesh_dims", "torch's dp_mesh_dims"]
    for p, q in zip(named.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0)
    if spelling is not None:
        own = _Stack().double()
        own.load_state_dict(ref.state_dict())
        _shard_each(own, lambda m: fully_shard(m, mesh, **spelling))
        for p, q in zip(own.parameters(), named.parameters()):
            assert p._spec == q._spec, (p._spec, q._spec)
        models, names = [own] + models, ["own spelling"] + names
    d = mesh.position()  # the data-parallel rank: every rank its own batch
    mine = slice(2 * d, 2 * d + 2)

    def loss_of(model, x, target):
        out = model(x)
        return (((out.to_local() if isinstance(out, (DTensor, TorchDTensor)) else out) - target) ** 2).mean()

    record, after = _train(models, ref, STEPS, lambda model, x, target: (x[mine], target[mine]), loss_of, s + 1)
    for row in record:
        for column in row[1:]:
            column[0] = float(_mean_over(torch.tensor(column[0], dtype=torch.float64), None, 4))
    _same(record, after, names)
    return {name: str(p._spec.layout) for name, p in named.named_parameters()}


@pytest.mark.parametrize("case", list(DATA_DIMS))
def test_dp_mesh_dims_hsdp_shard_tuple_and_ddp(case, seed):
    """``replicate=`` (HSDP), a tuple of shard dims (sharded over both, flattened: 4 shards) and
    replicate alone (DDP: replicated, gradients all-reduced), each on (rep, dp) = (2, 2): the layouts
    of axedist's spelling, torch's local pieces, and the one-process model's losses, gradients and
    parameters over three AdamW steps, as torch's fully_shard gives them."""
    w1 = run_on_ranks(_data_dims, 4, args=(seed, case))[0]["blocks.0.w1"]  # (10, 6)
    assert w1 == {"hsdp": "S[(2,5,6):(1@dp,6,1)] + R[2:1@rep]", "shard-tuple": "S[(2,2,3,6):(1@rep,1@dp,6,1)]",
                  "ddp": "S[(10,6):(6,1)] + R[(2,2):(1@rep,1@dp)]"}[case], w1


# ---------------------------------------------------------------------------
# register_fsdp_forward_method
# ---------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


class _Decoder(nn.Module):
    """``generate`` decodes greedily by calling the embedding and the blocks and using the output
    weight and the temperature (the root unit's parameters) directly, not through ``forward``."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([_Block(dim), _Block(dim)])
        self.out = nn.Linear(dim, vocab, bias=False)
        self.temperature = nn.Parameter(torch.rand(1) + 0.5)  # (torch's fully_shard refuses 0-d parameters)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)

    def generate(self, tokens, steps: int):
        scores = []
        for _ in range(steps):
            h = self.emb(tokens)
            for block in self.blocks:
                h = block(h)
            logits = (h[:, -1] @ self.out.weight.t()) / self.temperature
            chosen = logits.argmax(-1, keepdim=True)
            scores.append(logits.log_softmax(-1).gather(-1, chosen))
            tokens = torch.cat([tokens, chosen], dim=1)
        return tokens, torch.cat(scores, dim=1)


def _generate(rank, world, s, tp):
    """``tp``: the blocks tensor parallel on a (dp, tp) = (2, 2) mesh (torch's styles through each
    side's ``parallelize_module``), sharded over dp with ``mesh=world_mesh["dp"]``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

    from axedist.nn import parallelize_module

    shape, names = ((2, 2), ("dp", "tp")) if tp else ((world,), ("dp",))
    torch_world = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch_mesh = torch_world["dp"] if tp else torch_world
    torch.manual_seed(s)
    ref = _Decoder().double()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    for model, shard, register, parallel in (
            (ours, fully_shard, register_fsdp_forward_method, parallelize_module),
            (theirs, torch_fsdp.fully_shard, torch_fsdp.register_fsdp_forward_method, torch_parallelize_module)):
        if tp:
            parallel(model, torch_world["tp"], plan)
        for block in model.blocks:
            shard(block, mesh=torch_mesh)
        shard(model, mesh=torch_mesh)
        register(model, "generate")
    d, dp = torch_mesh.get_local_rank(), torch_mesh.size()  # this rank's batch among the dp ranks'
    unit = fsdp_units(ours)[0]
    g = torch.Generator().manual_seed(s + 1)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ref, ours, theirs)]
    out = []
    for step in range(STEPS):
        prompt = torch.randint(0, 11, (2 * dp, 3), generator=g)
        mine = slice(2 * d, 2 * d + 2)
        ref_tokens, ref_scores = ref.generate(prompt, 3)
        ref_scores.mean().backward()
        row = []
        for model in (ours, theirs):
            tokens, scores = model.generate(prompt[mine], 3)
            if model is ours:
                gathered = unit.is_gathered  # the root keeps its parameters for backward, as after forward
            assert torch.equal(tokens, ref_tokens[mine]), (step, tokens, ref_tokens[mine])
            torch.testing.assert_close(scores, ref_scores[mine], **TOL64)
            scores.mean().backward()
            row.append([[float(v) for v in _plain(p.grad).flatten()] for p in model.parameters()])
        for (name, p_ref), ours_grad, theirs_grad in zip(ref.named_parameters(), *row):
            torch.testing.assert_close(_f64(ours_grad), p_ref.grad.flatten(), **TOL64,
                                       msg=lambda m: f"step {step}, gradient of {name}: {m}")
            torch.testing.assert_close(_f64(ours_grad), _f64(theirs_grad), **TOL64,
                                       msg=lambda m: f"step {step}, gradient of {name} against torch's: {m}")
        out.append((gathered, unit.is_gathered))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return out


def _not_registered(rank, world, s):
    """Unregistered, ``generate`` meets the root's sharded parameters (an error, or other values than
    one process's); registering a module that is not an FSDP module does nothing (torch's neither);
    a method it lacks is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(s)
    ref = _Decoder().double()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=torch_mesh)
    out = {}
    prompt = torch.randint(0, 11, (2, 3))
    try:
        scores = _plain(model.generate(prompt, 2)[1])
        same = scores.shape == (2, 2) and torch.allclose(scores, ref.generate(prompt, 2)[1])
        out["unregistered"] = "the one-process values" if same else "other values"
    except Exception as e:  # noqa: BLE001 (whatever the sharded parameters make the ops raise)
        out["unregistered"] = type(e).__name__
    model.reset_iter_state()
    plain = _Decoder()
    register_fsdp_forward_method(plain, "generate")
    out["plain"] = "generate" not in plain.__dict__
    try:
        register_fsdp_forward_method(model, "decode")
    except ValueError as e:
        out["missing"] = str(e)
    # registered, a call that raises (a token out of the vocabulary) leaves the root's modules their
    # sharded parameters, frees its gathers, and the next call gives the one-process values
    register_fsdp_forward_method(model, "generate")
    try:
        model.generate(torch.full((2, 3), 11), 2)
    except IndexError:
        out["raised"] = (all(isinstance(p, DTensor) and p.is_leaf for p in model.parameters()),
                         fsdp_units(model)[0].is_gathered)
    scores = _plain(model.generate(prompt, 2)[1])
    out["after"] = bool(torch.allclose(scores, ref.generate(prompt, 2)[1], **TOL64))
    return out


def test_register_fsdp_forward_method_matches_one_process_and_torch(seed):
    """``register_fsdp_forward_method(model, "generate")`` on a model whose blocks are units and whose
    root owns the embedding, output weight and temperature: on 2 ranks, three steps of greedy
    decoding give the one-process model's tokens and scores, and the backward of the scores its
    gradients (averaged over the ranks), as torch's fully_shard with the same registration; the
    root keeps its gathered parameters after it, as after forward. Unregistered, it fails; a
    registered call that raises leaves the sharded parameters in the modules, nothing gathered."""
    kept = run_on_ranks(_generate, 2, args=(seed, False))
    assert all(k == [(True, False)] * STEPS for k in kept), kept  # the root: gathered from generate to backward's end
    out = run_on_ranks(_not_registered, 2, args=(seed,))[0]
    assert out["unregistered"] != "the one-process values" and out["plain"], out
    assert "has no method 'decode'" in out["missing"], out
    assert out["raised"] == (True, False) and out["after"], out


def test_register_fsdp_forward_method_dp_x_tp(seed):
    """The same on (dp, tp) = (2, 2), the blocks column / row parallel on tp, against the one-process
    model and torch's fully_shard + parallelize_module with the same registration."""
    kept = run_on_ranks(_generate, 4, args=(seed, True))
    assert all(k == [(True, False)] * STEPS for k in kept), kept


# ---------------------------------------------------------------------------
# share_comm_ctx, UnshardHandle, FSDPModule's methods
# ---------------------------------------------------------------------------


def _pipeline_stages(rank, world, s):
    """Two FSDP roots run one after the other (a pipeline's stages on one rank), their comm context
    shared: three SGD steps equal the one-process model's; the handle of ``unshard(async_op=True)``."""
    from torch.distributed.device_mesh import init_device_mesh

    torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(s)
    ref = nn.Sequential(_Block(6), _Block(6)).double()
    ours = copy.deepcopy(ref)
    for stage in ours:
        fully_shard(stage, mesh=torch_mesh)
    share_comm_ctx([ours[0], ours[1]])
    share_comm_ctx([])
    errors = []
    for bad in ([ours[0], nn.Linear(2, 2)], ours[0], "stages"):
        try:
            share_comm_ctx(bad)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ours)]
    g = torch.Generator().manual_seed(s + 1)
    for step in range(STEPS):
        x = torch.randn(2 * world, 6, generator=g, dtype=torch.float64)
        ref(x).square().mean().backward()
        ours[1](ours[0](x[2 * rank:2 * rank + 2])).square().mean().backward()
        for (name, p_ref), p in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL64, msg=lambda m: f"{step} {name}: {m}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    unit = fsdp_units(ours[0])[0]
    handle = ours[0].unshard(async_op=True)
    handles = (isinstance(handle, UnshardHandle), isinstance(handle, torch_fsdp.UnshardHandle), unit.is_gathered)
    handle.wait()
    gathered = unit.is_gathered
    ours[0].reshard()
    handle.wait()  # a second wait does nothing (torch's neither)
    return errors, handles, (gathered, unit.is_gathered), repr(handle), ours[0].unshard() is None


def test_share_comm_ctx_and_unshard_handle(seed):
    """``share_comm_ctx([stage0, stage1])`` for two FSDP roots (a pipeline's stages, on 2 ranks): accepted,
    the stages train as one process does; a module that is no FSDP module, or no list, refused.
    ``unshard(async_op=True)`` returns an ``UnshardHandle`` (torch's class too) whose ``wait()``
    finishes the gathers, once."""
    for errors, handles, waited, text, sync in run_on_ranks(_pipeline_stages, 2, args=(seed,)):
        assert len(errors) == 3, errors
        assert "ValueError" in errors[0] and "Linear" in errors[0], errors
        assert all("TypeError" in e and "list of FSDP modules" in e for e in errors[1:]), errors
        assert handles[:2] == (True, True), handles
        assert waited == (True, False), waited  # gathered by wait(); the second wait() after reshard() gathers nothing
        assert text == "UnshardHandle(waited)" and sync


def test_fsdp_module_has_torchs_methods():
    """Every public method of torch 2.13's ``FSDPModule`` is on axedist's (and the names of
    ``torch.distributed.fsdp``'s FSDP2 API import from ``axedist.nn``); the ones that change no value
    here accept their arguments as torch's do, or refuse what would change the values."""
    import axedist.nn as axnn

    missing = [n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_") and not hasattr(FSDPModule, n)]
    assert not missing, f"torch's FSDPModule methods axedist's lacks: {missing}"
    for name in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
                 "DataParallelMeshDims", "register_fsdp_forward_method", "UnshardHandle", "share_comm_ctx"):
        assert name in axnn.__all__ and hasattr(torch_fsdp, name), name
    for same in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"):
        assert getattr(axnn, same) is getattr(torch_fsdp, same), same  # torch's classes themselves
    module = FSDPModule()
    module.set_reduce_scatter_max_input_buffers(2)
    with pytest.raises(TypeError, match="must be an int"):
        module.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match=">= 1"):
        module.set_reduce_scatter_max_input_buffers(0)
    module.set_reduce_scatter_unused_params(False)
    with pytest.raises(NotImplementedError, match="same parameters"):
        module.set_reduce_scatter_unused_params(True)
    with pytest.raises(ValueError, match="NCCL"):
        module.set_symm_mem_for_comm("gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.set_separate_reduce_scatter_group(True)
        module.set_allocate_memory_from_process_group_for_comm(True)
        module.set_separate_reduce_scatter_group(False)
    assert len(caught) == 2 and all("the values are the same" in str(w.message) for w in caught), caught



def _refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch_world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = DeviceMesh.from_torch(torch_world)

    def whole(lead=Replicate()):
        return _distribute(_MLP().double(), _axedist_make, mesh, [lead])

    def error(make_module, **kwargs):
        kwargs.setdefault("mesh", torch_world)
        kwargs.setdefault("dp_mesh_dims", DataParallelMeshDims(shard="dp"))
        try:
            fully_shard(make_module(), **kwargs)
        except (ValueError, TypeError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    neither = DataParallelMeshDims(shard="dp")
    neither.shard = None  # (torch's class refuses both None when made; set after, fully_shard refuses it)
    return {
        "unknown": error(whole, dp_mesh_dims=DataParallelMeshDims(shard="data")),
        "unknown_replicate": error(whole, dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="pp")),
        "neither": error(whole, dp_mesh_dims=neither),
        "both": error(whole, dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="dp")),
        "not_dims": error(whole, dp_mesh_dims={"shard": "dp"}),
        "no_mesh": error(whole, mesh=None),
        "with_dp_axes": error(whole, mesh=mesh, dp_axes="dp"),
        "plain": error(lambda: _MLP().double()),
        "sub_mesh": error(lambda: _distribute(_MLP().double(), _axedist_make, mesh["tp"])),
        "sharded_on_dp": error(lambda: whole(Shard(0))),
        "int_reshard": error(whole, reshard_after_forward=2),
        "traced": error(whole, mesh=mesh, traced=True),
        "traced_whole": error(whole, mesh=mesh, dp_mesh_dims=None, dp_axes="dp", traced=True),
        "accepted": error(whole, mesh=mesh),
    }


def test_dp_mesh_dims_refusals():
    """Clear errors on every rank, where torch's fully_shard refuses too: a dim name the mesh lacks,
    neither shard nor replicate, a dim in both, a plain parameter, a parameter on a sub-mesh or not
    replicated over the dp dim, an int ``reshard_after_forward``; and with axedist's own axes or
    traced mode (whole-mesh parameters in traced mode also without it), or something else than
    torch's DataParallelMeshDims."""
    out = run_on_ranks(_refusals, 4)
    assert all(o == out[0] for o in out), "ranks disagree"
    o = out[0]
    assert o["unknown"].startswith("ValueError") and "'data'" in o["unknown"] and "lacks" in o["unknown"], o
    assert o["unknown_replicate"].startswith("ValueError") and "'pp'" in o["unknown_replicate"], o
    assert o["neither"].startswith("ValueError") and "at least one of shard or replicate" in o["neither"], o
    assert o["both"].startswith("ValueError") and "twice" in o["both"], o
    assert o["not_dims"].startswith("TypeError") and "DataParallelMeshDims" in o["not_dims"], o
    assert o["no_mesh"].startswith("ValueError") and "whole mesh" in o["no_mesh"], o
    assert o["with_dp_axes"].startswith("TypeError") and "leave dp_axes" in o["with_dp_axes"], o
    assert o["plain"].startswith("ValueError") and "w1 is a plain Parameter" in o["plain"], o
    assert o["sub_mesh"].startswith("ValueError") and "w1 is on ('tp',)" in o["sub_mesh"], o
    assert o["sharded_on_dp"].startswith("ValueError") and "w1 is laid out on ['dp']" in o["sharded_on_dp"], o
    assert o["int_reshard"].startswith("NotImplementedError") and "int" in o["int_reshard"], o
    assert o["traced"].startswith("NotImplementedError") and "traced" in o["traced"], o
    assert o["traced_whole"].startswith("NotImplementedError") and "whole mesh" in o["traced_whole"], o
    assert o["accepted"] == "no error", o


def _pipeline_ranks(rank, world, seed):
    """A (pp, dp) torch mesh, a stage per pp coordinate with its own model (other sizes: the
    stages run different programs, as torch.distributed.pipelining's do), each fully sharded over
    ``world_mesh["dp"]``: its parameters laid out over dp only, so no check or collective of one
    stage waits for the other. Each stage's input a leaf, its gradient taken by
    ``torch.autograd.grad`` (a pipeline stage's backward), then a step by ``backward()``: both
    against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    world_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    pp, dp = world_mesh["pp"].get_local_rank(), world_mesh["dp"]
    torch.manual_seed(seed + pp)
    dim = 4 + 2 * pp
    ref = nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, dim)).double()
    model = copy.deepcopy(ref)
    fully_shard(model[0], mesh=dp)
    fully_shard(model, mesh=dp)
    meshes = {p.mesh.axis_names for p in model.parameters()}
    x = torch.randn(4, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7 + pp))
    mine = x[2 * dp.get_local_rank():][:2].clone().requires_grad_()
    (got,) = torch.autograd.grad(model(mine).square().sum(), [mine])
    whole = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(ref(whole).square().sum(), [whole])
    torch.testing.assert_close(got, want[2 * dp.get_local_rank():][:2], **TOL64)
    untouched = all(p.grad is None for p in model.parameters())
    model(mine.detach()).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor() * dp.size(), q.grad, **TOL64)
    return meshes, untouched


def test_stages_on_a_pipeline_axis_and_input_gradients_by_autograd_grad(seed):
    """fully_shard(mesh=world_mesh["dp"]) of a (pp, dp) mesh: each stage's units over its dp ranks
    only; the input gradient of a leaf by ``torch.autograd.grad`` (a multi-grad hook over a leaf
    raises there: the input is seen as a view of itself) leaves the parameters' gradients alone."""
    for meshes, untouched in run_on_ranks(_pipeline_ranks, 4, args=(seed,)):
        assert meshes == {("dp",)} and untouched, (meshes, untouched)


def _accumulate_without_sync(rank, world, seed):
    """Three microbatches, the first two with ``set_requires_gradient_sync(False)``: those leave
    every ``param.grad`` unset (nothing reduced), the third's backward reduces the sum; against
    the same run syncing every backward and one process on the whole batch."""
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(3, 2 * world, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    runs = {}
    for sync_each in (False, True):
        model = copy.deepcopy(ref)
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        unset_between = []
        for i, batch in enumerate(x):
            last = i == len(x) - 1
            model.set_requires_gradient_sync(sync_each or last)
            model(batch[2 * rank:2 * rank + 2]).square().sum().backward()
            if not last:
                unset_between.append(all(p.grad is None for p in model.parameters()))
        runs[sync_each] = ([p.grad.full_tensor() for p in model.parameters()], unset_between)
    for batch in x:
        ref(batch).square().sum().backward()
    for got, want, q in zip(runs[False][0], runs[True][0], ref.parameters()):
        torch.testing.assert_close(got, want, **TOL64)
        torch.testing.assert_close(got * world, q.grad, **TOL64)  # (averaged over the dp ranks)
    return runs[False][1], runs[True][1]


def test_gradient_accumulation_without_sync(seed):
    for held, synced in run_on_ranks(_accumulate_without_sync, 2, args=(seed,)):
        assert held == [True, True] and synced == [False, False], (held, synced)
