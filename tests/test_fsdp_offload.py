"""``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on gloo ranks: dp = 2, dp x tp = 2 x 2, HSDP.

The mesh's device is the CPU here, so offloading moves nothing: these tests check the API, the state
(every shard, gradient and optimizer moment a DTensor whose piece is on the CPU, sharded like its
parameter; the unit says it offloads) and that training equals the one-process model (float64, rel
1e-9: the loss and every gradient over three AdamW steps, the parameters after, ``clip_grad_norm_``),
a checkpoint round trip (into offloaded and plain models alike), torchtitan's meta-device flow
(``to_empty(device="cpu")`` after ``fully_shard``) and the bad input. The copies to and from a GPU,
the pinned memory and the peak memory are tested in ``tests_multigpu/test_fsdp_offload_nccl.py``.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from axedist.dtensor import DTensor
from axedist.mesh import DeviceMesh
from axedist.nn import checkpoint, fsdp_units, fully_shard, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.nn.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from axedist.testing import run_on_ranks
from tests.fsdp_reference import TOL64, gradients_then_step, same_after_steps
STEPS = 3


def tiny(tie: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_hidden=24, max_seq_len=8, tie_embeddings=tie)


def _shard(model, cfg, mesh, root_policy=None, **kwargs):
    """``model`` tensor parallel on ``mesh["tp"]`` (if the mesh has it), each block and the root
    fully sharded with CPU offload (the root with ``root_policy`` when given)."""
    if "tp" in mesh.axis_names:
        parallelize(model, mesh["tp"], llama_tp_plan(cfg))
    for layer in model.layers:
        fully_shard(layer, mesh, offload_policy=CPUOffloadPolicy(), **kwargs)
    fully_shard(model, mesh, offload_policy=root_policy or CPUOffloadPolicy(), **kwargs)
    return model


def _on_the_cpu(name: str, t: torch.Tensor, like: DTensor) -> None:
    assert isinstance(t, DTensor) and t.device.type == "cpu" and t.to_local().device.type == "cpu", (name, t)
    assert t._spec == like._spec, f"{name}: {t._spec} is not sharded like its parameter {like._spec}"


def _data_rank(mesh: DeviceMesh, data_axes) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number."""
    index = 0
    for a in data_axes:
        index = index * mesh.size(a) + mesh.coordinates()[a]
    return index, math.prod(mesh.size(a) for a in data_axes)


def _matches_one_process(rank, world, s, shape, names, case):
    mesh = DeviceMesh("cpu", shape, names)
    cfg = tiny(tie=case.get("tie", False))
    torch.manual_seed(s)
    ref = Llama(cfg).double()
    hsdp = names == ("rep", "shard")
    kwargs = dict(dp_axes="shard", replicate_axes="rep") if hsdp else {}
    if not hsdp and len(shape) > 1:
        kwargs = dict(dp_axes="dp")
    root_policy = OffloadPolicy() if case.get("root_on_device") else CPUOffloadPolicy(pin_memory=case.get("pin", True))
    par = _shard(copy.deepcopy(ref), cfg, mesh, root_policy, **kwargs)
    units = fsdp_units(par)
    offloading = ["shards on the CPU" in repr(u) for u in units]
    assert offloading == [not (case.get("root_on_device") and u is units[0]) for u in units], (units, offloading)
    data_axes = ("rep", "shard") if hsdp else ("dp",)
    d, parts = _data_rank(mesh, data_axes)
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)) if case.get("foreach") else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    opt_ref, opt_par = make(ref.parameters()), make(par.parameters())
    offloaded = {id(p) for u in units if "shards on the CPU" in repr(u) for p in
                 (record.param for record in u.params)}
    for name, p in par.named_parameters():
        if id(p) in offloaded:
            _on_the_cpu(name, p, p)
    g = torch.Generator().manual_seed(s + 1)
    tp_mesh = mesh["tp"] if "tp" in names else None
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (2 * parts, cfg.max_seq_len + 1), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * d, 2 * d + 2)
        loss_ref = next_token_loss(ref(inputs), targets)
        loss = next_token_loss(par(inputs[mine]), replicate(targets[mine], tp_mesh) if tp_mesh else targets[mine])
        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(value, group=mesh.group(data_axes))
        torch.testing.assert_close(value / parts, loss_ref.detach(), **TOL64, msg=lambda m: f"step {step} loss: {m}")
        loss_ref.backward()
        loss.backward()
        gradients_then_step(step, ref, par, opt_ref, opt_par, clip=0.05 if case.get("clip") else None,
                            each=lambda name, p: id(p) in offloaded and _on_the_cpu(f"grad of {name}", p.grad, p))

    def on_the_cpu_with_state(name, p):
        if id(p) in offloaded:
            _on_the_cpu(f"after {STEPS} steps: {name}", p, p)
            for key in ("exp_avg", "exp_avg_sq"):
                _on_the_cpu(f"{name}'s {key}", opt_par.state[p][key], p)

    same_after_steps(ref, par, opt_ref, opt_par, STEPS, each=on_the_cpu_with_state)
    return len(offloaded)


CASES = {
    "dp2": ((2,), ("dp",), {}),
    "dp2xtp2-clip-foreach": ((2, 2), ("dp", "tp"), {"clip": True, "foreach": True}),
    "dp2xtp2-tied-no-pin-root-not-offloaded": ((2, 2), ("dp", "tp"), {"tie": True, "pin": False,
                                                                       "root_on_device": True}),
    "hsdp-2x2": ((2, 2), ("rep", "shard"), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_training_matches_one_process(case, seed):
    shape, names, options = CASES[case]
    counts = run_on_ranks(_matches_one_process, math.prod(shape), args=(seed, shape, names, options))
    assert all(n > 0 for n in counts), counts


def _checkpoint_round_trip(rank, world, s, path):
    """Offloaded (2, 2): state dicts hold the CPU shards; a checkpoint saved after a step loads back
    (parameters and AdamW moments in place, still on the CPU) and into a model without offload,
    and the next step of the two is the same."""
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    cfg = tiny()
    torch.manual_seed(s)
    ref = Llama(cfg).double()
    model = _shard(copy.deepcopy(ref), cfg, mesh, dp_axes="dp")
    plain = copy.deepcopy(ref)  # the same model with no offload (torch's default policy given)
    parallelize(plain, mesh["tp"], llama_tp_plan(cfg))
    for layer in plain.layers:
        fully_shard(layer, mesh, dp_axes="dp")
    fully_shard(plain, mesh, dp_axes="dp", offload_policy=OffloadPolicy())
    assert not any("shards on the CPU" in repr(u) for u in fsdp_units(plain))
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (model, plain)}
    d = mesh.coordinates()["dp"]

    def step(m, k):
        g = torch.Generator().manual_seed(s + k)
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=g)[2 * d:2 * d + 2]
        next_token_loss(m(tokens[:, :-1]), replicate(tokens[:, 1:], mesh["tp"])).backward()
        optimizers[id(m)].step()
        optimizers[id(m)].zero_grad()

    step(model, 1)
    for name, value in get_model_state_dict(model).items():
        _on_the_cpu(f"state dict {name}", value, value)
    for name, value in model.state_dict().items():
        _on_the_cpu(f"state_dict() {name}", value, value)
    saved = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    moments = {name: optimizers[id(model)].state[p]["exp_avg"].full_tensor().clone()
               for name, p in model.named_parameters()}
    checkpoint.save(model, f"{path}/offloaded", optimizer=optimizers[id(model)])
    step(model, 2)  # moves on: the load must bring the saved values back
    for m in (model, plain):
        checkpoint.load(m, f"{path}/offloaded", optimizer=optimizers[id(m)])
        for name, p in m.named_parameters():
            torch.testing.assert_close(p.full_tensor(), saved[name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(optimizers[id(m)].state[p]["exp_avg"].full_tensor(), moments[name],
                                       rtol=0, atol=0, msg=name)
    for name, p in model.named_parameters():
        _on_the_cpu(f"loaded {name}", p, p)
        _on_the_cpu(f"loaded {name}'s exp_avg", optimizers[id(model)].state[p]["exp_avg"], p)
    for m in (model, plain):
        step(m, 3)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **TOL64, msg=name)
    return True


def test_checkpoint_round_trip_of_offloaded_parameters(tmp_path, seed):
    assert run_on_ranks(_checkpoint_round_trip, 4, args=(seed, str(tmp_path))) == [True] * 4


def _meta_device_flow(rank, world, s):
    """torchtitan's flow with CPU offload: built and sharded on the meta device (dp = 4), then
    ``to_empty(device="cpu")`` and values loaded; a forward before that is refused clearly."""
    mesh = DeviceMesh("cpu", (4,), ("dp",))
    cfg = tiny()
    torch.manual_seed(s)
    ref = Llama(cfg).double()
    with torch.device("meta"):
        model = Llama(cfg).double()
    _shard(model, cfg, mesh)
    assert all(p.to_local().is_meta for p in model.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(s))
    mine = tokens[2 * rank:2 * rank + 2]
    try:
        model(mine[:, :-1])
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    model.reset_iter_state()
    model.to_empty(device="cpu")
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        for b, b_ref in zip(model.buffers(), ref.buffers()):  # the rope tables: not in the state dict
            b.copy_(b_ref)
    for name, p in model.named_parameters():
        _on_the_cpu(name, p, p)
    loss = next_token_loss(model(mine[:, :-1]), mine[:, 1:])
    loss.backward()
    value = loss.detach().clone()
    dist.all_reduce(value)
    loss_ref = next_token_loss(ref(tokens[:, :-1]), tokens[:, 1:])
    loss_ref.backward()
    torch.testing.assert_close(value / 4, loss_ref.detach(), **TOL64)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        _on_the_cpu(f"grad of {name}", p.grad, p)
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL64, msg=name)
    return refused


def test_meta_device_flow_to_empty_on_the_cpu(seed):
    for refused in run_on_ranks(_meta_device_flow, 4, args=(seed,)):
        assert "not on the CPU" in refused and 'to_empty(device="cpu")' in refused, refused


def _bad_input(rank, world):
    mesh = DeviceMesh("cpu", (2,), ("dp",))
    torch.manual_seed(0)  # every rank's Linear alike

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    out = {
        "string": error(lambda: fully_shard(torch.nn.Linear(4, 4), mesh, offload_policy="cpu")),
        "bool": error(lambda: fully_shard(torch.nn.Linear(4, 4), mesh, offload_policy=True)),
        "traced": error(lambda: fully_shard(torch.nn.Linear(4, 4), mesh, offload_policy=CPUOffloadPolicy(),
                                            traced=True)),
    }
    plain = fully_shard(torch.nn.Linear(4, 4), mesh, offload_policy=OffloadPolicy())
    out["default"] = repr(fsdp_units(plain)[0])
    offloaded = fully_shard(torch.nn.Linear(4, 4), mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    out["offloaded"] = repr(fsdp_units(offloaded)[0])
    return out


def test_bad_offload_input_and_torch_default():
    for out in run_on_ranks(_bad_input, 2):
        assert out["string"].startswith("TypeError") and "CPUOffloadPolicy" in out["string"], out
        assert out["bool"].startswith("TypeError"), out
        assert out["traced"].startswith("NotImplementedError") and "traced" in out["traced"], out
        assert "shards on the CPU" not in out["default"], out  # OffloadPolicy(): torch's no-offload default
        assert "shards on the CPU" in out["offloaded"] and "pinned" not in out["offloaded"], out
