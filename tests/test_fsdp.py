"""Fully sharded data parallel x tensor parallel (``axedist.nn.fully_shard``) on 4 gloo ranks.

Against the one-process model (float64, rel 1e-9, so fp32 rounding through AdamW cannot pass for
a bug or fail a correct run): the loss and every gradient over three AdamW
steps, and the parameters after them, for ``(dp, tp)`` = (2, 2), (4, 1), (1, 4), HSDP (2
replicate x 2 shard), uneven parameters (vocabulary 30), tied embeddings, frozen parameters,
``reshard_after_forward=False``, ``clip_grad_norm_`` over the whole mesh and a foreach optimizer,
and torch's spelling (``fully_shard(block, mesh=world_mesh["dp"])``, a 2-D HSDP mesh, no mesh).
Against torch's ``fully_shard`` + ``parallelize_module`` on the same model: equal losses, bytes
sent per rank per step no more than torch's, the sharded parameter + gradient + optimizer bytes.
Checkpoints across (dp, tp) degrees and to and from torch's; bad input; the main job under torchrun.
"""

import copy
import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from axedist.dtensor import DTensor, fused_gemm_stats
from axedist.layout import LayoutError
from axedist.mesh import DeviceMesh, MeshError
from axedist.nn import checkpoint, fsdp_units, fully_shard, parallelize, replicate
from axedist.nn.fsdp import MixedPrecisionPolicy, data_parallel_specs, pending_gradient_spec
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.runtime import count_collectives
from axedist.spec import spec_from_placements
from axedist.testing import run_on_ranks, run_torchrun, torch_comm_bytes, torch_fully_shard_llama, torch_llama_loss
from tests.fsdp_reference import gradients_then_step, same_after_steps

ROOT = Path(__file__).resolve().parents[1]
TOL64 = dict(rtol=1e-9, atol=1e-11)
STEPS = 3


def tiny(tie: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_hidden=24, max_seq_len=8, tie_embeddings=tie)


def sharded_llama(cfg, mesh, **kwargs):
    """The Llama tensor parallel on ``mesh["tp"]``, fully sharded per block and at the root."""
    model = Llama(cfg)
    parallelize(model, mesh["tp"], llama_tp_plan(cfg))
    for layer in model.layers:
        fully_shard(layer, mesh, **kwargs)
    fully_shard(model, mesh, **kwargs)
    return model


def _matches_one_process(rank, world, s, shape, names, case):
    mesh = DeviceMesh("cpu", shape, names)
    cfg = tiny(tie=case.get("tie", False))
    torch.manual_seed(s)
    ref = Llama(cfg).double()
    if case.get("frozen"):
        ref.layers[0].attention.wq.weight.requires_grad_(False)
        ref.norm.weight.requires_grad_(False)
    hsdp = names == ("rep", "shard")
    tp = "tp" in names
    kwargs = dict(dp_axes="shard", replicate_axes="rep") if hsdp else {}
    where = mesh
    spelling = case.get("torch")  # torch's: fully_shard(module, mesh=<the data-parallel torch mesh> or none)
    if spelling:
        from torch.distributed.device_mesh import init_device_mesh
        torch_world = init_device_mesh("cpu", shape, mesh_dim_names=names)
        kwargs = {}
        where = None if spelling == "none" else torch_world if hsdp else torch_world["dp"]
    if case.get("keep"):
        kwargs["reshard_after_forward"] = False
    par = copy.deepcopy(ref)  # same values and frozen flags
    if tp:
        parallelize(par, torch_world["tp"] if spelling else mesh["tp"],
                    llama_tp_plan(cfg, sequence_parallel=case.get("sp", True)))
    for layer in par.layers:
        if case.get("linear_units"):  # each projection its own unit: freed as soon as its input's gradient is in
            for name, sub in layer.named_modules():
                if isinstance(sub, torch.nn.Linear):
                    fully_shard(sub, mesh=where, **kwargs)
        fully_shard(layer, mesh=where, **kwargs)
    fully_shard(par, mesh=where, **kwargs)
    data_axes = ("rep", "shard") if hsdp else ("dp",)
    d = sum(mesh.coordinates()[a] * (mesh.size("shard") if a == "rep" else 1) for a in data_axes)
    parts = math.prod(mesh.size(a) for a in data_axes)
    for p in par.parameters():
        assert isinstance(p, DTensor) and p.mesh == mesh, p
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)) if case.get("foreach") else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    opt_ref = make([p for p in ref.parameters() if p.requires_grad])
    opt_par = make([p for p in par.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(s + 1)
    tp_mesh = mesh["tp"] if tp else None
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (2 * parts, cfg.max_seq_len + 1), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * d, 2 * d + 2)
        loss_ref = next_token_loss(ref(inputs), targets)
        logits = par(inputs[mine])
        loss = next_token_loss(logits, replicate(targets[mine], tp_mesh) if tp else targets[mine])
        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(value, group=mesh.group(data_axes))
        torch.testing.assert_close(value / parts, loss_ref.detach(), **TOL64, msg=lambda m: f"step {step} loss: {m}")
        loss_ref.backward()
        loss.backward()
        gradients_then_step(step, ref, par, opt_ref, opt_par, clip=0.05 if case.get("clip") else None)
    same_after_steps(ref, par, opt_ref, opt_par, STEPS)
    schedule = fsdp_units(par)[0].schedule
    return schedule.prefetches, schedule.peak_bytes


CASES = {
    "2x2": ((2, 2), ("dp", "tp"), {}),
    "4x1-foreach-sgd": ((4, 1), ("dp", "tp"), {"sp": False, "foreach": True}),
    "1x4": ((1, 4), ("dp", "tp"), {}),
    "hsdp-2x2": ((2, 2), ("rep", "shard"), {}),
    "2x2-tied-frozen-clip-keep": ((2, 2), ("dp", "tp"), {"tie": True, "frozen": True, "clip": True, "keep": True}),
    "2x2-deferred-linear-units": ((2, 2), ("dp", "tp"), {"deferred": True, "linear_units": True}),
    # torch's spelling: fully_shard(module, mesh=world_mesh["dp"]), HSDP as a 2-D mesh, no mesh at all
    "2x2-torch-spelling": ((2, 2), ("dp", "tp"), {"torch": "sub"}),
    "hsdp-2x2-torch-spelling": ((2, 2), ("rep", "shard"), {"torch": "sub", "keep": True}),
    "4-torch-spelling-no-mesh": ((4,), ("dp",), {"torch": "none"}),
}


def _deferred_matches_one_process(rank, world, s, shape, names, case):
    """The same run with every product and row all-gather deferred as on CUDA (the fused
    kernels' CPU stand-ins): the input gradients stay pending until their reduce-scatter."""
    from axedist.runtime.deferred import defer_gathers
    policies = DTensor.dispatcher.defer_gemm, defer_gathers()
    DTensor.dispatcher.defer_gemm = "always"
    defer_gathers("always")
    before = fused_gemm_stats()
    try:
        out = _matches_one_process(rank, world, s, shape, names, case)
    finally:
        DTensor.dispatcher.defer_gemm = policies[0]
        defer_gathers(policies[1])
    after = fused_gemm_stats()
    # the summed input gradients (wq/wk/wv, w1/w3) and the head's reached the fused decision
    assert after["summed"] > before["summed"] and after["unfused"] > before["unfused"], (before, after)
    # every deferred product computed once (CPU: none fused): a product added into a sum that
    # ran is not run again alone when FSDP frees the gathered weights it reads
    ran = {k: after[k] - before[k] for k in ("deferred", "fused", "materialized")}
    assert ran["fused"] == 0 and ran["materialized"] == ran["deferred"], (before, after)
    return out


def _each_product_once(rank, world, s):
    """bench_train_2d's model (TP + SP per layer, each layer and the root a unit) with every
    product deferred as on CUDA: each deferred product is computed once per step (none may run
    again when FSDP frees the gathered weights it reads), and losses and gradients equal the
    run that defers nothing."""
    from axedist.runtime.deferred import DeferredGemm, defer

    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=8)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(s))
    rows = tokens[2 * mesh.coordinates()["dp"]:][:2]

    def run(policy):
        torch.manual_seed(s)
        model = Llama(cfg).double()
        parallelize(model, mesh["tp"], llama_tp_plan(cfg, sequence_parallel=True))
        for layer in model.layers:
            fully_shard(layer, mesh)
        fully_shard(model, mesh)
        kept, DTensor.dispatcher.defer_gemm = DTensor.dispatcher.defer_gemm, policy
        try:
            losses, counts = [], []
            for _ in range(2):
                before = fused_gemm_stats()
                loss = next_token_loss(model(rows[:, :-1]), replicate(rows[:, 1:], mesh["tp"]))
                loss.backward()
                after = fused_gemm_stats()
                counts.append({k: after[k] - before[k] for k in ("deferred", "summed", "fused", "materialized")})
                losses.append(float(loss.full_tensor()))
            grads = [p.grad.full_tensor() for p in model.parameters()]
        finally:
            DTensor.dispatcher.defer_gemm = kept
        return losses, grads, counts

    losses, grads, counts = run("always")
    want_losses, want_grads, _ = run("never")
    # a product whose sum ran, its operand's storage freed, then used alone: the clear error
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    product = defer(lambda: (a @ b).unsqueeze(0), a, b, None, 1, 1, (3, 5))
    b.untyped_storage().resize_(0)
    with pytest.raises(LayoutError, match="operand was freed"):
        product.wait()
    assert type(product) is DeferredGemm
    return losses, want_losses, max((g - h).abs().max().item() for g, h in zip(grads, want_grads)), counts


def test_each_deferred_product_runs_once_under_fsdp_x_tp():
    for losses, want_losses, grad_error, counts in run_on_ranks(_each_product_once, 4,
                                                                args=(random.randrange(2**31),)):
        assert losses == pytest.approx(want_losses, rel=1e-12) and grad_error < 1e-12
        for c in counts:
            assert c["summed"] > 0 and c["fused"] == 0 and c["materialized"] == c["deferred"], counts


@pytest.mark.parametrize("case", list(CASES))
def test_fully_sharded_training_matches_one_process(case):
    shape, names, options = CASES[case]
    s = random.randrange(2**31)
    body = _deferred_matches_one_process if options.get("deferred") else _matches_one_process
    out = run_on_ranks(body, 4, args=(s, shape, names, options))
    prefetches, peak = out[0]
    assert peak > 0
    if shape[0] > 1:  # one data-parallel rank gathers nothing (each gather is a local copy)
        assert prefetches > 0, "no unit's gather was started ahead"


def state_bytes(model, optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (the sharded pieces)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        for t in [p, p.grad, *optimizer.state.get(p, {}).values()]:
            if isinstance(t, torch.Tensor) and t.dim():
                total += local(t).numel() * t.element_size()
    return total


def _against_torch(rank, world, s, mixed):
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    torch_mesh = mesh.to_torch()
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_hidden=24, max_seq_len=8)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else \
        MixedPrecisionPolicy()
    torch.manual_seed(s)
    ours = sharded_llama(cfg, mesh, mp_policy=policy)
    torch.manual_seed(s)
    theirs = torch_fully_shard_llama(Llama(cfg), torch_mesh, policy)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, foreach=False)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(s + 1)
    d = mesh.coordinates()["dp"]
    out = []
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=g)[2 * d:2 * d + 2]
        with count_collectives() as seen:
            loss = next_token_loss(ours(tokens[:, :-1]), replicate(tokens[:, 1:], mesh["tp"]))
            loss.backward()
        theirs_loss, theirs_bytes = torch_comm_bytes(lambda: torch_llama_loss(theirs(tokens[:, :-1]), tokens[:, 1:],
                                                                              torch_mesh["tp"]))
        memory = (state_bytes(ours, opt_ours), state_bytes(theirs, opt_theirs))
        out.append((float(loss.detach().full_tensor()), float(theirs_loss.detach().full_tensor()), seen.bytes_sent,
                    theirs_bytes, memory))
        for opt in (opt_ours, opt_theirs):
            opt.step()
            opt.zero_grad()
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-compute"])
def test_against_torch_fully_shard_and_parallelize_module(mixed):
    """Same model, data and (dp, tp) = (2, 2) as torch's fully_shard + parallelize_module: equal losses
    (bf16: one bf16 step apart at most), bytes sent per rank per step (forward + backward) at most
    torch's, and no more parameter + gradient + optimizer bytes per rank."""
    s = random.randrange(2**31)
    for rank_steps in run_on_ranks(_against_torch, 4, args=(s, mixed)):
        for step, (ours, theirs, sent, theirs_sent, (memory, theirs_memory)) in enumerate(rank_steps):
            if mixed:
                assert abs(ours - theirs) <= 2e-2 * abs(theirs), (step, ours, theirs)
            else:
                assert ours == pytest.approx(theirs, rel=1e-5), (step, ours, theirs)
            assert 0 < sent <= theirs_sent, f"step {step}: axedist sends {sent} B, torch {theirs_sent} B"
            assert memory <= theirs_memory, f"step {step}: {memory} B of state here, torch {theirs_memory} B"


def _no_tensor_in_cycles(rank, world, s):
    """The tensors a 2-D training step makes (activations, gathered parameters, gradients, the
    ops' temporaries) are freed by reference counting: none waits in a reference cycle for the
    garbage collector (which, on a GPU, kept memory of one step into the next)."""
    import gc
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=8)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(s)
    model = sharded_llama(cfg, mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(s + 1)
    d = mesh.coordinates()["dp"]

    def step():
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=g)[2 * d:2 * d + 2]
        next_token_loss(model(tokens[:, :-1]), replicate(tokens[:, 1:], mesh["tp"])).backward()
        opt.step()
        opt.zero_grad()

    step()  # plans, caches and the optimizer's state made
    gc.collect()
    # tensors alive now (this pool process ran other tests: their models may be let go meanwhile)
    before = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    known = {id(o) for o in before}
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(2):
            step()
        gc.collect()
        found = [(type(o).__name__, tuple(o.shape)) for o in gc.garbage
                 if isinstance(o, torch.Tensor) and id(o) not in known]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


def test_a_training_step_leaves_no_tensor_in_a_reference_cycle():
    """FSDP x TP (2 x 2), bf16 compute: two steps leave no tensor that only the garbage collector
    would free (before the dispatcher's argument walks were rewritten, dozens a step did: every
    op's DTensor inputs, held by a closure that called itself)."""
    s = random.randrange(2**31)
    for rank, found in enumerate(run_on_ranks(_no_tensor_in_cycles, 4, args=(s,))):
        assert not found, f"rank {rank}: tensors freed only by the garbage collector: {found[:8]}"


def _one_rank_data_axis(rank, world, s):
    """FSDP over a data axis of one rank: (dp, tp) = (1, 2). Each gradient's "sum over dp" has
    one summand: a copy. The plans keep no per-element slot index of it (8 bytes per gradient
    element, on the GPU where it runs there: the step's memory grew by half its parameters').
    The memos of earlier calls in this pooled rank process are emptied first (their plans' index
    tensors of other shapes would count: seen after tests/test_runtime_executor.py)."""
    import gc

    import axedist
    axedist.reset()  # every rank, at the same point
    gc.collect()
    mesh = DeviceMesh("cpu", (1, 2), ("dp", "tp"))
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_hidden=24, max_seq_len=8)
    torch.manual_seed(s)
    model = sharded_llama(cfg, mesh)
    torch.manual_seed(s)
    reference = Llama(cfg).double()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(s))
    next_token_loss(model(tokens[:, :-1]), replicate(tokens[:, 1:], mesh["tp"])).backward()
    next_token_loss(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor().double(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    gc.collect()
    largest = max(p.to_local().numel() for p in model.parameters())
    return sorted(o.numel() for o in gc.get_objects()
                  if isinstance(o, torch.Tensor) and o.dtype == torch.int64 and o.numel() >= largest)


def test_a_data_axis_of_one_rank_keeps_no_per_element_index():
    s = random.randrange(2**31)
    for rank, big in enumerate(run_on_ranks(_one_rank_data_axis, 2, args=(s,))):
        assert not big, f"rank {rank}: int64 tensors as large as a parameter kept: {big}"


def _dropped_models(rank, world, s):
    """Models trained a step and dropped, one after another: each is freed (its parameters with it)."""
    import gc
    import weakref
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    cfg = tiny()
    g = torch.Generator().manual_seed(s)
    d = mesh.coordinates()["dp"]
    dropped = []
    for _ in range(3):
        model = sharded_llama(cfg, mesh)
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=g)[2 * d:2 * d + 2]
        next_token_loss(model(tokens[:, :-1]), replicate(tokens[:, 1:], mesh["tp"])).backward()
        dropped.append((weakref.ref(model), weakref.ref(model.layers[0].feed_forward.w1.weight)))
        del model
        gc.collect()
    return [(m() is None, w() is None) for m, w in dropped]


def test_a_dropped_model_is_freed():
    """Before each step's multi-grad hooks on the units' inputs were removed at the end of its
    backward, they kept the last two models (and their parameters) alive after they were dropped."""
    s = random.randrange(2**31)
    for rank, freed in enumerate(run_on_ranks(_dropped_models, 4, args=(s,))):
        assert freed == [(True, True)] * 3, f"rank {rank}: (model freed, parameter freed) per model: {freed}"


def _torch_llama(cfg, mesh, seed):
    torch.manual_seed(seed)
    return torch_fully_shard_llama(Llama(cfg), mesh.to_torch())


def _same_values(model, cfg, seed, what):
    torch.manual_seed(seed)
    want = Llama(cfg)
    for (name, w), p in zip(want.named_parameters(), model.parameters()):
        assert torch.equal(p.full_tensor(), w.detach()), f"{what}: {name}"


def _checkpoints(rank, world, path):
    cfg = tiny()  # vocabulary 30: uneven on tp = 4 and again on dp
    mesh22 = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    torch.manual_seed(1)
    checkpoint.save(sharded_llama(cfg, mesh22), f"{path}/ours")
    for shape in ((4, 1), (1, 4)):
        torch.manual_seed(2)
        model = sharded_llama(cfg, DeviceMesh("cpu", shape, ("dp", "tp")))
        checkpoint.load(model, f"{path}/ours")
        _same_values(model, cfg, 1, f"(2, 2) -> {shape}")
    torch.manual_seed(6)
    again = sharded_llama(cfg, DeviceMesh("cpu", (1, 4), ("dp", "tp")))
    again.load_state_dict(model.state_dict())  # the sharded DTensors of state_dict, in place
    _same_values(again, cfg, 1, "state_dict at (1, 4)")
    tp_only = Llama(cfg)  # the tensor-parallel model of infer_tp.py, TP = 4
    parallelize(tp_only, DeviceMesh("cpu", (4,), ("tp",)), llama_tp_plan(cfg, sequence_parallel=False))
    checkpoint.load(tp_only, f"{path}/ours")
    _same_values(tp_only, cfg, 1, "(2, 2) -> TP=4")
    # torch's fully_shard + parallelize_module writes, we read; we write, torch reads
    import torch.distributed.checkpoint as dcp

    dcp.save(_torch_llama(cfg, mesh22, 3).state_dict(), checkpoint_id=f"{path}/torch")
    torch.manual_seed(4)
    model = sharded_llama(cfg, DeviceMesh("cpu", (4, 1), ("dp", "tp")))
    checkpoint.load(model, f"{path}/torch")
    _same_values(model, cfg, 3, "torch (2, 2) -> ours (4, 1)")
    theirs = _torch_llama(cfg, mesh22, 5)
    state = theirs.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/ours")
    theirs.load_state_dict(state)
    _same_values(theirs, cfg, 1, "ours (2, 2) -> torch (2, 2)")
    return True


def test_checkpoints_across_degrees_and_with_torch(tmp_path):
    """DCP: (2, 2) -> (4, 1), (1, 4) and TP-only; torch's FSDP2 + TP checkpoint into ours and ours into torch's
    (vocabulary 30: uneven rows on both axes)."""
    assert run_on_ranks(_checkpoints, 4, args=(str(tmp_path),)) == [True] * 4


def _layouts_and_errors(rank, world):
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    out = {}
    # the layouts of DESIGN section 7: (8, 6) ColwiseParallel / RowwiseParallel on tp, FSDP over dp
    for name, placement in (("colwise", torch.distributed.tensor.Shard(0)), ("rowwise", torch.distributed.tensor.Shard(1))):
        view = spec_from_placements((8, 6), mesh["tp"], [placement])
        gathered, sharded = data_parallel_specs(view, (8, 6), mesh, ("dp",))
        out[name] = (str(gathered.layout), str(sharded.layout))
    # uneven: 10 rows, 5 per tp rank, 3 + 2 per dp rank; torch's placements of the same split
    view = spec_from_placements((10, 6), mesh["tp"], [torch.distributed.tensor.Shard(0)])
    _, sharded = data_parallel_specs(view, (10, 6), mesh, ("dp",))
    out["uneven"] = (str(sharded.layout), sharded.padded, sharded.true_index[0])
    out["pending"] = str(pending_gradient_spec(view, (10, 6), mesh, ("dp",)).layout)
    hsdp = DeviceMesh("cpu", (2, 2), ("rep", "shard"))
    out["hsdp"] = str(data_parallel_specs(None, (8, 6), hsdp, ("shard",), ("rep",))[1].layout)

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError, LayoutError, MeshError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    cfg = tiny()
    model = Llama(cfg)
    parallelize(model, mesh["tp"], llama_tp_plan(cfg))
    out["no_axis"] = error(lambda: fully_shard(model.layers[0], mesh, dp_axes=("data",)))
    out["tp_axis"] = error(lambda: fully_shard(model.layers[0], mesh, dp_axes=("tp",)))
    out["both"] = error(lambda: fully_shard(model.layers[0], mesh, dp_axes="dp", replicate_axes="dp"))
    fully_shard(model.layers[0], mesh)
    out["twice"] = error(lambda: fully_shard(model.layers[0], mesh))
    meta = torch.nn.Linear(4, 4, device="meta")
    fully_shard(meta, mesh)  # built on the meta device: sharded there, no values (to_empty gives them a device)
    out["device"] = (meta.weight.device.type, meta.weight.to_local().is_meta, tuple(meta.weight.to_local().shape))
    tied = Llama(tiny(tie=True))
    fully_shard(tied.output, DeviceMesh("cpu", (4,), ("dp",)))
    out["shared"] = error(lambda: fully_shard(tied, DeviceMesh("cpu", (4,), ("dp",))))
    # torch's spelling: what it does not support, and an axedist sub-mesh that lacks the model's tp axis
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Shard
    torch_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = model.layers[1]
    out["offload"] = error(lambda: fully_shard(block, mesh=torch_mesh["dp"], offload_policy=CPUOffloadPolicy(), traced=True))
    out["placement_fn"] = error(lambda: fully_shard(block, mesh=torch_mesh["dp"], shard_placement_fn=lambda p: Shard(2)))
    out["listed_twice"] = error(lambda: fully_shard([block.attention, block.attention], mesh=torch_mesh["dp"]))
    out["not_modules"] = error(lambda: fully_shard([], mesh=torch_mesh["dp"]))
    out["sub_mesh"] = error(lambda: fully_shard(block, mesh=mesh["dp"]))
    out["dp_axes_torch"] = error(lambda: fully_shard(block, torch_mesh, dp_axes="dp"))
    return out


def _micro_batches(rank, world, s):
    """Gradient accumulation as torch's FSDP2 scripts write it: three micro-batches, gradient sync
    off for the first two (they set no gradient: held unreduced), dp x tp; unshard() / reshard()
    called by hand around a forward."""
    from axedist.nn import FSDPModule
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    cfg = tiny()
    torch.manual_seed(s)
    ref = Llama(cfg).double()
    par = copy.deepcopy(ref)
    parallelize(par, mesh["tp"], llama_tp_plan(cfg))
    for layer in par.layers:
        fully_shard(layer, mesh)
    fully_shard(par, mesh)
    assert isinstance(par, FSDPModule) and type(par).__name__ == "FSDPLlama" and isinstance(par, Llama)
    d = mesh.coordinates()["dp"]
    g = torch.Generator().manual_seed(s + 1)
    for micro in range(3):
        par.set_requires_gradient_sync(micro == 2)
        par.set_is_last_backward(micro == 2)
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        next_token_loss(ref(inputs), targets).backward()
        mine = slice(2 * d, 2 * d + 2)
        next_token_loss(par(inputs[mine]), replicate(targets[mine], mesh["tp"])).backward()
        assert all((p.grad is not None) == (micro == 2) for p in par.parameters()), micro
    for (name, p_ref), p in zip(ref.named_parameters(), par.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL64, msg=lambda m: f"accumulated {name}: {m}")
    # by hand: gathered before the forward (the forward then gathers nothing), freed after
    block = par.layers[0]
    block.reshard()
    block.unshard(async_op=True).wait()
    unit = fsdp_units(block)[0]
    assert unit.is_gathered
    with torch.no_grad():
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=g)[:, :-1]
        torch.testing.assert_close(par(tokens[2 * d:2 * d + 2]).full_tensor(), ref(tokens)[:, 2 * d:2 * d + 2], **TOL64)
    block.reshard()
    assert not unit.is_gathered
    par.set_reshard_after_forward(False)
    assert all(not u.reshard_after_forward for u in fsdp_units(par))
    return True


def test_gradient_accumulation_and_fsdp_module_calls():
    assert run_on_ranks(_micro_batches, 4, args=(random.randrange(2**31),)) == [True] * 4


class _Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim - 1)

    def forward(self, h):
        return h + torch.nn.functional.pad(self.down(torch.relu(self.up(h))), (0, 1))


class _Net(torch.nn.Module):
    """An embedding, blocks, a final norm and projection, and a gain ``fully_shard`` is told to
    ignore; dims that do not divide by 2 (uneven shards)."""

    def __init__(self, vocab=11, dim=6, tie=False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([_Block(dim) for _ in range(3)])
        self.norm = torch.nn.LayerNorm(dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        if tie:
            self.out.weight = self.emb.weight
        self.gain = torch.nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, tokens, features_only=False, checkpointed=False):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(tokens) * self.gain
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
        h = self.norm(h)
        return h if features_only else self.out(h)

    def loss(self, tokens, chunked: bool):
        """``chunked``: the forward stops at the norm, the output projection runs on two halves of the
        sequence after it (torch's chunked loss: one unit of [norm, out], its modules called apart)."""
        if not chunked:
            return self(tokens).logsumexp(-1).mean()
        features = self(tokens, features_only=True)
        return sum(self.out(part).logsumexp(-1).sum() for part in features.split(3, dim=1)) / features.shape[:2].numel()


def _shard_as_torchtitan(net, shard, mesh, divide):
    """torchtitan's grouping, with torch's options: the embedding (with the output projection when
    they share a weight), the blocks, [norm, out] kept after forward, the root ignoring ``gain``;
    gradients divided by ``divide`` over the ranks; explicit prefetches. The same calls for torch's
    ``fully_shard`` and axedist's."""
    from torch.distributed.tensor import Shard

    tied = net.out.weight is net.emb.weight
    shard([net.emb, net.out] if tied else net.emb, mesh=mesh, shard_placement_fn=lambda p: Shard(0))
    for block in net.blocks:
        shard(block, mesh=mesh, reshard_after_forward=None, shard_placement_fn=lambda p: None)
    if not tied:
        shard([net.norm, net.out], mesh=mesh, reshard_after_forward=False)
    shard(net, mesh=mesh, ignored_params={net.gain})
    for module in net.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(divide)
    net.blocks[0].set_modules_to_forward_prefetch([net.blocks[1], net.blocks[2]])
    net.blocks[2].set_modules_to_backward_prefetch([net.blocks[1], net.blocks[0]])


def _options_against_torch(rank, world, s, tie, chunked=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(s)
    ours = _Net(tie=tie).double()
    theirs = copy.deepcopy(ours)
    divide = 4.0  # gradients / 4 summed over 2 ranks: half the mean
    _shard_as_torchtitan(ours, fully_shard, torch_mesh, divide)
    _shard_as_torchtitan(theirs, torch_fully_shard, torch_mesh, divide)
    group = fsdp_units(ours.norm)[0] if not tie else fsdp_units(ours.emb)[0]
    assert fsdp_units(ours.out) == [group] and len(group.params) == (3 if not tie else 1), group
    assert not isinstance(ours.gain, DTensor) and isinstance(ours.out.weight, DTensor)
    g = torch.Generator().manual_seed(s + 1)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ours, theirs)]
    out = []
    for step in range(STEPS):
        tokens = torch.randint(0, 11, (2 * world, 5), generator=g)[2 * rank:2 * rank + 2]
        losses = []
        for model in (ours, theirs):
            loss = model.loss(tokens, chunked)
            if model is ours:  # gathered once a forward, kept after it (reshard_after_forward=False)
                assert group.is_gathered == (not tie), step
                assert group.schedule.order.count(group) == (2 if chunked else 1)  # (chunked: norm, then out apart)
            loss.backward()
            losses.append(float(loss))
        if step == 0:
            assert not group.is_gathered  # freed when its backward ended
        grads = [[p.grad.full_tensor() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
                  for p in model.parameters()] for model in (ours, theirs)]
        out.append((losses, [[float(x) for x in g.flatten()] for g in grads[0]],
                    [[float(x) for x in g.flatten()] for g in grads[1]]))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    values = [[p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p.detach() for p in m.parameters()]
              for m in (ours, theirs)]
    return out, [[float(x) for x in v.flatten()] for v in values[0]], [[float(x) for x in v.flatten()] for v in values[1]]


@pytest.mark.parametrize("tie, chunked", [(False, False), (True, False), (False, True)],
                         ids=["groups", "tied-group", "chunked-loss"])
def test_torch_fully_shard_options_match_torch(tie, chunked):
    """torchtitan's FSDP2 calls on torch's options, axedist's fully_shard against torch's on the same
    2 ranks, fp64, 3 AdamW steps: a list of modules as one unit (``[norm, out]``, or the embedding
    and the output projection that share its weight), ``ignored_params`` (the gain stays a plain
    parameter, its gradient this rank's own), ``set_gradient_divide_factor``, explicit prefetches,
    ``shard_placement_fn`` giving ``None`` / ``Shard(0)`` and ``reshard_after_forward=None``, and a
    chunked loss (the group's output projection called apart from the forward, per chunk): equal
    losses, gradients and parameters after the steps."""
    s = random.randrange(2**31)
    for steps, ours, theirs in run_on_ranks(_options_against_torch, 2, args=(s, tie, chunked)):
        for step, (losses, grads, torch_grads) in enumerate(steps):
            assert losses[0] == pytest.approx(losses[1], rel=1e-12), (step, losses)
            for i, (a, b) in enumerate(zip(grads, torch_grads)):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL64,
                                           msg=lambda m: f"step {step}, gradient of parameter {i}: {m}")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL64, msg=lambda m: f"parameter {i}: {m}")


def _same_gradients_then_step(step, ref, ours, optimizers):
    """Every gradient of the sharded model ``ours`` equals the one-process model's; then both step."""
    for (name, p_ref), p in zip(ref.named_parameters(), ours.parameters()):
        assert p.grad is not None, f"step {step}: {name} has no gradient"
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL64, msg=lambda m: f"step {step}, {name}: {m}")
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


class _Failing(torch.autograd.Function):
    """Identity that raises in forward or backward when told to."""

    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        if where == "forward":
            raise RuntimeError("failing forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.where == "backward":
            raise RuntimeError("failing backward")
        return grad, None


def _blocks_and_root_sharded(world, s):
    """A one-process ``_Net`` and its copy with each block and the root ``fully_shard``-ed over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(s)
    ref = _Net().double()
    ours = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in ours.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    return ref, ours


def _recovery(rank, world, s, reset):
    ref, ours = _blocks_and_root_sharded(world, s)
    fail = {"where": None}
    block = ours.blocks[1]
    block.register_forward_hook(lambda m, a, out: _Failing.apply(out, fail["where"]))
    ours.set_reshard_after_backward(False)
    unit = fsdp_units(block)[0]
    opt_ref, opt_ours = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours))
    g = torch.Generator().manual_seed(s + 1)
    for step, where in enumerate(["forward", None, "backward", None, None]):
        tokens = torch.randint(0, 11, (2 * world, 5), generator=g)
        fail["where"] = where
        try:
            ours(tokens[2 * rank:2 * rank + 2]).logsumexp(-1).mean().backward()
        except RuntimeError as e:
            assert f"failing {where}" in str(e), e
            opt_ours.zero_grad()
            if reset:
                ours.reset_iter_state()
                assert not unit.is_gathered
            continue
        assert where is None
        assert unit.is_gathered  # set_reshard_after_backward(False): kept after backward
        ref(tokens).logsumexp(-1).mean().backward()
        _same_gradients_then_step(step, ref, ours, (opt_ref, opt_ours))
    for (name, p_ref), p in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref.detach(), **TOL64, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("reset", [True, False])
def test_a_step_stopped_by_an_exception_and_reset_iter_state(reset):
    """A forward, then a backward, that raise inside a unit; ``reset_iter_state()`` on the root, or
    nothing (the next forward starts a new step: before, after a backward that raised, the next
    backward reduced no gradient); the next steps' gradients and the parameters after them equal
    one process's (which skipped the failed steps), with ``set_reshard_after_backward(False)``
    keeping a unit gathered after backward."""
    assert run_on_ranks(_recovery, 2, args=(random.randrange(2**31), reset)) == [True] * 2


def _skipped_batch(rank, world, s, where, reshard_after_backward):
    """A forward that raises inside a unit (``where``: the root's first module, its last one, or an
    inner block's), caught and skipped without ``reset_iter_state`` (a script skipping a bad batch);
    the optimizer then steps with the earlier micro-batch's gradients, and the following steps run
    as new ones: their gathers see the stepped shards (a prefetch the failed forward started, of a
    unit it never reached, is dropped)."""
    ref, ours = _blocks_and_root_sharded(world, s)
    ours.set_reshard_after_backward(reshard_after_backward)
    fail = {"on": False}

    def maybe_raise(module, args):
        if fail["on"]:
            raise RuntimeError("bad batch")

    raising = {"root_first": ours.emb, "root_last": ours.norm, "block": ours.blocks[1].up}[where]
    raising.register_forward_pre_hook(maybe_raise)
    opt_ref, opt_ours = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours))
    g = torch.Generator().manual_seed(s + 1)
    for step in range(3):
        tokens, bad = (torch.randint(0, 11, (2 * world, 5), generator=g) for _ in range(2))
        mine = slice(2 * rank, 2 * rank + 2)
        ours(tokens[mine]).logsumexp(-1).mean().backward()
        ref(tokens).logsumexp(-1).mean().backward()
        fail["on"] = True
        with pytest.raises(RuntimeError, match="bad batch"):
            ours(bad[mine]).logsumexp(-1).mean().backward()
        fail["on"] = False
        # the modules hold their sharded parameters again, and what the failed forward gathered is freed
        assert all(isinstance(p, DTensor) and p.is_leaf for p in ours.parameters())
        raised = fsdp_units(ours.blocks[1] if where == "block" else ours)[0]
        assert not raised.is_gathered
        _same_gradients_then_step(step, ref, ours, (opt_ref, opt_ours))
    for (name, p_ref), p in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref.detach(), **TOL64, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("reshard_after_backward", [True, False])
@pytest.mark.parametrize("where", ["root_first", "root_last", "block"])
def test_a_batch_skipped_after_its_forward_raised(where, reshard_after_backward):
    """A forward that raised inside a unit, caught without ``reset_iter_state``, then an optimizer step
    with the micro-batch before it: the raising unit's modules hold their sharded parameters again and
    its gathered ones are freed; the next step's gathers see the stepped parameters (not the values
    the failed forward gathered or prefetched), and every gradient and parameter equals one
    process's, three times."""
    args = (random.randrange(2**31), where, reshard_after_backward)
    assert run_on_ranks(_skipped_batch, 2, args=args) == [True] * 2


def _gathered_by_hand(rank, world, s):
    """``unshard()`` (and ``unshard(async_op=True)``, waited or not) on a block after the optimizer
    step, as torch's manual prefetch: the next forward gathers that block no more, and computes with
    the stepped parameters (the block kept its gathered values after backward: those are stale)."""
    ref, ours = _blocks_and_root_sharded(world, s)
    ours.set_reshard_after_backward(False)
    opt_ref, opt_ours = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours))
    g = torch.Generator().manual_seed(s + 1)
    calls = []
    for step, by_hand in enumerate([None, "sync", "async", "async_waited", None]):
        tokens = torch.randint(0, 11, (2 * world, 5), generator=g)
        if by_hand == "sync":
            assert ours.blocks[1].unshard() is None
        elif by_hand is not None:
            handle = ours.blocks[1].unshard(async_op=True)
            if by_hand == "async_waited":
                handle.wait()
        with count_collectives() as counted:
            loss = ours(tokens[2 * rank:2 * rank + 2]).logsumexp(-1).mean()
        calls.append(counted.calls)
        loss.backward()
        ref(tokens).logsumexp(-1).mean().backward()
        _same_gradients_then_step(step, ref, ours, (opt_ref, opt_ours))
    assert calls[1:4] == [calls[0] - 1] * 3 and calls[4] == calls[0], calls
    # gathered by hand, then a step that does not use it (block 0 alone) and a change of its values:
    # the gather served that step only, so the next forward gathers block 1 anew
    ours.blocks[1].unshard()
    h = torch.randn(2 * world, 5, 6, generator=g, dtype=torch.float64)
    ours.blocks[0](h[2 * rank:2 * rank + 2]).square().mean().backward()
    ref.blocks[0](h).square().mean().backward()
    _same_gradients_then_step("block 0 alone", ref.blocks[0], ours.blocks[0], (opt_ref, opt_ours))
    with torch.no_grad():
        for p_ref, p in zip(ref.blocks[1].parameters(), ours.blocks[1].parameters()):
            p_ref.mul_(0.5)
            p.mul_(0.5)
    tokens = torch.randint(0, 11, (2 * world, 5), generator=g)
    ours(tokens[2 * rank:2 * rank + 2]).logsumexp(-1).mean().backward()
    ref(tokens).logsumexp(-1).mean().backward()
    _same_gradients_then_step("after", ref, ours, (opt_ref, opt_ours))
    return True


def test_unshard_by_hand_before_a_forward(seed):
    """A block gathered by hand after the optimizer step (``unshard()``, ``unshard(async_op=True)``
    waited or not) is not gathered again by the next forward, and every gradient equals one
    process's (its values are the stepped ones, not those it kept gathered after backward). A gather
    by hand serves the next step only: after a step without that block and a change of its values,
    the block is gathered anew."""
    assert run_on_ranks(_gathered_by_hand, 2, args=(seed,)) == [True] * 2


class _Twice(torch.nn.Module):
    """A block called twice in one forward, the first time on an input that needs no gradient."""

    def __init__(self):
        super().__init__()
        self.block, self.out = _Block(7), torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.out(self.block(self.block(x)))


def _forwards_before_backward(rank, world, s):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(s)
    ref = _Twice().double()
    ours = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(ours.block, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    opt_ref, opt_ours = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours))
    g = torch.Generator().manual_seed(s + 1)
    for step in range(3):
        x, y = (torch.randn(2 * world, 7, generator=g, dtype=torch.float64) for _ in range(2))
        mine = slice(2 * rank, 2 * rank + 2)
        # two forwards, a no-grad forward between them and the backward, then one backward of both
        loss = ours(x[mine]).square().mean()
        loss = loss + ours(y[mine]).square().mean()
        with torch.no_grad():
            ours(x[mine])
        loss.backward()
        (ref(x).square().mean() + ref(y).square().mean()).backward()
        _same_gradients_then_step(step, ref, ours, (opt_ref, opt_ours))
    return True


def test_several_forwards_before_a_backward():
    """A unit called twice in one forward (first on an input that needs no gradient), two forwards of
    the model before one backward of their sum, a no-grad forward in between: every saved gathered
    value is still there in backward (a gathered parameter is one storage, refilled in place), and the
    gradients equal one process's over three SGD steps."""
    assert run_on_ranks(_forwards_before_backward, 2, args=(random.randrange(2**31),)) == [True] * 2


def _checkpointed(rank, world, s, style):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(s)
    ref = _Net().double()
    ours = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if style == "wrap":  # torchtitan's order: wrapped, then sharded
        ours.blocks = torch.nn.ModuleList([checkpoint_wrapper(b) for b in ours.blocks])
    for block in ours.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    opt_ref, opt_ours = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours))
    g = torch.Generator().manual_seed(s + 1)
    for step in range(3):
        tokens = torch.randint(0, 11, (2 * world, 5), generator=g)
        ours(tokens[2 * rank:2 * rank + 2], checkpointed=style == "call").logsumexp(-1).mean().backward()
        ref(tokens).logsumexp(-1).mean().backward()
        assert all(isinstance(p, DTensor) for b in ours.blocks for p in b.parameters())  # sharded again
        _same_gradients_then_step(step, ref, ours, (opt_ref, opt_ours))
    return True


@pytest.mark.parametrize("style", ["call", "wrap"])
def test_activation_checkpointing_of_fully_sharded_blocks(style):
    """Activation checkpointing of sharded blocks: ``checkpoint(block, h)`` in the forward (``call``),
    and torchtitan's ``checkpoint_wrapper(block)`` then ``fully_shard`` (``wrap``: the recompute in
    backward runs inside the unit, with the gathered values the modules hold in backward). Every
    gradient equals one process's over three AdamW steps (before: none arrived, or backward raised)."""
    assert run_on_ranks(_checkpointed, 2, args=(random.randrange(2**31), style)) == [True] * 2


class _Residuals(torch.nn.Module):
    """Blocks whose residual sum is outside them: what a block's output dtype is matters."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        dtypes = []
        for block in self.blocks:
            out = block(x)
            dtypes.append(str(out.dtype))
            x = x + out
        return x, dtypes


def _output_dtype(rank, world, s):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    x = 100 * torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
    out = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(s)
        model = _Residuals()
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=policy)
        shard(model, mesh=mesh, mp_policy=policy)
        y, dtypes = model(x)
        y.sum().backward()
        out.append((dtypes, str(y.dtype), [float(v) for v in y.detach().flatten()],
                    [float(v) for p in model.parameters() for v in p.grad.full_tensor().flatten()]))
    return out


def test_output_dtype_casts_every_unit_output_as_torch():
    """``MixedPrecisionPolicy(output_dtype=fp32)`` with bf16 compute: every unit's output is fp32 (not
    only the root's), so a residual sum outside the blocks is the same as under torch's fully_shard:
    equal outputs and gradients."""
    for ours, theirs in run_on_ranks(_output_dtype, 2, args=(random.randrange(2**31),)):
        assert ours[0] == theirs[0] == ["torch.float32", "torch.float32"], (ours[0], theirs[0])
        assert ours[1:] == theirs[1:]


def test_layouts_and_bad_input():
    out = run_on_ranks(_layouts_and_errors, 4)
    assert all(o == out[0] for o in out), "ranks disagree"
    o = out[0]
    assert o["colwise"] == ("S[(2,4,6):(1@tp,6,1)] + R[2:1@dp]", "S[(2,2,2,6):(1@tp,1@dp,6,1)]")
    assert o["rowwise"] == ("S[(8,2,3):(3,1@tp,1)] + R[2:1@dp]", "S[(2,4,2,3):(1@dp,3,1@tp,1)]")
    assert o["uneven"] == ("S[(2,2,3,6):(1@tp,1@dp,6,1)]", (12, 6), (0, 1, 2, 3, 4, -1, 5, 6, 7, 8, 9, -1))
    assert o["pending"] == "S[(2,2,5,6):(1@dp,1@tp,6,1)]"
    assert o["hsdp"] == "S[(2,4,6):(1@shard,6,1)] + R[2:1@rep]"
    assert "MeshError" in o["no_axis"] and "'data'" in o["no_axis"]
    assert "MeshError" in o["tp_axis"] and "already laid out on" in o["tp_axis"]
    assert "MeshError" in o["both"] and "both" in o["both"]
    assert "already applied" in o["twice"]
    assert o["device"] == ("meta", True, (2, 4)), o["device"]
    assert "shared with another FSDP unit" in o["shared"]
    assert "NotImplementedError" in o["offload"] and "offload" in o["offload"]
    assert "ValueError" in o["placement_fn"] and "Shard(dim=2)" in o["placement_fn"], o["placement_fn"]
    assert "ValueError" in o["listed_twice"] and "listed twice" in o["listed_twice"]
    assert "TypeError" in o["not_modules"] and "non-empty list" in o["not_modules"]
    assert "MeshError" in o["sub_mesh"] and "lacks ['tp']" in o["sub_mesh"], o["sub_mesh"]
    assert "TypeError" in o["dp_axes_torch"] and "whole axedist DeviceMesh" in o["dp_axes_torch"]


def test_main_job_trains_dp2_x_tp2_under_torchrun(tmp_path):
    """launch/train_tp.py on 4 ranks: dp = 2 x tp = 2 by default, the parameters' 2-D layouts and one
    step's collectives printed, losses and a checkpoint written."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    returncode, stdout, stderr = run_torchrun(
        ["launch/train_tp.py", "--steps", "3", "--log-every", "3", "--seq", "8", "--batch", "4", "--dim", "16",
         "--vocab", "30", "--layers", "1", "--out", str(tmp_path)], 4, cwd=ROOT, env=env)
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "axes=('dp', 'tp')" in stdout and "fully sharded" in stdout
    assert "S[(2,2,4,16):(1@tp,1@dp,16,1)]" in stdout          # wq: (16, 16), ColwiseParallel + FSDP
    assert "all_gather over dp" in stdout and "reduce_scatter over dp" in stdout
    record = json.loads((tmp_path / "losses.json").read_text())
    assert record["dp"] == 2 and len(record["loss"]) == 3
    assert (tmp_path / "checkpoint" / ".metadata").exists()  # loads at other degrees: test_checkpoints_...
