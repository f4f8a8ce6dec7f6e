"""Distributed tensors described by Axe layouts over a DeviceMesh.

A DTensor's layout maps each element of its global tensor to mesh coordinates
(which devices hold it: the layout's non-``m`` axes are the mesh's axis names) and
to ``m``, its row-major position in that device's local tensor (DESIGN §2)::

    >>> mesh = DeviceMesh("cpu", (4,))                        # axis 'gpuid'
    >>> x = distribute(torch.arange(48.).reshape(8, 6), mesh, Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"))
    >>> x.to_local()                                          # rank 1: rows 2..3, shape (2, 6)
    >>> x.redistribute([Replicate()]).to_local()              # every rank: the (8, 6) tensor

Local shape (for any layout, placements included): group the layout by the global
shape (``layout.blocks``); dim ``d`` of the local tensor has the product of the
extents of the ``m`` iters in block ``d``, and ``m`` must be row-major over that
shape (strides are checked). A device the layout does not reach holds an empty
tensor of shape ``(0,)*ndim``.

Uneven shapes: the layout admits a *padded* shape (``torch.chunk``'s split rounds
each sharded dim up); the local tensor is the box of real (unpadded) elements,
which must be a leading box of the padded local tensor (it is for ``torch.chunk``).
Padding sits at the end of each dim, except where torch chunks a dim again inside
each chunk (two ``Shard`` of one dim): there every chunk is padded to the largest and
the spec records the true row of each padded row.

Partial values (the paper's Fig. 8): a pending reduction is a leading *summand*
dim of the layout, sharded over the mesh axes that hold partials, plus a reduce op
(``sum``, ``avg``, ``max``, ``min``). ``dt.shape`` excludes the summand dim; the local
tensor keeps it (extent 1 for torch's ``Partial``).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .layout import Layout, LayoutError
from .spec import (DTensorSpec, contiguous_strides, element_table, even_shape_from_local, is_placements,
                   layout_from_placements, make_spec, placements_from_layout, placements_of, replicated_layout,
                   row_major_iters, spec_for_layout, spec_from_placements, target_spec)
from .planning import plan_layouts, plan_redistribute
from .runtime import redistribute_local
from .mesh import DeviceMesh, MeshError

__all__ = [
    "DTensor",
    "plan",
    "distribute",
    "from_torch",
    "layout_from_placements",
    "placements_from_layout",
]

_dispatch = None  # axedist.ops.dispatch.dispatch, bound on the first op
_RECORDING: list = []  # ops/fastpath.py's recorders of the torch call now running (innermost last)


class _Ready(threading.local):
    """ops/fastpath.py's output computed ahead for a grad-mode call, per thread: ``value`` is
    (aten op, positions of its DTensor arguments, the torch-level arguments, output); see
    ``DTensor.__torch_dispatch__``, which sets it to None once served, False once dropped."""

    value = None


_READY = _Ready()


# ---------------------------------------------------------------------------
# Agreement across ranks (so a mistake on one rank is an error on all)
# ---------------------------------------------------------------------------

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_MAX_DIMS = 8


def _describe(t: torch.Tensor, ok: bool = True) -> list[int]:
    if t.dim() > _MAX_DIMS:
        raise LayoutError(f"axedist DTensors have at most {_MAX_DIMS} dims, got {t.dim()}")
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    return [int(ok), code, t.dim(), *t.shape, *([0] * (_MAX_DIMS - t.dim()))]


def _gather_descriptions(mesh: DeviceMesh, row: list[int]) -> dict[int, list[int]]:
    """``{global rank: row}`` for every rank of the mesh (one small all_gather)."""
    mine = torch.tensor(row, dtype=torch.int64, device=mesh.device)
    rows = [torch.empty_like(mine) for _ in range(mesh.size)]
    dist.all_gather(rows, mine, group=mesh.group())
    return {rank: r.tolist() for rank, r in zip(sorted(mesh.ranks), rows)}


def _shape_text(row) -> str:
    dtype = _DTYPES[row[1]] if row[1] >= 0 else "an unsupported dtype"
    return f"{tuple(row[3:3 + row[2]])} {dtype}"


# ---------------------------------------------------------------------------
# The tensor
# ---------------------------------------------------------------------------


class DTensor(torch.Tensor):
    """A global tensor whose elements sit on a mesh as an Axe layout says.

    A wrapper subclass (like torch's DTensor): ``shape``/``dtype``/``device``/``requires_grad``
    describe the global tensor; the data is ``to_local()`` on each rank. Torch ops run on it
    through ``axedist.ops`` (sharding rules per op family; ops without one gather, with a
    one-time warning): ``(x + y).sum()`` works on DTensors as on tensors, autograd included.
    """

    _spec: DTensorSpec
    _pending = None   # an async redistribute or a deferred GEMM: waited for on first use of the data

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False, *, stride=None, pending=None):
        if WRAPPER_POSITIONAL:  # (size, strides, storage_offset, memory_format, dtype, layout, device, pin, grad)
            self = _make_wrapper(cls, spec.shape, stride, None, None, local.dtype, torch.strided, local.device,
                                 False, requires_grad)
        else:
            kwargs = {} if stride is None else {"strides": stride}
            self = _make_wrapper(cls, spec.shape, dtype=local.dtype, device=local.device, requires_grad=requires_grad,
                                 **kwargs)
        self._value = local
        self._spec = spec
        if pending is not None:
            self._pending = pending
        return self

    @classmethod
    def _wrap(cls, local: torch.Tensor, spec: DTensorSpec, stride) -> "DTensor":
        """``DTensor(local, spec, stride=stride)`` without the keyword handling (the dispatcher's
        hot path; ``stride`` None means contiguous)."""
        if WRAPPER_POSITIONAL:
            self = _make_wrapper(cls, spec.shape, stride, None, None, local.dtype, torch.strided, local.device)
        elif stride is None:
            self = _make_wrapper(cls, spec.shape, dtype=local.dtype, device=local.device)
        else:
            self = _make_wrapper(cls, spec.shape, dtype=local.dtype, device=local.device, strides=stride)
        self._value = local
        self._spec = spec
        return self

    @property
    def _local(self) -> torch.Tensor:
        if self._pending is not None:
            self._value = self._pending.wait()
            self._pending = None
        return self._value

    _tag = None       # (spec, ops/fastpath.py's int for (spec, dtype, stride)), set on first use

    if os.environ.get("AXEDIST_FASTPATH", "1") == "0":
        __torch_function__ = torch._C._disabled_torch_function_impl
    else:
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            # The first torch call on a DTensor installs ops/fastpath.py's handler in place of
            # this one (ops sit above dtensor, so it is imported on first use).
            from .ops import fastpath

            fastpath.enable(True)
            return DTensor.__torch_function__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        ready = _READY.value
        if ready:
            # A grad-mode fast-path hit: ops/fastpath.py ran the op on the local tensors and let
            # autograd record the call through torch's dispatcher, which brings it here. The
            # output is served only to the op it was computed for, on the same DTensor objects
            # (this thread's first aten op of the call); anything else drops it.
            op, positions, expected, out = ready
            if func is op:
                count = len(args)
                for i in positions:
                    if i >= count or args[i] is not expected[i]:
                        break
                else:
                    _READY.value = None
                    return out
            _READY.value = False
        global _dispatch
        if _dispatch is None:
            from .ops.dispatch import dispatch as _dispatch  # ops sit above dtensor: import on first use
        if _RECORDING:  # the fast path is recording what this torch call dispatches
            return _RECORDING[-1](func, args, kwargs)
        return _dispatch(func, args, kwargs)

    # -- construction ----------------------------------------------------------

    @staticmethod
    def from_local(local: torch.Tensor, mesh: DeviceMesh, layout_or_placements, shape: Sequence[int] | None = None, *,
                   padded_shape: Sequence[int] | None = None, reduce_op: str | None = None,
                   run_check: bool = False) -> "DTensor":
        """This rank's piece of a global tensor (no data moves).

        With placements, ``local`` follows torch's convention (``shape`` for uneven dims;
        default: every shard as large as this one). With a layout, ``shape`` is required
        (a layout alone does not say where dims begin), ``padded_shape`` is what it admits
        when that differs, and ``reduce_op`` marks its leading dim as pending summands.
        ``run_check=True`` compares every rank's local shape and dtype (one all_gather)
        and raises on every rank when any differs from the layout's.
        """
        mesh.position()
        failure = None
        try:
            if is_placements(layout_or_placements):
                if padded_shape is not None or reduce_op is not None:
                    raise LayoutError("padded_shape and reduce_op go with a layout; placements imply both")
                if shape is None:
                    shape = even_shape_from_local(local.shape, mesh, layout_or_placements)
                spec = spec_from_placements(shape, mesh, layout_or_placements)
            else:
                if shape is None:
                    raise LayoutError("from_local with a layout needs shape= (the global shape)")
                spec = spec_for_layout(mesh, layout_or_placements, shape, padded_shape, reduce_op,
                                        dims_include_summands=True)
            expected = element_table(spec).local_shapes[mesh.position()]
            if spec.reduce_op and is_placements(layout_or_placements):
                expected = expected[1:]  # the summand dim is added below
        except LayoutError as e:
            if not run_check:
                raise
            failure, spec, expected = e, None, None  # still join the check, so no peer waits forever
        ok = failure is None and tuple(local.shape) == expected
        if run_check:
            # each rank's local shape and dtype, and the global shape it inferred
            inferred = list(spec.shape) if spec else []
            rows = _gather_descriptions(mesh, _describe(local, ok) + inferred + [0] * (_MAX_DIMS - len(inferred)))
            first = rows[mesh.ranks[0]]
            bad = {r: row for r, row in rows.items()
                   if not row[0] or row[1] != first[1] or row[1] < 0 or row[-_MAX_DIMS:] != first[-_MAX_DIMS:]}
            if bad:
                lines = [f"rank {r}: local {_shape_text(row)} (global {tuple(v for v in row[-_MAX_DIMS:] if v)})"
                         + (f", the layout gives it {element_table(spec).local_shapes[mesh.position(r)]}" if spec else "")
                         for r, row in sorted(bad.items())]
                here = f" (here: {failure})" if failure else ""
                raise LayoutError(f"from_local({spec or layout_or_placements}): local tensors do not fit the layout"
                                  f"{here}:\n  " + "\n  ".join(lines))
        elif not ok:
            raise LayoutError(f"from_local({spec}): rank {dist.get_rank()}'s local tensor has shape {tuple(local.shape)}, "
                              f"the layout gives it {expected}")
        if local.device != mesh.device:
            raise LayoutError(f"local tensor is on {local.device}, the mesh's device here is {mesh.device}")
        unsqueeze = bool(spec.reduce_op) and is_placements(layout_or_placements)
        if local.requires_grad and torch.is_grad_enabled():
            return _FromLocal.apply(local, spec, unsqueeze)
        return DTensor(local.unsqueeze(0) if unsqueeze else local, spec)

    # -- reading -------------------------------------------------------------------

    def to_local(self) -> torch.Tensor:
        """This rank's piece (with the leading summand dim for a pending reduction).

        Differentiable: the gradient of the piece comes back as a DTensor in this layout.
        """
        if torch.is_grad_enabled() and _requires_grad(self):
            return _ToLocal.apply(self)
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank of the mesh (pending reductions applied)."""
        return self.redistribute(replicated_layout(self._spec.shape, self.mesh)).to_local()

    @property
    def layout(self) -> Layout:  # shadows torch.Tensor.layout (torch.strided): an Axe layout is the point here
        return self._spec.layout

    @property
    def mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return self._spec.padded

    @property
    def reduce_op(self) -> str | None:
        return self._spec.reduce_op

    @property
    def placements(self) -> tuple[Placement, ...]:
        return placements_of(self._spec)

    # -- moving --------------------------------------------------------------------

    def redistribute(self, layout_or_placements, *, padded_shape: Sequence[int] | None = None,
                     reduce_op: str | None = None, async_op: bool = False) -> "DTensor":
        """The same global tensor in another layout (or placements) on the same mesh.

        Differentiable: the gradient goes back to this tensor's layout (a pending reduction's
        gradient is replicated on its axes, as in torch). ``async_op=True`` starts the
        communication and returns at once; the result's data is waited for on its first use
        (any op, ``to_local``, ``full_tensor``), so independent work can overlap it.
        """
        dst = target_spec(self._spec, layout_or_placements, padded_shape, reduce_op)
        if dst == self._spec:
            return self
        if torch.is_grad_enabled() and _requires_grad(self):
            return _Redistribute.apply(self, dst, async_op)
        return _redistributed(self, dst, async_op)

    def to_partial(self, reduce_op: str = "sum") -> "DTensor":
        """Read the leading dim as pending summands (no data moves): shape ``(k, *s)`` -> ``s``.

        Fig. 8: ``x`` of shape (4,64,64) in ``S[(4,64,64):(1@gpuid,64,1)]``;
        ``x.to_partial().redistribute(S[(4,16,64):(1@gpuid,64,1)])`` is a reduce-scatter.
        """
        spec = self._spec
        if spec.reduce_op is not None:
            raise LayoutError(f"{spec} already has a pending {spec.reduce_op}")
        if len(spec.shape) < 1 or spec.padded[0] != spec.shape[0]:
            raise LayoutError(f"to_partial needs an unpadded leading dim, got {spec}")
        if spec.true_index and spec.true_index[0] is not None:
            raise LayoutError(f"to_partial needs an unpadded leading dim, got {spec}")
        new = make_spec(spec.mesh, spec.layout, spec.shape[1:], spec.padded[1:], reduce_op, spec.shape[0],
                         spec.true_index[1:] if spec.true_index else None)
        return DTensor(self._local, new, requires_grad=self.requires_grad)

    # -- interop -------------------------------------------------------------------

    def to_torch(self):
        """The equal ``torch.distributed.tensor.DTensor`` (same local tensors)."""
        from torch.distributed.tensor import DTensor as TorchDTensor

        placements = placements_of(self._spec)
        local = self._local[0] if self._spec.reduce_op else self._local
        return TorchDTensor.from_local(local, self.mesh.to_torch(), placements, run_check=False,
                                       shape=torch.Size(self.shape), stride=contiguous_strides(self.shape))

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"DTensor({dtype}{self._spec}, mesh={self.mesh})"


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _wrapper_takes_positions() -> bool:
    """Does ``_make_wrapper_subclass`` take (size, strides, storage_offset, memory_format, dtype,
    layout, device, pin_memory, requires_grad) by position? Its keywords cost ~1 us per call in torch's argument parser,
    a tenth of an op's whole overhead; positions are checked here once, keywords otherwise."""
    try:
        probe = _make_wrapper(DTensor, (2, 3), (1, 2), None, None, torch.float64, torch.strided, torch.device("meta"),
                              False, True)
        with torch._C.DisableTorchFunctionSubclass():
            return (probe.dtype, probe.device.type, probe.stride(), tuple(probe.shape), probe.requires_grad) == \
                (torch.float64, "meta", (1, 2), (2, 3), True)
    except (TypeError, RuntimeError):
        return False


WRAPPER_POSITIONAL = _wrapper_takes_positions()


def _requires_grad(dt: DTensor) -> bool:
    """``dt.requires_grad`` without a trip through ``__torch_function__`` (a getter costs ~2 us
    there; DTensor's own methods read it on every call)."""
    with torch._C.DisableTorchFunctionSubclass():
        return dt.requires_grad


# ---------------------------------------------------------------------------
# Autograd: the moves between local tensors and DTensors, and between layouts
# ---------------------------------------------------------------------------


def _redistributed(dt: DTensor, dst: DTensorSpec, async_op: bool = False) -> DTensor:
    pending = dt._pending
    if isinstance(pending, _DeferredGemm) and pending.value is None:
        fused = _fused_reduce_scatter(dt, pending, dst)
        if fused is not None:
            return DTensor(fused, dst)
    if async_op:
        pending = redistribute_local(dt._local, dt._spec, dst, async_op=True)
        probe = torch.empty(0, dtype=dt.dtype, device=dt.mesh.device)
        return DTensor(probe, dst, pending=pending)
    return DTensor(redistribute_local(dt._local, dt._spec, dst), dst)


# ---------------------------------------------------------------------------
# Deferred products: mm / addmm giving a pending sum, fused with a row reduce-scatter
# ---------------------------------------------------------------------------

# Counts for tests and plans: products deferred, fused (gemm_reduce_scatter ran), reduce-scatters
# of a deferred product that ran unfused (GEMM, then the planned collective), and products
# computed on first use of their data; "reason": why the last row reduce-scatter was not fused.
_GEMM_STATS = {"deferred": 0, "fused": 0, "unfused": 0, "materialized": 0, "reason": ""}
# Deferred products nobody has consumed yet (weak): every op dispatch computes them first, so an
# in-place op on an operand can never reach a product still waiting for it.
_OUTSTANDING: list = []


def fused_gemm_stats() -> dict:
    """How deferred products ran in this process: ``{"deferred", "fused", "unfused",
    "materialized", "reason"}`` (reason: why the last row reduce-scatter was not fused)."""
    return dict(_GEMM_STATS)


class _DeferredGemm:
    """The local product of an ``mm``/``addmm`` whose result is a pending sum, not yet run.

    ``redistribute`` of it to rows sharded on the summed mesh axis runs
    ``collectives.gemm_reduce_scatter`` on the operands instead (one fused kernel on CUDA);
    any other use of the data runs ``compute()`` once (the GEMM as the op would have). The
    product is ``alpha * (a @ b) + beta * bias`` with the bias counted once per pending sum.
    """

    __slots__ = ("compute", "a", "b", "bias", "alpha", "beta", "shape", "versions", "value", "__weakref__")

    def __init__(self, compute, a, b, bias, alpha, beta, shape):
        self.compute, self.a, self.b, self.bias = compute, a, b, bias
        self.alpha, self.beta, self.shape, self.value = alpha, beta, tuple(shape), None
        self.versions = self._versions()
        _GEMM_STATS["deferred"] += 1

    def _versions(self) -> tuple:
        # inference tensors (made under torch.inference_mode) keep no version counter: an
        # in-place change of such an operand before the product is used cannot be detected
        return tuple(-1 if t.is_inference() else t._version
                     for t in (self.a, self.b, self.bias) if t is not None)

    def wait(self) -> torch.Tensor:
        if self.value is None:
            if self._versions() != self.versions:
                raise LayoutError("a deferred matrix product's operand was changed in place (outside axedist ops, "
                                  "e.g. through to_local()) before the product was used; use the product first, "
                                  "or clone the operand's local tensor before changing it")
            value = self.compute()
            if tuple(value.shape) != self.shape:
                raise LayoutError(f"deferred product: local result {tuple(value.shape)}, expected {self.shape}")
            self.value = value
            self.compute = self.a = self.b = self.bias = None
            _GEMM_STATS["materialized"] += 1
        return self.value


def _defer_gemm(compute, a, b, bias, alpha, beta, spec: DTensorSpec, local_shape, stride) -> DTensor:
    """A DTensor in ``spec`` whose local tensor is the deferred product (ops/dispatch.py calls this)."""
    pending = _DeferredGemm(compute, a, b, bias, alpha, beta, local_shape)
    if len(_OUTSTANDING) > 64:
        _flush_deferred()
    _OUTSTANDING.append(weakref.ref(pending))
    key = (a.dtype, a.device)
    probe = _PROBES.get(key)
    if probe is None:  # an empty stand-in for the data (never written): one per dtype and device
        probe = _PROBES[key] = torch.empty(0, dtype=a.dtype, device=a.device)
    return DTensor(probe, spec, stride=stride, pending=pending)


_PROBES: dict = {}


def _flush_deferred() -> None:
    """Compute every outstanding deferred product (before an op that might change an operand)."""
    refs = list(_OUTSTANDING)
    _OUTSTANDING.clear()
    for ref in refs:
        pending = ref()
        if pending is not None and pending.value is None and pending.compute is not None:
            pending.wait()


def _consumed(pending: _DeferredGemm) -> None:
    """A fused reduce-scatter used the product: no eager flush for it any more (later uses of
    the pending sum itself still compute it, checking its operands did not change)."""
    for i, ref in enumerate(_OUTSTANDING):
        if ref() is pending:
            del _OUTSTANDING[i]
            return


@lru_cache(maxsize=1024)
def _row_scatter_axis(src: DTensorSpec, dst: DTensorSpec) -> str | None:
    """The mesh axis when ``src -> dst`` is a reduce-scatter of a 2-d pending sum's rows over
    one mesh axis (every other axis kept, rows even), the move a fused GEMM + RS can do."""
    if src.reduce_op != "sum" or len(src.shape) != 2 or dst.reduce_op is not None or dst.mesh != src.mesh:
        return None
    try:
        ps, pd = placements_of(src), placements_of(dst)
    except LayoutError:
        return None
    partial = [i for i, p in enumerate(ps) if isinstance(p, Partial)]
    if len(partial) != 1:
        return None
    (i,) = partial
    if not (type(pd[i]) is Shard and pd[i].dim % 2 == 0):
        return None
    for j, (p, q) in enumerate(zip(ps, pd)):
        if j != i and (p != q or isinstance(p, (Shard, _StridedShard)) and p.dim % 2 == 0):
            return None  # another axis changes, or also splits the rows (then the row blocks differ)
    if src.shape[0] % src.mesh.shape[i]:
        return None      # uneven rows: torch.chunk pieces, not the equal row blocks of the kernel
    return src.mesh.axis_names[i]


@dataclass(frozen=True)
class _FusedChoice:
    axis: str
    gemm: object          # collectives.GemmReduceScatterPlan, or None
    fused: bool
    reason: str


def _fused_choice(spec: DTensorSpec, pending: _DeferredGemm, dst: DTensorSpec) -> _FusedChoice | None:
    """None when ``spec -> dst`` is not a row reduce-scatter (or the product already ran);
    otherwise whether the fused kernel runs, and why not when it does not."""
    axis = _row_scatter_axis(spec, dst)
    if axis is None or pending.a is None:
        return None
    a, b = pending.a, pending.b
    if not a.is_cuda:
        return _FusedChoice(axis, None, False, f"operands on {a.device.type} (the fused kernel is CUDA-only)")
    if a.dtype not in (torch.bfloat16, torch.float16):
        return _FusedChoice(axis, None, False, f"dtype {a.dtype} (the fused kernel takes bf16/fp16)")
    mesh = spec.mesh
    group = mesh.group(axis)
    if dist.get_rank(group) != mesh.coordinates()[axis]:
        return _FusedChoice(axis, None, False, f"process-group order differs from mesh axis {axis}'s order")
    from .collectives import plan_gemm_reduce_scatter

    try:
        gemm = plan_gemm_reduce_scatter(a, b, group)
    except ValueError as e:
        return _FusedChoice(axis, None, False, str(e))
    if gemm.backend == "torch":
        return _FusedChoice(axis, gemm, False, gemm.reason)
    return _FusedChoice(axis, gemm, True, gemm.reason)


def _fused_reduce_scatter(dt: DTensor, pending: _DeferredGemm, dst: DTensorSpec) -> torch.Tensor | None:
    """The local result of ``dt -> dst`` by ``gemm_reduce_scatter``, or None (unfused path)."""
    choice = _fused_choice(dt._spec, pending, dst)
    if choice is None:
        return None
    if not choice.fused:
        _GEMM_STATS["unfused"] += 1
        _GEMM_STATS["reason"] = choice.reason
        return None
    from .collectives import gemm_reduce_scatter

    if pending._versions() != pending.versions:
        pending.wait()  # raises the clear error
    mesh = dt.mesh
    out = gemm_reduce_scatter(pending.a, pending.b, mesh.group(choice.axis))
    if pending.alpha != 1:
        out.mul_(pending.alpha)
    bias = pending.bias
    if bias is not None and pending.beta != 0:
        if bias.dim() == 2 and bias.shape[0] != 1:  # a whole [M, n] bias: this rank's rows
            rows = out.shape[0]
            bias = bias.narrow(0, mesh.coordinates()[choice.axis] * rows, rows)
        out.add_(bias, alpha=pending.beta)
    _GEMM_STATS["fused"] += 1
    _GEMM_STATS["reason"] = ""
    _consumed(pending)
    return out


@dataclass(frozen=True)
class FusedGemmPlan:
    """What ``redistribute`` runs for a deferred product's pending sum going to row shards:
    the fused GEMM + reduce-scatter, or the GEMM then ``collective`` (and why)."""

    fused: bool
    gemm: object        # collectives.GemmReduceScatterPlan, or None (not asked: CPU, dtype, ...)
    reason: str
    collective: object  # the layout-inference Plan the unfused path runs

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.collective, name)  # steps, kinds, bytes_sent, ... of the collective

    def __str__(self) -> str:
        if self.fused:
            return f"fused GEMM + reduce-scatter: {self.gemm}"
        return (f"GEMM, then {self.collective}\n(fused GEMM + reduce-scatter not used: {self.reason})")


def _grad_spec(spec: DTensorSpec) -> DTensorSpec:
    """Where the gradient of a tensor in ``spec`` goes: the same layout, but a pending
    reduction's axes replicated (d sum / d summand = 1 for every summand), like torch."""
    if not spec.reduce_op:
        return spec
    try:
        placements = placements_of(spec)
    except LayoutError:
        return make_spec(spec.mesh, replicated_layout(spec.shape, spec.mesh), spec.shape)
    return spec_from_placements(spec.shape, spec.mesh,
                                 [Replicate() if isinstance(p, Partial) else p for p in placements])


def _grad_local(grad, spec: DTensorSpec, placements_partial: bool) -> torch.Tensor:
    """The gradient of a local tensor that was given in ``spec``, from a DTensor gradient."""
    if not isinstance(grad, DTensor):
        raise LayoutError(f"the gradient of a DTensor output must be a DTensor, got {type(grad).__name__}")
    if spec.reduce_op and not placements_partial:
        # a layout with summands held locally: every summand's gradient is the whole gradient
        full_spec = make_spec(spec.mesh, replicated_layout(spec.shape, spec.mesh), spec.shape)
        full = redistribute_local(grad._local, grad._spec, full_spec)
        lead = (spec.summands,)
        expanded = full.unsqueeze(0).expand(lead + tuple(spec.shape)).contiguous()
        src = make_spec(spec.mesh, replicated_layout(lead + spec.shape, spec.mesh), lead + spec.shape)
        dst = make_spec(spec.mesh, spec.layout, lead + spec.shape, lead + spec.padded,
                         true_index=((None,) + spec.true_index) if spec.true_index else None)
        return redistribute_local(expanded, src, dst)
    target = _grad_spec(spec)
    local = grad._local if grad._spec == target else redistribute_local(grad._local, grad._spec, target)
    return local[0] if target.reduce_op else local


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, spec, unsqueeze):
        ctx.spec, ctx.unsqueeze = spec, unsqueeze
        return DTensor(local.unsqueeze(0) if unsqueeze else local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad):
        return _grad_local(grad, ctx.spec, ctx.unsqueeze), None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt):
        ctx.spec = dt._spec
        return dt._local.view_as(dt._local)

    @staticmethod
    def backward(ctx, grad):
        return DTensor(grad.contiguous(), ctx.spec)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, dst, async_op):
        ctx.src = dt._spec
        return _redistributed(dt, dst, async_op)

    @staticmethod
    def backward(ctx, grad):
        target = _grad_spec(ctx.src)
        if grad._spec == target:
            return grad, None, None
        return DTensor(redistribute_local(grad._local, grad._spec, target), target), None, None


class _Distribute(torch.autograd.Function):
    """distribute of a tensor that requires grad: the tensor is read as the same global
    tensor on every rank, so each rank's gradient is the whole (replicated) gradient."""

    @staticmethod
    def forward(ctx, tensor, local, src, dst):
        ctx.shape, ctx.mesh = tuple(tensor.shape), dst.mesh
        return DTensor(redistribute_local(local.detach(), src, dst), dst)

    @staticmethod
    def backward(ctx, grad):
        full = make_spec(ctx.mesh, replicated_layout(ctx.shape, ctx.mesh), ctx.shape)
        return _grad_local(grad, full, False), None, None, None


def plan(src, dst, *, mesh: DeviceMesh | None = None, shape: Sequence[int] | None = None, itemsize: int | None = None):
    """The route (``axedist.Redistribution``) that moves ``src`` to ``dst``: every step it runs; nothing moves.

    ``src``: a DTensor, or a layout / placements with ``mesh=`` and ``shape=``; ``dst``: a
    layout or placements (or a DTensor, whose layout is the target). Example, 4 ranks::

        >>> print(ax.plan(x, [Replicate()]))        # x: (8, 6) in [Shard(0)]
        plan S[(4,2,6):(1@gpuid,6,1)] -> S[(8,6):(6,1)] + R[4:1@gpuid], ...
          1. all-gather over gpuid (1 group of 4): each member sends 144 B, receives 144 B

    ``src`` the pending sum of an ``mm``/``addmm`` (deferred, see ``_DeferredGemm``) and
    ``dst`` its rows sharded on the summed axis: a :class:`FusedGemmPlan`, whose text says
    ``fused GEMM + reduce-scatter: ...`` or the GEMM, the collective, and why not fused.
    """
    if isinstance(src, DTensor):
        src_spec, mesh, itemsize = src._spec, src.mesh, itemsize or src.element_size()
    else:
        if mesh is None or shape is None:
            raise LayoutError("plan(src, dst): give mesh= and shape= when src is a layout or placements")
        src_spec = (spec_from_placements(shape, mesh, src) if is_placements(src)
                    else spec_for_layout(mesh, src, shape, None, None, dims_include_summands=False))
    if isinstance(dst, DTensor):
        dst_spec = dst._spec
    else:
        dst_spec = target_spec(src_spec, dst, None, None)
    itemsize = itemsize or 4
    if isinstance(src, DTensor) and isinstance(src._pending, _DeferredGemm) and src._pending.value is None:
        choice = _fused_choice(src_spec, src._pending, dst_spec)
        if choice is not None:
            collective = plan_layouts(src_spec.layout, dst_spec.layout, src_spec.mesh, src_spec.padded, itemsize,
                                      src_spec.reduce_op)
            return FusedGemmPlan(choice.fused, choice.gemm, choice.reason, collective)
    return plan_redistribute(src_spec, dst_spec, itemsize)


# ---------------------------------------------------------------------------
# Public constructors
# ---------------------------------------------------------------------------


def distribute(tensor: torch.Tensor, mesh: DeviceMesh, layout_or_placements, src_rank: int | None = 0, *,
               padded_shape: Sequence[int] | None = None) -> DTensor:
    """Place a global tensor on the mesh; the data comes from ``src_rank`` only.

    Every rank of the mesh passes a tensor of the same shape and dtype (checked, one
    small all_gather); only ``src_rank``'s values are read. ``src_rank=None``: every rank
    already has the same values and keeps its own piece (no data moves).

        >>> distribute(torch.arange(8.), DeviceMesh("cpu", (4,)), [Shard(0)]).to_local()   # rank 3
        tensor([6., 7.])
    """
    mesh.position()
    rows = _gather_descriptions(mesh, _describe(tensor))
    first = rows[mesh.ranks[0]]
    differ = [r for r, row in rows.items() if row[1:] != first[1:]]
    if differ:
        listing = ", ".join(f"rank {r}: {_shape_text(row)}" for r, row in sorted(rows.items()))
        raise LayoutError(f"distribute needs the same shape and dtype on every rank of the mesh; got {listing}")
    if tensor.numel() == 0:
        raise LayoutError(f"distribute: shape {tuple(tensor.shape)} is empty")
    shape = tuple(tensor.shape)
    if is_placements(layout_or_placements):
        if padded_shape is not None:
            raise LayoutError("padded_shape goes with a layout; placements imply it")
        dst = spec_from_placements(shape, mesh, layout_or_placements)
        if dst.reduce_op:
            raise LayoutError("distribute to Partial placements has no single meaning; distribute, then to_partial()")
    else:
        dst = make_spec(mesh, layout_or_placements, shape, padded_shape)
    if src_rank is None:
        src = make_spec(mesh, replicated_layout(shape, mesh), shape)
    else:
        if not mesh.contains(src_rank):
            raise MeshError(f"distribute: src_rank {src_rank} is not in mesh {mesh}")
        src = make_spec(mesh, Layout(row_major_iters(shape), (), mesh.coordinates(src_rank)), shape)
    if src_rank is None or dist.get_rank() == src_rank:
        local = tensor.to(mesh.device)
    else:
        local = tensor.new_empty((0,) * len(shape), device=mesh.device)  # other ranks' data is never read
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Distribute.apply(tensor, local, src, dst)
    return DTensor(redistribute_local(local, src, dst), dst)


def from_torch(torch_dtensor) -> DTensor:
    """The axedist DTensor equal to a torch DTensor (same local tensors; mesh axes keep their names)."""
    mesh = _mesh_from_torch(torch_dtensor.device_mesh)
    spec = spec_from_placements(torch_dtensor.shape, mesh, torch_dtensor.placements)
    local = torch_dtensor.to_local()
    if spec.reduce_op:
        local = local.unsqueeze(0)
    expected = element_table(spec).local_shapes[mesh.position()]
    if tuple(local.shape) != expected:
        raise LayoutError(f"from_torch: torch's local shape {tuple(local.shape)} differs from the layout's {expected} "
                          f"for {spec}")
    return DTensor(local, spec, requires_grad=torch_dtensor.requires_grad)


_TORCH_MESHES: dict = {}


def _mesh_from_torch(torch_mesh) -> DeviceMesh:
    key = (torch_mesh.device_type, tuple(torch_mesh.mesh.flatten().tolist()), tuple(torch_mesh.mesh.shape),
           torch_mesh.mesh_dim_names)
    if key not in _TORCH_MESHES:
        _TORCH_MESHES[key] = DeviceMesh.from_torch(torch_mesh)
    return _TORCH_MESHES[key]
