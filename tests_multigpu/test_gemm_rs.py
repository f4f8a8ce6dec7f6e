"""Fused GEMM + reduce-scatter vs an fp32 reference (matmul, sum over ranks, scatter) on W GPUs.

W = torch.cuda.device_count(): run under CUDA_VISIBLE_DEVICES=0,1 and with all four GPUs.
"""
import pytest
import torch
import torch.distributed as dist

from axedist.testing import run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")

# (rows per rank chunk, N, K_local): tails in every dim, small M, TMA and pointer paths
SHAPES = (
    (64, 256, 128),
    (100, 300, 200),      # N, K strides not 16-byte aligned: masked pointer path
    (257, 1000, 520),     # odd chunk rows, N and K tails on the TMA path
    (128, 512, 1024),
    (16, 8192, 7168),     # inference-size M
    (512, 8192, 2048),
    (1, 64, 64),
)


def _inputs(rank, m, n, k, dtype, seed, transposed):
    generator = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    a = torch.randn((m, k), generator=generator, device="cuda", dtype=torch.float32)
    b = torch.randn((n, k) if transposed else (k, n), generator=generator, device="cuda")
    a, b = (a / k ** 0.25).to(dtype), (b / k ** 0.25).to(dtype)
    return a, (b.t() if transposed else b)


def _reference(a, b, rank, world):
    partial = a.float() @ b.float()
    dist.all_reduce(partial)
    rows = a.shape[0] // world
    return partial[rank * rows:(rank + 1) * rows]


def _rel_error(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def body_shapes(rank, world, shapes, dtypes, backend):
    from axedist.collectives import gemm_reduce_scatter
    failures = []
    for dtype in dtypes:
        for transposed in (False, True):
            for index, (rows, n, k) in enumerate(shapes):
                m = rows * world
                a, b = _inputs(rank, m, n, k, dtype, index, transposed)
                out = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
                gemm_reduce_scatter(a, b, None, backend=backend, out=out, check=True)
                ref = _reference(a, b, rank, world)
                error = _rel_error(out, ref)
                label = f"{dtype} {'B^T' if transposed else 'B'} M={m} N={n} K={k}"
                if torch.isnan(out).any():
                    failures.append(f"{label}: NaN (unwritten or overflow)")
                elif error > 1e-2:
                    failures.append(f"{label}: rel error {error:.2e}")
    return failures


def body_configs(rank, world):
    """Every candidate tile config the tuner may choose is correct (tails included)."""
    from axedist.collectives import gemm_reduce_scatter
    from axedist.kernels import gemm_rs
    failures = []
    # the second shape is whole row tiles, so the TMA-push candidates take their TMA path
    for (m, n, k), config in [(shape, config) for shape in ((300 * world, 1000, 520), (256 * world, 1024, 512))
                              for config in gemm_rs.CANDIDATES + gemm_rs.TMA_PUSH_CONFIGS
                              + gemm_rs.TWO_PER_SM_CONFIGS]:
        gemm_rs.remember_config(gemm_rs.shape_key(m, n, k, world, torch.bfloat16), config)
        a, b = _inputs(rank, m, n, k, torch.bfloat16, 5, False)
        out = torch.full((m // world, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm_reduce_scatter(a, b, None, backend="p2p", out=out, check=True)
        error = _rel_error(out, _reference(a, b, rank, world))
        if not error <= 1e-2:
            failures.append(f"config {config} M={m}: rel error {error:.2e}")
        only = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        from axedist.collectives.fused import gemm_only
        gemm_only(a, b, world, config, out=only)
        error = _rel_error(only, a.float() @ b.float())
        if not error <= 1e-2:
            failures.append(f"gemm-only {config} M={m}: rel error {error:.2e}")
    return failures


STYLES = {"pull": {}, "push": dict(push=True), "tma": dict(push=True, defer_release=True, tma_push=True)}


def body_back_to_back(rank, world, calls, style="pull"):
    """Calls of alternating shapes with no host sync in between (epochs, no memset). With the
    TMA style, the second shape (chunks of 64 rows) takes the masked-store path."""
    from axedist.collectives import gemm_reduce_scatter
    from axedist.kernels import gemm_rs
    shapes = [(128 * world, 1024, 512), (64 * world, 520, 256), (256 * world, 2048, 1024)]
    for m, n, k in shapes:
        key = gemm_rs.shape_key(m, n, k, world, torch.bfloat16)
        gemm_rs.remember_config(key, gemm_rs.GemmConfig(**STYLES[style]))
    pending = []
    for call in range(calls):
        m, n, k = shapes[call % len(shapes)]
        a, b = _inputs(rank, m, n, k, torch.bfloat16, 1000 + call, call % 2 == 1)
        pending.append((a, b, gemm_reduce_scatter(a, b, None, backend="p2p")))
    failures = []
    for call, (a, b, out) in enumerate(pending):
        error = _rel_error(out, _reference(a, b, rank, world))
        if not error <= 1e-2:
            failures.append(f"call {call}: rel error {error:.2e}")
    from axedist.collectives import check
    check()
    return failures


def body_cached_launches(rank, world):
    """After the first call of a specialization, calls go through the compiled C launcher:
    fresh values every call stay correct, and a 16-byte-misaligned A (pointer path) gets its
    own compiled kernel instead of reusing the TMA one."""
    from axedist.collectives import check, gemm_reduce_scatter
    from axedist.kernels import gemm_rs
    m, n, k = 96 * world, 640, 384
    failures, counts = [], []
    for misaligned in (False, True, False):
        for call in range(3):
            a, b = _inputs(rank, m, n, k, torch.bfloat16, 50 + call, False)
            if misaligned:
                flat = torch.empty(m * k + 8, device="cuda", dtype=torch.bfloat16)
                a = flat[1:1 + m * k].view(m, k).copy_(a)
            out = gemm_reduce_scatter(a, b, None, backend="p2p")
            error = _rel_error(out, _reference(a, b, rank, world))
            if not error <= 1e-2:
                failures.append(f"misaligned={misaligned} call {call}: rel error {error:.2e}")
            counts.append(gemm_rs.cached_launches())
    check()
    # one new compiled kernel for the aligned A, one for the misaligned, none for repeats
    first = counts[0]
    if counts != [first] * 3 + [first + 1] * 6:
        failures.append(f"compiled-launch cache sizes {counts}")
    return failures


def body_timeout(rank, world, push=False):
    from axedist.collectives import CollectiveTimeoutError, gemm_reduce_scatter, reset
    from axedist.collectives.symmetric import get_workspace
    from axedist.kernels import gemm_rs
    m, n, k = 128 * world, 512, 256
    gemm_rs.remember_config(gemm_rs.shape_key(m, n, k, world, torch.bfloat16), gemm_rs.GemmConfig(push=push))
    a, b = _inputs(rank, m, n, k, torch.bfloat16, 3, False)
    get_workspace(None, m * n * 2, fresh=True)
    # the shape's first call checks that every rank runs the same product (a collective of its
    # own): made together, so that the lone call below meets only the kernel's own wait
    gemm_reduce_scatter(a, b, None, backend="p2p", check=True)
    message = ""
    if rank != 0:
        try:
            gemm_reduce_scatter(a, b, None, backend="p2p", timeout_s=0.5, check=True)
        except CollectiveTimeoutError as error:
            message = str(error)
    dist.barrier()
    reset()
    out = gemm_reduce_scatter(a, b, None, backend="p2p", check=True)
    return message, _rel_error(out, _reference(a, b, rank, world))


def body_errors(rank, world):
    from axedist.collectives import gemm_reduce_scatter
    a = torch.randn(world * 4 + 1, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    cases = {
        "m_not_divisible": lambda: gemm_reduce_scatter(a, b, None),
        "inner_mismatch": lambda: gemm_reduce_scatter(a[:world * 4], b[:32], None),
        "dtype_mismatch": lambda: gemm_reduce_scatter(a[:world * 4], b.half(), None),
        "fp32": lambda: gemm_reduce_scatter(a[:world * 4].float(), b.float(), None),
        "device": lambda: gemm_reduce_scatter(a[:world * 4], b.cpu(), None),
        "multimem_refused": lambda: gemm_reduce_scatter(a[:world * 4], b, None, backend="multimem"),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


def body_plan(rank, world):
    from axedist.collectives import plan_gemm_reduce_scatter
    a = torch.randn(world * 256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(world * 32, 128, device="cuda", dtype=torch.bfloat16)
    return (str(plan_gemm_reduce_scatter(a, b, None)), str(plan_gemm_reduce_scatter(a, b, None, backend="torch")),
            str(plan_gemm_reduce_scatter(small, b, None)))


def test_fused_matches_fp32_reference_bf16():
    results = run_on_ranks(body_shapes, WORLD, "nccl", args=(SHAPES, (torch.bfloat16,), "p2p"), timeout_s=900)
    assert results == [[]] * WORLD, results


def test_fused_matches_fp32_reference_fp16():
    results = run_on_ranks(body_shapes, WORLD, "nccl", args=(SHAPES[:4], (torch.float16,), "p2p"), timeout_s=900)
    assert results == [[]] * WORLD, results


def test_torch_backend_matches_reference():
    results = run_on_ranks(body_shapes, WORLD, "nccl", args=(SHAPES[:3], (torch.bfloat16,), "torch"), timeout_s=600)
    assert results == [[]] * WORLD, results


def test_symm_backend_matches_reference():
    """backend="symm": torch's fused_matmul_reduce_scatter, which "auto" runs where the table says."""
    results = run_on_ranks(body_shapes, WORLD, "nccl", args=(SHAPES[:3], (torch.bfloat16,), "symm"), timeout_s=600)
    assert results == [[]] * WORLD, results


def test_every_candidate_config_and_gemm_only_mode():
    results = run_on_ranks(body_configs, WORLD, "nccl", timeout_s=900)
    assert results == [[]] * WORLD, results


@pytest.mark.parametrize("style", list(STYLES))
def test_back_to_back_calls_without_sync(style):
    results = run_on_ranks(body_back_to_back, WORLD, "nccl", args=(24, style), timeout_s=600)
    assert results == [[]] * WORLD, results


def test_repeated_calls_run_the_compiled_launcher_correctly():
    results = run_on_ranks(body_cached_launches, WORLD, "nccl", timeout_s=600)
    assert results == [[]] * WORLD, results


@pytest.mark.parametrize("push", [False, True])
def test_peer_that_never_signals_raises_timeout(push):
    results = run_on_ranks(body_timeout, WORLD, "nccl", args=(push,), timeout_s=300)
    assert results[0][0] == ""
    for rank in range(1, WORLD):
        assert "rank 0" in results[rank][0] and "gave up" in results[rank][0], results[rank][0]
    assert all(error <= 1e-2 for _, error in results), results


def test_bad_input_raises_clear_errors():
    messages = run_on_ranks(body_errors, WORLD, "nccl", timeout_s=300)[0]
    assert "not divisible by the group size" in messages["m_not_divisible"]
    assert "(" in messages["m_not_divisible"] and "@" in messages["m_not_divisible"]
    assert "inner dimensions" in messages["inner_mismatch"]
    assert "bfloat16" in messages["dtype_mismatch"] and "float16" in messages["dtype_mismatch"]
    assert "bf16 or fp16" in messages["fp32"]
    assert "cpu" in messages["device"]
    assert "AXEDIST_ENABLE_MULTICAST" in messages["multimem_refused"]


def test_plan_says_what_runs():
    fused, torch_plan, small = run_on_ranks(body_plan, WORLD, "nccl", timeout_s=300)[0]
    assert "p2p" in fused and "torch" in torch_plan
    assert "torch" in small and "rows per rank" in small


def test_fused_calls_have_gradients():
    # the CPU suite's body with the fused kernels: gemm_reduce_scatter, all_gather_gemm and
    # gemm_all_reduce on operands that require grad, exact against the whole products
    from tests.test_collectives_autograd import grads_body
    names = ["gemm_reduce_scatter", "gemm_all_reduce", "all_gather_gemm"]
    assert run_on_ranks(grads_body, WORLD, backend="nccl", args=("cuda", "p2p", WORLD)) == [names] * WORLD
