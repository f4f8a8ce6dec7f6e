"""``axedist.nn.state_dict`` on GPUs (NCCL): full state dicts of a fully sharded model gathered to
rank 0's CPU, a CPU-offloaded sharded state dict through ``torch.distributed.checkpoint`` and back,
``dcp.async_save`` while the parameters change, and full state dicts loaded with ``broadcast_from_rank0`` (broadcast on the GPU), each against the
one-GPU model trained alike.

W = torch.cuda.device_count(), any W >= 1 (at W = 1 the layouts are trivial but every tensor's
device moves are the ones a W-GPU job makes: the one-GPU machine's check).
"""

import copy
import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from axedist.dtensor import DTensor
from axedist.mesh import DeviceMesh
from axedist.nn import fully_shard
from axedist.nn.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                   set_model_state_dict, set_optimizer_state_dict)
from axedist.testing import run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 1, reason="needs a CUDA GPU")


def _models(seed):
    torch.manual_seed(seed)
    reference = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 7)).cuda()
    model = copy.deepcopy(reference)
    fully_shard(model, mesh=DeviceMesh("cuda", (dist.get_world_size(),), ("dp",)))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(seed + 1)).cuda()
    for m, optimizer in zip((model, reference), optimizers):
        m(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, reference, optimizers


def _state_dicts(rank, world, seed, path):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, reference, (optimizer, ref_optimizer) = _models(seed)
    # full + cpu_offload: rank 0's plain CPU tensors, nothing elsewhere
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    moments = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
    if rank == 0:
        for name, value in reference.state_dict().items():
            assert type(full[name]) is torch.Tensor and full[name].device.type == "cpu", name
            torch.testing.assert_close(full[name], value.cpu(), rtol=1e-5, atol=1e-6)
        for name, value in ref_optimizer.state_dict()["state"][0].items():
            torch.testing.assert_close(moments["state"]["0.weight"][name], value.cpu(), rtol=1e-5, atol=1e-6)
    else:
        assert full == {} and moments == {}
    # cpu_offload alone: the sharded DTensors with their pieces on the CPU, saved by DCP, loaded back
    offloaded = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    assert all(isinstance(v, DTensor) and v.to_local().device.type == "cpu" for v in offloaded.values())
    dcp.save(offloaded, checkpoint_id=path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sharded = get_model_state_dict(model)
    dcp.load(sharded, checkpoint_id=path)
    set_model_state_dict(model, sharded)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), reference.state_dict()[name], rtol=1e-5, atol=1e-6)
    # torch's asynchronous save (staged to the CPU, over a gloo group as torchtitan makes one) while
    # training goes on
    saving = dcp.async_save(get_model_state_dict(model), checkpoint_id=path + ".async",
                            process_group=dist.new_group(backend="gloo"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    saving.result()
    sharded = get_model_state_dict(model)
    dcp.load(sharded, checkpoint_id=path + ".async")
    set_model_state_dict(model, sharded)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), reference.state_dict()[name], rtol=1e-5, atol=1e-6)
    # rank 0's full state dicts broadcast into a model built from another seed
    other, _, (other_optimizer, _) = _models(seed + 5)
    loading = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(other, full, options=loading)
    set_optimizer_state_dict(other, other_optimizer, moments, options=loading)
    for name, value in other.state_dict().items():
        assert value.to_local().is_cuda
        torch.testing.assert_close(value.full_tensor(), reference.state_dict()[name], rtol=1e-5, atol=1e-6)
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(seed + 2)).cuda()
    for m, o in ((other, other_optimizer), (reference, ref_optimizer)):
        m(x).square().sum().backward()
        o.step()
    for name, value in other.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), reference.state_dict()[name], rtol=1e-4, atol=1e-5)
    return True


def test_state_dicts_on_gpus(tmp_path):
    seed = random.randrange(2**31)
    assert run_on_ranks(_state_dicts, WORLD, backend="nccl", args=(seed, str(tmp_path / "ckpt"))) == [True] * WORLD
