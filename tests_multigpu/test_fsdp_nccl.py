"""Fully sharded data parallel x tensor parallel on GPUs (NCCL): training matches one GPU in fp32
(the unit gathers started ahead on the side stream), bf16 compute with fp32 masters matches torch's
fully_shard + parallelize_module with no more bytes, and launch/train_tp.py --cuda trains dp x tp.

W = torch.cuda.device_count() (even; mesh (dp, tp) = (2, W / 2)). CUDA_VISIBLE_DEVICES=0,1 for W=2.
"""

import copy
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from axedist.mesh import DeviceMesh
from axedist.nn import fsdp_units, fully_shard, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.runtime import count_collectives
from axedist.testing import run_on_ranks, run_torchrun, torch_comm_bytes, torch_fully_shard_llama, torch_llama_loss

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2 or WORLD % 2, reason="needs an even number (>= 2) of CUDA GPUs")
ROOT = Path(__file__).resolve().parents[1]
CFG = LlamaConfig(vocab_size=100, dim=64, n_layers=2, n_heads=8, ffn_hidden=96, max_seq_len=16)


def _sharded(model, mesh, policy=None):
    parallelize(model, mesh["tp"], llama_tp_plan(CFG))
    for layer in model.layers:
        fully_shard(layer, mesh, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mesh, mp_policy=policy or MixedPrecisionPolicy())
    return model


def _matches_one_gpu(rank, world, s):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mesh = DeviceMesh("cuda", (2, world // 2), ("dp", "tp"))
    torch.manual_seed(s)
    ref = Llama(CFG).cuda()
    par = _sharded(copy.deepcopy(ref), mesh)
    # eps 1e-3: AdamW's first step moves a weight by lr * g / (|g| + eps), about lr * sign(g), so a
    # gradient element near 0 whose sign the two sides' summation orders disagree on moved that
    # weight by 2 lr, and the next step's gradients apart (one element of 6400 seen at W=2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2, eps=1e-3, foreach=False)
    g = torch.Generator().manual_seed(s + 1)
    d = mesh.coordinates()["dp"]
    for step in range(3):
        tokens = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=g).cuda()
        loss_ref = next_token_loss(ref(tokens[:, :-1]), tokens[:, 1:])
        mine = tokens[2 * d:2 * d + 2]
        loss = next_token_loss(par(mine[:, :-1]), replicate(mine[:, 1:], mesh["tp"]))
        value = loss.full_tensor().detach().clone()
        dist.all_reduce(value, group=mesh.group("dp"))
        torch.testing.assert_close(value / 2, loss_ref.detach(), rtol=1e-4, atol=1e-5)
        loss_ref.backward()
        loss.backward()
        for (name, p_ref), p in zip(ref.named_parameters(), par.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-3, atol=1e-5,
                                       msg=lambda m: f"step {step}: grad of {name}: {m}")
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()
    return fsdp_units(par)[0].schedule.prefetches


def test_fsdp_tp_training_matches_one_gpu():
    out = run_on_ranks(_matches_one_gpu, WORLD, backend="nccl", args=(random.randrange(2**31),))
    assert all(n > 0 for n in out), f"no gather was started ahead: {out}"


def _against_torch_bf16(rank, world, s):
    mesh = DeviceMesh("cuda", (2, world // 2), ("dp", "tp"))
    torch_mesh = mesh.to_torch()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(s)
    ours = _sharded(Llama(CFG).cuda(), mesh, policy)
    torch.manual_seed(s)
    theirs = torch_fully_shard_llama(Llama(CFG).cuda(), torch_mesh, policy)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, foreach=False)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(s + 1)
    d = mesh.coordinates()["dp"]
    out = []
    for _ in range(3):
        tokens = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=g).cuda()[2 * d:2 * d + 2]
        with count_collectives() as seen:
            loss = next_token_loss(ours(tokens[:, :-1]), replicate(tokens[:, 1:], mesh["tp"]))
            loss.backward()
        theirs_loss, theirs_bytes = torch_comm_bytes(
            lambda: torch_llama_loss(theirs(tokens[:, :-1]), tokens[:, 1:], torch_mesh["tp"]))
        out.append((float(loss.detach().full_tensor()), float(theirs_loss.detach().full_tensor()), seen.bytes_sent,
                    theirs_bytes))
        for opt in (opt_ours, opt_theirs):
            opt.step()
            opt.zero_grad()
    assert all(p.dtype == torch.float32 and p.grad is None for p in ours.parameters())
    return out


def test_bf16_compute_matches_torch_fsdp2_tp():
    for steps in run_on_ranks(_against_torch_bf16, WORLD, backend="nccl", args=(random.randrange(2**31),)):
        for ours, theirs, sent, theirs_sent in steps:
            assert abs(ours - theirs) <= 2e-2 * abs(theirs), (ours, theirs)
            assert sent <= theirs_sent, (sent, theirs_sent)


@pytest.mark.skipif(WORLD < 4, reason="dp = 2 x tp = 2 needs 4 GPUs")
def test_train_script_cuda_dp2_tp2(tmp_path):
    returncode, stdout, stderr = run_torchrun(["launch/train_tp.py", "--cuda", "--dp", "2", "--steps", "20", "--out",
                                               str(tmp_path)], WORLD, cwd=ROOT, timeout_s=500)
    print(stdout[-6000:])
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "training finished" in stdout and "all_gather over dp" in stdout
