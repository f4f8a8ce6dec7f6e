"""GPU communication layer: symmetric workspaces, p2p/multimem collectives, fused GEMM + RS.

Nothing here imports Triton at import time. Public entry points:

    reduce_scatter(x, group, backend="auto") / all_gather / all_reduce   (api.py)
    gemm_reduce_scatter(a, b, group, scatter_dim=0, backend="auto")      (fused.py)
    plan_gemm_reduce_scatter(...)  -> GemmReduceScatterPlan (what runs and why)
    check(group)                   -> raise a pending kernel timeout (CollectiveTimeoutError)
"""
from .api import all_gather, all_reduce, reduce_scatter
from .errors import CollectiveError, CollectiveTimeoutError, SymmetricMemoryUnavailable
from .fused import GemmReduceScatterPlan, gemm_reduce_scatter, plan_gemm_reduce_scatter
from .symmetric import check, reset

__all__ = [
    "CollectiveError", "CollectiveTimeoutError", "GemmReduceScatterPlan",
    "SymmetricMemoryUnavailable", "all_gather", "all_reduce", "check", "gemm_reduce_scatter",
    "plan_gemm_reduce_scatter", "reduce_scatter", "reset",
]
