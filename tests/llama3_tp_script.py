"""A Llama-3 training script written for PyTorch's tensor-parallel API, as torchtitan writes it.

torchtitan's module names (``tok_embeddings``, ``layers.N.attention.wq/wk/wv/wo``,
``attention_norm``, ``feed_forward.w1/w2/w3``, ``ffn_norm``, ``norm``, ``output``), RoPE on
complex numbers (a ``freqs_cis`` buffer from ``torch.polar``, ``view_as_complex`` /
``view_as_real``), grouped-query attention, torchtitan's TP plan (sequence parallel norms,
``PrepareModuleInput``, column / row parallel linears with torch's ``use_local_output``), the
loss under ``loss_parallel()`` with plain integer labels, ``clip_grad_norm_`` over the
gradients and AdamW (``fused=True`` where this torch build has the fused kernel for the
device, else ``foreach=True``).

``apply_fsdp`` adds torchtitan's FSDP2 as its ``apply_fsdp`` writes it (``fully_shard(block,
mesh=world_mesh["dp"])``, ``fully_shard([model.norm, model.output])``, then the root, and
``set_gradient_divide_factor(1.0)`` with the loss scaled here) on a dp x tp mesh. Only the block between the two ``# -- TP imports`` lines differs between running on torch's
DTensor and on axedist: ``tests/test_dropin_llama3.py`` runs this file's text as it is and
with that block replaced (``AXEDIST_IMPORTS`` there), and once with no parallelism at all.
Standalone: ``torchrun --nproc-per-node 4 tests/llama3_tp_script.py``.
"""

import copy
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

# -- TP imports (begin)
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
# -- TP imports (end)


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 64
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 16


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64 [end, dim / 2]


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1: the number of heads this rank holds under tensor parallelism
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len,
                                                               args.rope_theta), persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = 0.02 if not name.endswith(("wo.weight", "w2.weight")) else 0.02 / math.sqrt(2 * self.args.n_layers)
                nn.init.trunc_normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # a pipeline stage's part lacks the modules other stages hold (``pipeline_part``)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def apply_tp(model: Transformer, tp_mesh, loss_parallel_on: bool = True) -> None:
    """torchtitan's tensor-parallel plan (sequence parallel, loss parallel)."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
                                  use_local_output=not loss_parallel_on),
    })
    for block in model.layers.values():
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            # torchtitan's plan names q / k norms its Llama-3 attention lacks: torch warns and goes on
            "attention.q_norm": SequenceParallel(use_local_output=True),
            "attention.k_norm": SequenceParallel(use_local_output=True),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(module=block, device_mesh=tp_mesh, parallelize_plan=layer_plan)


def apply_ac(model: Transformer) -> None:
    """torchtitan's full activation checkpointing: each block wrapped (before FSDP), its forward
    recomputed in backward."""
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_compile(model: Transformer, backend: str) -> None:
    """torchtitan's per-block compilation: each block replaced by ``torch.compile(block,
    fullgraph=True)`` (after tensor parallelism and activation checkpointing, before FSDP)."""
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, backend=backend, fullgraph=True))


def apply_fsdp(model: Transformer, dp_mesh) -> None:
    """torchtitan's FSDP2 (after tensor parallelism): the embedding and each block a unit, the
    final norm and the output projection one unit of two modules kept gathered after forward, then
    the root; FSDP's division of the gradients turned off (``train`` scales the loss itself)."""
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, reshard_after_forward=True)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    if model.norm is not None:
        fully_shard([model.norm, model.output], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)


def parallelize_llama(model: Transformer, tp_mesh, dp_mesh, ac: bool = False, compile_backend=None) -> None:
    """torchtitan's ``parallelize_llama`` order: tensor parallelism over ``tp_mesh``, activation
    checkpointing, each block compiled with ``compile_backend``, FSDP over ``dp_mesh`` (each step
    skipped where its argument is None / False)."""
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    if ac:
        apply_ac(model)
    if compile_backend is not None:
        apply_compile(model, compile_backend)
    if dp_mesh is not None:
        apply_fsdp(model, dp_mesh)


def full(t):
    """The whole tensor of a DTensor (torch's or axedist's), or ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fused_adamw_supported(device: str) -> bool:
    """Does this torch build have the fused AdamW kernel for ``device``?"""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    return device in _get_fused_kernels_supported_devices()


def adamw(parameters) -> torch.optim.AdamW:
    """The script's optimizer: AdamW, fused where this torch build has the kernel, else foreach."""
    fused = fused_adamw_supported("cpu")
    return torch.optim.AdamW(parameters, lr=1e-2, fused=True if fused else False, foreach=None if fused else True)


def next_batch(args: ModelArgs, data: torch.Generator, batch: int, dp_rank: int, dp_size: int):
    """One step's ``(inputs, labels)``: ``batch * dp_size`` sequences drawn from ``data``, this
    data-parallel rank's ``batch`` of them, labels the inputs shifted by one position."""
    tokens = torch.randint(0, args.vocab_size, (batch * dp_size, args.max_seq_len + 1), generator=data)
    tokens = tokens[dp_rank * batch:(dp_rank + 1) * batch]
    return tokens[:, :-1], tokens[:, 1:]


def build(args: ModelArgs, seed: int, dtype, device=None) -> Transformer:
    """The model with ``dtype`` parameters, its values ``init_weights`` drawn right after
    ``torch.manual_seed(seed)`` (on the meta device: no values)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else nullcontext():
            model = Transformer(args)
    finally:
        torch.set_default_dtype(default)
    if device != "meta":
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()
    return model


def train(tp_mesh, seed: int, steps: int = 5, batch: int = 2, max_norm: float = 0.5, dtype=torch.float32,
          dp_mesh=None, compile_backend=None, fullgraph=True, meta_init=False, ac=False, resume_at=None, cp_mesh=None,
          n_layers=2):
    """``steps`` training steps: the model, and per step the loss, the gradient norm and every
    gradient after clipping, as whole tensors. ``tp_mesh=None``: one process, no parallelism.
    ``dtype``: the parameters' (RoPE runs in fp32 and complex64 whatever it is, as torchtitan's).
    ``dp_mesh``: also fully sharded over it, each dp rank training on its ``batch`` rows of the
    ``batch * dp`` drawn per step (the loss recorded is their mean over dp). ``compile_backend``:
    the whole model compiled with it (``torch.compile(model, fullgraph=fullgraph)``). ``meta_init``:
    as torchtitan builds it, on the meta device, parallelized there, then ``to_empty`` and given its
    values: the ones ``seed`` draws on one process copied in as replicated tensors, or with
    ``meta_init="init_weights"`` as torchtitan does, ``init_weights()`` on the sharded parameters
    after ``torch.manual_seed(seed)`` (axedist draws each whole tensor and keeps its piece: the
    one-process values; torch's CPU DTensor draws each piece from the seed). ``ac``: each block under
    activation checkpointing (``apply_ac``). ``resume_at``: before that step, the model's and the
    optimizer's full state dicts taken (``resume``) and training goes on in a model built anew from
    another seed that loads them: the same numbers as without. ``cp_mesh`` (without ``dp_mesh``):
    context parallelism as torchtitan runs it, each step's forward and backward inside
    ``context_parallel`` with the inputs, the labels and the RoPE table cut along the sequence
    over ``cp_mesh``, and FSDP over ``cp_mesh`` (torchtitan's ``dp_shard_cp`` with ``dp_shard`` 1)
    summing the ranks' gradients. ``n_layers``: the model's blocks."""
    args = ModelArgs(n_layers=n_layers)
    assert cp_mesh is None or dp_mesh is None, "cp_mesh shards the parameters over the cp ranks itself"
    shard_mesh = dp_mesh if cp_mesh is None else cp_mesh
    model, optimizer, forward = setup(args, tp_mesh, seed, dtype, shard_mesh, compile_backend, fullgraph, meta_init, ac)
    dp_rank, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    cp_size = cp_mesh.size() if cp_mesh is not None else 1
    data = torch.Generator().manual_seed(seed + 1)
    record = []
    for step in range(steps):
        if step == resume_at:
            model, optimizer, forward = resume(model, optimizer, lambda: setup(
                args, tp_mesh, seed + 100, dtype, shard_mesh, compile_backend, fullgraph, meta_init, ac))
        inputs, labels = next_batch(args, data, batch, dp_rank, dp_size)
        sequence = nullcontext()
        if cp_mesh is not None:  # torchtitan's: this rank's positions of the batch, and their RoPE rows
            inputs, labels = inputs.clone(), labels.clone()
            sequence = context_parallel(cp_mesh, buffers=[inputs, labels, model.freqs_cis], buffer_seq_dims=[1, 1, 0],
                                        no_restore_buffers={inputs, labels})
        with sequence, loss_parallel() if tp_mesh is not None else nullcontext():
            pred = forward(inputs)
            loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
            # the gradients are summed over dp and cp (apply_fsdp): the mean over every rank's rows and positions
            (loss / (dp_size * cp_size)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        loss_value = full(loss).detach().clone()
        if shard_mesh is not None:
            torch.distributed.all_reduce(loss_value, group=shard_mesh.get_group())
            loss_value /= shard_mesh.size()
        record.append({"loss": loss_value, "norm": full(norm).detach().clone(),
                       "grads": {n.replace("._checkpoint_wrapped_module", ""): full(p.grad).detach().clone()
                                 for n, p in model.named_parameters()},
                       "fused": optimizer.defaults["fused"]})
        optimizer.step()
        optimizer.zero_grad()
    return model, record


def setup(args: ModelArgs, tp_mesh, seed: int, dtype, dp_mesh, compile_backend, fullgraph, meta_init, ac):
    """The model built from ``seed`` and parallelized as ``train`` says, its optimizer, and what
    runs its forward (the model, or the model compiled)."""
    model = build(args, seed, dtype, "meta" if meta_init else None)
    parallelize_llama(model, tp_mesh, dp_mesh, ac)
    if meta_init:
        model.to_empty(device="cpu")
        with torch.no_grad(), implicit_replication():
            if meta_init == "init_weights":  # torchtitan's: drawn on the sharded parameters
                torch.manual_seed(seed)
                model.init_weights()
            else:
                values = build(args, seed, dtype)
                for p, value in zip(model.parameters(), values.parameters()):
                    p.copy_(value)
            model.freqs_cis.copy_(precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len,
                                                       args.rope_theta))
    forward = model if compile_backend is None else torch.compile(model, backend=compile_backend,
                                                                      fullgraph=fullgraph)
    optimizer = adamw(model.parameters())
    return model, optimizer, forward


def resume(model, optimizer, make):
    """torchtitan's export and load of full state dicts: the model's and the optimizer's whole
    tensors on rank 0's CPU (the other ranks hold none), then a model from ``make()`` loading them
    with rank 0's values broadcast."""
    saving = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=saving)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=saving)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        assert model_state == {} and optimizer_state == {}
    else:
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in model_state.values())
    model, optimizer, forward = make()
    loading = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=loading)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=loading)
    return model, optimizer, forward


def pipeline_part(whole: Transformer, stage: int, stages: int) -> Transformer:
    """torchtitan's pipeline split: a copy of the model keeping the blocks of ``stage`` (an equal
    share, in order), the embedding on the first stage only, the final norm and output projection
    on the last only."""
    part = copy.deepcopy(whole)
    per_stage = whole.args.n_layers // stages
    assert per_stage * stages == whole.args.n_layers, "the blocks split evenly over the stages"
    for name in list(part.layers.keys()):
        if not stage * per_stage <= int(name) < (stage + 1) * per_stage:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != stages - 1:
        part.norm, part.output = None, None
    return part


def clip_grad_norm_pp(parameters, max_norm: float, pp_mesh):
    """torchtitan's gradient clipping under pipeline parallelism: each stage's gradients' norm
    (a DTensor's made whole), squared, summed over the pipeline ranks, then every gradient scaled."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = full(torch.nn.utils.get_total_norm(grads, 2.0, foreach=True))
    total = total ** 2
    torch.distributed.all_reduce(total, group=pp_mesh.get_group())
    total = total ** 0.5
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


def train_pipeline(tp_mesh, pp_mesh, seed: int, schedule: str = "1F1B", steps: int = 5, batch: int = 2,
                   microbatches: int = 2, max_norm: float = 0.5, dtype=torch.float32, dp_mesh=None, n_layers=2,
                   ac=False, compile_backend=None):
    """``train`` with pipeline parallelism as torchtitan runs it: the model built whole from
    ``seed``, this rank's stages cut out of it (``pipeline_part``; one stage per rank, or two with a
    schedule of several stages per rank: ``loop`` order, or ``v`` for ZBVZeroBubble / DualPipeV),
    each part tensor parallel over ``tp_mesh``, its blocks checkpointed (``ac``), compiled one by
    one (``compile_backend``: torchtitan's ``apply_compile``) and fully sharded over ``dp_mesh``, torch's ``PipelineStage`` per part and the schedule named ``schedule`` stepping
    ``microbatches`` of the ``batch`` rows under ``loss_parallel``. The record as ``train``'s: the
    loss of the last stage, the gradient norm over every stage (``clip_grad_norm_pp``), and every
    parameter's gradient, each stage's gathered over the pipeline ranks."""
    args = ModelArgs(n_layers=n_layers)
    whole = build(args, seed, dtype)
    schedule_class = get_schedule_class(schedule)
    per_rank = 2 if issubclass(schedule_class, PipelineScheduleMulti) else 1
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    stages = pp_size * per_rank
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        stage_ids = [pp_rank, stages - 1 - pp_rank]
    else:
        stage_ids = [pp_rank + i * pp_size for i in range(per_rank)]
    parts = [pipeline_part(whole, stage, stages) for stage in stage_ids]
    for part in parts:
        parallelize_llama(part, tp_mesh, dp_mesh, ac, compile_backend)
    dp_rank, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)

    def loss_fn(pred, labels):  # the gradients are summed over dp (apply_fsdp): the mean over every rank's rows
        return F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1)) / dp_size

    pipeline = [PipelineStage(part, stage, stages, torch.device("cpu"), group=pp_mesh.get_group())
                for part, stage in zip(parts, stage_ids)]
    runner = schedule_class(pipeline if per_rank > 1 else pipeline[0], n_microbatches=microbatches, loss_fn=loss_fn)
    first, last = 0 in stage_ids, stages - 1 in stage_ids
    parameters = [p for part in parts for p in part.parameters()]
    optimizer = adamw(parameters)
    data = torch.Generator().manual_seed(seed + 1)
    record = []
    for step in range(steps):
        inputs, labels = next_batch(args, data, batch, dp_rank, dp_size)
        losses = [] if last else None
        with loss_parallel() if tp_mesh is not None else nullcontext():
            runner.step(*([inputs] if first else []), target=labels if last else None, losses=losses)
        loss = (torch.stack([full(x).detach() for x in losses]).mean() * dp_size if last
                else torch.zeros((), dtype=dtype))
        torch.distributed.all_reduce(loss, group=pp_mesh.get_group())  # the last stage's
        if dp_mesh is not None:
            torch.distributed.all_reduce(loss, group=dp_mesh.get_group())
            loss /= dp_size
        norm = clip_grad_norm_pp(parameters, max_norm, pp_mesh)
        mine = {n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): full(p.grad).detach().clone()
                for part in parts for n, p in part.named_parameters()}
        every = [None] * pp_size
        torch.distributed.all_gather_object(every, mine, group=pp_mesh.get_group())
        record.append({"loss": loss, "norm": norm.detach().clone(),
                       "grads": {n: g for stage_grads in every for n, g in stage_grads.items()},
                       "fused": optimizer.defaults["fused"]})
        optimizer.step()
        optimizer.zero_grad()
    return parts, record


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    dp = 2 if world % 2 == 0 and world > 2 else 1
    world_mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    for step, r in enumerate(train(world_mesh["tp"], seed=0, dp_mesh=world_mesh["dp"] if dp > 1 else None)[1]):
        if torch.distributed.get_rank() == 0:
            print(f"step {step}: loss {r['loss'].item():.5f}, grad norm {r['norm'].item():.5f}")


if __name__ == "__main__":
    main()
