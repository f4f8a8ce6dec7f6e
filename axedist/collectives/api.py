"""Collectives with backend selection: what layout inference's plans execute.

    >>> from axedist.collectives import reduce_scatter
    >>> y = reduce_scatter(x, group)                 # backend="auto": the measured table (backend.py)
    >>> y = reduce_scatter(x, group, backend="torch")
"""
from __future__ import annotations

import torch

from . import fallback
from .backend import select_backend


def reduce_scatter(x: torch.Tensor, group=None, backend: str = "auto",
                   out: torch.Tensor | None = None, timeout_s: float | None = None):
    chosen = select_backend("reduce_scatter", x, group, backend)
    if chosen == "torch":
        return fallback.reduce_scatter(x, group, out)
    from . import p2p
    return p2p.reduce_scatter(x, group, out, multimem=chosen == "multimem", timeout_s=timeout_s)


def all_gather(x: torch.Tensor, group=None, backend: str = "auto",
               out: torch.Tensor | None = None, timeout_s: float | None = None):
    chosen = select_backend("all_gather", x, group, backend)
    if chosen == "torch":
        return fallback.all_gather(x, group, out)
    from . import p2p
    return p2p.all_gather(x, group, out, timeout_s=timeout_s)  # a gather has nothing to reduce


def all_reduce(x: torch.Tensor, group=None, backend: str = "auto",
               out: torch.Tensor | None = None, timeout_s: float | None = None):
    chosen = select_backend("all_reduce", x, group, backend)
    if chosen == "torch":
        return fallback.all_reduce(x, group, out)
    from . import p2p
    return p2p.all_reduce(x, group, out, multimem=chosen == "multimem", timeout_s=timeout_s)
