"""GPU communication layer: symmetric workspaces, p2p/multimem collectives, fused GEMM + RS.

Nothing here imports Triton at import time. Public entry points:

    reduce_scatter(x, group, backend="auto") / all_gather / all_reduce   (api.py)
    gemm_reduce_scatter(a, b, group, scatter_dim=0, backend="auto")      (fused.py)
    plan_gemm_reduce_scatter(...)  -> GemmReduceScatterPlan (what runs and why)
    all_gather_gemm(a, b, group, gather_dim=0, backend="auto")           (fused_tp.py)
    gemm_all_reduce(a, b, group, backend="auto", algorithm="auto")       (fused_tp.py)
    plan_all_gather_gemm(...) / plan_gemm_all_reduce(...) -> FusedPlan
    all_reduce_rms_norm(x, residual, weight, eps, group)  -> (h, y): the decode layer tail,
                                   one kernel on CUDA (layer_tail.py)
    check(group)                   -> raise a pending kernel timeout (CollectiveTimeoutError)
    all_gather_into / reduce_scatter_into: torch.distributed's one-tensor collectives under the
    torch version's current name (all_gather_single on 2.13, all_gather_into_tensor before)

Each of the six collectives and fused ops is also a custom op, ``torch.ops.axedist.<name>``
(library.py, registered on import): what torch.compile traces into a graph.
"""
from .api import all_gather, all_reduce, reduce_scatter
from .fallback import all_gather_into, reduce_scatter_into
from .errors import CollectiveError, CollectiveTimeoutError, SymmetricMemoryUnavailable
from .fused import GemmReduceScatterPlan, gemm_reduce_scatter, plan_gemm_reduce_scatter
from .fused_tp import (FusedPlan, all_gather_gemm, gemm_all_reduce, plan_all_gather_gemm,
                       plan_gemm_all_reduce)
from .layer_tail import all_reduce_add, all_reduce_rms_norm
from .library import OPS
from .symmetric import check, reset

__all__ = [
    "CollectiveError", "CollectiveTimeoutError", "FusedPlan", "GemmReduceScatterPlan", "OPS", "all_gather_into",
    "reduce_scatter_into",
    "SymmetricMemoryUnavailable", "all_gather", "all_gather_gemm", "all_reduce", "all_reduce_add", "all_reduce_rms_norm", "check",
    "gemm_all_reduce", "gemm_reduce_scatter", "plan_all_gather_gemm", "plan_gemm_all_reduce",
    "plan_gemm_reduce_scatter", "reduce_scatter", "reset",
]
