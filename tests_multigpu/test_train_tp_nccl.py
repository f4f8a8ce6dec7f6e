"""The tensor-parallel Llama on GPUs (NCCL): training matches one GPU, the row-parallel
reduce-scatter picks the fused GEMM + reduce-scatter, and launch/train_tp.py --cuda runs.

W = torch.cuda.device_count() (CUDA_VISIBLE_DEVICES=0,1 for W=2).
"""

import copy
import random
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from axedist.mesh import DeviceMesh
from axedist.nn import RowwiseParallel, describe, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.testing import run_on_ranks, run_torchrun

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")
ROOT = Path(__file__).resolve().parents[1]


def _train_step(rank, world, s, sequence_parallel):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = LlamaConfig(vocab_size=100, dim=64, n_layers=2, n_heads=8, ffn_hidden=96, max_seq_len=16)
    torch.manual_seed(s)
    ref = Llama(cfg).cuda()
    par = copy.deepcopy(ref)
    mesh = DeviceMesh("cuda", (world,))
    parallelize(par, mesh, llama_tp_plan(cfg, sequence_parallel=sequence_parallel))
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(s))
    tokens = tokens.cuda()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss_ref = next_token_loss(ref(inputs), targets)
    loss = next_token_loss(par(inputs), replicate(targets, mesh))
    torch.testing.assert_close(loss.full_tensor(), loss_ref, rtol=1e-4, atol=1e-5)
    loss_ref.backward()
    loss.backward()
    for (name, p_ref), p in zip(ref.named_parameters(), par.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-3, atol=1e-5,
                                   msg=lambda m: f"grad of {name}: {m}")
    return True


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_tp_training_matches_one_gpu(sequence_parallel):
    s = random.randrange(2**31)
    assert run_on_ranks(_train_step, WORLD, backend="nccl", args=(s, sequence_parallel)) == [True] * WORLD, s


def _fused_row_parallel(rank, world, s):
    """bf16 row-parallel linear into sequence-sharded rows: 512 rows per rank, enough for the fused kernel."""
    torch.manual_seed(s)
    mesh = DeviceMesh("cuda", (world,))
    seq, batch, k, n = 256 * world, 2, 1024, 1024
    ref = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    par = copy.deepcopy(ref)
    parallelize(par, mesh, {"": RowwiseParallel(output_layouts=Shard(0))})
    x = torch.randn(seq, batch, k, device="cuda", dtype=torch.bfloat16)
    want = (x.float() @ ref.weight.float().t())
    from axedist.dtensor import fused_gemm_stats

    fused_before = fused_gemm_stats()["fused"]
    for _ in range(3):  # back to back calls
        y = par(torch.chunk(x, world, dim=-1)[rank])
        assert y.placements == (Shard(0),)
        got = y.full_tensor().float()
        error = ((got - want).norm() / want.norm()).item()
        assert error < 2e-2, error
    stats = fused_gemm_stats()
    assert stats["fused"] - fused_before == 3, stats   # the redistribute ran gemm_reduce_scatter each time
    report = describe(par)
    assert "reduce_scatter" in report and "gemm_reduce_scatter" in report, report
    return report


def test_row_parallel_output_uses_fused_gemm_reduce_scatter():
    reports = run_on_ranks(_fused_row_parallel, WORLD, backend="nccl", args=(random.randrange(2**31),))
    print(reports[0])
    assert ": p2p" in reports[0] or ": multimem" in reports[0], reports[0]


def test_train_script_cuda(tmp_path):
    returncode, stdout, stderr = run_torchrun(["launch/train_tp.py", "--cuda", "--steps", "20", "--out", str(tmp_path)],
                                              WORLD, cwd=ROOT, timeout_s=500)
    print(stdout[-6000:])
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "training finished" in stdout and "gemm_reduce_scatter" in stdout
