"""The GEMM core (axedist.kernels.gemm) and the fused kernel's GEMM-only mode on one GPU,
against an fp32 reference: every candidate config (warp-specialized or not, split-K), both B
orientations, tails, the masked-pointer path, and the cached launcher on repeated calls."""
import os

import pytest
import torch


def _operands(m, n, k, transposed, dtype=torch.bfloat16):
    a = (torch.randn(m, k, device="cuda") / k ** 0.25).to(dtype)
    b = (torch.randn((n, k) if transposed else (k, n), device="cuda") / k ** 0.25).to(dtype)
    return a, (b.t() if transposed else b)


def _error(out, a, b):
    ref = a.float() @ b.float()
    assert not torch.isnan(out).any(), "NaN left: unwritten output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def _candidates():
    """Every candidate config, or the comma list in AXEDIST_CORE_CONFIGS (what a probe of this
    machine found working: benchmarks/bench_gemm.py --probe)."""
    from axedist.kernels.gemm import CORE_CANDIDATES
    chosen = os.environ.get("AXEDIST_CORE_CONFIGS")
    return chosen.split(",") if chosen else [str(config) for config in CORE_CANDIDATES]


@pytest.mark.parametrize("config", _candidates() if torch.cuda.is_available() else ["none"])
def test_every_candidate_matches_fp32(config, seed):
    from axedist.kernels.gemm import GemmCoreConfig, gemm
    config = GemmCoreConfig.parse(config)
    failures = []
    for (m, n, k), transposed in [((300, 1000, 520), False), ((300, 1000, 520), True),
                                  ((128, 2048, 4096), False), ((1024, 768, 64), True)]:
        a, b = _operands(m, n, k, transposed)
        out = torch.full((m, n), float("nan"), dtype=a.dtype, device="cuda")
        error = _error(gemm(a, b, out=out, config=config), a, b)
        if not error <= 1e-2:
            failures.append(f"{config} {m}x{n}x{k} B^T={transposed} seed={seed}: {error:.2e}")
    assert not failures, failures


def _default(m, n, k):
    """The shipped config of the shape, unless AXEDIST_CORE_CONFIGS (a probe's working list)
    leaves it out: then the first working one."""
    from axedist.kernels.gemm import GemmCoreConfig, core_config
    config = core_config(m, n, k, 0)
    chosen = _candidates()
    return config if str(config) in chosen else GemmCoreConfig.parse(chosen[0])


def test_default_configs_pointer_path_and_fp16(seed):
    from axedist.kernels.gemm import gemm
    for m, n, k in [(128, 8192, 1024), (512, 4096, 2048), (100, 300, 200), (1, 64, 64)]:
        a, b = _operands(m, n, k, False)
        assert _error(gemm(a, b, config=_default(m, n, k)), a, b) <= 1e-2, (m, n, k, seed)
    a, b = _operands(256, 512, 384, True, torch.float16)
    assert _error(gemm(a, b, config=_default(256, 512, 384)), a, b) <= 1e-2, seed
    storage = torch.empty(300 * 520 + 8, device="cuda", dtype=torch.bfloat16)
    a = storage[1:1 + 300 * 520].view(300, 520)      # 2 bytes off 16-byte alignment
    a.copy_(torch.randn(300, 520, device="cuda"))
    _, b = _operands(300, 1000, 520, True)
    assert _error(gemm(a, b, config=_default(300, 1000, 520)), a, b) <= 1e-2, seed  # pointer path


def test_cached_launcher_on_repeated_calls(seed):
    """Calls after the first go through the cached launcher: new values in the same buffers,
    new buffers (new descriptors), and out= given; every result right."""
    from axedist.kernels import gemm as core
    m, n, k = 512, 1024, 768
    config = _default(m, n, k)
    a, b = _operands(m, n, k, True)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    core.gemm(a, b, out=out, config=config)
    cached = core.cached_launches()
    for call in range(4):
        if call % 2:
            a, b = _operands(m, n, k, True)                       # new addresses
        else:
            a.copy_(torch.randn(m, k, device="cuda") / k ** 0.25)  # same addresses, new values
        out.fill_(float("nan"))
        assert _error(core.gemm(a, b, out=out, config=config), a, b) <= 1e-2, (call, seed)
    assert core.cached_launches() == cached


def test_fused_kernel_gemm_only_mode(seed):
    from axedist.collectives.fused import gemm_only
    from axedist.kernels.gemm_rs import GemmConfig
    for config in (GemmConfig(), GemmConfig(64, 256, 64, 8, 4, 4)):
        a, b = _operands(1024, 1000, 520, False)
        out = torch.full((1024, 1000), float("nan"), dtype=a.dtype, device="cuda")
        assert _error(gemm_only(a, b, 4, config, out=out), a, b) <= 1e-2, (config, seed)
    # the Gluon kernel's GEMM-only mode (chunks of whole row tiles), both orientations
    for transposed in (False, True):
        a, b = _operands(2048, 1000, 520, transposed)
        out = torch.full((2048, 1000), float("nan"), dtype=a.dtype, device="cuda")
        assert _error(gemm_only(a, b, 4, GemmConfig(pipelined=True), out=out), a, b) <= 1e-2, \
            (transposed, seed)


def test_bad_input_raises_clear_errors():
    from axedist.kernels.gemm import gemm
    a = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shapes do not match"):
        gemm(a, torch.randn(48, 16, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemm(a.float(), torch.randn(32, 16, device="cuda"))
    with pytest.raises(ValueError, match="one CUDA device"):
        gemm(a, torch.randn(32, 16, dtype=torch.bfloat16))
