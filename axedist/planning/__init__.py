"""Planning: how a tensor moves between layouts, as data (no communication).

``plan_layouts(src, dst, mesh, shape)`` derives a ``Plan`` (``Step`` s of ``Transfer`` boxes)
that prints and costs itself; ``simulate`` runs it on Python lists; ``plan_redistribute(src_spec,
dst_spec)`` is the whole route of a DTensor move, uneven shapes included, that
``axedist.runtime`` executes. The records load without torch; the rest on first use.
"""

from importlib import import_module

from .plans import Plan, buffer_size
from .steps import Step, Transfer

# name -> module that defines it, imported on first access (they import torch through axedist.spec)
_LAZY = {
    "plan_layouts": "derive",
    "plan_alternatives": "alternatives",
    "plan_direct": "direct",
    "simulate": "simulation",
    "local_buffers": "simulation",
    "global_values": "simulation",
    "plan_redistribute": "redistribution",
    "Redistribution": "redistribution",
    "Repad": "redistribution",
    "clear_plan_cache": "redistribution",
    "Side": "repad",
    "FusedStep": "fused",
    "row_scatter_axis": "fused",
    "all_reduce_axis": "fused",
    "row_gather_axis": "fused",
}

__all__ = ["Plan", "Step", "Transfer", "buffer_size", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'axedist.planning' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
