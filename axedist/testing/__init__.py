"""Helpers for tests and benchmarks: real multi-rank process groups without torchrun
(``run_on_ranks``), torchrun launches (``run_torchrun``), W ranks of the GPU kernels in one
process on one GPU (``VirtualRanks``), CUDA-graph capture as torch's recipe does it
(``capture``), torch DTensor's bytes (``torch_comm_bytes``, loaded on first use: torch's
CommDebugMode imports Triton), and the Llama under torch's own tensor parallelism
(``torch_parallelize_llama``, ``torch_llama_loss``) for comparisons.

    run_on_ranks(body, 4, args=(3,))   # body(rank, world_size, 3) on 4 gloo ranks
    VirtualRanks(4).reduce_scatter(xs) # 4 virtual ranks' reduce-scatter on this GPU
"""

from .graphs import capture
from .ranks import RankError, run_on_ranks, run_torchrun, shutdown_pools
from .virtual_ranks import VirtualRanks

__all__ = ["RankError", "VirtualRanks", "capture", "run_on_ranks", "run_torchrun", "shutdown_pools", "torch_comm_bytes",
           "torch_llama_plan", "torch_parallelize_llama", "torch_fully_shard_llama", "torch_llama_loss"]

# name -> module, imported on first use (torch's CommDebugMode and TP styles are slow to import)
_LAZY = {"torch_comm_bytes": "comm_bytes", "torch_llama_plan": "torch_llama", "torch_parallelize_llama": "torch_llama",
         "torch_llama_loss": "torch_llama", "torch_fully_shard_llama": "torch_llama"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'axedist.testing' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_LAZY[name]}", __name__), name)
