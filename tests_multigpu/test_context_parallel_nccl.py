"""Context parallelism on GPUs (NCCL): a Llama training step inside ``context_parallel`` matches
one GPU's step on the whole sequence (loss and every gradient, fp32), and bf16 causal attention
with grouped-query heads runs on the fused kernels (flash or cuDNN; no materialised mask) and
matches the whole sequence's attention within bf16 error.

W = torch.cuda.device_count(); runs from W = 1 (where the whole sequence is on the one rank and
SDPA runs as it is; the lower-right causal runs of W >= 2 ran on one GPU at 2a932d2, before that
shortcut: benchmarks/results/tests_multigpu.md).
"""

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from axedist.mesh import DeviceMesh
from axedist.nn import SequenceShards, context_parallel
from axedist.nn.llama import Llama, LlamaConfig, next_token_loss
from axedist.testing import run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 1, reason="needs a CUDA GPU")


def _llama_step(rank, world, s):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = LlamaConfig(vocab_size=100, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=96, max_seq_len=32)
    torch.manual_seed(s)
    model = Llama(cfg).cuda()
    gen = torch.Generator().manual_seed(s)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, 32), generator=gen).cuda() for _ in range(2))
    reference = next_token_loss(model(tokens), labels)
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    mesh = DeviceMesh("cuda", (world,))
    with context_parallel(mesh, buffers=[tokens, labels, model.rope_cos, model.rope_sin],
                          buffer_seq_dims=[1, 1, 0, 0]):
        loss = next_token_loss(model(tokens), labels)
        loss.backward()
    dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
    torch.testing.assert_close(loss, reference, rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(grad, expected[name], rtol=1e-3, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")
    return True


def test_llama_step_matches_one_gpu():
    s = random.randrange(2**31)
    assert run_on_ranks(_llama_step, WORLD, backend="nccl", args=(s,)) == [True] * WORLD, s


def _bf16_attention(rank, world, s):
    length = 1024 * world
    gen = torch.Generator(device="cuda").manual_seed(s)
    q, k, v, g = (torch.randn(2, heads, length, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for heads in (8, 2, 2, 8))
    whole = [t.double().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    reference.backward(g.double())
    pieces = [t.clone() for t in (q, k, v, g)]
    mesh = DeviceMesh("cuda", (world,))
    with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2] * 4, no_restore_buffers=set(pieces)):
        leaves = [t.requires_grad_() for t in pieces[:3]]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(pieces[3])
    ops = {event.name for event in prof.events()}
    fused = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention"}
    assert ops & fused, sorted(o for o in ops if "attention" in o)
    assert not ops & {"aten::_efficient_attention_forward", "aten::_scaled_dot_product_attention_math"}, \
        sorted(o for o in ops if "attention" in o)
    here = SequenceShards.of(length, world).positions(mesh.position(), "cuda")
    for mine, theirs in zip([out] + [t.grad for t in leaves], [reference] + [t.grad for t in whole]):
        theirs = theirs[:, :, here]
        error = (mine.double() - theirs).norm() / theirs.norm()
        assert error < 2e-2, error.item()
    return True


def test_bf16_attention_on_flash_kernels():
    s = random.randrange(2**31)
    assert run_on_ranks(_bf16_attention, WORLD, backend="nccl", args=(s,)) == [True] * WORLD, s
