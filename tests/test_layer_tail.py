"""The decode layer tail's public call (collectives/layer_tail.py) on CPU ranks: the unfused
sequence it falls back to off CUDA, against a single-process float64 reference, and its clear
errors. The fused kernel itself is checked under the Triton interpreter (tests/collectives_interpreter.py)
and on GPUs (tests_multigpu/test_collectives.py::test_layer_tail_matches_the_unfused_sequence)."""

import pytest
import torch

from axedist.collectives.layer_tail import all_reduce_add, all_reduce_rms_norm
from axedist.testing import run_on_ranks


def _inputs(world, rows, hidden, seed):
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, hidden, generator=generator, dtype=torch.float64) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(hidden, generator=generator, dtype=torch.float64)
    return xs, residual, weight


def _body(rank, world, rows, hidden, seed):
    xs, residual, weight = _inputs(world, rows, hidden, seed)
    h, y = all_reduce_rms_norm(xs[rank], residual, weight, 1e-6)
    added = all_reduce_add(xs[rank], residual)
    errors = []
    for bad in ({"backend": "nccl"}, {"backend": "p2p"}):
        try:
            all_reduce_rms_norm(xs[rank], residual, weight, 1e-6, **bad)
        except ValueError as error:
            errors.append(str(error))
    try:
        all_reduce_rms_norm(xs[rank], residual[:, :-1], weight, 1e-6)
    except ValueError as error:
        errors.append(str(error))
    return h, y, added, errors


@pytest.mark.parametrize("world,rows,hidden", [(2, 3, 40), (4, 1, 64)])
def test_layer_tail_off_cuda_is_the_unfused_sequence(world, rows, hidden):
    seed = torch.randint(0, 1 << 30, ()).item()  # fresh inputs every run
    results = run_on_ranks(_body, world, args=(rows, hidden, seed))
    xs, residual, weight = _inputs(world, rows, hidden, seed)
    h_ref = residual + torch.stack(xs).sum(0)
    y_ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    for h, y, added, errors in results:
        torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(added, h_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        assert "backend must be auto, p2p or torch, got 'nccl'" in errors[0]
        assert "backend p2p cannot run: it needs CUDA tensors" in errors[1]
        assert "x and residual must be [rows, hidden] of one shape" in errors[2]


class LlamaStack(torch.nn.Module):
    """Llama blocks without embedding and head (bench_decode's stack): h [S, B, dim] -> same. Its RoPE
    tables are plain tensors, not buffers (tests/test_compile.py mixes them into DTensor ops)."""

    def __init__(self, cfg):
        from axedist.nn.llama import TransformerBlock, rope_tables
        super().__init__()
        self.layers = torch.nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h, self.cos[:h.shape[0]], self.sin[:h.shape[0]])
        return h


def _decode_body(rank, world, layers, seed, deferred_gemms):
    import copy

    from torch.distributed.tensor import Replicate

    from axedist import DTensor
    from axedist.mesh import DeviceMesh
    from axedist.nn import parallelize, to_inference
    from axedist.nn.llama import LlamaConfig, llama_tp_plan
    from axedist.runtime import deferred, tails

    cfg = LlamaConfig(vocab_size=16, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=4)
    torch.manual_seed(seed)
    base = LlamaStack(cfg).double()
    h = torch.randn(1, 3, cfg.dim, dtype=torch.float64)
    mesh = DeviceMesh("cpu", (world,))
    model = parallelize(copy.deepcopy(base), mesh, {k: v for k, v in llama_tp_plan(cfg, sequence_parallel=False).items()
                                                    if k.startswith("layers.")})
    to_inference(model)
    outs, counts = {}, {}
    fallbacks_before = set(DTensor.dispatcher.fallback_ops())  # (an earlier test's on this worker are not ours)
    policy, gemm_policy = tails.defer_tails(), DTensor.dispatcher.defer_gemm
    # deferred_gemms: the row-parallel GEMMs' outputs pending, as on CUDA (a tail runs its GEMM first)
    DTensor.dispatcher.defer_gemm = "always" if deferred_gemms else "never"
    try:
        for mode in ("never", "always"):
            tails.defer_tails(mode)
            before = dict(deferred.fused_gemm_stats())
            with torch.inference_mode():
                out = model(DTensor.from_local(h, mesh, [Replicate()]))
                assert out._pending is None  # the model's output carries no deferred tail
                outs[mode] = out.to_local().clone()
            after = deferred.fused_gemm_stats()
            counts[mode] = {k: after[k] - before[k] for k in ("tails_deferred", "tails_fused", "tails_materialized")}
            counts[mode + " products offered to the fused kernel"] = after["fused"] + after["unfused"] - (
                before["fused"] + before["unfused"])
    finally:
        tails.defer_tails(policy)
        DTensor.dispatcher.defer_gemm = gemm_policy
    with torch.inference_mode():
        reference = base(h)
    # names, not OpOverloads (which do not pickle back to the test)
    return outs, counts, reference, sorted(map(str, set(DTensor.dispatcher.fallback_ops()) - fallbacks_before))


@pytest.mark.parametrize("world,layers,deferred_gemms", [(2, 2, False), (4, 3, False), (2, 2, True)])
def test_decode_tails_run_fused_in_a_parallelized_llama_stack(world, layers, deferred_gemms):
    """At decode (inference mode) every row-parallel all-reduce but the last waits for the residual
    add and the RMSNorm after it and runs with them as one call (on CPU: the unfused sequence of
    all_reduce_rms_norm); outputs equal the undeferred stack's and the one-process model's. With
    the GEMMs deferred (as on CUDA, where a product would otherwise run as the fused GEMM +
    all-reduce), the tail takes precedence: the GEMM runs alone, the all-reduce waits."""
    seed = torch.randint(0, 1 << 30, ()).item()
    for outs, counts, reference, fallbacks in run_on_ranks(_decode_body, world, args=(layers, seed, deferred_gemms)):
        torch.testing.assert_close(outs["always"], reference, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(outs["always"], outs["never"], rtol=1e-12, atol=1e-12)
        offered = counts.pop("never products offered to the fused kernel"), counts.pop("always products offered to the fused kernel")
        # deferred GEMMs: without tails each row-parallel product reaches the fused GEMM + all-reduce's
        # choice (declined on CPU); with tails none does
        assert offered == ((2 * layers, 0) if deferred_gemms else (0, 0)), offered
        assert counts["never"] == {"tails_deferred": 0, "tails_fused": 0, "tails_materialized": 0}
        # two tails per block; each but the model's last is taken by the next RMSNorm
        assert counts["always"] == {"tails_deferred": 2 * layers, "tails_fused": 2 * layers - 1,
                                    "tails_materialized": 1}, counts
        assert not fallbacks
