"""torch.compile on one GPU: the TP = 1 Llama block through Inductor (Triton), and axedist's
collectives and fused kernels compiled as custom ops that Inductor's generated code calls.

A one-rank NCCL process group in this process. At TP = 1 every layout is replicated, so the
block has no collective to fuse (the layout-driven choice applies from 2 ranks on: see
tests/test_compile.py); the kernels are compiled here as the custom ops
``torch.ops.axedist.*`` with ``backend="p2p"`` (the real per-rank path: symmetric workspace,
compiled launch), and the generated code must call each of them. Values and gradients against
fp32 references on fresh random inputs.

    pytest tests_onegpu/test_compile_onegpu.py -x
"""

import pytest
import torch
from torch.distributed.tensor import Shard

from tests.test_compile import block_step, relative_error

SIX = ("reduce_scatter", "all_gather", "all_reduce", "gemm_reduce_scatter", "all_gather_gemm", "gemm_all_reduce")


def test_compiled_tp1_block_matches_eager(group, seed):
    from torch._inductor.utils import run_and_get_code

    from axedist.dtensor import distribute
    from axedist.mesh import DeviceMesh
    from axedist.nn import parallelize
    from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan

    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=1, n_heads=4, ffn_hidden=512, max_seq_len=128)
    mesh = DeviceMesh("cuda", (1,))
    model = Llama(cfg).to(device="cuda", dtype=torch.bfloat16)
    parallelize(model, mesh, llama_tp_plan(cfg))
    block = model.layers[0]
    x = distribute(torch.randn(cfg.max_seq_len, 2, cfg.dim, device="cuda", dtype=torch.bfloat16), mesh,
                      [Shard(0)])
    cos, sin = model.rope_cos.to(torch.bfloat16), model.rope_sin.to(torch.bfloat16)

    def step(fn):
        return block_step(fn, block, x, cos, sin)

    want = step(block)
    explained = torch._dynamo.explain(block)(x, cos, sin)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(lambda: step(compiled))
    assert any("triton" in code for code in codes), "Inductor generated no Triton kernel"
    assert relative_error(got[0], want[0]) < 2e-2, f"seed {seed}"
    for name in want[1]:
        assert relative_error(got[1][name], want[1][name]) < 5e-2, f"grad of {name}, seed {seed}"


def test_compiled_code_calls_the_custom_ops(group, seed):
    from torch._inductor.utils import run_and_get_code

    from axedist import collectives as C

    for op in ("gemm_reduce_scatter", "all_gather_gemm", "gemm_all_reduce"):
        a = torch.empty(256, 512, device="cuda", dtype=torch.bfloat16)
        planner = getattr(C, f"plan_{op}")
        assert planner(a, torch.empty(512, 1024, device="cuda", dtype=torch.bfloat16), group,
                       backend="p2p").backend == "p2p"

    def six(x, a, b):
        return (C.reduce_scatter(x, group, backend="p2p"), C.all_gather(x, group, backend="p2p"),
                C.all_reduce(x, group, backend="p2p"), C.gemm_reduce_scatter(a, b, group, backend="p2p"),
                C.all_gather_gemm(a, b, group, backend="p2p"), C.gemm_all_reduce(a[:64], b, group, backend="p2p"))

    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    a = (torch.randn(512, 1024, device="cuda") / 1024 ** 0.25).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(2048, 1024, device="cuda") / 1024 ** 0.25).to(torch.bfloat16).t().detach().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(six, backend="inductor", fullgraph=True)
    outs, codes = run_and_get_code(compiled, x, a, b)
    missing = [op for op in SIX if not any(f"torch.ops.axedist.{op}.default" in code for code in codes)]
    assert not missing, f"the generated code does not call {missing}"
    product = a.detach().float() @ b.detach().float()
    for name, out, ref in zip(SIX, outs, (x, x, x, product, product, product[:64])):
        assert relative_error(out, ref) < 1e-2, f"{name}, seed {seed}"
    # gradients through the compiled fused ops (W = 1: those of a @ b)
    (outs[3].float().sum() + outs[4].float().sum() + outs[5].float().sum()).backward()
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ((a32 @ b32).sum() * 2 + (a32[:64] @ b32).sum()).backward()
    assert relative_error(a.grad, a32.grad) < 2e-2 and relative_error(b.grad, b32.grad) < 2e-2, f"seed {seed}"
    C.check(group)
