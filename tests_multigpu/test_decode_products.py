"""Decode-sized products of TP linears run the skinny GEMM where its table says it is faster
(ops/matmul._decode_product, kernels/skinny_gemm.py), and give what one GPU gives.

Run on 2+ GPUs: ``pytest tests_multigpu/test_decode_products.py -q`` (W = every GPU, and 2). A
Llama-3-8B-sized feed-forward (dim 4096, hidden 14336: the shapes the shipped table measured)
with w1 / w3 column-parallel and w2 row-parallel, at 1, 8 and 64 tokens: eagerly with grad
(forward and backward against the one-GPU module), under inference mode, and replayed from a
CUDA graph; the profiler shows which local products launched the skinny kernel, and that is
exactly the ones the table chose.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from axedist.dtensor import DTensor
from axedist.kernels.skinny_gemm import skinny_config
from axedist.mesh import DeviceMesh
from axedist.nn import ColwiseParallel, RowwiseParallel, parallelize, to_inference
from axedist.testing import capture, run_on_ranks

GPUS = torch.cuda.device_count()
WORLDS = sorted({2, GPUS}) if GPUS >= 2 else []
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")

DIM, HIDDEN = 4096, 14336


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _skinny_launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if "skinny_gemm_kernel" in event.name)


def _relative(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _decode_products(rank, world):
    mesh = DeviceMesh("cuda", (world,))
    torch.manual_seed(0)  # the same module and inputs on every rank
    base = FeedForward().cuda().to(torch.bfloat16)
    plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    report = []
    for tokens in (1, 8, 64):
        x = torch.randn(1, tokens, DIM, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(1, tokens, DIM, device="cuda", dtype=torch.bfloat16)
        ref_x = x.clone().requires_grad_()
        ref = base(ref_x)
        ref.backward(grad)
        # which local products the table sends to the skinny kernel: w1 and w3 ([tokens, DIM] @
        # [DIM, HIDDEN / W]) and w2 ([tokens, HIDDEN / W] @ [HIDDEN / W, DIM]); the backward's
        # products read the weight untransposed (torch.mm)
        chosen = 2 * (skinny_config(tokens, HIDDEN // world, DIM) is not None) + \
            (skinny_config(tokens, DIM, HIDDEN // world) is not None)
        model = parallelize(copy.deepcopy(base), mesh, plan)
        dx = DTensor.from_local(x.clone(), mesh, [Replicate()]).requires_grad_()
        out = model(dx)
        forward_launches = _skinny_launches(lambda: model(dx))
        out.backward(DTensor.from_local(grad, mesh, [Replicate()]))
        w1_grad = model.w1.weight.grad.full_tensor()
        report.append(dict(tokens=tokens, chosen=chosen, forward_launches=forward_launches,
                           out=_relative(out.full_tensor(), ref), x_grad=_relative(dx.grad.full_tensor(), ref_x.grad),
                           w1_grad=_relative(w1_grad, base.w1.weight.grad)))
        base.zero_grad()
        inference = to_inference(parallelize(copy.deepcopy(base), mesh, plan))
        with torch.inference_mode():
            static = DTensor.from_local(x.clone(), mesh, [Replicate()])
            eager = inference(static).full_tensor()
            graph, captured = capture(lambda: inference(static))
            fresh = torch.randn(1, tokens, DIM, device="cuda", dtype=torch.bfloat16)
            static.to_local().copy_(fresh)
            graph_launches = _skinny_launches(graph.replay)
            replayed = captured.full_tensor()
            want = base(fresh)
        report[-1].update(eager=_relative(eager, ref), graph=_relative(replayed, want), graph_launches=graph_launches)
        del graph
    return report


@pytest.mark.parametrize("world", WORLDS)
def test_decode_products_run_the_skinny_gemm_where_the_table_says(world):
    for report in run_on_ranks(_decode_products, world, backend="nccl", timeout_s=300):
        for row in report:
            assert row["forward_launches"] == row["chosen"] == row["graph_launches"], row
            for key in ("out", "x_grad", "w1_grad", "eager", "graph"):
                assert row[key] < 2e-2, (key, row)
    assert any(row["chosen"] for row in report), "the shipped table chose no product at these shapes"


def test_skinny_gemm_on_another_device_than_the_current_one():
    """A product on cuda:1 called while cuda:0 is current runs on cuda:1 (the launch enters the
    tensors' device) and gives torch.mm's values; operands on two devices raise."""
    from axedist.kernels.skinny_gemm import skinny_mm
    torch.cuda.set_device(0)
    a = torch.randn(1, 4096, device="cuda:1", dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device="cuda:1", dtype=torch.bfloat16)
    for rows in (1, 8):
        got = skinny_mm(a.expand(rows, -1).contiguous(), w.t())
        assert got.device == a.device
        torch.testing.assert_close(got.float(), (a.expand(rows, -1).float() @ w.float().t()), rtol=2e-2, atol=2e-1)
    with pytest.raises(ValueError, match="on one device"):
        skinny_mm(a, w.t().to("cuda:0"))
