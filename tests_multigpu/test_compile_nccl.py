"""torch.compile of the TP Llama block on W real GPUs (NCCL): Inductor's graph calls axedist's
fused kernels where the layouts choose them, and matches eager. Written for the multi-GPU run.

    CUDA_VISIBLE_DEVICES=0,1 python -m pytest tests_multigpu/test_compile_nccl.py -q
    CUDA_VISIBLE_DEVICES=0,1,2,3 python -m pytest tests_multigpu/test_compile_nccl.py -q
"""
import pytest
import torch
from torch.distributed.tensor import Shard

from axedist.testing import run_on_ranks
from tests.test_compile import block_step, relative_error

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")


def body_compiled_block(rank, world):
    """Sequence-parallel TP block, bf16, 512 rows per rank: the fused all-gather + GEMM (q/k/v,
    w1/w3) and GEMM + reduce-scatter (wo, w2) appear in the generated forward; forward values
    and gradients match eager (which runs the same kernels); a second step compiles nothing. The
    fused kernels are pinned (`pinned_backends(fused="p2p")`), so the measured tables cannot
    pick the unfused pair for these shapes. The generated backward calls the fused all-gather +
    GEMM for the gradients of wo and w2 (their output gradients' gathers)."""
    from axedist.runtime import pinned_backends

    with pinned_backends(fused="p2p"):
        return compiled_block(rank, world)


def compiled_block(rank, world):
    from torch._inductor.utils import run_and_get_code

    from axedist.dtensor import distribute
    from axedist.mesh import DeviceMesh
    from axedist.nn import parallelize
    from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan

    cfg = LlamaConfig(vocab_size=1024, dim=1024, n_layers=1, n_heads=16, ffn_hidden=2048, max_seq_len=256 * world)
    mesh = DeviceMesh("cuda", (world,))
    torch.manual_seed(0)
    model = Llama(cfg).to(device="cuda", dtype=torch.bfloat16)
    parallelize(model, mesh, llama_tp_plan(cfg))
    block = model.layers[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = distribute(torch.randn(cfg.max_seq_len, 2, cfg.dim, device="cuda", dtype=torch.bfloat16, generator=g),
                      mesh, [Shard(0)])
    cos, sin = model.rope_cos.to(torch.bfloat16), model.rope_sin.to(torch.bfloat16)

    def step(fn):
        return block_step(fn, block, x, cos, sin)

    want = step(block)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(lambda: step(compiled))
    missing = [op for op in ("gemm_reduce_scatter", "all_gather_gemm") if f"torch.ops.axedist.{op}" not in codes[0]]
    assert not missing, f"rank {rank}: the generated forward does not call {missing}"
    # backward: the row-parallel layers' output-gradient gathers (wo, w2) run fused with the input
    # gradient's GEMM, also where torch's mm backward asks for the weight gradient first
    backward = "".join(codes[1:])
    assert backward.count("torch.ops.axedist.all_gather_gemm") >= 2, f"rank {rank}: the backward's gathers ran unfused"
    assert relative_error(got[0], want[0]) < 2e-2, relative_error(got[0], want[0])
    errors = {n: relative_error(got[1][n], want[1][n]) for n in want[1]}
    bad = {n: e for n, e in errors.items() if not e < 5e-2}
    assert not bad, bad
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    step(compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before, "the second step recompiled"
    return True


def test_compiled_block_calls_the_fused_kernels():
    assert run_on_ranks(body_compiled_block, WORLD, "nccl", timeout_s=900) == [True] * WORLD


def body_whole_model(rank, world):
    """The whole TP + SP Llama, token ids to logits, compiled with fullgraph=True (Inductor) next to
    eager on W GPUs: the same losses (bf16, relative 2e-2) for three AdamW steps, one graph for all
    of them (no recompile), no graph break (``explain``)."""
    import copy

    from axedist.mesh import DeviceMesh
    from axedist.nn import parallelize, replicate
    from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss

    cfg = LlamaConfig(vocab_size=1024, dim=512, n_layers=2, n_heads=8, ffn_hidden=1024, max_seq_len=128 * world)
    mesh = DeviceMesh("cuda", (world,))
    torch.manual_seed(0)
    base = Llama(cfg).to(device="cuda", dtype=torch.bfloat16)
    eager, compiled = (parallelize(copy.deepcopy(base), mesh, llama_tp_plan(cfg)) for _ in range(2))
    torch._dynamo.reset()
    forward = torch.compile(compiled, backend="inductor", fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in (eager, compiled)]
    g = torch.Generator(device="cuda").manual_seed(1)
    losses, graphs = [], []
    for _ in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1), device="cuda", generator=g)
        pair = []
        for model in (eager, forward):
            loss = next_token_loss(model(tokens[:, :-1]), replicate(tokens[:, 1:], mesh))
            loss.backward()
            pair.append(float(loss.full_tensor().float()))
        losses.append(pair)
        _end_step(optimizers, graphs)
    explained = torch._dynamo.explain(eager)(tokens[:, :-1])
    return losses, graphs, explained.graph_break_count


def _end_step(optimizers, graphs: list) -> None:
    """Each optimizer's step, then the number of graphs Dynamo has made so far."""
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _one_graph_same_losses(reports, what: str) -> None:
    """Every rank: no graph break, no graph made after the first step, losses within 2e-2 of ``what``."""
    for rank, (losses, graphs, breaks) in enumerate(reports):
        assert breaks == 0, f"rank {rank}: {breaks} graph breaks"
        assert graphs[1:] == graphs[:1] * (len(graphs) - 1), f"rank {rank}: graphs after each step {graphs} (a recompile)"
        for step, (want, got) in enumerate(losses):
            assert abs(got - want) <= 2e-2 * abs(want), f"rank {rank} step {step}: compiled {got}, {what} {want}"


def test_whole_model_compiles_fullgraph_on_gpus():
    _one_graph_same_losses(run_on_ranks(body_whole_model, WORLD, "nccl", timeout_s=900), "eager")


def body_traced_fsdp(rank, world):
    """dp = 2 x tp = W / 2: the TP + SP Llama under ``fully_shard(traced=True)`` compiled whole with
    fullgraph=True (Inductor, fp32 masters, bf16 compute) against the one-GPU model on the whole
    batch (same bf16 compute): losses within 2e-2 for three AdamW steps, one graph, no break."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from axedist.mesh import DeviceMesh
    from axedist.nn import fully_shard, parallelize, replicate
    from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss

    cfg = LlamaConfig(vocab_size=1024, dim=512, n_layers=2, n_heads=8, ffn_hidden=1024, max_seq_len=256)
    mesh = DeviceMesh("cuda", (2, world // 2), ("dp", "tp"))
    torch.manual_seed(0)
    reference = Llama(cfg).cuda()
    model = parallelize(copy.deepcopy(reference), mesh["tp"], llama_tp_plan(cfg))
    fully_shard(model, mesh, traced=True,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    torch._dynamo.reset()
    forward = torch.compile(model, backend="inductor", fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in (reference, model)]
    g = torch.Generator(device="cuda").manual_seed(1)
    d = mesh.coordinates()["dp"]
    losses, graphs = [], []
    for _ in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = next_token_loss(reference(tokens[:, :-1]), tokens[:, 1:])
        want.backward()
        mine = tokens[2 * d:2 * d + 2]
        loss = next_token_loss(forward(mine[:, :-1]), replicate(mine[:, 1:], mesh["tp"]))
        loss.backward()
        mean = loss.full_tensor().detach().float().clone()
        dist.all_reduce(mean, group=mesh.group("dp"))
        losses.append((float(want), float(mean) / 2))
        _end_step(optimizers, graphs)
    explained = torch._dynamo.explain(model)(mine[:, :-1])
    return losses, graphs, explained.graph_break_count


@pytest.mark.skipif(WORLD < 4 or WORLD % 2, reason="dp = 2 x tp >= 2 needs an even number >= 4 of GPUs")
def test_traced_fsdp_x_tp_compiles_whole_on_gpus():
    _one_graph_same_losses(run_on_ranks(body_traced_fsdp, WORLD, "nccl", timeout_s=900), "one GPU")


def body_compiled_decode(rank, world, mode):
    """Decode steps of the TP Llama (bf16, inference mode) compiled whole by Inductor beside eager,
    where the fused decode tails run (all-reduce + residual add + RMSNorm in one p2p kernel): the
    same logits (bf16, relative 2e-2) at B = 1 and 8, on the first compiled call and the next, with
    Inductor's default mode and with ``reduce-overhead`` (its CUDA graphs, as decoding servers use). The
    tails are not deferred while tracing (inference mode is off there), so no p2p kernel meets a
    traced tensor."""
    import copy

    from axedist.mesh import DeviceMesh
    from axedist.nn import parallelize, to_inference
    from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan
    from axedist.runtime import deferred, tails

    cfg = LlamaConfig(vocab_size=2048, dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, ffn_hidden=2816, max_seq_len=64)
    mesh = DeviceMesh("cuda", (world,))
    torch.manual_seed(0)
    model = Llama(cfg).to(device="cuda", dtype=torch.bfloat16)
    model = to_inference(parallelize(copy.deepcopy(model), mesh, llama_tp_plan(cfg, sequence_parallel=False)))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: model(t).full_tensor(), backend="inductor", fullgraph=True, mode=mode)
    g = torch.Generator(device="cuda").manual_seed(1)
    errors, fused_eager = {}, 0
    # the default policy: no earlier test in these pooled rank processes may leave another (one
    # left "never" until 2026-11-30: this test then failed in the whole suite and passed alone)
    assert tails.defer_tails() == "auto", tails.defer_tails()
    for batch in (1, 8):
        tokens = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda", generator=g)
        with torch.inference_mode():
            before = deferred.fused_gemm_stats()["tails_fused"]
            want = model(tokens).full_tensor()
            fused_eager += deferred.fused_gemm_stats()["tails_fused"] - before
            got = compiled(tokens).clone()  # (a CUDA graph's output is overwritten by its next replay)
            again = compiled(tokens).clone()
            third = compiled(tokens)
        errors[batch] = (relative_error(got, want), relative_error(again, want), relative_error(third, want))
    return errors, fused_eager


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_decode_under_inference_mode_matches_eager(mode):
    for errors, fused_eager in run_on_ranks(body_compiled_decode, WORLD, "nccl", args=(mode,), timeout_s=900):
        assert fused_eager > 0, "eager decode ran no fused tail: the comparison is not the one meant"
        assert all(e < 2e-2 for pair in errors.values() for e in pair), errors
