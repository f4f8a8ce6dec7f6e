"""``fully_shard(model, mesh, traced=True)``: FSDP whose gathers and reduce-scatters are
redistributes inside the model's forward and backward, so ``torch.compile(model, fullgraph=True)``
compiles dp x tp whole (issue 31). Checked against a one-process model on the whole batch (fp64):
losses, every gradient and the parameters after AdamW; one graph for three steps, no break
(``explain``), the gather and the reduce-scatter inside the graphs; each block compiled alone
instead (``block.compile()``), one graph for both blocks; eager (uncompiled) too; state_dict names
and values as the plain model's; refused inputs raise on every rank.
"""

import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.utils import parametrize

from axedist.dtensor import DTensor
from axedist.mesh import DeviceMesh
from axedist.nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize, replicate
from axedist.nn.fsdp import data_parallel_specs
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.planning.redistribution import plan_redistribute
from axedist.spec import spec_from_placements
from axedist.testing import run_on_ranks

from .test_compile import _fresh_dynamo, _guard_failures, capture

CFG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=8)
TOL = dict(rtol=1e-9, atol=1e-11)


def traced_training(rank, world, seed, compiled, sequence_parallel, steps=3):
    """dp = 2 x tp = world / 2: the TP Llama under fully_shard(traced=True), compiled with
    fullgraph=True (``compiled`` True: the model whole; "blocks": each block, one backend for
    both, as torchtitan compiles) or eager, against the one-process Llama on the whole batch."""
    torch.manual_seed(seed)
    reference = Llama(CFG).double()
    mesh = DeviceMesh("cpu", (2, world // 2), ("dp", "tp"))
    model = parallelize(copy.deepcopy(reference), mesh["tp"], llama_tp_plan(CFG, sequence_parallel=sequence_parallel))
    fully_shard(model, mesh, traced=True)
    _fresh_dynamo()
    codes: list = []
    forward = torch.compile(model, backend=capture(codes), fullgraph=True) if compiled is True else model
    if compiled == "blocks":  # the blocks are alike: one graph serves both (no guard on a block's own objects)
        backend = capture(codes)
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (reference, model)]
    g = torch.Generator().manual_seed(seed + 1)
    d = mesh.coordinates()["dp"]
    report = {"graphs": [], "local": {}}
    for step in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=g)
        expected = next_token_loss(reference(tokens[:, :-1]), tokens[:, 1:])
        mine = tokens[2 * d:2 * d + 2]
        loss = next_token_loss(forward(mine[:, :-1]), replicate(mine[:, 1:], mesh["tp"]))
        mean = loss.full_tensor().detach().clone()
        dist.all_reduce(mean, group=mesh.group("dp"))
        torch.testing.assert_close(mean / 2, expected.detach(), **TOL, msg=lambda m: f"step {step}: loss: {m}")
        expected.backward()
        loss.backward()
        named = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            ours = named[name.replace(".weight", ".parametrizations.weight.original")]
            torch.testing.assert_close(ours.grad.full_tensor(), p.grad, **TOL,
                                       msg=lambda m: f"step {step}: grad of {name}: {m}")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        state = model.state_dict()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(state[name].full_tensor(), p.detach(), **TOL,
                                       msg=lambda m: f"after step {step}: {name}: {m}")
        report["graphs"].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    report["failures"] = _guard_failures()
    report["gathers"] = sum(code.count("all_gather") for code in codes[:1])
    report["reductions"] = sum(code.count("all_reduce") + code.count("reduce_scatter") for code in codes[1:])
    report["grad_moves"] = gradient_moves(model, mesh)
    report["keys"] = sorted(model.state_dict()) == sorted(reference.state_dict())
    report["local"] = {n: (tuple(v.to_local().shape), tuple(v.shape)) for n, v in model.state_dict().items()
                       if n in ("layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight",
                                "layers.0.attention_norm.weight")}
    if compiled:
        _fresh_dynamo()
        explained = torch._dynamo.explain(model)(mine[:, :-1])
        report["breaks"] = (explained.graph_break_count, [str(r.reason)[:300] for r in explained.break_reasons])
    else:  # load_state_dict takes the plain names back
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_state_dict(state)
        report["reloaded"] = all(torch.equal(model.state_dict()[k].to_local(), v.to_local()) for k, v in state.items())
    _fresh_dynamo()
    return report


def gradient_moves(model, mesh) -> set:
    """``(dim 0 divides by dp x tp, plan kinds)`` of each parameter's gradient move: its pending
    mean over dp -> its shard."""
    kinds = set()
    for sub in model.modules():
        if not parametrize.is_parametrized(sub):
            continue
        for gathers in sub.parametrizations.values():
            view = gathers[0]
            _, sharded = data_parallel_specs(view.view, view.gathered.shape, mesh, ("dp",))
            pending = spec_from_placements(view.gathered.shape, mesh, view.grad_placements)
            kinds.add((view.gathered.shape[0] % 4 == 0, plan_redistribute(pending, sharded, 8).kinds))
    return kinds


@pytest.mark.parametrize("compiled,sequence_parallel", [(True, True), ("blocks", True), (False, False)])
def test_traced_fsdp_x_tp_trains_like_one_process(compiled, sequence_parallel):
    seed = random.randrange(2**31)
    reports = run_on_ranks(traced_training, 4, args=(seed, compiled, sequence_parallel), timeout_s=500)
    for rank, report in enumerate(reports):
        assert report["keys"], f"rank {rank}: state_dict names differ from the plain model's"
        # every gradient goes from its pending mean over dp to its shard in one collective over dp:
        # a reduce-scatter (gloo runs it as all-reduce + own chunk: what the CPU graph shows), or
        # where dim 0 splits unevenly (the vocabulary's 30 rows) an all-to-all-v of the same bytes
        assert report["grad_moves"] == {(True, ("reduce_scatter",)), (False, ("all_to_all_v",))}, report["grad_moves"]
        # (16, 16) column-parallel: 8 rows per tp rank, 4 per (dp, tp) rank; (16, 24) w2 row-parallel
        # (columns over tp, rows over dp); a norm weight (16,) replicated over tp, halved over dp
        assert report["local"] == {"layers.0.attention.wq.weight": ((4, 16), (16, 16)),
                                   "layers.0.feed_forward.w2.weight": ((8, 12), (16, 24)),
                                   "layers.0.attention_norm.weight": ((8,), (16,))}, report["local"]
        if compiled:
            assert report["breaks"] == (0, []), f"rank {rank}: graph breaks {report['breaks']}"
            assert report["graphs"] == [1, 1, 1] and not report["failures"], (
                f"rank {rank} (seed {seed}): graphs after each step {report['graphs']}, guard failures "
                f"{report['failures']}")
            assert report["gathers"] > 0 and report["reductions"] > 0, (
                f"rank {rank}: the forward graph has {report['gathers']} all-gathers, the backward "
                f"{report['reductions']} reductions")
        else:
            assert report["reloaded"], f"rank {rank}: load_state_dict did not restore the parameters"


def uneven_mlp(rank, world):
    """Linear(16, 31) column-parallel then Linear(31, 16) row-parallel on (dp, tp) = (2, 2): 31 rows
    split 16 + 15 over tp and again over dp (padded), compiled whole; gradients as one process's."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 31), nn.ReLU(), nn.Linear(31, 16)).double()
    mesh = DeviceMesh("cpu", (2, world // 2), ("dp", "tp"))
    model = parallelize(copy.deepcopy(reference), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh, traced=True)
    _fresh_dynamo()
    forward = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    d = mesh.coordinates()["dp"]
    reference(x).square().mean().backward()
    forward(x[4 * d:4 * d + 4]).full_tensor().square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL)
    _fresh_dynamo()
    return [tuple(p.to_local().shape) for p in model.parameters()]


def test_traced_fsdp_uneven_rows():
    shapes = run_on_ranks(uneven_mlp, 4)
    assert shapes[3] == [(7, 16), (7,), (8, 15), (8,)], shapes  # tp rank 1's 15 rows: 8 + 7 over dp


def refused(rank, world):
    """dp-only (plain parameters) trains like one process, also computing in bf16 (reducing in fp32
    or bf16); each refused input raises here."""
    mesh = DeviceMesh("cpu", (world,), ("dp",))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)).double()
    model = fully_shard(copy.deepcopy(reference), mesh, traced=True)
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference(x).square().mean().backward()
    model(x[2 * rank:2 * rank + 2]).square().mean().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    torch.testing.assert_close(grads, [p.grad for p in reference.parameters()], **TOL)
    # the parametrized modules of one class share one class (Dynamo guards a module by its class's
    # id: one compiled graph serves every alike block), whose properties read each module's own
    # parametrization, also when parametrize.cached() keeps each module's value
    assert type(model[0]) is type(model[2]) and parametrize.type_before_parametrizations(model[0]) is nn.Linear
    with parametrize.cached():
        assert [tuple(model[i].weight.shape) for i in (0, 2)] == [(8, 6), (4, 8)]
        torch.testing.assert_close(model(x[2 * rank:2 * rank + 2]), reference(x[2 * rank:2 * rank + 2]), **TOL)
    # param_dtype: the shard is cast before its gather, the module computes in bf16, the sharded
    # parameter and its gradient stay in the parameter's dtype; the gradient reduced in fp32 (the
    # parameter's dtype, the default), or in bf16 as asked
    for reduce in (None, torch.bfloat16):
        half = fully_shard(copy.deepcopy(reference).float(), mesh, traced=True,
                           mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce))
        out = half(x[2 * rank:2 * rank + 2].float().bfloat16())
        out.float().square().mean().backward()
        assert out.dtype == torch.bfloat16
        assert "reduces in torch.bfloat16" in repr(half) if reduce else "reduces" not in repr(half)
        for p, q in zip(half.parameters(), reference.parameters()):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad.full_tensor().double(), q.grad, rtol=5e-2, atol=2e-2)
    errors = []

    def expect(error, fn):
        try:
            fn()
        except error as e:
            errors.append(f"{type(e).__name__}: {e}")
        else:
            errors.append(None)

    expect(NotImplementedError, lambda: fully_shard(nn.Linear(4, 4).double(), DeviceMesh("cpu", (1, world), ("r", "dp")),
                                                    dp_axes="dp", replicate_axes="r", traced=True))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    expect(ValueError, lambda: fully_shard(tied, mesh, traced=True))
    hooked = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(hooked[0], mesh)
    expect(ValueError, lambda: fully_shard(hooked, mesh, traced=True))
    assert isinstance(next(model.parameters()), DTensor)
    return errors


def test_traced_fsdp_plain_parameters_and_refused_inputs():
    for rank, errors in enumerate(run_on_ranks(refused, 2)):
        assert all(errors), f"rank {rank}: an input was not refused: {errors}"
        assert "HSDP" in errors[0] and "shared" in errors[1] and "hooked" in errors[2], errors
