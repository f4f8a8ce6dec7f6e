"""DTensor mm / F.linear with a pending sum, redistributed to row shards, on W GPUs: the fused
GEMM + reduce-scatter kernel runs (counted, and named by the plan), values match an fp32
reference, gradients flow, and shapes the measured table sends to cuBLAS + NCCL fall back.

W = torch.cuda.device_count(): run under CUDA_VISIBLE_DEVICES=0,1 and with all four GPUs:
    CUDA_VISIBLE_DEVICES=0,1 python -m pytest tests_multigpu/test_fused_dtensor.py -q
    CUDA_VISIBLE_DEVICES=0,1,2,3 python -m pytest tests_multigpu/test_fused_dtensor.py -q
"""
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Shard

from axedist.testing import run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")


def _full(shape, seed, scale):
    """The same fp32 tensor on every rank (seeded), never zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda") * scale


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _counts(before, after):
    return {k: after[k] - before[k] for k in ("deferred", "fused", "unfused", "materialized")}


def body_mm(rank, world, rows_per_rank, n, k, dtype_name, expect):
    """expect: "fused" (the kernel runs), "fallback" (deferred, then GEMM + collective with a
    reason), "eager" (not deferred at all: fp32 never fuses, so the GEMM runs at once)."""
    from axedist.dtensor import distribute, fused_gemm_stats, plan
    from axedist.mesh import DeviceMesh

    dtype = getattr(torch, dtype_name)
    mesh = DeviceMesh("cuda", (world,))
    m = rows_per_rank * world
    a32, b32 = _full((m, k), 1, k ** -0.25), _full((k, n), 2, k ** -0.25)
    da = distribute(a32.to(dtype), mesh, [Shard(1)])
    db = distribute(b32.to(dtype), mesh, [Shard(0)])
    before = fused_gemm_stats()
    c = torch.mm(da, db)
    assert c.placements == (Partial(),)
    p = plan(c, [Shard(0)])
    text = str(p)
    if expect == "eager":
        assert p.fused is None and c._pending is None, text
    else:
        assert p.fused is not None and p.fused.fused == (expect == "fused"), text
    y = c.redistribute([Shard(0)])
    torch.cuda.synchronize()
    d = _counts(before, fused_gemm_stats())
    if expect == "fused":
        assert "fused GEMM + reduce-scatter" in text and d == {"deferred": 1, "fused": 1, "unfused": 0,
                                                               "materialized": 0}, (text, d)
    elif expect == "fallback":
        assert "not used" in text and d["fused"] == 0 and d["unfused"] == 1, (text, d)
    else:
        assert d["deferred"] == 0 and d["fused"] == 0, d
    ref = (a32.to(dtype).float() @ b32.to(dtype).float())[rank * rows_per_rank:(rank + 1) * rows_per_rank]
    local = y.to_local()
    assert local.shape == (rows_per_rank, n) and local.dtype == dtype
    assert not torch.isnan(local).any()
    error = _rel(local, ref)
    assert error < 1e-2, (text, error)
    # the pending sum itself still reads right (computed on this use)
    assert _rel(c.full_tensor(), a32.to(dtype).float() @ b32.to(dtype).float()) < 1e-2
    return text


def body_linear_autograd(rank, world, rows_per_rank, n, k):
    """RowwiseParallel's pattern: F.linear(x [M, K] Shard(1), w [N, K] Shard(1)) -> Shard(0), bf16,
    forward fused; gradients of x and w against an fp32 reference."""
    from axedist.dtensor import distribute, fused_gemm_stats
    from axedist.mesh import DeviceMesh

    mesh = DeviceMesh("cuda", (world,))
    m = rows_per_rank * world
    x32, w32 = _full((m, k), 3, k ** -0.25), _full((n, k), 4, k ** -0.25)
    up = _full((m, n), 5, 1.0)
    x = distribute(x32.to(torch.bfloat16), mesh, [Shard(1)]).requires_grad_()
    w = distribute(w32.to(torch.bfloat16), mesh, [Shard(1)]).requires_grad_()
    before = fused_gemm_stats()
    y = F.linear(x, w).redistribute((Shard(0),))
    d = _counts(before, fused_gemm_stats())
    assert d["fused"] == 1 and d["materialized"] == 0, d
    loss = (y.full_tensor().float() * up).sum()
    loss.backward()
    xr, wr = x32.to(torch.bfloat16).float().requires_grad_(), w32.to(torch.bfloat16).float().requires_grad_()
    ref = F.linear(xr, wr)
    (ref * up).sum().backward()
    assert _rel(y.full_tensor(), ref.detach()) < 1e-2
    assert _rel(x.grad.full_tensor(), xr.grad) < 2e-2
    assert _rel(w.grad.full_tensor(), wr.grad) < 2e-2
    return True


def body_rowwise_module(rank, world):
    """axedist.nn.RowwiseParallel(output_layouts=Shard(0)) on [S, B, K] bf16 activations runs the kernel."""
    from axedist.dtensor import distribute, fused_gemm_stats
    from axedist.mesh import DeviceMesh
    from axedist.nn import RowwiseParallel, parallelize

    mesh = DeviceMesh("cuda", (world,))
    s, b, k, n = 256 * world, 2, 128 * world, 512
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    ref_lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.float32)
    ref_lin.load_state_dict({name: t.float() for name, t in lin.state_dict().items()})
    parallelize(lin, mesh, {"": RowwiseParallel(output_layouts=Shard(0))})
    x32 = _full((s, b, k), 6, 1.0)
    x = distribute(x32.to(torch.bfloat16), mesh, [Shard(2)])
    before = fused_gemm_stats()
    y = lin(x)
    d = _counts(before, fused_gemm_stats())
    assert d["fused"] == 1, (d, fused_gemm_stats()["reason"])
    assert y.placements == (Shard(0),)
    assert _rel(y.full_tensor(), ref_lin(x32.to(torch.bfloat16).float()).detach()) < 1e-2
    return True


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mm_partial_to_rows_runs_fused_kernel(dtype):
    texts = run_on_ranks(body_mm, WORLD, "nccl", args=(512, 1024, 256 * WORLD, dtype, "fused"), timeout_s=600)
    print(texts[0])


def test_tails_fused():
    run_on_ranks(body_mm, WORLD, "nccl", args=(300, 1000, 200 * WORLD + 40, "bfloat16", "fused"), timeout_s=600)


def test_small_rows_fall_back_to_cublas_and_collective():
    texts = run_on_ranks(body_mm, WORLD, "nccl", args=(64, 512, 128 * WORLD, "bfloat16", "fallback"), timeout_s=600)
    assert "rows per rank" in texts[0], texts[0]


def test_fp32_is_not_deferred():
    run_on_ranks(body_mm, WORLD, "nccl", args=(256, 256, 64 * WORLD, "float32", "eager"), timeout_s=600)


def test_linear_autograd_through_fused():
    run_on_ranks(body_linear_autograd, WORLD, "nccl", args=(512, 768, 256 * WORLD), timeout_s=600)


def test_rowwise_parallel_module_runs_fused_kernel():
    run_on_ranks(body_rowwise_module, WORLD, "nccl", timeout_s=600)
