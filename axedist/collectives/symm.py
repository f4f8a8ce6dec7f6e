"""torch's symmetric-memory fused ops as the ``"symm"`` backend of the fused GEMM + collectives.

``torch.ops.symm_mem.fused_matmul_reduce_scatter`` and ``fused_all_gather_matmul`` (the
kernels of torch's async-TP: the matmul cut into chunks whose copies overlap through
symmetric memory) measured faster than axedist's fused kernels at some shapes
(``benchmarks/results/ag_gemm_w4_llama8b.md``: all three all-gather + GEMM calls of the
Llama-3-8B step at W=4, 1.29-1.39x; ``gemm_rs_w4_llama8b.md``: three of five GEMM +
reduce-scatter calls, 1.04-1.06x). ``backend="auto"`` runs them where the shipped tables name
the shape (``kernels/gemm_rs_auto.json``, ``kernels/ag_gemm_auto.json``: ``"symm_wins"``,
written by the benchmarks' ``--tables-from``), so every rank makes the same choice from the
same file; ``backend="symm"`` asks for them. NVLink multicast stays off
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``): the benchmarks measured these ops that way.
"""

from __future__ import annotations

import torch

from ..caches import cached, memo
from .backend import group_name

__all__ = ["symm_ops_available", "matmul_reduce_scatter", "all_gather_matmul"]

_ENABLED: dict = memo("collectives.symm enabled groups")  # group name -> True once torch was told


@cached(maxsize=1)
def symm_ops_available() -> tuple[bool, str]:
    """Whether this torch has the two fused symmetric-memory ops (asked once)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError as error:
        return False, f"torch.distributed._symmetric_memory is missing ({error})"
    ops = getattr(torch.ops, "symm_mem", None)
    for name in ("fused_matmul_reduce_scatter", "fused_all_gather_matmul"):
        if ops is None or not hasattr(ops, name):
            return False, f"torch {torch.__version__} has no torch.ops.symm_mem.{name}"
    return True, "ok"


def _enabled(group) -> str:
    """The group's name, symmetric memory enabled for it first (torch versions that need it);
    every rank reaches this at the same call, the choice of the backend coming from the shipped
    tables."""
    name = group_name(group)
    if name not in _ENABLED:
        from torch.distributed import _symmetric_memory

        if hasattr(_symmetric_memory, "enable_symm_mem_for_group"):
            _symmetric_memory.enable_symm_mem_for_group(name)
        _ENABLED[name] = True
    return name


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group, scatter_dim: int) -> torch.Tensor:
    """This rank's slice (along ``scatter_dim``) of the sum over ``group`` of ``a @ b``."""
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim, _enabled(group))


def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, group, gather_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_gather(a, gather_dim) @ b, all_gather(a, gather_dim))`` over ``group``."""
    gathered, (product,) = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim, _enabled(group))
    return product, gathered
