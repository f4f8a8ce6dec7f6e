"""axedist: distributed tensors for tensor-parallel PyTorch, described by Axe layouts.

    import axedist as ax
    L = ax.Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")   # Shard(0) of an (8,6) tensor on 4 GPUs
    L.apply((5, 3), shape=(8, 6))                     # -> [{'gpuid': 2, 'm': 9}]

The layout algebra and the plan records are pure Python and load with the package;
the names that need torch (planning, mesh, DTensor, collectives, kernels) load on
first use, so ``import axedist`` stays fast and never imports torch or Triton.
"""

import warnings
from importlib import import_module

from .caches import reset
from .env import EnvironmentVariableError, check_environment
from .layout import Iter, Layout, LayoutError, direct_sum, tile, tile_quotient

check_environment()  # a bad AXEDIST_* value fails here, naming the variable and what it accepts

# The top level a user learns in one sitting: torch.distributed.tensor's names, the layout
# algebra, plan, the fused ops, the errors. name -> module that defines it, imported on first use.
_LAZY = {
    "DeviceMesh": "mesh",
    "init_mesh": "mesh",
    "MeshError": "mesh",
    "TopologyWarning": "mesh",
    "Link": "topology",
    "PeerError": "peers",
    "RankDisagreementError": "peers",
    "DTensor": "dtensor",
    "distribute_tensor": "dtensor",
    "distribute_module": "nn",
    "from_torch": "dtensor",
    "local_map": "dtensor",
    "zeros": "dtensor",
    "ones": "dtensor",
    "empty": "dtensor",
    "full": "dtensor",
    "rand": "dtensor",
    "randn": "dtensor",
    "Shard": "placements",
    "Replicate": "placements",
    "Partial": "placements",
    "Placement": "placements",
    "layout_from_placements": "spec",
    "placements_from_layout": "spec",
    "plan": "dtensor",
    "visualize": "visualize",
    "gemm_reduce_scatter": "collectives",
    "all_gather_gemm": "collectives",
    "gemm_all_reduce": "collectives",
    "CollectiveError": "collectives",
    "CollectiveTimeoutError": "collectives",
    "SymmetricMemoryUnavailable": "collectives",
}

# Names that moved to their subpackage: still found here, with a DeprecationWarning naming the home.
_MOVED = {
    "distribute": "dtensor",                  # torch's spelling at the top: distribute_tensor
    "parallelize": "nn",                      # torch's spelling: axedist.nn.parallelize_module
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
    "plan_layouts": "layout_inference",
    "plan_alternatives": "layout_inference",
    "simulate": "layout_inference",
    "plan_redistribute": "layout_inference",
    "Redistribution": "layout_inference",
    "Plan": "layout_inference",
    "Step": "layout_inference",
    "Transfer": "layout_inference",
    "DTensorSpec": "spec",
    "fused_gemm_stats": "dtensor",
    "plan_gemm_reduce_scatter": "collectives",
    "GemmReduceScatterPlan": "collectives",
    "plan_all_gather_gemm": "collectives",
    "plan_gemm_all_reduce": "collectives",
    "run_on_ranks": "testing",
    "count_collectives": "runtime",
}

__all__ = ["Iter", "Layout", "LayoutError", "direct_sum", "tile", "tile_quotient", "EnvironmentVariableError",
           "reset", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        module = _MOVED.get(name)
        if module is None:
            raise AttributeError(f"module 'axedist' has no attribute {name!r}")
        warnings.warn(f"axedist.{name} moved to axedist.{module}.{name} (the top level keeps torch's names, the "
                      f"layout algebra, plan, the fused ops and the errors)", DeprecationWarning, stacklevel=2)
        return getattr(import_module(f".{module}", __name__), name)
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
