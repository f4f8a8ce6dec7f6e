"""Context parallelism's causal runs on one GPU (``axedist.nn.attention.causal_runs``): the
queries of one rank's runs of positions over keys in position order, each run as a square causal
call and an unmasked call merged by log-sum-exp, on cuDNN's attention op and on FlashAttention's
(cuDNN switched off), forward and the gradients of query, key and value, against fp64 attention
with the lower-right causal mask written out. bf16 and fp16, the head-tail runs of rank 0 and
rank 1 of 2 and of rank 3 of 4.
"""

import pytest
import torch
import torch.nn.functional as F

from axedist.nn import SequenceShards
from axedist.nn.attention import causal_runs


def _reference(query, key, value, spans):
    """fp64 attention of the held queries, each over the keys up to its own position."""
    positions = torch.cat([torch.arange(start, stop) for start, stop in spans]).to(query.device)
    mask = torch.arange(key.shape[2], device=query.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=mask)


@pytest.mark.parametrize("cudnn", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks,position", [(2, 0), (2, 1), (4, 3)])
def test_causal_runs_match_the_masked_attention(seed, cudnn, dtype, ranks, position):
    length = 2048
    spans = SequenceShards.of(length, ranks).spans(position)
    held = sum(stop - start for start, stop in spans)
    query = torch.randn(2, 8, held, 64, device="cuda", dtype=dtype, requires_grad=True)
    key, value = (torch.randn(2, 8, length, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 8, held, 64, device="cuda", dtype=dtype)
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        out = causal_runs(query, key, value, spans)
        out.backward(grad)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)
    leaves = [t.detach().double().requires_grad_() for t in (query, key, value)]
    reference = _reference(*leaves, spans)
    reference.backward(grad.double())
    for what, mine, theirs in (("out", out, reference), ("grad query", query.grad, leaves[0].grad),
                               ("grad key", key.grad, leaves[1].grad), ("grad value", value.grad, leaves[2].grad)):
        error = float((mine.double() - theirs).norm() / theirs.norm())
        assert error < 1e-2, f"{what}: relative error {error:.2e} (seed {seed})"
