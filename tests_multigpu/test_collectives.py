"""p2p collectives vs torch.distributed (NCCL) on W = torch.cuda.device_count() GPUs.

Fresh random inputs every time (never zeros), outputs poisoned with NaN beforehand, odd sizes,
all three dtypes, many calls back to back without resets, and a peer that never signals.
"""

import os

import pytest
import torch
import torch.distributed as dist

from axedist.collectives import all_gather_into, reduce_scatter_into
from axedist.testing import run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# elements per rank chunk: tiny, odd, not a multiple of 16, block-sized, multi-block, large
SIZES = (1, 7, 33, 1000, 4096, 4097, 65_537, 1 << 20, 3_000_001)


def _tolerance(dtype, world):
    # the reference sums in fp32 and rounds once; NCCL may round per step: bf16 differs by ulps
    return {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


def _rel_error(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(rank, shape, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32).to(dtype)


def _reference_sum(x, world):
    """fp32 sum over ranks of x (gathered through NCCL)."""
    gathered = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    all_gather_into(gathered, x.contiguous())
    return gathered.float().sum(0)


def _error_of(op, x, out, rank, world):
    """Relative error of a p2p ``op`` call's ``out`` on input ``x``: reduce-scatter and all-reduce
    against the fp32 sum over ranks, all-gather exact against NCCL's (0 or 1)."""
    if op == "all_gather":
        ref = torch.empty(world * x.numel(), dtype=x.dtype, device="cuda")
        all_gather_into(ref, x.contiguous())
        return 0.0 if torch.equal(out, ref) else 1.0
    total = _reference_sum(x, world)
    if op == "reduce_scatter":
        chunk = x.numel() // world
        total = total[rank * chunk:(rank + 1) * chunk]
    return _rel_error(out, total)


def body_reduce_scatter(rank, world, sizes, dtypes, repeats, variant):
    from axedist.collectives import p2p
    failures = []
    for dtype in dtypes:
        for chunk in sizes:
            for repeat in range(repeats):
                x = _inputs(rank, (world * chunk,), dtype, seed=chunk + repeat + 7 * DTYPES.index(dtype))
                out = torch.full((chunk,), float("nan"), dtype=dtype, device="cuda")
                if variant == "zero_copy":
                    staged = p2p.symmetric_input(x.shape, dtype, None, "reduce_scatter")
                    if staged is None:  # chunk not a multiple of 16: the call copies instead
                        staged = x
                    else:
                        staged.copy_(x)
                    p2p.reduce_scatter(staged, out=out)
                else:
                    p2p.reduce_scatter(x, out=out, variant=variant)
                ref = _reference_sum(x, world)[rank * chunk:(rank + 1) * chunk]
                nccl = torch.empty(chunk, dtype=dtype, device="cuda")
                reduce_scatter_into(nccl, x)
                if torch.isnan(out).any():
                    failures.append(f"{dtype} chunk {chunk} repeat {repeat}: NaN left (unwritten)")
                error = _rel_error(out, ref)
                if error > _tolerance(dtype, world) / 4:
                    failures.append(f"{variant} {dtype} chunk {chunk}: rel error {error:.2e} vs fp32 ref")
                if _rel_error(out, nccl) > _tolerance(dtype, world):
                    failures.append(f"{variant} {dtype} chunk {chunk}: differs from NCCL")
    # 2-D input, dim 0 scattered
    x = _inputs(rank, (world * 3, 129), torch.bfloat16, seed=99)
    out = p2p.reduce_scatter(x, variant="pull" if variant == "zero_copy" else variant)
    ref = _reference_sum(x, world)[rank * 3:(rank + 1) * 3]
    if out.shape != (3, 129) or _rel_error(out, ref) > 5e-3:
        failures.append(f"2-D reduce-scatter: shape {tuple(out.shape)}, error {_rel_error(out, ref)}")
    torch.cuda.synchronize()
    from axedist.collectives import check
    check()
    return failures


def body_all_gather(rank, world, sizes, dtypes, variant):
    from axedist.collectives import p2p
    failures = []
    for dtype in dtypes:
        for chunk in sizes:
            x = _inputs(rank, (chunk,), dtype, seed=chunk + 3)
            out = torch.full((world * chunk,), float("nan"), dtype=dtype, device="cuda")
            if variant == "zero_copy":
                staged = p2p.symmetric_input(x.shape, dtype, None, "all_gather")
                staged.copy_(x)
                p2p.all_gather(staged, out=out)
            else:
                p2p.all_gather(x, out=out, variant=variant)
            ref = torch.empty(world * chunk, dtype=dtype, device="cuda")
            all_gather_into(ref, x)
            if not torch.equal(out, ref):
                failures.append(f"{variant} {dtype} chunk {chunk}: all_gather differs from NCCL "
                                f"(NaN left: {bool(torch.isnan(out).any())})")
    torch.cuda.synchronize()
    return failures


def body_all_reduce(rank, world, sizes, dtypes, algorithm, variant):
    from axedist.collectives import p2p
    failures = []
    for dtype in dtypes:
        for numel in sizes:
            x = _inputs(rank, (numel,), dtype, seed=numel + 11)
            out = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
            if variant == "zero_copy":
                staged = p2p.symmetric_input(x.shape, dtype, None, "all_reduce")
                staged.copy_(x)
                p2p.all_reduce(staged, out=out, algorithm=algorithm)
            else:
                p2p.all_reduce(x, out=out, algorithm=algorithm, variant=variant)
            ref = _reference_sum(x, world)
            if torch.isnan(out).any():
                failures.append(f"{algorithm} {variant} {dtype} n {numel}: NaN left")
            error = _rel_error(out, ref)
            if error > _tolerance(dtype, world) / 4:
                failures.append(f"{algorithm} {variant} {dtype} n {numel}: rel error {error:.2e}")
            # every rank must hold bit-identical results (two-shot gathers one reduced copy)
            if algorithm == "two_shot":
                gathered = torch.empty((world, numel), dtype=dtype, device="cuda")
                all_gather_into(gathered, out)
                if not all(torch.equal(gathered[0], gathered[r]) for r in range(world)):
                    failures.append(f"two_shot {variant} {dtype} n {numel}: ranks disagree")
    torch.cuda.synchronize()
    return failures


def body_back_to_back(rank, world, calls):
    """Many calls of mixed ops, variants and sizes with no host sync: epochs and halves
    alternate, push calls write into halves that pull calls read, and the public api runs."""
    import axedist.collectives as collectives
    from axedist.collectives import p2p
    inputs, outputs = [], []
    for call in range(calls):
        chunk = 1000 + 4096 * (call % 5) + 24 * (call % 2)  # odd calls: multiples of 16
        x = _inputs(rank, (world * chunk,), torch.bfloat16, seed=500 + call)
        inputs.append(x)
        kind, variant = call % 3, ("push", "pull", "auto", "zero_copy")[call % 4]
        if kind == 0:
            if variant == "zero_copy" and chunk % 16 == 0:
                staged = p2p.symmetric_input(x.shape, x.dtype, None, "reduce_scatter")
                staged.copy_(x)
                outputs.append(p2p.reduce_scatter(staged))
            elif variant == "auto":
                outputs.append(collectives.reduce_scatter(x, backend="p2p"))
            else:
                outputs.append(p2p.reduce_scatter(x, variant="pull" if variant == "zero_copy" else variant))
        elif kind == 1:
            algorithm = ("one_shot", "two_shot")[call % 2]
            if variant == "auto":
                outputs.append(collectives.all_reduce(x, backend="p2p"))
            else:
                outputs.append(p2p.all_reduce(x, algorithm=algorithm,
                                              variant="push" if variant == "push" else "pull"))
        else:
            outputs.append(p2p.all_gather(x, variant="push" if variant == "push" else "pull"))
    failures = []
    for call, (x, out) in enumerate(zip(inputs, outputs)):
        kind = call % 3
        error = _error_of(("reduce_scatter", "all_reduce", "all_gather")[kind], x, out, rank, world)
        if error > 5e-3:
            failures.append(f"call {call} kind {kind}: error {error:.2e}")
    return failures


def body_two_streams(rank, world, calls):
    """FSDP's pattern: calls on one group issued in turn from two side streams, no host sync,
    one stream held back on rank 0 only (a long sleep kernel before each of its calls). Every
    rank must still run the calls in the order it issued them: each result against NCCL."""
    from axedist.collectives import p2p
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    inputs, outputs = [], []
    for call in range(calls):
        x = _inputs(rank, (world * 4096,), torch.bfloat16, seed=900 + call)
        inputs.append(x)
        stream = streams[call % 2]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if rank == 0 and call % 2 == 0:
                torch.cuda._sleep(20_000_000)  # ~10 ms: without ordering the other stream overtakes
            outputs.append(p2p.reduce_scatter(x) if call % 2 == 0 else p2p.all_gather(x[:4096]))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    failures = []
    for call, (x, out) in enumerate(zip(inputs, outputs)):
        op = ("reduce_scatter", "all_gather")[call % 2]
        error = _error_of(op, x if op == "reduce_scatter" else x[:4096], out, rank, world)
        if not error <= 5e-3:
            failures.append(f"call {call} ({op}): error {error:.2e}")
    return failures


def body_view_inside_workspace(rank, world):
    """An input that lies inside the call's workspace half but is not the symmetric_input
    tensor (an offset view) must still give the right sum: the call copies it out first."""
    from axedist.collectives import p2p
    chunk = 4096
    staged = p2p.symmetric_input((world * chunk + 64,), torch.float32, None, "reduce_scatter")
    x = _inputs(rank, (world * chunk,), torch.float32, seed=77)
    view = staged[64:]
    view.copy_(x)
    out = p2p.reduce_scatter(view)
    ref = _reference_sum(x, world)[rank * chunk:(rank + 1) * chunk]
    return _rel_error(out, ref)


def body_timeout(rank, world, variant):
    """Rank 0 never launches; the other ranks' kernels must give up and raise, naming rank 0."""
    from axedist.collectives import CollectiveTimeoutError, p2p
    from axedist.collectives.symmetric import get_workspace
    x = _inputs(rank, (world * 4096,), torch.bfloat16, seed=1)
    workspace = get_workspace(None, x.numel() * 2 * 64, fresh=True)  # collective allocation
    message = ""
    if rank != 0:
        p2p.reduce_scatter(x, timeout_s=0.5, variant=variant)
        try:
            workspace.check(synchronize=True)
        except CollectiveTimeoutError as error:
            message = str(error)
    dist.barrier()
    from axedist.collectives import reset
    reset()
    # the group works again afterwards (fresh workspace)
    out = p2p.reduce_scatter(x, variant=variant)
    ref = _reference_sum(x, world)[rank * 4096:(rank + 1) * 4096]
    return message, _rel_error(out, ref)


def body_errors(rank, world):
    from axedist.collectives import p2p, reduce_scatter
    messages = []
    for bad in (lambda: p2p.reduce_scatter(torch.randn(world * 2 + 1, device="cuda")),
                lambda: p2p.reduce_scatter(torch.randn(8)),
                lambda: p2p.all_reduce(torch.ones(8, dtype=torch.int32, device="cuda")),
                lambda: reduce_scatter(torch.randn(8, device="cuda"), backend="nccl"),
                lambda: p2p.all_gather(torch.randn(8, device="cuda"), variant="multicast"),
                lambda: p2p.reduce_scatter(torch.randn(world * 4, device="cuda"),
                                           out=torch.empty(3, device="cuda"))):
        try:
            bad()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def body_pipelined(rank, world, rounds, sizes):
    """Reduce-scatter and all-gather with their phases pipelined over `rounds` ranges (forced
    through AXEDIST_P2P_ROUNDS; production picks rounds by size from the measured table)."""
    from axedist.collectives import p2p
    os.environ["AXEDIST_P2P_ROUNDS"] = str(rounds)
    p2p.cached_plans().clear()
    try:
        failures = []
        for variant in ("push", "pull"):
            failures += body_reduce_scatter(rank, world, sizes, (torch.bfloat16, torch.float32), 2,
                                            variant)
            failures += body_all_gather(rank, world, sizes, (torch.bfloat16,), variant)
        used = {plan.rounds for plan in p2p.cached_plans().values()
                if plan.op in ("reduce_scatter", "all_gather")}
        if used != {rounds}:
            failures.append(f"plans ran with rounds {used}, not {rounds}")
        return failures
    finally:
        del os.environ["AXEDIST_P2P_ROUNDS"]
        p2p.cached_plans().clear()


VARIANTS = ("push", "pull", "zero_copy")


@pytest.mark.parametrize("rounds", [2, 3])
def test_pipelined_reduce_scatter_and_all_gather_match_nccl(rounds):
    results = run_on_ranks(body_pipelined, WORLD, "nccl", args=(rounds, SIZES + (9_000_011,)),
                           timeout_s=600)
    assert results == [[]] * WORLD, results


@pytest.mark.parametrize("variant", VARIANTS)
def test_reduce_scatter_matches_nccl(variant):
    results = run_on_ranks(body_reduce_scatter, WORLD, "nccl", args=(SIZES, DTYPES, 2, variant),
                           timeout_s=600)
    assert results == [[]] * WORLD, results


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_gather_matches_nccl(variant):
    results = run_on_ranks(body_all_gather, WORLD, "nccl", args=(SIZES, DTYPES, variant), timeout_s=600)
    assert results == [[]] * WORLD, results


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_all_reduce_matches_reference(algorithm, variant):
    sizes = (1, 7, 4097, 65_537, 1 << 20, 3_000_001)
    results = run_on_ranks(body_all_reduce, WORLD, "nccl", args=(sizes, DTYPES, algorithm, variant),
                           timeout_s=600)
    assert results == [[]] * WORLD, results


def test_back_to_back_calls_without_resets():
    results = run_on_ranks(body_back_to_back, WORLD, "nccl", args=(60,), timeout_s=600)
    assert results == [[]] * WORLD, results


def test_calls_from_two_streams_run_in_issue_order():
    results = run_on_ranks(body_two_streams, WORLD, "nccl", args=(12,), timeout_s=300)
    assert results == [[]] * WORLD, results


def test_input_view_inside_the_workspace_is_copied_out_first():
    errors = run_on_ranks(body_view_inside_workspace, WORLD, "nccl", timeout_s=300)
    assert all(error < 1e-5 for error in errors), errors


@pytest.mark.parametrize("variant", ["push", "pull"])
def test_peer_that_never_signals_raises_timeout(variant):
    results = run_on_ranks(body_timeout, WORLD, "nccl", args=(variant,), timeout_s=300)
    assert results[0][0] == ""
    for rank in range(1, WORLD):
        message, error = results[rank]
        assert "rank 0" in message and "gave up" in message, message
    assert all(error < 5e-3 for _, error in results), results


def test_bad_input_raises_clear_errors():
    messages = run_on_ranks(body_errors, WORLD, "nccl", timeout_s=300)[0]
    assert messages[0] and "not divisible by the group size" in messages[0]
    assert messages[1] and "CUDA" in messages[1]
    assert messages[2] and "dtype" in messages[2]
    assert messages[3] and "backend must be one of" in messages[3]
    assert messages[4] and "variant must be one of" in messages[4]
    assert messages[5] and "out must be" in messages[5]


def body_layer_tail(rank, world, shapes, dtypes, variant, graph):
    """The fused all-reduce + residual add + RMSNorm against the unfused sequence on NCCL (fp32
    reference), bit-identical across ranks; eager, or captured once in a CUDA graph and replayed
    on fresh inputs (the kernel takes its epoch from device memory)."""
    from axedist.collectives.layer_tail import all_reduce_add, all_reduce_rms_norm
    failures = []
    for dtype in dtypes:
        for rows, hidden in shapes:
            x = _inputs(rank, (rows, hidden), dtype, seed=rows * 7 + hidden)
            residual = _inputs(0, (rows, hidden), dtype, seed=hidden)      # replicated: same on every rank
            weight = 1 + 0.1 * _inputs(0, (hidden,), dtype, seed=hidden + 1)
            if graph:
                static_x = x.clone()
                for _ in range(2):
                    all_reduce_rms_norm(static_x, residual, weight, 1e-5, variant=variant)  # warm up, compile
                torch.cuda.synchronize()
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    h, y = all_reduce_rms_norm(static_x, residual, weight, 1e-5, variant=variant)
                runs = []
                for step in range(3):
                    fresh = _inputs(rank, (rows, hidden), dtype, seed=step * 13 + hidden)
                    static_x.copy_(fresh)
                    captured.replay()
                    runs.append((fresh, h.clone(), y.clone()))
            else:
                runs = [(x, *all_reduce_rms_norm(x, residual, weight, 1e-5, variant=variant))]
                # without the norm (a model's last tail): h alone, the same bits as with it
                added = all_reduce_add(x, residual, variant=variant)
                if not torch.equal(added, runs[0][1]):
                    failures.append(f"{variant} {dtype} ({rows}, {hidden}): all_reduce_add differs from h")
            for inp, h, y in runs:
                total = _reference_sum(inp, world)
                h_ref = residual.float() + total
                y_ref = torch.nn.functional.rms_norm(h_ref.to(dtype).float(), (hidden,), weight.float(), 1e-5)
                name = f"{variant} graph={graph} {dtype} ({rows}, {hidden})"
                for label, got, ref in (("h", h, h_ref), ("y", y, y_ref)):
                    error = _rel_error(got, ref)
                    if torch.isnan(got).any() or error > _tolerance(dtype, world) / 4:
                        failures.append(f"{name} {label}: rel error {error:.2e}")
                gathered = torch.empty((world, 2, rows, hidden), dtype=dtype, device="cuda")
                all_gather_into(gathered, torch.stack([h, y]))
                if not all(torch.equal(gathered[0], gathered[r]) for r in range(world)):
                    failures.append(f"{name}: ranks disagree")
    torch.cuda.synchronize()
    return failures


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("variant", ["push", "pull"])
def test_layer_tail_matches_the_unfused_sequence(variant, graph):
    shapes = ((1, 4096), (8, 4096), (64, 8192), (5, 1000), (3, 16384))
    results = run_on_ranks(body_layer_tail, WORLD, "nccl", args=(shapes, DTYPES, variant, graph), timeout_s=300)
    assert results == [[]] * WORLD, results


def body_decode_tails(rank, world, batches):
    """The TP Llama stack at decode with the layers' all-reduce + residual add + RMSNorm fused
    (defer_tails("auto")) against the same stack unfused and against one GPU, bf16, eager and in a
    CUDA graph (the model's output tail runs inside the capture)."""
    import copy

    from torch.distributed.tensor import Replicate

    from axedist import DTensor
    from axedist.mesh import DeviceMesh
    from axedist.nn import parallelize, to_inference
    from axedist.nn.llama import LlamaConfig, TransformerBlock, llama_tp_plan, rope_tables
    from axedist.runtime import deferred, tails

    class Stack(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.layers = torch.nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

        def forward(self, h):
            for layer in self.layers:
                h = layer(h, self.cos[:h.shape[0]], self.sin[:h.shape[0]])
            return h

    cfg = LlamaConfig(vocab_size=16, dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_hidden=8192, max_seq_len=4)
    torch.manual_seed(0)
    base = Stack(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    mesh = DeviceMesh("cuda", (world,))
    model = parallelize(copy.deepcopy(base), mesh, {k: v for k, v in llama_tp_plan(cfg, sequence_parallel=False).items()
                                                    if k.startswith("layers.")}, src_rank=None)
    to_inference(model)
    failures = []
    policy_before = tails.defer_tails()  # restored at the end: the pooled rank processes run later tests
    for batch in batches:
        h = torch.randn(1, batch, cfg.dim, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(batch))
        with torch.inference_mode():
            reference = base(h).float()
            outs = {}
            for policy in ("never", "auto"):
                tails.defer_tails(policy)
                before = deferred.fused_gemm_stats()["tails_fused"]
                outs[policy] = model(DTensor.from_local(h, mesh, [Replicate()])).to_local().float()
                fused = deferred.fused_gemm_stats()["tails_fused"] - before
                if (policy == "auto") != (fused == 2 * cfg.n_layers - 1):
                    failures.append(f"B={batch} {policy}: {fused} tails fused")
                static = DTensor.from_local(h.clone(), mesh, [Replicate()])
                model(static)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_out = model(static)
                fresh = torch.randn_like(h)
                static.to_local().copy_(fresh)
                graph.replay()
                torch.cuda.synchronize()
                expected = base(fresh).float()
                error = _rel_error(graph_out.to_local(), expected)
                if error > 3e-2:
                    failures.append(f"B={batch} {policy} CUDA graph: rel error {error:.2e}")
            tails.defer_tails(policy_before)
        for policy, out in outs.items():
            error = _rel_error(out, reference)
            if error > 3e-2:
                failures.append(f"B={batch} {policy}: rel error {error:.2e} vs one GPU")
    return failures


def test_decode_tails_fused_in_the_tp_stack():
    results = run_on_ranks(body_decode_tails, WORLD, "nccl", args=((1, 8, 64),), timeout_s=300)
    assert results == [[]] * WORLD, results
