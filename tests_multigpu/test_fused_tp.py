"""The fused all-gather + GEMM and GEMM + all-reduce on W real GPUs (NCCL process group, torch's
symmetric memory), directly and layout-driven, against fp32 references; a decode step captured
in a CUDA graph and replayed. Written for the multi-GPU run (one GPU runs the same kernels as
virtual ranks: tests_onegpu/test_virtual_tp.py).

    CUDA_VISIBLE_DEVICES=0,1 python -m pytest tests_multigpu/test_fused_tp.py -q
    CUDA_VISIBLE_DEVICES=0,1,2,3 python -m pytest tests_multigpu/test_fused_tp.py -q
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from axedist.testing import capture, run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")


def _full(shape, seed, scale=1.0):
    """The same fp32 tensor on every rank (seeded), never zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda") * scale


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def body_all_gather_gemm(rank, world, backend="p2p"):
    """Direct calls (p2p, or torch's symmetric-memory op: "symm"): tails, both B orientations,
    back to back, the gathered rows copied out."""
    import axedist as ax
    failures = []
    for call, (rows, n, k, transposed) in enumerate([(257, 1000, 520, False), (257, 1000, 520, True),
                                                     (512, 2048, 1024, True), (300, 768, 512, False)]):
        a = _full((world * rows, k), 10 + call, k ** -0.25)
        w = _full((n, k), 20 + call, k ** -0.25)
        mine = a[rank * rows:(rank + 1) * rows].to(torch.bfloat16)
        b = w.to(torch.bfloat16).t() if transposed else w.t().contiguous().to(torch.bfloat16)
        gathered = torch.full((world * rows, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = ax.all_gather_gemm(mine, b, backend=backend, gathered=gathered)
        ref = a.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().t()
        if not _rel(out, ref) < 1e-2:
            failures.append(f"call {call}: {_rel(out, ref):.2e}")
        if not torch.equal(gathered, a.to(torch.bfloat16)):
            failures.append(f"call {call}: gathered rows differ")
    from axedist.collectives import check
    check()
    return failures


def body_copy_engine_all_gather_gemm(rank, world):
    """/ce on real GPUs (the rows to every peer by copy engine over NVLink, a flag copied after
    each chunk): tails, both orientations, 1 and 4 chunks, the gathered rows copied out, back to
    back without a sync and between calls of the push kernel on the same workspace."""
    import torch.distributed as dist
    from axedist.collectives import check, plan_all_gather_gemm
    from axedist.collectives.fused_tp import AllGatherGemmCall
    from axedist.collectives.symmetric import get_workspace
    from axedist.kernels.ag_gemm import AllGatherGemmConfig
    configs = [AllGatherGemmConfig(engine=True), AllGatherGemmConfig.parse("128x128x64/g8/s4/w8/c32x512/p1/ce"),
               AllGatherGemmConfig()]
    failures, results = [], []
    for call, (rows, n, k, transposed) in enumerate([(257, 1000, 520, False), (257, 1000, 520, True),
                                                     (512, 2048, 1024, True), (1024, 4096, 4096, True),
                                                     (300, 768, 512, False), (512, 2048, 1024, False)]):
        a = _full((world * rows, k), 30 + call, k ** -0.25)
        w = _full((n, k), 40 + call, k ** -0.25)
        mine = a[rank * rows:(rank + 1) * rows].to(torch.bfloat16)
        b = w.to(torch.bfloat16).t() if transposed else w.t().contiguous().to(torch.bfloat16)
        config = configs[call % len(configs)]
        runner = AllGatherGemmCall(plan_all_gather_gemm(mine, b, backend="p2p"), world, rank,
                                   lambda nbytes: get_workspace(dist.group.WORLD, nbytes, mine.device),
                                   pinned_config=config)
        gathered = torch.full((world * rows, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = runner.run(mine, b, gathered=gathered if call % 2 else None)
        launch = next(iter(runner.launches.values()))
        if launch.engine != config.engine:
            failures.append(f"call {call}: launch.engine {launch.engine} for {config}")
        ref = a.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().t()
        results.append((call, out, ref, gathered if call % 2 else None, a))
    check()
    for call, out, ref, gathered, a in results:
        if not _rel(out, ref) < 1e-2:
            failures.append(f"call {call} ({configs[call % len(configs)]}): {_rel(out, ref):.2e}")
        if gathered is not None and not torch.equal(gathered, a.to(torch.bfloat16)):
            failures.append(f"call {call}: gathered rows differ")
    return failures


def body_gemm_all_reduce(rank, world):
    """Direct calls, p2p: M in 1..256, one-shot and two-shot, bit-identical on every rank."""
    import axedist as ax
    failures = []
    for m in (1, 7, 64, 200, 256):
        for algorithm in ("one_shot", "two_shot"):
            k, n = 256 * world, 1000
            a = _full((m, k), m, k ** -0.25)
            w = _full((n, k), 2 * m, k ** -0.25)
            part = slice(rank * 256, (rank + 1) * 256)
            out = ax.gemm_all_reduce(a[:, part].to(torch.bfloat16), w[:, part].to(torch.bfloat16).t(),
                                     backend="p2p", algorithm=algorithm)
            ref = a.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().t()
            if not _rel(out, ref) < 1e-2:
                failures.append(f"M={m} {algorithm}: {_rel(out, ref):.2e}")
            everyone = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(everyone, out)
            if not all(torch.equal(everyone[0], other) for other in everyone):
                failures.append(f"M={m} {algorithm}: ranks differ")
    return failures


def body_colwise_sequence_parallel(rank, world):
    """ColwiseParallel(input_layouts=Shard(0)) on [S, B, K] bf16: the row all-gather fuses into
    the GEMM (counted), a second layer on the same gathered input gathers nothing more, and in
    backward the input's gradient (q's and v's products, summed unrun) runs ONE fused GEMM +
    reduce-scatter of ``[g_q g_v] @ [W_q; W_v]``; an output head with its own gather (one
    consumer) runs one more; values and gradients against an fp32 reference."""
    from axedist.dtensor import distribute, fused_gemm_stats
    from axedist.mesh import DeviceMesh
    from axedist.nn import ColwiseParallel, parallelize

    mesh = DeviceMesh("cuda", (world,))
    s, b, k, n = 256 * world, 2, 1024, 256 * world
    torch.manual_seed(0)
    layers = torch.nn.ModuleDict({name: torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                                  for name in ("q", "v", "head")})
    ref = {name: layer.weight.detach().float().clone() for name, layer in layers.items()}
    parallelize(layers, mesh, {"q": ColwiseParallel(), "v": ColwiseParallel(),
                               "head": ColwiseParallel(input_layouts=Shard(0))}, src_rank=None)
    x32 = _full((s, b, k), 7)
    x = distribute(x32.to(torch.bfloat16), mesh, [Shard(0)]).requires_grad_()
    before = fused_gemm_stats()
    gathered = x.redistribute([Replicate()])
    yq, yv = layers["q"](gathered), layers["v"](gathered)
    after = fused_gemm_stats()
    assert after["gathers_fused"] - before["gathers_fused"] == 1, after
    assert after["gathers_materialized"] == before["gathers_materialized"], after
    yh = layers["head"](x)
    up = _full((s, b, n), 8)
    local = slice(rank * (n // world), (rank + 1) * (n // world))
    loss = sum((y.to_local().float() * up[..., local]).sum() for y in (yq, yv, yh))
    forward = fused_gemm_stats()
    loss.backward()
    end = fused_gemm_stats()
    counts = {key: end[key] - forward[key] for key in ("summed", "fused", "unfused")}
    assert counts == {"summed": 1, "fused": 2, "unfused": 0}, (counts, end["reason"])   # the input gradient
    xr = x32.to(torch.bfloat16).float().requires_grad_()
    wants = {name: xr @ ref[name].t() for name in ("q", "v", "head")}
    sum((want * up).sum() for want in wants.values()).backward()
    for name, y in (("q", yq), ("v", yv), ("head", yh)):
        assert _rel(y.full_tensor(), wants[name].detach()) < 1e-2, name
    assert _rel(x.grad.full_tensor(), xr.grad) < 2e-2
    return True


def body_rowwise_backward_gather(rank, world):
    """RowwiseParallel(output_layouts=Shard(0)) on [S, B, K] bf16, in backward: the output
    gradient's row all-gather runs fused with the input gradient's GEMM (counted), although
    torch's mm backward asks for the weight gradient (``grad.t() @ x``) first; the input and
    weight gradients against an fp32 reference."""
    from axedist.dtensor import distribute, fused_gemm_stats
    from axedist.mesh import DeviceMesh
    from axedist.nn import RowwiseParallel, parallelize

    mesh = DeviceMesh("cuda", (world,))
    s, b, k, n = 256 * world, 2, 256 * world, 1024   # the input gradient's GEMM: N_local 256, K 1024
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    w = layer.weight.detach().float().clone()
    parallelize(layer, mesh, {"": RowwiseParallel(output_layouts=Shard(0))}, src_rank=None)
    x32 = _full((s, b, k), 9)
    local = slice(rank * (k // world), (rank + 1) * (k // world))
    x = x32.to(torch.bfloat16)[..., local].clone().requires_grad_()
    y = layer(x)
    up = _full((s, b, n), 10)
    before = fused_gemm_stats()
    (y * distribute(up.to(torch.bfloat16), mesh, [Shard(0)])).sum().backward()
    after = fused_gemm_stats()
    counts = {key: after[key] - before[key] for key in ("gathers_deferred", "gathers_fused", "gathers_materialized")}
    assert counts == {"gathers_deferred": 1, "gathers_fused": 1, "gathers_materialized": 0}, (counts, after["gather_reason"])
    xr = x32.to(torch.bfloat16).float().requires_grad_()
    wr = w.to(torch.bfloat16).float().requires_grad_()
    ((xr @ wr.t()) * up.to(torch.bfloat16).float()).sum().backward()
    assert _rel(x.grad.float(), xr.grad[..., local]) < 2e-2
    assert _rel(layer.weight.grad.full_tensor().float(), wr.grad) < 2e-2
    return True


def body_decode_graph(rank, world):
    """RowwiseParallel without sequence parallelism at decode sizes: the fused GEMM + all-reduce
    runs (counted); the layer pair captured in a CUDA graph and replayed with fresh inputs. (Decode
    tails off: with them, the GEMM runs alone and its all-reduce waits for an RMSNorm.)"""
    from axedist.dtensor import DTensor, fused_gemm_stats
    from axedist.mesh import DeviceMesh
    from axedist.nn import ColwiseParallel, RowwiseParallel, parallelize, to_inference
    from axedist.runtime.tails import defer_tails

    policy = defer_tails()  # (pooled rank processes: restored after)
    defer_tails("never")
    try:
        mesh = DeviceMesh("cuda", (world,))
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(1024, 512 * world, bias=False), torch.nn.ReLU(),
                                  torch.nn.Linear(512 * world, 1024, bias=False)).to("cuda", torch.bfloat16)
        w1, w2 = (layer.weight.detach().float().clone() for layer in (mlp[0], mlp[2]))
        parallelize(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_rank=None)
        to_inference(mlp)
        static = torch.zeros(4, 1024, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            before = fused_gemm_stats()
            out = mlp(DTensor.from_local(static, mesh, [Replicate()]))
            assert fused_gemm_stats()["fused"] - before["fused"] == 1, fused_gemm_stats()
            graph, out = capture(lambda: mlp(DTensor.from_local(static, mesh, [Replicate()])), warmups=1)
            for step in range(10):
                h = _full((4, 1024), 100 + step)
                static.copy_(h.to(torch.bfloat16))
                graph.replay()
                got = out.to_local() if isinstance(out, DTensor) else out
                ref = torch.relu(h.to(torch.bfloat16).float() @ w1.t()) @ w2.t()
                assert _rel(got, ref) < 2e-2, (step, _rel(got, ref))
    finally:
        defer_tails(policy)
    return True


def test_all_gather_gemm_direct():
    assert run_on_ranks(body_all_gather_gemm, WORLD, "nccl", timeout_s=600) == [[]] * WORLD


def test_all_gather_gemm_through_torchs_symmetric_memory_op():
    assert run_on_ranks(body_all_gather_gemm, WORLD, "nccl", args=("symm",), timeout_s=600) == [[]] * WORLD


def test_all_gather_gemm_rows_by_copy_engine():
    assert run_on_ranks(body_copy_engine_all_gather_gemm, WORLD, "nccl", timeout_s=600) == [[]] * WORLD


def test_gemm_all_reduce_direct():
    assert run_on_ranks(body_gemm_all_reduce, WORLD, "nccl", timeout_s=600) == [[]] * WORLD


def test_colwise_sequence_parallel_fuses_both_directions():
    run_on_ranks(body_colwise_sequence_parallel, WORLD, "nccl", timeout_s=600)


def test_rowwise_backward_runs_its_gradient_gather_fused():
    run_on_ranks(body_rowwise_backward_gather, WORLD, "nccl", timeout_s=600)


def test_rowwise_decode_fused_all_reduce_in_a_cuda_graph():
    run_on_ranks(body_decode_graph, WORLD, "nccl", timeout_s=600)
