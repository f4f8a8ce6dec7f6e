"""Collectives with backend selection: what layout inference's plans execute.

    >>> from axedist.collectives import reduce_scatter
    >>> y = reduce_scatter(x, group)                 # backend="auto": the measured table (backend.py)
    >>> y = reduce_scatter(x, group, backend="torch")

Each runs directly (``run_*``) or, while torch.compile traces or autograd records the call,
as its custom op ``torch.ops.axedist.<name>`` (``library.py``: fake shapes and gradients).
"""
from __future__ import annotations

import torch

from . import fallback
from .backend import as_custom_op, group_name, select_backend


def reduce_scatter(x: torch.Tensor, group=None, backend: str = "auto",
                   out: torch.Tensor | None = None, timeout_s: float | None = None):
    return _routed("reduce_scatter", run_reduce_scatter, x, group, backend, out, timeout_s)


def all_gather(x: torch.Tensor, group=None, backend: str = "auto",
               out: torch.Tensor | None = None, timeout_s: float | None = None):
    return _routed("all_gather", run_all_gather, x, group, backend, out, timeout_s)


def all_reduce(x: torch.Tensor, group=None, backend: str = "auto",
               out: torch.Tensor | None = None, timeout_s: float | None = None):
    return _routed("all_reduce", run_all_reduce, x, group, backend, out, timeout_s)


def _routed(op: str, run, x, group, backend, out, timeout_s):
    """The custom op ``torch.ops.axedist.<op>`` while compiling or recording autograd (a call
    without ``out`` and ``timeout_s``), else ``run`` now."""
    if out is None and timeout_s is None and as_custom_op(x):
        return getattr(torch.ops.axedist, op)(x, group_name(group), backend)
    return run(x, group, backend, out, timeout_s)


def run_reduce_scatter(x: torch.Tensor, group=None, backend: str = "auto",
                       out: torch.Tensor | None = None, timeout_s: float | None = None):
    """``reduce_scatter`` run now on these tensors (the custom op's implementation)."""
    chosen = select_backend("reduce_scatter", x, group, backend)
    if chosen == "torch":
        return fallback.reduce_scatter(x, group, out)
    from . import p2p
    return p2p.reduce_scatter(x, group, out, multimem=chosen == "multimem", timeout_s=timeout_s)


def run_all_gather(x: torch.Tensor, group=None, backend: str = "auto",
                   out: torch.Tensor | None = None, timeout_s: float | None = None):
    """``all_gather`` run now on these tensors (the custom op's implementation)."""
    chosen = select_backend("all_gather", x, group, backend)
    if chosen == "torch":
        return fallback.all_gather(x, group, out)
    from . import p2p
    return p2p.all_gather(x, group, out, timeout_s=timeout_s)  # a gather has nothing to reduce


def run_all_reduce(x: torch.Tensor, group=None, backend: str = "auto",
                   out: torch.Tensor | None = None, timeout_s: float | None = None):
    """``all_reduce`` run now on these tensors (the custom op's implementation)."""
    chosen = select_backend("all_reduce", x, group, backend)
    if chosen == "torch":
        return fallback.all_reduce(x, group, out)
    from . import p2p
    return p2p.all_reduce(x, group, out, multimem=chosen == "multimem", timeout_s=timeout_s)
