"""``axedist.nn.state_dict``: torch's ``get/set_model_state_dict`` and ``get/set_optimizer_state_dict``
on axedist models, against the same functions on the one-process model trained alike.

2 gloo ranks; a small MLP with uneven dims (5 rows over 2 ranks) in fp64, fully sharded or tensor
parallel, one AdamW step on both before the state dicts are read; fresh random values are loaded.
"""

import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_sd

from axedist.dtensor import DTensor
from axedist.nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
from axedist.nn.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
                                   set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from axedist.testing import run_on_ranks


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _pair(mode: str, seed: int):
    """(parallel model and optimizer, one-process model and optimizer), one AdamW step taken by both."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = _MLP().double()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode == "fsdp":
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _step(model, optimizer, reference, ref_optimizer, seed)
    return model, optimizer, reference, ref_optimizer


def _step(model, optimizer, reference, ref_optimizer, seed):
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    for m, o in ((model, optimizer), (reference, ref_optimizer)):
        m(x).square().sum().backward()
        o.step()
        o.zero_grad()


def _close(got, want, what):
    assert type(got) is torch.Tensor, f"{what}: {type(got).__name__}, want a plain tensor"
    assert got.shape == want.shape and got.dtype == want.dtype, what
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=what)


def _same_state(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for key, value in want.items():
        if isinstance(value, dict):
            _same_state(got[key], value, f"{what}.{key}")
        elif isinstance(value, torch.Tensor):
            _close(got[key], value, f"{what}.{key}")
        else:
            assert got[key] == value, (what, key)


def _random_like(state, seed: int):
    """``state`` with every tensor of dim > 0 replaced by fresh positive values (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(state, torch.Tensor):
        return torch.rand(state.shape, dtype=state.dtype, generator=generator) + 0.1 if state.dim() else state.clone()
    if isinstance(state, dict):
        return {key: _random_like(value, seed + index) for index, (key, value) in enumerate(sorted(state.items()))}
    if isinstance(state, list):
        return [copy.deepcopy(value) for value in state]
    return state


def _full_state_dicts(rank, world, mode, seed):
    model, optimizer, reference, ref_optimizer = _pair(mode, seed)
    full = StateDictOptions(full_state_dict=True)
    _same_state(get_model_state_dict(model, options=full), reference.state_dict(), "model")
    _same_state(get_optimizer_state_dict(model, optimizer, options=full),
                torch_sd.get_optimizer_state_dict(reference, ref_optimizer), "optimizer")
    flat = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    _same_state(get_optimizer_state_dict(model, optimizer, options=flat),
                torch_sd.get_optimizer_state_dict(reference, ref_optimizer,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=True)),
                "flattened optimizer")
    # full + cpu_offload: rank 0 only, as torch's
    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                            cpu_offload=True))
    if rank == 0:
        _same_state(model_state, reference.state_dict(), "rank 0's model")
        assert all(v.device.type == "cpu" for v in model_state.values())
    else:
        assert model_state == {} and optimizer_state == {}
    # the default and cpu_offload alone: sharded, axedist DTensors in the parameters' layouts
    for options in (None, StateDictOptions(cpu_offload=True)):
        sharded = get_model_state_dict(model, options=options)
        for name, parameter in model.named_parameters():
            assert isinstance(sharded[name], DTensor) and sharded[name].axe_layout == parameter.axe_layout
            _close(sharded[name].full_tensor(), reference.state_dict()[name], f"sharded {name}")
    return True


def _load_full(rank, world, mode, seed, broadcast, flatten):
    model, optimizer, reference, ref_optimizer = _pair(mode, seed)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast,
                               flatten_optimizer_state_dict=flatten)
    model_state = _random_like(reference.state_dict(), seed + 7)
    optimizer_state = _random_like(torch_sd.get_optimizer_state_dict(reference, ref_optimizer, options=StateDictOptions(
        flatten_optimizer_state_dict=flatten)), seed + 11)
    reference.load_state_dict(model_state)
    torch_sd.set_optimizer_state_dict(reference, ref_optimizer, copy.deepcopy(optimizer_state),
                                      options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    given = rank == 0 or not broadcast
    keys = set_state_dict(model, optimizer, model_state_dict=copy.deepcopy(model_state) if given else {},
                          optim_state_dict=copy.deepcopy(optimizer_state) if given else {}, options=options)
    assert not keys.missing_keys and not keys.unexpected_keys
    for name, value in model.state_dict().items():
        assert isinstance(value, DTensor)
        _close(value.full_tensor(), model_state[name], f"loaded {name}")
    for state in optimizer.state.values():
        assert all(isinstance(v, DTensor) for v in state.values() if v.dim())  # moments in the parameters' layouts
    _same_state(get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)),
                torch_sd.get_optimizer_state_dict(reference, ref_optimizer), "loaded optimizer")
    _step(model, optimizer, reference, ref_optimizer, seed + 3)  # training goes on as the one process's
    _same_state(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), reference.state_dict(),
                "after a step")
    return True


def _wrong_shape(rank, world, mode, seed):
    model, optimizer, reference, _ = _pair(mode, seed)
    state = reference.state_dict()
    state["a.weight"] = torch.zeros(10, 7, dtype=torch.float64)
    try:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_full_state_dicts_equal_the_one_process_models(mode):
    assert run_on_ranks(_full_state_dicts, 2, args=(mode, random.randrange(2**31))) == [True, True]


@pytest.mark.parametrize("mode,broadcast,flatten", [("fsdp", False, False), ("fsdp", True, True), ("tp", True, False),
                                                    ("tp", False, True)])
def test_full_state_dicts_load_into_the_layouts(mode, broadcast, flatten):
    seed = random.randrange(2**31)
    assert run_on_ranks(_load_full, 2, args=(mode, seed, broadcast, flatten)) == [True, True], seed


def test_a_full_tensor_of_another_shape_is_refused_on_every_rank():
    errors = run_on_ranks(_wrong_shape, 2, args=("fsdp", 0))
    assert all(e is not None and "[10, 7]" in e and "[10, 6]" in e for e in errors), errors
