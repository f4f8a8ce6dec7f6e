"""Helpers for tests and benchmarks: real multi-rank process groups without torchrun
(``run_on_ranks``), torchrun launches (``run_torchrun``).

    run_on_ranks(body, 4, args=(3,))   # body(rank, world_size, 3) on 4 gloo ranks
"""

from .ranks import RankError, run_on_ranks, run_torchrun, shutdown_pools

__all__ = ["RankError", "run_on_ranks", "run_torchrun", "shutdown_pools"]
