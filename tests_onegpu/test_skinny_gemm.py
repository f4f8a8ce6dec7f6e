"""The skinny GEMM (kernels/skinny_gemm.py, decode products of 1-64 rows) on a GPU against an
fp64 product of the same inputs: every row count up to MAX_ROWS, ragged N and K, both strides of
the weight, bf16 / fp16 / fp32, the shipped and heuristic tiles and a few others. The CPU tests run
the same kernel under the Triton interpreter (tests/test_kernels_cpu.py)."""
import pytest
import torch

from axedist.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, heuristic_config, skinny_config, skinny_mm

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _check(rows, n, k, dtype, transposed, config, generator):
    a = torch.randn(rows, k, device="cuda", generator=generator).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=generator).to(dtype)
    b = w.t() if transposed else w.t().contiguous()
    out = skinny_mm(a, b, config=config)
    reference = a.double() @ b.double()
    error = ((out.double() - reference).norm() / reference.norm()).item()
    assert out.shape == (rows, n) and out.dtype == dtype
    assert error < TOLERANCE[dtype], (rows, n, k, dtype, transposed, config, error)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_row_count_against_fp64(dtype):
    generator = torch.Generator(device="cuda").manual_seed(torch.seed() % (1 << 31))
    for rows in range(1, MAX_ROWS + 1):
        for n, k in [(512, 4096), (200, 300), (33, 1000)]:
            _check(rows, n, k, dtype, rows % 2 == 0, None, generator)


def test_decode_shapes_with_every_kind_of_tiles():
    generator = torch.Generator(device="cuda").manual_seed(torch.seed() % (1 << 31))
    for rows in (1, 5, 8, 16, 17, 64):
        for n, k in [(2048, 4096), (4096, 7168), (512, 4096), (7168, 4096)]:
            configs = [heuristic_config(rows, n, k), skinny_config(rows, n, k),
                       SkinnyConfig(16, 256, 8, 2), SkinnyConfig(32 if rows > 1 else 4, 64, 4, 1)]
            for config in configs:
                if config is not None:
                    for transposed in (True, False):
                        _check(rows, n, k, torch.bfloat16, transposed, config, generator)


def test_skinny_gemm_into_a_view_and_under_a_cuda_graph():
    a = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    wide = torch.full((8, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
    skinny_mm(a, w.t(), out=wide[:, 1024:3072])
    torch.testing.assert_close(wide[:, 1024:3072].float(), (a.float() @ w.float().t()), rtol=2e-2, atol=2e-1)
    assert wide[:, :1024].isnan().all() and wide[:, 3072:].isnan().all()
    out = torch.empty(8, 2048, device="cuda", dtype=torch.bfloat16)
    skinny_mm(a, w.t(), out=out)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_mm(a, w.t(), out=out)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), (a.float() @ w.float().t()), rtol=2e-2, atol=2e-1)


def test_bad_calls_raise():
    a = torch.randn(65, 64, device="cuda")
    with pytest.raises(ValueError, match="1 to 64 rows"):
        skinny_mm(a, torch.randn(64, 8, device="cuda"))
    with pytest.raises(ValueError, match=r"\[M, K\] by \[K, N\]"):
        skinny_mm(a[:4], torch.randn(63, 8, device="cuda"))
    with pytest.raises(ValueError, match="one floating dtype"):
        skinny_mm(a[:4], torch.randn(64, 8, device="cuda", dtype=torch.float16))
