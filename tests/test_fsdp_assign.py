"""Sharded parameters replaced after ``fully_shard``, as FSDP2 scripts do (2 and 4 gloo ranks, float64).

torch's FSDP2 example builds the model on the meta device, shards it, then loads a full state dict
by distributing each tensor like the parameter it replaces and ``load_state_dict(..., assign=True)``;
a script may also assign ``module.weight = nn.Parameter(...)``. The new parameters must be the ones
gathered and trained (before, axedist kept gathering the old ones: a meta model failed, a real one
silently trained its old values). Against the one-process model and torch's ``fully_shard`` making the
same calls: equal parameters after the load and after three AdamW steps; replacements that are not
the parameter's sharded DTensor are errors.
"""

import copy
import random

import pytest
import torch
from torch import nn

import axedist as ax
from axedist.dtensor import DTensor, distribute_tensor
from axedist.nn import fully_shard, parallelize_module
from axedist.testing import run_on_ranks

TOL64 = dict(rtol=1e-9, atol=1e-11)
STEPS = 3


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, dim: int = 6, hidden: int = 8, vocab: int = 13, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _shard(net, shard, **kwargs):
    for block in net.blocks:
        shard(block, **kwargs)
    shard(net, **kwargs)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _train(model, rank, world, s, batch_share=2):
    """Three AdamW steps on this rank's share of each step's batch (the mean over ranks: the
    one-process loss over the whole batch); the full parameters after them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(s + 1)
    for _ in range(STEPS):
        tokens = torch.randint(0, 13, (batch_share * world, 5), generator=g)
        if rank is not None:
            tokens = tokens[batch_share * rank:batch_share * (rank + 1)]
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {name: _full(p) for name, p in model.named_parameters()}


def _example_flow(rank, world, s, tp):
    """The FSDP2 example's load on axedist (and, at tp = 1, on torch's fully_shard beside it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # torch's styles (docs/migration.md)

    torch.manual_seed(s)
    ref = _Net().double()
    loaded = {k: v + 0.1 * torch.randn_like(v) for k, v in ref.state_dict().items()}  # not the initial values
    ref.load_state_dict(loaded)
    with torch.device("meta"):
        ours = _Net().double()
    if tp > 1:
        mesh = ax.init_mesh((world // tp, tp), ("dp", "tp"))
        for block in ours.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        _shard(ours, fully_shard, mesh=mesh)
    else:
        _shard(ours, fully_shard)
    sides = [(ours, distribute_tensor)]
    if tp == 1:
        with torch.device("meta"):
            theirs = _Net().double()
        _shard(theirs, torch_fully_shard, mesh=init_device_mesh("cpu", (world,)))
        sides.append((theirs, torch_distribute_tensor))
    for model, distribute in sides:
        meta = model.state_dict()
        model.load_state_dict({k: nn.Parameter(distribute(v, meta[k].device_mesh, meta[k].placements))
                               for k, v in loaded.items()}, assign=True)
        for name, p in model.named_parameters():
            assert not p.is_meta, name
            torch.testing.assert_close(_full(p), loaded[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    world_share = world // tp  # every rank of a tp group sees its data-parallel rank's batch
    after = [_train(model, rank // tp, world_share, s) for model, _ in sides]
    expected = _train(ref, None, world_share, s)
    return [{k: (v, expected[k]) for k, v in side.items()} for side in after]


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)], ids=["dp2", "dp2xtp2"])
def test_the_fsdp2_example_load_on_a_meta_model(world, tp):
    """meta init, fully_shard per block and at the root, a full state dict loaded with
    ``nn.Parameter(distribute_tensor(full, p.device_mesh, p.placements))`` and ``assign=True``:
    the loaded values, then three AdamW steps, equal to the one-process model (and to torch's
    fully_shard on the same calls at dp = 2)."""
    s = random.randrange(2**31)
    for sides in run_on_ranks(_example_flow, world, args=(s, tp)):
        for side, params in enumerate(sides):
            for name, (got, expected) in params.items():
                torch.testing.assert_close(got, expected, **TOL64, msg=lambda m: f"side {side}, {name}: {m}")


def _replaced_on_a_real_model(rank, world, s):
    torch.manual_seed(s)
    ref = _Net().double()
    ours = copy.deepcopy(ref)
    _shard(ours, fully_shard)
    _train(ours, rank, world, s)  # a step ran first: the replacement comes between steps
    loaded = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    ref.load_state_dict(loaded)
    meta = ours.state_dict()
    ours.load_state_dict({k: nn.Parameter(distribute_tensor(v, meta[k].device_mesh, meta[k].placements))
                          for k, v in loaded.items()}, assign=True)
    # one parameter set by assignment
    fresh = torch.randn_like(ref.blocks[1].up.weight)
    with torch.no_grad():
        ref.blocks[1].up.weight.copy_(fresh)
    w = ours.blocks[1].up.weight
    ours.blocks[1].up.weight = nn.Parameter(distribute_tensor(fresh, w.device_mesh, w.placements))
    after, expected = _train(ours, rank, world, s + 7), _train(ref, None, world, s + 7)
    return {k: (v, expected[k]) for k, v in after.items()}


def test_parameters_replaced_between_steps_are_trained():
    """A trained sharded model given new parameters by ``load_state_dict(assign=True)`` and by
    assignment trains those: equal to the one-process model given the same values."""
    s = random.randrange(2**31)
    for params in run_on_ranks(_replaced_on_a_real_model, 2, args=(s,)):
        for name, (got, expected) in params.items():
            torch.testing.assert_close(got, expected, **TOL64, msg=lambda m: f"{name}: {m}")


def _bad_replacements(rank, world):
    errors = []
    for case in ("plain", "replicated", "dtype", "shared"):
        torch.manual_seed(0)
        net = _Net().double()
        if case == "shared":
            net.out.weight = net.emb.weight  # a tied weight: one parameter in two slots
            fully_shard(net)
        else:
            _shard(net, fully_shard)
        w = net.blocks[0].up.weight
        full = w.full_tensor()
        if case == "plain":
            net.blocks[0].up.weight = nn.Parameter(full.clone())
        elif case == "replicated":
            net.blocks[0].up.weight = nn.Parameter(distribute_tensor(full, w.device_mesh, [ax.Replicate()]))
        elif case == "dtype":
            net.blocks[0].up.weight = nn.Parameter(distribute_tensor(full.float(), w.device_mesh, w.placements))
        else:
            e = net.emb.weight
            net.out.weight = nn.Parameter(distribute_tensor(e.full_tensor(), e.device_mesh, e.placements))
        with pytest.raises(ValueError) as info:
            net(torch.zeros(2, 3, dtype=torch.long))
        errors.append(str(info.value))
    return errors


def test_replacements_that_are_not_the_sharded_parameter_are_errors():
    """A plain parameter, a DTensor of another layout or dtype, and one slot of a tied weight
    replaced alone: an error at the next forward naming the parameter, on every rank."""
    for errors in run_on_ranks(_bad_replacements, 2):
        plain, replicated, dtype, shared = errors
        assert "blocks.0.up.weight was replaced by a Parameter" in plain, plain
        assert "laid out as" in replicated and "R[" in replicated, replicated
        assert "torch.float32" in dtype and "torch.float64 axedist DTensor" in dtype, dtype
        assert "share" in shared and "2 different tensors" in shared, shared
