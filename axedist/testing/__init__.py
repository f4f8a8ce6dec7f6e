"""Helpers for tests and benchmarks: real multi-rank process groups without torchrun
(``run_on_ranks``), torchrun launches (``run_torchrun``), W ranks of the GPU kernels in one
process on one GPU (``VirtualRanks``), and torch DTensor's bytes (``torch_comm_bytes``, loaded
on first use: torch's CommDebugMode imports Triton).

    run_on_ranks(body, 4, args=(3,))   # body(rank, world_size, 3) on 4 gloo ranks
    VirtualRanks(4).reduce_scatter(xs) # 4 virtual ranks' reduce-scatter on this GPU
"""

from .ranks import RankError, run_on_ranks, run_torchrun, shutdown_pools
from .virtual_ranks import VirtualRanks

__all__ = ["RankError", "VirtualRanks", "run_on_ranks", "run_torchrun", "shutdown_pools", "torch_comm_bytes"]


def __getattr__(name: str):
    if name != "torch_comm_bytes":
        raise AttributeError(f"module 'axedist.testing' has no attribute {name!r}")
    from .comm_bytes import torch_comm_bytes

    return torch_comm_bytes
