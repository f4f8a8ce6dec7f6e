"""Deferred GEMMs: an mm/addmm whose output is a pending sum, kept unrun until its data is used.

Redistributing that pending sum to rows sharded on the summed mesh axis can then run the fused
GEMM + reduce-scatter kernel on the operands instead of the GEMM followed by a reduce-scatter.
Two ranks, ``x [8, 6] (Shard(1),) @ w [6, 4] (Shard(0),)``: the dispatcher defers each rank's
``[8, 3] @ [3, 4]`` product (:func:`defer`); ``.redistribute([Shard(0)])`` asks
:func:`fused_reduce_scatter`, which on CUDA bf16 gives each rank its ``[4, 4]`` rows from one
kernel; any other use of the data runs :meth:`DeferredGemm.wait` (the GEMM, once).

Nothing here builds a DTensor: callers wrap what these functions return.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..layout import LayoutError
from ..planning.fused import FusedStep, row_scatter_axis
from ..spec import DTensorSpec

__all__ = ["DeferredGemm", "OUTSTANDING", "defer", "placeholder", "flush", "fused_gemm_stats", "fused_choice",
           "fused_reduce_scatter"]

# Products deferred, fused (gemm_reduce_scatter ran), reduce-scatters of a deferred product that
# ran unfused (GEMM, then the planned collective), products computed on first use of their data;
# "reason": why the last row reduce-scatter was not fused.
_STATS = {"deferred": 0, "fused": 0, "unfused": 0, "materialized": 0, "reason": ""}
# Deferred products nobody has consumed yet (weak): every op dispatch computes them first
# (:func:`flush`), so an in-place op on an operand can never reach a product still waiting for it.
OUTSTANDING: list = []
_FLUSH_AT = 64  # outstanding products kept at most; beyond, they are computed


def fused_gemm_stats() -> dict:
    """How deferred products ran in this process: ``{"deferred", "fused", "unfused",
    "materialized", "reason"}`` (reason: why the last row reduce-scatter was not fused)."""
    return dict(_STATS)


class DeferredGemm:
    """The local product ``alpha * (a @ b) + beta * bias`` of an mm/addmm, not yet run.

    ``compute()`` runs it as the op would have (with the leading summand dim); ``wait()`` does
    so once and checks that no operand changed in place since the product was deferred.
    """

    __slots__ = ("compute", "a", "b", "bias", "alpha", "beta", "shape", "versions", "value", "__weakref__")

    def __init__(self, compute, a, b, bias, alpha, beta, shape):
        self.compute, self.a, self.b, self.bias = compute, a, b, bias
        self.alpha, self.beta, self.shape, self.value = alpha, beta, tuple(shape), None
        self.versions = self.current_versions()

    def current_versions(self) -> tuple:
        # inference tensors (made under torch.inference_mode) keep no version counter: an
        # in-place change of such an operand before the product is used cannot be detected
        return tuple(-1 if t.is_inference() else t._version
                     for t in (self.a, self.b, self.bias) if t is not None)

    def wait(self) -> torch.Tensor:
        if self.value is None:
            if self.current_versions() != self.versions:
                raise LayoutError("a deferred matrix product's operand was changed in place (outside axedist ops, "
                                  "e.g. through to_local()) before the product was used; use the product first, "
                                  "or clone the operand's local tensor before changing it")
            value = self.compute()
            if tuple(value.shape) != self.shape:
                raise LayoutError(f"deferred product: local result {tuple(value.shape)}, expected {self.shape}")
            self.value = value
            self.compute = self.a = self.b = self.bias = None
            _STATS["materialized"] += 1
        return self.value


def defer(compute, a, b, bias, alpha, beta, local_shape) -> DeferredGemm:
    """A product kept unrun (counted as outstanding until used); the caller wraps it."""
    pending = DeferredGemm(compute, a, b, bias, alpha, beta, local_shape)
    _STATS["deferred"] += 1
    if len(OUTSTANDING) > _FLUSH_AT:
        flush()
    OUTSTANDING.append(weakref.ref(pending))
    return pending


_PLACEHOLDERS: dict = {}


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty stand-in for a deferred product's local tensor (never written): one per dtype and device."""
    key = (dtype, device)
    found = _PLACEHOLDERS.get(key)
    if found is None:
        found = _PLACEHOLDERS[key] = torch.empty(0, dtype=dtype, device=device)
    return found


def flush() -> None:
    """Compute every outstanding deferred product (before an op that might change an operand)."""
    refs = list(OUTSTANDING)
    OUTSTANDING.clear()
    for ref in refs:
        pending = ref()
        if pending is not None and pending.value is None and pending.compute is not None:
            pending.wait()


def _consumed(pending: DeferredGemm) -> None:
    """A fused reduce-scatter used the product: no eager flush for it any more (later uses of
    the pending sum itself still compute it, checking its operands did not change)."""
    for i, ref in enumerate(OUTSTANDING):
        if ref() is pending:
            del OUTSTANDING[i]
            return


def fused_choice(spec: DTensorSpec, pending: DeferredGemm, dst: DTensorSpec) -> FusedStep | None:
    """None when ``spec -> dst`` is not a row reduce-scatter (or the product already ran);
    otherwise whether the fused kernel runs, and why not when it does not."""
    axis = row_scatter_axis(spec, dst)
    if axis is None or pending.a is None:
        return None
    a, b = pending.a, pending.b
    if not a.is_cuda:
        return FusedStep(axis, False, f"operands on {a.device.type} (the fused kernel is CUDA-only)")
    if a.dtype not in (torch.bfloat16, torch.float16):
        return FusedStep(axis, False, f"dtype {a.dtype} (the fused kernel takes bf16/fp16)")
    mesh = spec.mesh
    group = mesh.group(axis)
    if dist.get_rank(group) != mesh.coordinates()[axis]:
        return FusedStep(axis, False, f"process-group order differs from mesh axis {axis}'s order")
    from ..collectives import plan_gemm_reduce_scatter

    try:
        gemm = plan_gemm_reduce_scatter(a, b, group)
    except ValueError as e:
        return FusedStep(axis, False, str(e))
    return FusedStep(axis, gemm.backend != "torch", gemm.reason, gemm)


def fused_reduce_scatter(spec: DTensorSpec, pending: DeferredGemm, dst: DTensorSpec) -> torch.Tensor | None:
    """This rank's local tensor of ``spec -> dst`` by ``gemm_reduce_scatter``, or None (then
    the caller takes the unfused path: the GEMM, then the planned collective)."""
    choice = fused_choice(spec, pending, dst)
    if choice is None:
        return None
    if not choice.fused:
        _STATS["unfused"] += 1
        _STATS["reason"] = choice.reason
        return None
    from ..collectives import gemm_reduce_scatter

    if pending.current_versions() != pending.versions:
        pending.wait()  # raises the clear error
    mesh = spec.mesh
    out = gemm_reduce_scatter(pending.a, pending.b, mesh.group(choice.axis))
    if pending.alpha != 1:
        out.mul_(pending.alpha)
    bias = pending.bias
    if bias is not None and pending.beta != 0:
        if bias.dim() == 2 and bias.shape[0] != 1:  # a whole [M, n] bias: this rank's rows
            rows = out.shape[0]
            bias = bias.narrow(0, mesh.coordinates()[choice.axis] * rows, rows)
        out.add_(bias, alpha=pending.beta)
    _STATS["fused"] += 1
    _STATS["reason"] = ""
    _consumed(pending)
    return out
