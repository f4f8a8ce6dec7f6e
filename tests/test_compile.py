"""torch.compile over axedist DTensors: traced whole (no graph break), the same numbers as eager.

The TP Llama (tests/test_train_tp.py's model) with every transformer block compiled
(``fullgraph=True``) trains for three steps next to the same model in eager, on 2 and 4 gloo
ranks: losses, every gradient and the parameters after AdamW match; ``explain`` finds no graph
break; later steps never recompile (Dynamo's guard failures are reported if they do) and a new
sequence length compiles once. Every kind of plan step traces to torch's functional
collectives; axedist's collectives and fused kernels run as custom ops (forward, gradient,
compiled); where the fused kernels are chosen (CUDA) the compiled graph calls them, shown here
on CPU by forcing the choice. The whole model compiled at once (``fullgraph=True``, token ids
in) is one graph with eager's numbers, the same graph on every rank; so is a toy model from
plain inputs, with axedist's or torch's styles, and ``from_local`` / ``to_local`` /
``redistribute`` inside a compiled function. Two small tests run Inductor's CPU backend (a C++
compile: slow); ``launch/train_tp.py --compile`` runs under torchrun.
"""

import contextlib
import copy
import dataclasses
import itertools
import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import axedist as ax
from axedist.dtensor import distribute, DTensor
from axedist.mesh import DeviceMesh
from axedist.nn import describe, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.testing import run_on_ranks, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-9, atol=1e-11)
CFG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_hidden=24, max_seq_len=8)


def capture(codes: list, outlines: list | None = None):
    """An aot_eager backend that keeps the code of every forward and backward graph it compiles
    (and, given ``outlines``, each graph's ``graph_outline``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        codes.append(gm.code)
        if outlines is not None:
            outlines.append(graph_outline(gm))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.guard_failures.clear()


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative error in the Frobenius norm (bf16 results against fp32 references)."""
    reference = reference.float()
    return ((x.float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def block_step(fn, block, *inputs):
    """``fn(*inputs)`` (a block or its compiled twin) and a squared-sum backward: the whole output
    and every parameter's whole gradient; the block's gradients are zeroed after. Shared with the
    GPU compile tests."""
    y = fn(*inputs)
    (y.float() ** 2).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in block.named_parameters()}
    block.zero_grad()
    return y.full_tensor(), grads


def _guard_failures() -> list[str]:
    return [reason for reasons in torch._dynamo.utils.guard_failures.values() for reason in reasons]


# -- the TP Llama, compiled block by block, against eager ----------------------------------------

def _twins(world: int, seed: int, sequence_parallel: bool):
    """Two equal TP Llamas on a fresh 1-D mesh (one to run eagerly, one to compile), and the mesh."""
    torch.manual_seed(seed)
    base = Llama(CFG).double()
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    mesh = DeviceMesh("cpu", (world,))
    for model in (eager, compiled):
        parallelize(model, mesh, llama_tp_plan(CFG, sequence_parallel=sequence_parallel))
    _fresh_dynamo()
    return eager, compiled, mesh


def _same_step(forwards, models, tokens, mesh, step: int) -> None:
    """Forward and backward of both models on ``tokens`` (``forwards``: the models, or a model's
    compiled twin): equal losses and gradients."""
    losses = []
    for forward in forwards:
        loss = next_token_loss(forward(tokens[:, :-1]), replicate(tokens[:, 1:], mesh))
        loss.backward()
        losses.append(loss.full_tensor())
    torch.testing.assert_close(losses[1], losses[0], **TOL, msg=lambda m: f"step {step}: loss: {m}")
    eager, compiled = models
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad.full_tensor(), **TOL,
                                   msg=lambda m: f"step {step}: grad of {name}: {m}")


def _train_twins(forward, eager, compiled, mesh, seed: int, steps: int, after_step) -> torch.Tensor:
    """``steps`` AdamW steps of ``eager`` and its twin ``compiled`` (called through ``forward``) on
    the same tokens: equal losses, gradients and parameters after each step; ``after_step(step)``
    then. Returns the last step's tokens."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (eager, compiled)]
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1), generator=g)
        _same_step((eager, forward), (eager, compiled), tokens, mesh, step)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.full_tensor(), p.full_tensor(), **TOL,
                                       msg=lambda m: f"after step {step}: {name}")
        after_step(step)
    return tokens


def _same_grads_then_step(eager, compiled, optimizers, graphs: list, tol: dict, label: str) -> None:
    """The compiled twin's gradients equal to eager's, then each optimizer's step, then the
    number of graphs Dynamo has made so far appended to ``graphs``."""
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad.full_tensor(), **tol,
                                   msg=lambda m: f"{label}grad of {name}: {m}")
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compiled_training(rank, world, seed, sequence_parallel, steps, shapes_and_breaks):
    eager, compiled, mesh = _twins(world, seed, sequence_parallel)
    codes: list = []
    backend = capture(codes)  # one backend for every block: the blocks share their graph
    for block in compiled.layers:
        block.compile(backend=backend, fullgraph=True)
    report = {"graphs": [], "failures": []}

    def after_step(step):
        report["graphs"].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        report["failures"].append(_guard_failures())

    tokens = _train_twins(compiled, eager, compiled, mesh, seed, steps, after_step)
    # the block's graphs hold the plan's collectives as functional collectives, nothing in place
    report["functional"] = any("_c10d_functional" in code for code in codes)
    report["in_place"] = [line for code in codes for line in code.splitlines() if "c10d." in line and "functional" not in line]
    if not shapes_and_breaks:
        _fresh_dynamo()
        return report
    # another sequence length: one new graph, and the first one serves the old length again
    x = compiled.tok_embeddings(tokens[:, :4].t())
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.layers[0](x, compiled.rope_cos[:4], compiled.rope_sin[:4])
    compiled.layers[0](compiled.tok_embeddings(tokens[:, :-1].t()), compiled.rope_cos[:8], compiled.rope_sin[:8])
    report["new_shape_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    report["new_shape_failures"] = _guard_failures()
    # no graph break anywhere in a block
    block = eager.layers[0]
    explained = torch._dynamo.explain(block)(eager.tok_embeddings(tokens[:, :-1].t()), eager.rope_cos[:8],
                                              eager.rope_sin[:8])
    report["breaks"] = (explained.graph_break_count, [str(r) for r in explained.break_reasons])
    _fresh_dynamo()
    return report


def whole_model_training(rank, world, seed, sequence_parallel, steps=3):
    """``torch.compile(model, fullgraph=True)`` of the whole TP Llama (token ids in as a plain
    tensor, the vocab-parallel embedding, every block, the output head) next to eager: losses,
    gradients and parameters after AdamW per step; graphs made after each step; Dynamo's guard
    failures; agreement checks joined while tracing and while the compiled steps ran; ``explain``."""
    from axedist.peers import agreements_made

    eager, compiled, mesh = _twins(world, seed, sequence_parallel)
    forward = torch.compile(compiled, backend=capture([]), fullgraph=True)
    report = {"graphs": [], "agreements": []}

    def after_step(step):
        report["graphs"].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        report["agreements"].append(agreements_made())

    tokens = _train_twins(forward, eager, compiled, mesh, seed, steps, after_step)
    report["failures"] = _guard_failures()
    _fresh_dynamo()
    explained = torch._dynamo.explain(eager)(tokens[:, :-1])
    report["breaks"] = (explained.graph_break_count, [str(r.reason)[:300] for r in explained.break_reasons])
    _fresh_dynamo()
    return report


@pytest.mark.parametrize("world,sequence_parallel", [(2, True), (4, False)])
def test_whole_tp_llama_compiles_as_one_graph(world, sequence_parallel):
    """The whole TP (+ SP) Llama compiled with fullgraph=True: no graph break, one graph for
    three steps (no recompile), eager's fp64 losses, gradients and parameters; the rank-agreement
    checks run while tracing, as many on every rank, and none while the compiled steps run."""
    seed = random.randrange(2**31)
    reports = run_on_ranks(whole_model_training, world, args=(seed, sequence_parallel), timeout_s=400)
    for rank, report in enumerate(reports):
        assert report["breaks"] == (0, []), f"rank {rank}: graph breaks: {report['breaks']}"
        assert report["graphs"] == [1, 1, 1] and not report["failures"], (
            f"rank {rank} (seed {seed}): graphs after each step {report['graphs']}; "
            f"guard failures: {report['failures']}")
        agreed = report["agreements"]
        assert agreed[1] == agreed[2], f"rank {rank}: agreement checks ran in compiled steps: {agreed}"
        assert agreed == reports[0]["agreements"], f"rank {rank} joined {agreed}, rank 0 {reports[0]['agreements']}"


def _toy_model(torch_styles: bool):
    """``nn.Sequential(Linear, ReLU, Linear)`` parallelized on a fresh 1-D mesh: axedist's styles
    (the issue's script), or torch's styles through ``axedist.nn.parallelize_module`` on a torch
    mesh (pytorch/examples' tensor-parallel example: in_proj column-, out_proj row-parallel, plain
    outputs)."""
    from torch import nn

    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)).double()
    if not torch_styles:
        from axedist.nn import ColwiseParallel, RowwiseParallel
        return parallelize(model, DeviceMesh("cpu", (dist.get_world_size(),)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from axedist.nn import parallelize_module
    return parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                              {"0": ColwiseParallel(), "2": RowwiseParallel()})


def toy_training(rank, world, seed, torch_styles, backend):
    """Three AdamW steps of the toy model compiled whole (fullgraph) next to eager, on plain
    inputs: outputs, gradients, parameters; graphs per step, guard failures, explain's breaks."""
    torch.manual_seed(seed)
    eager = _toy_model(torch_styles)
    torch.manual_seed(seed)
    compiled = _toy_model(torch_styles)
    _fresh_dynamo()
    forward = torch.compile(compiled, backend=backend, fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (eager, compiled)]
    graphs = []
    for step in range(3):
        torch.manual_seed(seed + step)
        x = torch.rand(20, 10, dtype=torch.float64)
        outs = []
        for fn in (eager, forward):
            y = fn(x)
            y.sum().backward()
            kind = type(y).__name__
            outs.append(y.full_tensor() if isinstance(y, DTensor) else y)
        torch.testing.assert_close(outs[1], outs[0], **TOL)
        _same_grads_then_step(eager, compiled, optimizers, graphs, TOL, "")
    failures = _guard_failures()
    _fresh_dynamo()
    explained = torch._dynamo.explain(eager)(x)
    _fresh_dynamo()
    return graphs, failures, explained.graph_break_count, kind


@pytest.mark.parametrize("torch_styles,backend", [(False, "aot_eager"), (False, "inductor"), (True, "aot_eager")],
                         ids=["axedist_styles", "axedist_styles_inductor", "torch_styles"])
def test_parallelized_toy_model_compiles_whole(torch_styles, backend):
    """The issue's script: ``torch.compile(parallelize(nn.Sequential(Linear, ReLU, Linear), mesh,
    {"0": ColwiseParallel(), "2": RowwiseParallel()}), fullgraph=True)`` on a plain input (its
    input hook's ``from_local`` once ran as a disabled twin: ``Unsupported``), under aot_eager and
    Inductor; and pytorch/examples' TP example written with torch's styles: one graph, no
    recompile over three steps, eager's values and gradients (fp64)."""
    seed = random.randrange(2**31)
    for rank, (graphs, failures, breaks, out) in enumerate(
            run_on_ranks(toy_training, 2, args=(seed, torch_styles, backend), timeout_s=600)):
        assert graphs == [1, 1, 1] and not failures and breaks == 0, (rank, seed, graphs, failures, breaks)
        assert out == ("Tensor" if torch_styles else "DTensor")  # torch's RowwiseParallel: a local output


def traced_api(rank, world, seed):
    """from_local (shape inferred, with a layout, run_check=True, grad_placements), to_local and
    full_tensor with grad_placements, redistribute with forward/backward dtypes, inside one
    compiled function (fullgraph) on plain tensors: eager's values and gradients."""
    from torch.distributed.tensor import Partial

    mesh = DeviceMesh("cpu", (world,))
    layout = ax.Layout.parse(f"S[({world},2,3):(1@gpuid,3,1)]")

    def f(x, w):
        a = DTensor.from_local(x, mesh, [Shard(0)])
        b = DTensor.from_local(x, device_mesh=mesh, placements=[Shard(0)], run_check=True)
        c = DTensor.from_local(x, mesh, layout, shape=(2 * world, 3))
        d = DTensor.from_local(w, mesh, [Replicate()], grad_placements=[Replicate()])
        e = (a * b + c).redistribute([Replicate()])
        g = e.redistribute([Shard(1)], forward_dtype=torch.float32, backward_dtype=torch.float64)
        return ((e.to_local() * d.to_local(grad_placements=[Partial()])).sum() + g.full_tensor().double().sum()
                + (a.full_tensor(grad_placements=[Partial()]) ** 2).sum())

    torch.manual_seed(seed + rank)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2 * world, 3, dtype=torch.float64, requires_grad=True)
    want = f(x, w)
    want.backward()
    grads = x.grad, w.grad
    x.grad = w.grad = None
    _fresh_dynamo()
    got = torch.compile(f, backend=capture([]), fullgraph=True)(x, w)
    got.backward()
    _fresh_dynamo()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close((x.grad, w.grad), grads, **TOL)
    # a rank whose local tensor does not fit: run_check's agreement (at trace time) fails on every rank
    misfit = torch.randn(3 if rank == 1 else 2, 3, dtype=torch.float64)
    try:
        torch.compile(lambda t: DTensor.from_local(t, mesh, layout, shape=(2 * world, 3), run_check=True).to_local(),
                      backend=capture([]), fullgraph=True)(misfit)
    except Exception as error:  # Dynamo wraps what the node raised
        return f"{type(error).__name__}: {error}"
    finally:
        _fresh_dynamo()
    return "no error"


def test_from_local_to_local_redistribute_trace():
    """The DTensor API inside compiled code, no graph break, eager's numbers; run_check's check
    of every rank's local tensor runs once, at trace time, and raises on every rank."""
    for rank, outcome in enumerate(run_on_ranks(traced_api, 2, args=(random.randrange(2**31),), timeout_s=300)):
        assert "RankDisagreementError" in outcome and "does not fit" in outcome, (rank, outcome)


def first_forward_compiled(rank, world, seed):
    """A freshly parallelized block whose first forward is compiled: describe's counting hooks
    are not traced (nothing counted, the hooks left in place); the first eager forward counts."""
    torch.manual_seed(seed)
    model = Llama(CFG)
    mesh = DeviceMesh("cpu", (world,))
    parallelize(model, mesh, llama_tp_plan(CFG))
    block = model.layers[0]

    def hooks():
        return {n: (list(m._forward_pre_hooks), list(m._forward_hooks)) for n, m in block.named_modules()}

    before = hooks()
    # hook dicts in registration order (no prepend): torch 2.11's Dynamo indexes them by the
    # plain dict's order when it builds the guards of a compiled module
    in_order = all(list(dict.keys(h)) == list(h)
                   for m in block.modules() for h in (m._forward_pre_hooks, m._forward_hooks))
    x = distribute(torch.randn(CFG.max_seq_len, 2, CFG.dim), mesh, [Shard(0)])
    _fresh_dynamo()
    torch.compile(block, backend=capture([]), fullgraph=True)(x, model.rope_cos, model.rope_sin)
    traced = hooks(), "forward ran" in describe(block)
    _fresh_dynamo()
    block(x, model.rope_cos, model.rope_sin)
    return in_order, before, traced, "forward ran" in describe(block)


def test_a_compiled_first_forward_leaves_describe_hooks_alone():
    for in_order, before, (after, counted), counted_eager in run_on_ranks(first_forward_compiled, 2,
                                                                          args=(random.randrange(2**31),)):
        assert in_order and after == before and not counted and counted_eager


@pytest.mark.parametrize("world,sequence_parallel,steps,shapes_and_breaks", [(2, True, 3, True), (4, False, 2, False)])
def test_compiled_tp_llama_trains_like_eager(world, sequence_parallel, steps, shapes_and_breaks):
    seed = random.randrange(2**31)
    reports = run_on_ranks(compiled_training, world, args=(seed, sequence_parallel, steps, shapes_and_breaks),
                           timeout_s=300)
    for rank, report in enumerate(reports):
        graphs, failures = report["graphs"], report["failures"]
        # one graph serves both blocks and every step
        assert graphs == [1] * steps and not failures[-1], (
            f"rank {rank} (seed {seed}): graphs after each step {graphs}; guard failures: {failures[-1]}")
        assert report["functional"] and not report["in_place"], report["in_place"]
        if not shapes_and_breaks:
            continue
        assert report["breaks"] == (0, []), f"rank {rank}: graph breaks in the block: {report['breaks']}"
        assert report["new_shape_graphs"] == 1, (
            f"rank {rank}: a new sequence length made {report['new_shape_graphs']} graphs; "
            f"guard failures: {report['new_shape_failures']}")
        assert any("___check_metadata" in f or "metadata" in f for f in report["new_shape_failures"]), \
            report["new_shape_failures"]


# -- every kind of plan step, traced ------------------------------------------------------------

def traced_moves(rank, world):
    L = ax.Layout.parse
    mesh = DeviceMesh("cpu", (world,))
    grid = DeviceMesh("cpu", (2, 2), ("x", "y"))
    torch.manual_seed(3)
    a = distribute(torch.randn(8, 6, dtype=torch.float64), mesh, [Shard(0)])
    summands = distribute(torch.randn(4, 8, 6, dtype=torch.float64), mesh, L("S[(4,8,6):(1@gpuid,6,1)]"))
    p = summands.to_partial()
    d = distribute(torch.randn(8, 8, dtype=torch.float64), mesh, [Shard(0)])
    e = distribute(torch.randn(4, 6, dtype=torch.float64), grid, [Shard(0), Shard(1)])
    t = torch.randn(8, 6, dtype=torch.float64)
    one = DTensor.from_local(t if rank == 0 else t.new_empty(0, 0), mesh, L("S[(8,6):(6,1)]"), shape=(8, 6))
    u = distribute(torch.randn(7, 6, dtype=torch.float64), mesh, [Shard(0)])
    on_two, cyclic = L("S[(8,6):(6,1)] + 2@gpuid"), L("S[(2,4,6):(6,1@gpuid,1)]")
    # inputs with work still pending from eager: a deferred product, an asynchronous move
    policy, DTensor.dispatcher.defer_gemm = DTensor.dispatcher.defer_gemm, "always"
    product = distribute(torch.randn(8, 8, dtype=torch.float64), mesh, [Shard(1)]) @ d
    DTensor.dispatcher.defer_gemm = policy
    moving = a.redistribute([Shard(1)], async_op=True)
    assert product._pending is not None and moving._pending is not None

    def moves(a, p, d, e, one, u, summands, product, moving):
        return (a.redistribute([Replicate()]),          # all-gather
                p.redistribute([Shard(0)]),              # reduce-scatter (gloo: all-reduce, own chunk)
                p.redistribute([Replicate()]),           # all-reduce
                d.redistribute([Shard(1)]),              # all-to-all
                e.redistribute([Shard(1), Shard(0)]),    # send/recv exchange
                one.redistribute([Replicate()]),         # broadcast
                p.redistribute(on_two),                  # reduce to one rank
                a.redistribute(cyclic),                  # all-to-all-v (block-cyclic rows)
                u.redistribute([Replicate()]),           # uneven all-gather (padded)
                summands.to_partial().redistribute([Shard(0)]),
                a.to_local() * 2, a.full_tensor(),       # the DTensor methods, traced as well
                product.redistribute([Shard(0)]), moving + 1)

    _fresh_dynamo()
    codes, outlines = [], []
    got = torch.compile(moves, backend=capture(codes, outlines), fullgraph=True)(a, p, d, e, one, u, summands, product,
                                                                                moving)
    want = moves(a, p, d, e, one, u, summands, product, moving)
    _fresh_dynamo()
    same = [torch.equal(g, w) if type(w) is torch.Tensor else g.axe_layout == w.axe_layout and torch.equal(g.to_local(), w.to_local())
            for g, w in zip(got, want)]
    ops = sorted({line.split("_c10d_functional.")[1].split(".")[0] for line in codes[0].splitlines()
                  if "_c10d_functional." in line})
    return same, ops, [row for row in outlines[0] if len(row) > 1]


def test_every_plan_step_kind_traces_to_functional_collectives():
    results = run_on_ranks(traced_moves, 4, timeout_s=180)
    for rank, (same, ops, collectives) in enumerate(results):
        assert all(same), f"rank {rank}: compiled moves that differ from eager: {same}"
        assert {"all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast"} <= set(ops), ops
        # every rank issues the same collectives in the same order, with the same groups and sizes
        assert collectives == results[0][2], f"rank {rank}: {collectives} vs rank 0: {results[0][2]}"


# -- axedist's collectives and fused kernels as custom ops ---------------------------------------

def custom_ops(rank, world, seed):
    from axedist import collectives as C
    group = dist.group.WORLD
    torch.manual_seed(seed + rank)
    checks = {}

    def gathered(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts)

    # collectives, fp64: forward against torch.distributed, gradients against their rules
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, dtype=torch.float64)  # a different weight per rank: gradients differ per rank
    rs, ag, ar = C.reduce_scatter(x, group), C.all_gather(x, group), C.all_reduce(x, group)
    total = x.detach().clone()
    dist.all_reduce(total)
    checks["collectives forward"] = (torch.allclose(rs, total.chunk(world)[rank]) and torch.equal(ag, gathered(x))
                                     and torch.allclose(ar, total))
    ((rs * w[:rs.shape[0], :]).sum() + (ag * ag).sum() + (ar * x.detach()).sum()).backward()
    expected = gathered(w[:rs.shape[0], :]) + 2 * x.detach() * world + x.detach()
    checks["collectives grad"] = torch.allclose(x.grad, expected)

    # fused ops, bf16 operands; references in fp32 with torch's differentiable functional collectives
    import torch.distributed._functional_collectives as fc
    a = torch.randn(8, 4, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
    outs = [C.gemm_reduce_scatter(a, b, group), C.all_gather_gemm(a[:4], b, group), C.gemm_all_reduce(a, b, group)]
    sum(o.float().square().sum() for o in outs).backward()
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    product = a32 @ b32
    refs = [fc.reduce_scatter_tensor_autograd(product, "sum", 0, group),
            fc.all_gather_tensor_autograd(a32[:4], 0, group) @ b32,
            product + fc.all_reduce(product.detach(), "sum", group) - product.detach()]  # grad passes through
    sum(r.square().sum() for r in refs).backward()
    checks["fused forward"] = [relative_error(o, r) for o, r in zip(outs, refs) if not relative_error(o, r) < 1e-2]
    checks["fused grad"] = [e for e in (relative_error(a.grad, a32.grad), relative_error(b.grad, b32.grad)) if not e < 1e-2]

    # the same calls compiled: one graph of custom ops, the same values
    def f(x, a, b):
        return (C.reduce_scatter(x, group).sum() + C.all_gather(x, group).sum() + C.all_reduce(x, group).sum(),
                C.gemm_reduce_scatter(a, b, group), C.all_gather_gemm(a, b, group), C.gemm_all_reduce(a, b, group))

    _fresh_dynamo()
    codes: list = []
    with torch.no_grad():
        got = torch.compile(f, backend=capture(codes), fullgraph=True)(x, a, b)
        want = f(x, a, b)
    _fresh_dynamo()
    checks["compiled"] = all(torch.equal(g, h) for g, h in zip(got, want))
    names = ("reduce_scatter", "all_gather", "all_reduce", "gemm_reduce_scatter", "all_gather_gemm", "gemm_all_reduce")
    checks["in graph"] = [n for n in names if f"torch.ops.axedist.{n}.default" not in codes[0]]
    # schema, fake tensor, autograd registration and tracing checks of torch.library
    for op, args in ((torch.ops.axedist.gemm_reduce_scatter, (a, b, group.group_name, 0, "auto")),
                     (torch.ops.axedist.all_gather, (x, group.group_name, "auto"))):
        torch.library.opcheck(op, args)
    return checks


def test_collectives_and_fused_kernels_are_custom_ops():
    seed = random.randrange(2**31)
    for rank, checks in enumerate(run_on_ranks(custom_ops, 2, args=(seed,), timeout_s=180)):
        failed = [k for k, v in checks.items() if v is not True and v != []]
        assert not failed, f"rank {rank} (seed {seed}): {failed}: {checks}"


# -- the fused kernels, chosen layout-driven, appear in the compiled graph -------------------------

@contextlib.contextmanager
def forced_fused():
    """The CUDA decisions forced on CPU (the custom ops then run torch's implementations): the
    deferred row-parallel product goes to gemm_reduce_scatter, the deferred sequence gather to
    all_gather_gemm, exactly as eager decides them on CUDA."""
    from axedist import collectives
    from axedist.runtime import deferred

    choice, plan_ag = deferred.fused_choice, collectives.plan_all_gather_gemm

    def fused(spec, pending, dst):
        step = choice(spec, pending, dst)
        return None if step is None else dataclasses.replace(step, fused=True)

    def gather_plan(*args, **kwargs):
        return dataclasses.replace(plan_ag(*args, **kwargs), backend="p2p")

    policies = (DTensor.dispatcher.defer_gemm, deferred.defer_gathers())
    deferred.fused_choice, collectives.plan_all_gather_gemm = fused, gather_plan
    DTensor.dispatcher.defer_gemm = "always"
    deferred.defer_gathers("always")
    _fresh_dynamo()
    try:
        yield
    finally:
        deferred.fused_choice, collectives.plan_all_gather_gemm = choice, plan_ag
        DTensor.dispatcher.defer_gemm = policies[0]
        deferred.defer_gathers(policies[1])
        _fresh_dynamo()


def _tp_block(world, seed, cfg=None):
    cfg = cfg or CFG
    torch.manual_seed(seed)
    model = Llama(cfg).to(torch.bfloat16)
    mesh = DeviceMesh("cpu", (world,))
    parallelize(model, mesh, llama_tp_plan(cfg))
    x = distribute(torch.randn(cfg.max_seq_len, 2, cfg.dim, dtype=torch.bfloat16), mesh, [Shard(0)])
    cos, sin = model.rope_cos[:cfg.max_seq_len].to(torch.bfloat16), model.rope_sin[:cfg.max_seq_len].to(torch.bfloat16)
    return model.layers[0], (x, cos, sin)


def forced_fused_block(rank, world, seed):
    block, inputs = _tp_block(world, seed)
    want = block_step(block, block, *inputs)  # eager, nothing forced
    codes: list = []
    with forced_fused():
        got = block_step(torch.compile(block, backend=capture(codes), fullgraph=True), block, *inputs)
    same = relative_error(got[0], want[0].float()) < 2e-2 and all(
        relative_error(got[1][n], want[1][n].float()) < 2e-2 for n in want[1])
    missing = [op for op in ("gemm_reduce_scatter", "all_gather_gemm") if f"axedist.{op}" not in codes[0]]
    # backward: the summed input gradients of wq/wk/wv and w1/w3, reduce-scattered back to sequence shards
    backward = codes[1].count("axedist.gemm_reduce_scatter") if len(codes) > 1 else 0
    return same, missing, backward


def test_fused_kernels_chosen_by_layout_are_custom_ops_in_the_graph():
    seed = random.randrange(2**31)
    for rank, (same, missing, backward) in enumerate(run_on_ranks(forced_fused_block, 2, args=(seed,))):
        assert same, f"rank {rank} (seed {seed}): compiled block with the fused ops differs from eager"
        assert not missing, f"rank {rank}: the forward graph lacks {missing}"
        assert backward >= 2, f"rank {rank}: the backward graph has {backward} fused GEMM + reduce-scatters"


def graph_outline(gm: torch.fx.GraphModule) -> list[tuple]:
    """A traced graph as its ranks must agree on it: every node's op, in order, and the
    non-tensor arguments of every collective and fused kernel (group, dims, backend). Index
    constants and slice offsets (which differ by rank, as torch's DTensor's do) are left out."""
    rows = []
    for node in gm.graph.nodes:
        name = str(node.target) if node.op == "call_function" else node.op
        if "axedist" in name or "c10d" in name:
            rows.append((name, tuple(a for a in node.args if not isinstance(a, (torch.fx.Node, list, tuple)))))
        else:
            rows.append((name,))
    return rows


def graph_outlines(rank, world, seed, whole_model=False):
    """The forward and backward graphs of the compiled sequence-parallel block (or of the whole
    model, token ids to logits, its vocabulary of 30 uneven over 4 ranks) with the fused kernels
    chosen (as on CUDA), on this rank."""
    cfg = LlamaConfig(vocab_size=30 if whole_model else 32, dim=32, n_layers=1, n_heads=8, ffn_hidden=64,
                      max_seq_len=16)
    outlines: list = []

    def keep(gm, example_inputs):
        from functorch.compile import make_boxed_func
        outlines.append(graph_outline(gm))
        return make_boxed_func(gm.forward)

    from torch._dynamo.backends.common import aot_autograd
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    with forced_fused():
        if not whole_model:
            block, inputs = _tp_block(world, seed, cfg)
            block_step(torch.compile(block, backend=backend, fullgraph=True), block, *inputs)
            return outlines
        torch.manual_seed(seed)
        model, mesh = Llama(cfg).to(torch.bfloat16), DeviceMesh("cpu", (world,))
        parallelize(model, mesh, llama_tp_plan(cfg))
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1), generator=g)
        logits = torch.compile(model, backend=backend, fullgraph=True)(tokens[:, :-1])
        next_token_loss(logits.float(), replicate(tokens[:, 1:], mesh)).backward()
    return outlines


@pytest.mark.parametrize("whole_model", [False, True], ids=["block", "whole_model"])
def test_every_rank_compiles_the_same_graph(whole_model):
    """Four ranks of a compiled TP + SP block, and of the whole model: the same graphs, op for op,
    with the same collectives and fused kernels in the same order and the same backend (a rank
    in the middle of its group once traced other copies than the ranks at its ends: different
    graphs compile at different speeds, and a rank still compiling left its peers' fused kernels
    spinning into their timeout; an uneven vocabulary once left one rank choosing another kernel
    than its peers for the output head)."""
    outlines = run_on_ranks(graph_outlines, 4, args=(random.randrange(2**31), whole_model), timeout_s=600)
    assert len(outlines[0]) == 2, "expected a forward and a backward graph"
    comms = [row for graph in outlines[0] for row in graph if len(row) > 1]
    assert any("all_gather_gemm" in row[0] for row in comms) and any("gemm_reduce_scatter" in row[0] for row in comms)
    for rank, graphs in enumerate(outlines[1:], start=1):
        for which, mine, first in zip(("forward", "backward"), graphs, outlines[0]):
            assert mine == first, f"rank {rank}'s {which} graph differs from rank 0's:\n" + "\n".join(
                f"  {a} | {b}" for a, b in itertools.zip_longest(first, mine) if a != b)


# -- Inductor (C++ on CPU): one small module ---------------------------------------------------------

def inductor_mlp(rank, world, seed):
    torch.manual_seed(seed)
    base = Llama(CFG).double()
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    mesh = DeviceMesh("cpu", (world,))
    for model in (eager, compiled):
        parallelize(model, mesh, llama_tp_plan(CFG))
    mlps = eager.layers[0].feed_forward, compiled.layers[0].feed_forward
    _fresh_dynamo()
    mlps[1].compile(backend="inductor", fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in mlps]
    graphs = []
    for step in range(2):
        x = distribute(torch.randn(CFG.max_seq_len, 2, CFG.dim, dtype=torch.float64), mesh, [Shard(0)])
        outs = []
        for mlp in mlps:
            y = mlp(x)
            (y * y).sum().backward()
            outs.append(y.full_tensor())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-10)
        _same_grads_then_step(mlps[0], mlps[1], optimizers, graphs, dict(rtol=1e-9, atol=1e-10), f"step {step}: ")
    failures = _guard_failures()
    _fresh_dynamo()
    return graphs, failures


def test_inductor_compiles_the_parallel_mlp_like_eager():
    # two graphs: module.compile() compiles the module's input hook (the sequence all-gather) and
    # its forward as two frames; the second step compiles nothing
    for rank, (graphs, failures) in enumerate(run_on_ranks(inductor_mlp, 2, args=(random.randrange(2**31),),
                                                           timeout_s=600)):
        assert graphs[0] == graphs[1] and not failures, f"rank {rank}: graphs {graphs}; guard failures: {failures}"


def test_train_script_compiles_its_blocks(tmp_path):
    """launch/train_tp.py --compile on 4 ranks, dp=2 x tp=2 (fully sharded hooks around the
    compiled blocks): the same losses as the eager run."""
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "aot_eager"])):
        returncode, stdout, stderr = run_torchrun(
            ["launch/train_tp.py", *extra, "--steps", "3", "--log-every", "3", "--seq", "8", "--batch", "4",
             "--dim", "16", "--vocab", "32", "--layers", "2", "--no-checkpoint", "--out", str(tmp_path / name)],
            4, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert "fully sharded data x" in stdout and "training finished" in stdout
        assert ("each transformer block compiled" in stdout) == bool(extra)
        losses[name] = json.loads((tmp_path / name / "losses.json").read_text())["loss"]
    assert len(losses["compiled"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5), losses


def test_fake_tensor_mode_counts_as_tracing():
    """Dynamo runs a graph node on fake tensors to learn its outputs; some torch releases do not
    report is_compiling() there, so a fake mode on the stack alone selects the traceable carrier."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from axedist.runtime.carriers import FUNCTIONAL, IN_PLACE, current
    from axedist.tracing import compiling

    assert not compiling() and current() is IN_PLACE
    with FakeTensorMode():
        assert compiling() and current() is FUNCTIONAL


def _compiled_tied_vocab_case(rank, world_size, seed, dealt):
    """Embedding lookup, logits ``h @ W.T`` and cross-entropy over one vocab-parallel weight
    (``Shard(0)``, or rows dealt round-robin in pairs: a layout), compiled whole: loss and the
    weight's gradient equal torch's; a target past the vocabulary fails in the compiled graph
    (a device-side assert, as torch's) rather than reading zeros."""
    import torch.nn.functional as F

    from axedist.layout import Layout

    g = torch.Generator().manual_seed(seed)
    mesh = DeviceMesh("cpu", (world_size,))
    dim, vocab = 4, 3 * world_size * 2
    layout = Layout.parse(f"S[(3,{world_size},2,{dim}):({2 * dim},1@gpuid,{dim},1)]") if dealt else [Shard(0)]
    weight = torch.randn(vocab, dim, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, vocab, (6,), generator=g)
    target = torch.randint(0, vocab, (6,), generator=g)
    want = F.cross_entropy(F.embedding(tokens, weight) @ weight.t(), target)
    (reference,) = torch.autograd.grad(want, weight)

    def step(t, w, y):
        return F.cross_entropy(F.embedding(t, w) @ w.t(), y)

    _fresh_dynamo()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    w = distribute(weight.detach(), mesh, layout).requires_grad_()
    on_all = [Replicate()]
    loss = compiled(distribute(tokens, mesh, on_all), w, distribute(target, mesh, on_all))
    (grad,) = torch.autograd.grad(loss, w)
    failures = []
    if not torch.allclose(loss.full_tensor(), want.detach()):
        failures.append("loss differs from torch")
    if not torch.allclose(grad.full_tensor(), reference):
        failures.append("the weight's gradient differs from torch's")
    wrong = target.clone()
    wrong[-1] = vocab
    try:
        compiled(distribute(tokens, mesh, on_all), w.detach(), distribute(wrong, mesh, on_all))
        failures.append("a target past the vocabulary passed")
    except RuntimeError as e:
        if f"out of bounds for {vocab} classes" not in str(e):
            failures.append(f"unexpected error: {e}")
    return failures


@pytest.mark.parametrize("dealt", [False, True], ids=["shard0", "dealt_layout"])
def test_compiled_tied_embedding_and_loss_over_a_vocab_parallel_weight(dealt):
    seed = random.randrange(2**31)
    results = run_on_ranks(_compiled_tied_vocab_case, 2, args=(seed, dealt), timeout_s=600)
    assert results == [[]] * 2, (seed, results[0])


# -- a graph break inside the dispatch: the eager code between the graphs ----------------------

def _graph_break_in_dispatch_case(rank, world_size, seed, mode):
    """Llama blocks whose RoPE tables are plain tensors (not buffers, so not distributed): the
    rotation ``x * cos`` mixes them into DTensor ops. At position 0 alone (a first decode step)
    each table holds one value, which the op takes as replicated once every rank agrees on it:
    reading the value is a graph break inside the op. Past position 0 the op refuses the tables."""
    from axedist.nn import to_inference
    from axedist.ops import DispatchError
    from tests.test_layer_tail import LlamaStack

    cfg = LlamaConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=4)
    torch.manual_seed(seed)
    base = LlamaStack(cfg).double()
    h = torch.randn(1, 2, cfg.dim, dtype=torch.float64)  # [S, B, dim] at position 0
    mesh = DeviceMesh("cpu", (world_size,))
    model = parallelize(copy.deepcopy(base), mesh, {k: v for k, v in llama_tp_plan(cfg, sequence_parallel=False).items()
                                                    if k.startswith("layers.")})
    if mode == "inference":
        to_inference(model)
    _fresh_dynamo()
    compiled = torch.compile(lambda x: model(x).to_local(), backend="aot_eager")  # not fullgraph: it breaks
    x = DTensor.from_local(h, mesh, [Replicate()])
    context = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    failures = []
    with context():
        out = compiled(x)
        again = compiled(x)  # the compiled frames run a second time, from Dynamo's cache
    with context():
        want = base(h)
    for label, value in (("first call", out), ("second call", again)):
        if not torch.allclose(value, want, rtol=1e-10, atol=1e-10):
            failures.append(f"{label}: the output differs from the one-process model's")
    if torch._dynamo.utils.counters["graph_break"] == {}:
        failures.append("no graph break: the case no longer tests what it is for")
    if mode == "grad":
        out.sum().backward()
        want.sum().backward()
        for name, p in model.named_parameters():
            if not torch.allclose(p.grad.full_tensor(), base.get_parameter(name).grad, rtol=1e-10, atol=1e-10):
                failures.append(f"{name}: the gradient differs from the one-process model's")
    longer = DTensor.from_local(torch.randn(3, 2, cfg.dim, dtype=torch.float64), mesh, [Replicate()])
    try:
        with context():
            compiled(longer)
        failures.append("tables of several values were taken as replicated")
    except DispatchError as e:  # the eager error, not a crash of Dynamo
        if "plain torch.Tensor of shape (3, 1, 1, 8)" not in str(e):
            failures.append(f"unexpected error: {e}")
    return failures


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_a_graph_break_inside_the_dispatch_runs_the_op_eagerly(mode):
    """torch.compile (not fullgraph) of a TP stack whose op breaks the graph inside the dispatch: the
    op runs eagerly between the graphs, where Dynamo hooks every Python frame. The dispatcher's
    handlers and ``wrap`` run as plain Python there (``tracing.eager_only``); compiled frame by
    frame, Dynamo resumed half-way through ``wrap`` on a DTensor without its spec and failed.
    Outputs (two calls) and gradients equal the one-process model's; tables the op refuses give
    eager's DispatchError."""
    seed = random.randrange(2**31)
    results = run_on_ranks(_graph_break_in_dispatch_case, 2, args=(seed, mode), timeout_s=600)
    assert results == [[]] * 2, (seed, results[0])


# -- decoding: the TP Llama compiled under inference mode, the decode tails on -------------------

def _compiled_decode_case(rank, world_size, seed):
    """Decode steps (one position of B sequences) of the TP Llama under ``torch.inference_mode``,
    with the decode tails and GEMM deferral forced on (as on CUDA): compiled whole (fullgraph)
    they give the eager model's and the one-process model's logits, for two sequence lengths."""
    from axedist.nn import to_inference
    from axedist.runtime import tails

    cfg = LlamaConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=8)
    torch.manual_seed(seed)
    base = Llama(cfg).double()
    mesh = DeviceMesh("cpu", (world_size,))
    model = to_inference(parallelize(copy.deepcopy(base), mesh, llama_tp_plan(cfg, sequence_parallel=False)))
    policy, gemm_policy = tails.defer_tails(), DTensor.dispatcher.defer_gemm
    tails.defer_tails("always")
    DTensor.dispatcher.defer_gemm = "always"
    failures = []
    try:
        _fresh_dynamo()
        compiled = torch.compile(lambda t: model(t).full_tensor(), backend="aot_eager", fullgraph=True)
        for batch, length in ((3, 1), (2, 4)):
            tokens = torch.randint(0, cfg.vocab_size, (batch, length))
            with torch.inference_mode():
                eager = model(tokens).full_tensor()
                got = compiled(tokens)
                want = base(tokens)
            if not torch.allclose(eager, want, rtol=1e-10, atol=1e-10):
                failures.append(f"B={batch} S={length}: eager decode differs from the one-process model")
            if not torch.allclose(got, want, rtol=1e-10, atol=1e-10):
                failures.append(f"B={batch} S={length}: compiled decode differs from the one-process model")
    finally:
        tails.defer_tails(policy)
        DTensor.dispatcher.defer_gemm = gemm_policy
    return failures


def test_compiled_decode_under_inference_mode_equals_eager():
    seed = random.randrange(2**31)
    results = run_on_ranks(_compiled_decode_case, 2, args=(seed,), timeout_s=600)
    assert results == [[]] * 2, (seed, results[0])
