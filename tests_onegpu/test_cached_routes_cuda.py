"""The cached routes of a decode step on CUDA (one-rank NCCL group, mesh of one GPU): the
attention kernels (flash, efficient, cuDNN: tuples of tensors, integers and undefined outputs)
and the composite ops that reach the dispatcher undecomposed under inference_mode, called three
times (planned or recorded, then served by the cached routes), every result equal to torch's on
the plain tensors; with autograd, outputs and gradients too.

    pytest tests_onegpu/test_cached_routes_cuda.py -x
"""
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


@pytest.fixture(scope="module")
def mesh(group):  # (conftest: the session's one-rank NCCL group)
    from axedist.mesh import DeviceMesh
    return DeviceMesh("cuda", (1,))


def _dt(t, mesh):
    from axedist.dtensor import DTensor
    return DTensor.from_local(t, mesh, [Replicate()])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_attention_kernels_three_calls_match_torch(mesh, backend, seed):
    from axedist.dtensor import DTensor

    fast = DTensor.dispatcher.fastpath
    q, k, v = (torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(BACKENDS[backend]):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.inference_mode():
            qd, kd, vd = (_dt(t, mesh) for t in (q, k, v))
            before = fast.stats()["hits"]
            for call in range(3):
                got = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                assert torch.equal(got.to_local(), want), f"{backend}, call {call}, seed {seed}"
            assert fast.stats()["hits"] - before >= 2, f"{backend}: the repeated calls were not served"
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        grad = torch.randn_like(out)
        out.backward(grad)
        for call in range(3):
            dleaves = [_dt(t.detach().clone(), mesh).requires_grad_() for t in (q, k, v)]
            dout = F.scaled_dot_product_attention(*dleaves, is_causal=True)
            dout.backward(_dt(grad, mesh))
            assert torch.equal(dout.to_local(), out.detach()), f"{backend}, call {call}"
            for d, t in zip(dleaves, leaves):  # (a backward kernel may add in another order: bf16 tolerance)
                torch.testing.assert_close(d.grad.to_local(), t.grad, atol=2e-2, rtol=2e-2)


def test_decode_ops_three_calls_match_torch(mesh, seed):
    x = torch.randn(1, 4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    calls = {
        "rms_norm, weight as a keyword": lambda x, w: F.rms_norm(x, (256,), w, 1e-5),
        "cat of a list": lambda x, w: torch.cat([x, x * 2.0], dim=-1),
        "chunk": lambda x, w: x.chunk(2, dim=-1)[1],
        "cast": lambda x, w: x.to(torch.float32),
        "reshape of an expand": lambda x, w: x.view(1, 4, 4, 64).unsqueeze(3).expand(1, 4, 4, 2, 64).reshape(1, 4, 512),
        "silu * w": lambda x, w: F.silu(x) * w,
    }
    with torch.inference_mode():
        xd, wd = _dt(x, mesh), _dt(w, mesh)
        for name, call in calls.items():
            want = call(x, w)
            for attempt in range(3):
                got = call(xd, wd)
                assert got.dtype == want.dtype and torch.equal(got.to_local(), want), f"{name}, call {attempt}"


@pytest.mark.parametrize("rows", [1, 16])
def test_decode_linear_hits_run_the_skinny_gemm(mesh, rows, seed, monkeypatch):
    """``F.linear`` at a decode shape the skinny GEMM's table chose (1 x 4096 x 4096; 16 x 7168 x
    4096) under inference_mode: the first call records, the next two are fast-path hits that run
    the skinny GEMM through the decode product's twin (counted), every result bit for bit the
    normal route's (fast path off) and close to cuBLAS's on the plain tensors."""
    from axedist.dtensor import DTensor
    from axedist.kernels import skinny_gemm

    fast = DTensor.dispatcher.fastpath
    n = 4096 if rows == 1 else 7168
    x = torch.randn(rows, 1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) / 64
    launches = []
    real = skinny_gemm.skinny_mm

    def counted(*args, **kwargs):
        launches.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_mm", counted)
    with torch.inference_mode():
        xd, wd = _dt(x, mesh), _dt(w, mesh)
        fast.enable(False)
        normal = F.linear(xd, wd).to_local().clone()
        fast.enable(True)
        assert launches == [1], f"the table's shape did not run the skinny GEMM: {launches}"
        before = fast.stats()["hits"]
        for call in range(3):
            got = F.linear(xd, wd)
            assert torch.equal(got.to_local(), normal), f"rows {rows}, call {call}, seed {seed}"
        assert fast.stats()["hits"] - before == 2, "the repeated calls were not served"
        assert len(launches) == 1 + 3 + 1, launches  # normal, recording, the entry's proof, two hits
    torch.testing.assert_close(normal, F.linear(x, w), atol=2e-2, rtol=2e-2)
