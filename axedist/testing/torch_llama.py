"""The Llama of ``axedist.nn.llama`` under torch's own tensor parallelism, for comparisons.

torch's styles for the same layouts as ``llama_tp_plan`` (as in torch's Llama recipe, q/k/v come
out as local tensors and attention runs on local heads: torch DTensor has no sharding rule for
CPU attention; everything else flows as torch DTensors), and the vocab-parallel loss::

    >>> torch_parallelize_llama(model, torch_mesh["tp"], sequence_parallel=True)
    >>> loss = torch_llama_loss(model(inputs), targets, torch_mesh["tp"])   # its backward ran too
    >>> torch_fully_shard_llama(model, torch_mesh)     # FSDP2 + TP on a (dp, tp) torch mesh
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import parallel as tp

__all__ = ["torch_llama_plan", "torch_parallelize_llama", "torch_fully_shard_llama", "torch_llama_loss"]


def torch_llama_plan(sequence_parallel: bool) -> dict:
    """torch's ``parallelize_module`` plan with the layouts of ``llama_tp_plan``."""
    residual = Shard(0) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                             use_local_output=False),
        "layers.*.attention": tp.PrepareModuleInput(input_layouts=(residual, None, None),
                                                    desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wq": tp.ColwiseParallel(),
        "layers.*.attention.wk": tp.ColwiseParallel(),
        "layers.*.attention.wv": tp.ColwiseParallel(),
        "layers.*.attention.wo": tp.RowwiseParallel(output_layouts=residual, use_local_output=False),
        "layers.*.feed_forward": tp.PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": tp.ColwiseParallel(use_local_output=False),
        "layers.*.feed_forward.w3": tp.ColwiseParallel(use_local_output=False),
        "layers.*.feed_forward.w2": tp.RowwiseParallel(output_layouts=residual, use_local_output=False),
        "output": tp.ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        for name in ("layers.*.attention_norm", "layers.*.ffn_norm", "norm"):
            plan[name] = tp.SequenceParallel(sequence_dim=0)
    return plan


def torch_parallelize_llama(model, tp_mesh, sequence_parallel: bool):
    """``model`` (an ``axedist.nn.llama.Llama``) under torch's ``parallelize_module`` on the 1-D
    torch mesh ``tp_mesh``, in place: attention on local heads, the other parameters (norms
    without sequence parallelism) replicated torch DTensors. Returns ``model``."""
    from ..nn.llama import Attention

    tp.parallelize_module(model, tp_mesh, torch_llama_plan(sequence_parallel))
    for sub in model.modules():
        if isinstance(sub, Attention):  # local heads
            sub.n_heads //= tp_mesh.size()
            sub.kv_heads //= tp_mesh.size()
        for name, param in list(sub.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                sub.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.data, tp_mesh, [Replicate()]),
                                                                requires_grad=param.requires_grad))
    return model


def torch_fully_shard_llama(model, torch_mesh, mp_policy=None):
    """``model`` under torch's ``parallelize_module`` on ``torch_mesh["tp"]`` (sequence parallel), then
    torch's ``fully_shard`` of every block and the root over ``torch_mesh["dp"]``, in place (FSDP2 + TP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy or MixedPrecisionPolicy()
    torch_parallelize_llama(model, torch_mesh["tp"], sequence_parallel=True)
    for layer in model.layers:
        fully_shard(layer, mesh=torch_mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=torch_mesh["dp"], mp_policy=policy)
    return model


def torch_llama_loss(logits, targets: torch.Tensor, tp_mesh, backward: bool = True):
    """``next_token_loss`` of vocab-sharded torch DTensor logits (``loss_parallel``: its backward
    must run inside too, so ``backward=True`` runs it here). ``targets`` are this rank's, the
    same on the ``tp_mesh`` ranks (made a replicated DTensor without communication)."""
    from ..nn.llama import next_token_loss

    with tp.loss_parallel():
        loss = next_token_loss(logits, DTensor.from_local(targets.to(logits.device), tp_mesh, [Replicate()],
                                                          run_check=False))
        if backward:
            loss.backward()
    return loss
