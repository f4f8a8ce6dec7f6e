"""axedist: distributed tensors for tensor-parallel PyTorch, described by Axe layouts.

    import axedist as ax
    L = ax.Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")   # Shard(0) of an (8,6) tensor on 4 GPUs
    L.apply((5, 3), shape=(8, 6))                     # -> [{'gpuid': 2, 'm': 9}]

The layout algebra (``axedist.layout``) is pure Python; the distributed parts
(mesh, DTensor, plans, kernels) import torch when used.
"""

from .layout import Iter, Layout, LayoutError, direct_sum, tile, tile_quotient

__all__ = ["Iter", "Layout", "LayoutError", "direct_sum", "tile", "tile_quotient"]
__version__ = "0.1.0"
