"""axedist: distributed tensors for tensor-parallel PyTorch, described by Axe layouts.

    import axedist as ax
    L = ax.Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")   # Shard(0) of an (8,6) tensor on 4 GPUs
    L.apply((5, 3), shape=(8, 6))                     # -> [{'gpuid': 2, 'm': 9}]

The layout algebra and the plan records are pure Python and load with the package;
the names that need torch (planning, mesh, DTensor, collectives, kernels) load on
first use, so ``import axedist`` stays fast and never imports torch or Triton.
"""

from importlib import import_module

from .caches import reset
from .env import EnvironmentVariableError, check_environment
from .layout import Iter, Layout, LayoutError, direct_sum, tile, tile_quotient
from .planning import Plan, Step, Transfer

check_environment()  # a bad AXEDIST_* value fails here, naming the variable and what it accepts

# name -> module that defines it, imported on first access
_LAZY = {
    "plan_layouts": "planning",
    "plan_alternatives": "planning",
    "simulate": "planning",
    "plan_redistribute": "planning",
    "Redistribution": "planning",
    "DeviceMesh": "mesh",
    "MeshError": "mesh",
    "PeerError": "peers",
    "RankDisagreementError": "peers",
    "init_mesh": "mesh",
    "TopologyWarning": "mesh",
    "Link": "topology",
    "DTensor": "dtensor",
    "distribute": "dtensor",
    "distribute_tensor": "dtensor",
    "zeros": "dtensor",
    "ones": "dtensor",
    "empty": "dtensor",
    "full": "dtensor",
    "rand": "dtensor",
    "randn": "dtensor",
    "distribute_module": "nn",
    "Shard": "placements",
    "Replicate": "placements",
    "Partial": "placements",
    "Placement": "placements",
    "from_torch": "dtensor",
    "layout_from_placements": "spec",
    "placements_from_layout": "spec",
    "DTensorSpec": "spec",
    "plan": "dtensor",
    "fused_gemm_stats": "dtensor",
    "visualize": "visualize",
    "gemm_reduce_scatter": "collectives",
    "plan_gemm_reduce_scatter": "collectives",
    "GemmReduceScatterPlan": "collectives",
    "all_gather_gemm": "collectives",
    "plan_all_gather_gemm": "collectives",
    "gemm_all_reduce": "collectives",
    "plan_gemm_all_reduce": "collectives",
    "CollectiveError": "collectives",
    "CollectiveTimeoutError": "collectives",
    "SymmetricMemoryUnavailable": "collectives",
    "run_on_ranks": "testing",
    "parallelize": "nn",
    "parallelize_module": "nn",
    "implicit_replication": "nn",
    "loss_parallel": "nn",
    "ColwiseParallel": "nn",
    "RowwiseParallel": "nn",
    "SequenceParallel": "nn",
    "VocabParallelEmbedding": "nn",
    "PrepareModuleInput": "nn",
    "PrepareModuleOutput": "nn",
    "vocab_parallel_cross_entropy": "nn",
    "fully_shard": "nn",
    "count_collectives": "runtime",
}

__all__ = [
    "Iter", "Layout", "LayoutError", "direct_sum", "tile", "tile_quotient", "EnvironmentVariableError", "reset",
    "Plan", "Step", "Transfer",
    *_LAZY,
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'axedist' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
