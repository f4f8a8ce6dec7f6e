"""Helpers for tests and benchmarks: real multi-rank process groups without torchrun
(``run_on_ranks``), torchrun launches (``run_torchrun``), W ranks of the GPU kernels in one
process on one GPU (``VirtualRanks``).

    run_on_ranks(body, 4, args=(3,))   # body(rank, world_size, 3) on 4 gloo ranks
    VirtualRanks(4).reduce_scatter(xs) # 4 virtual ranks' reduce-scatter on this GPU
"""

from .ranks import RankError, run_on_ranks, run_torchrun, shutdown_pools
from .virtual_ranks import VirtualRanks

__all__ = ["RankError", "VirtualRanks", "run_on_ranks", "run_torchrun", "shutdown_pools"]
