"""Tensor-parallel layers on axedist DTensors (``parallel``), fully sharded data parallel on the
same mesh (``fsdp``: every name of torch's ``torch.distributed.fsdp`` FSDP2 API), a small Llama
(``llama``), DCP checkpoints of parallelized models (``checkpoint``), context parallelism (``attention``), and torch's
``torch.distributed.checkpoint.state_dict`` functions for them (``state_dict``)."""

from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from ..ops.variants import implicit_replication, loss_parallel
from .attention import SequenceShards, context_parallel
from .checkpoint import load, save, torch_state_dict
from .fsdp import (DataParallelMeshDims, FSDPModule, FSDPUnit, MixedPrecisionPolicy, UnshardHandle, fsdp_units,
                   fully_shard, register_fsdp_forward_method, share_comm_ctx)
from .parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                       PrepareModuleOutput, RowwiseParallel, SequenceParallel, VocabParallelEmbedding, as_mesh,
                       describe, distribute_module, from_torch_style, parallelize, parallelize_module, replicate,
                       to_inference, vocab_parallel_cross_entropy)

__all__ = [
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "VocabParallelEmbedding",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize", "parallelize_module",
    "as_mesh", "describe", "replicate", "from_torch_style", "vocab_parallel_cross_entropy", "to_inference", "save",
    "load", "torch_state_dict", "implicit_replication", "loss_parallel", "fully_shard", "fsdp_units", "FSDPUnit",
    "MixedPrecisionPolicy", "FSDPModule", "distribute_module", "DataParallelMeshDims", "OffloadPolicy",
    "CPUOffloadPolicy", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx", "context_parallel",
    "SequenceShards",
]
