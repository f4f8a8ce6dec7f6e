"""Decode tails: the all-reduce ending a row-parallel layer, deferred so that the residual add
and the RMSNorm after it run with it as one kernel (``collectives.all_reduce_rms_norm``).

At decode each half of a TP transformer block ends ``h = x + all_reduce(partial)``, then the
next half starts ``rms_norm(h)``. Under ``torch.inference_mode`` with :func:`defer_tails` on, the
redistribute of the row-parallel output (Partial -> Replicate) returns a :class:`DeferredTail`
instead of running the all-reduce; ops/fusion.py's handlers keep it pending through the output's
view and the residual add, and run the three as one call at the RMSNorm. Any other use runs the
all-reduce and the add as planned. The process's :data:`deferred.PENDING` tracks tails like the
other deferred work (a write to what a tail reads runs it first).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..layout import LayoutError
from ..planning.fused import all_reduce_axis
from ..spec import DTensorSpec
from ..tracing import may_defer
from .deferred import PENDING, DeferredView, reads_any, version_of

__all__ = ["DeferredTail", "defer_tails", "tail_axis", "defer_tail", "pending_tail", "with_residual", "fused_tail_norm"]


def _link(pending):
    """The tail a pending value is, seen through a view (``DeferredView``) of it."""
    return pending.root if type(pending) is DeferredView else pending


def pending_tail(pending) -> "DeferredTail | DeferredView | None":
    """The unrun decode tail (an all-reduce, it plus a residual, or a view of either) a DTensor's
    pending value is, else None."""
    return pending if type(_link(pending)) is DeferredTail and pending.value is None else None


# the decode sizes a deferred tail is for: rows of the [rows, hidden] matrix, and the fused kernel's widest row
_TAIL_MAX_ROWS = 64
_TAIL_MAX_HIDDEN = 16384


class DeferredTail:
    """The all-reduce that ends a row-parallel layer at decode, not yet run (``kind``):

    * ``"reduce"``: ``value = all_reduce(local)`` (``local``: this rank's partial sum with its
      summand dim, as the redistribute ``src -> dst`` would move it, over mesh axis ``axis``);
    * ``"residual"``: ``value = residual + base.value``, ``base`` the ``"reduce"`` tail or a view
      of it (the row-parallel linear's ``[S * B, H]`` output seen as ``[S, B, H]``: a
      ``DeferredView``, as for the other deferred work).

    An RMSNorm of a ``"residual"`` tail runs the whole chain in one kernel
    (``collectives.all_reduce_rms_norm``, ops/fusion.py), which fills its ``value`` (the residual
    stream's next value); any other use runs the chain as planned (the all-reduce, the view, the
    add). ``shape``: the value's local shape."""

    __slots__ = ("kind", "local", "src", "dst", "axis", "residual", "base", "shape", "versions", "value",
                 "traced", "__weakref__")

    def __init__(self, kind: str, shape: tuple, local: torch.Tensor | None = None, src: DTensorSpec | None = None,
                 dst: DTensorSpec | None = None, axis: str | None = None, residual: torch.Tensor | None = None,
                 base=None):
        self.kind, self.shape, self.local, self.src, self.dst, self.axis = kind, tuple(shape), local, src, dst, axis
        self.residual, self.base, self.value, self.traced = residual, base, None, False
        self.versions = self._versions()

    def _versions(self) -> tuple:
        return tuple(-1 if t is None else version_of(t) for t in (self.local, self.residual))

    def changed(self) -> bool:
        return self._versions() != self.versions or (self.base is not None and self.root().changed())

    def root(self) -> "DeferredTail":
        """The ``"reduce"`` tail under this one."""
        return self if self.base is None else _link(self.base)

    def view(self, shape: tuple) -> DeferredView:
        return DeferredView(self, tuple(shape))

    def wait(self) -> torch.Tensor:
        if self.value is None:
            if self.changed():
                raise LayoutError("a deferred all-reduce's partial sum or residual was changed in place (outside "
                                  "axedist ops) before the reduced tensor was used; use it first, or clone it")
            if self.kind == "residual":
                self.value = _reduced_and_added(self)
            else:
                from .executor import redistribute_local
                self.value = redistribute_local(self.local, self.src, self.dst)
                PENDING.counts["tails_materialized"] += 1
            self.local = self.residual = None
        return self.value

    def reads(self, storages: set) -> bool:
        root = self.root()
        return reads_any(tuple(t for t in (self.local, self.residual) if t is not None), storages) or (
            root is not self and root.value is None and root.reads(storages))

    def __repr__(self) -> str:
        state = "computed" if self.value is not None else "unrun"
        if self.kind == "reduce":
            return f"DeferredTail(all-reduce {self.src} -> {self.dst} over {self.axis}: {state})"
        return f"DeferredTail(residual + {self.base!r}: {state})"


def _reduced_and_added(tail: DeferredTail) -> torch.Tensor:
    """``residual + all_reduce`` of a ``"residual"`` tail that no RMSNorm takes (a model's last): one
    call (the tail kernel without its norm on CUDA, the unfused pair elsewhere) while the all-reduce
    under it is unrun, else the add of its value."""
    if tail.root().value is not None:
        return torch.add(tail.residual, tail.base.wait())
    h, _ = _run_chain(tail, None, 0.0)
    PENDING.counts["tails_materialized"] += 1
    return h


def _run_chain(tail: DeferredTail, weight: torch.Tensor | None, eps: float) -> tuple:
    """``(h, y)`` of a ``"residual"`` tail whose all-reduce is unrun, as one call
    (``collectives.all_reduce_rms_norm``; weight None: no norm, y None), in the tail's shape; the
    all-reduce alone is then no longer wanted (only a use of it runs it)."""
    from ..collectives import all_reduce_rms_norm

    root, shape, hidden = tail.root(), tail.shape, tail.shape[-1]
    h, y = all_reduce_rms_norm(root.local[0].reshape(-1, hidden), tail.residual.reshape(-1, hidden), weight, eps,
                               root.src.mesh.group(root.axis))
    PENDING.consumed(root)
    return h.view(shape), None if y is None else y.view(shape)


def with_residual(pending, residual: torch.Tensor) -> DeferredTail | None:
    """``residual + pending`` still unrun (the add of a block's residual stream), where ``pending``
    is a ``"reduce"`` tail or a view of one; None for anything else (a residual already added)."""
    if _link(pending).kind != "reduce":
        return None
    tail = DeferredTail("residual", pending.shape, residual=residual, base=pending)
    PENDING.track(tail)
    return tail


def defer_tails(policy: str | None = None) -> str:
    """When the all-reduce ending a row-parallel layer is deferred (so that the residual add and
    RMSNorm after it run fused with it): ``"auto"`` (the default) at decode sizes where the fused
    kernel runs (CUDA, bf16/fp16, under ``torch.inference_mode``, at most 64 rows of at most
    16384), ``"always"`` (tests on CPU: still under inference mode only), ``"never"``. A
    row-parallel GEMM whose output a tail defers runs on its own (cuBLAS), not as the fused GEMM +
    all-reduce. Returns the policy in force."""
    return PENDING.policy("tail_policy", policy, "defer_tails")


def tail_axis(src: DTensorSpec, dst: DTensorSpec, local_shape: tuple, dtype: torch.dtype,
              device: torch.device) -> str | None:
    """The mesh axis of the all-reduce ``src -> dst`` when it is one to defer as a decode tail (a
    pending sum over one mesh axis made replicated, at decode sizes, in inference mode, under the
    policy in force; ``local_shape``: this rank's local shape with its summand dim first), else
    None (the caller moves the data now). Decided from shapes alone: nothing runs."""
    policy = PENDING.tail_policy
    if policy == "never" or not may_defer() or not torch.is_inference_mode_enabled():
        return None
    if policy == "auto" and (device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16)):
        return None
    shape = tuple(local_shape[1:])
    if len(shape) < 2 or shape[-1] > _TAIL_MAX_HIDDEN or math.prod(shape[:-1]) > _TAIL_MAX_ROWS:
        return None
    axis = all_reduce_axis(src, dst)
    if axis is None or dist.get_rank(src.mesh.group(axis)) != src.mesh.coordinates()[axis]:
        return None
    return axis


def defer_tail(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, axis: str) -> DeferredTail:
    """The all-reduce of ``local`` (``src -> dst`` over ``axis``, as :func:`tail_axis` found it),
    deferred."""
    tail = DeferredTail("reduce", tuple(local.shape[1:]), local, src, dst, axis)
    PENDING.counts["tails_deferred"] += 1
    PENDING.track(tail)
    return tail


def fused_tail_norm(tail: DeferredTail, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(tail's value) * weight`` by one all-reduce + residual add + RMSNorm (the p2p
    kernel on CUDA, the unfused sequence elsewhere), filling the tail's value with the residual
    stream's new value; returns the normalized local tensor."""
    if tail.changed():
        tail.wait()  # raises the clear error
    tail.value, y = _run_chain(tail, weight, eps)
    tail.residual = None
    PENDING.counts["tails_fused"] += 1
    PENDING.consumed(tail)
    tail.base = None
    return y
