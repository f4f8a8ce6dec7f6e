"""Distributed tensors described by Axe layouts over a DeviceMesh.

A DTensor's layout maps each element of its global tensor to mesh coordinates (which devices
hold it: the layout's non-``m`` axes are the mesh's axis names) and to ``m``, its row-major
position in that device's local tensor::

    >>> mesh = DeviceMesh("cpu", (4,))                        # axis 'gpuid'
    >>> x = distribute(torch.arange(48.).reshape(8, 6), mesh, Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"))
    >>> x.to_local()                                          # rank 1: rows 2..3, shape (2, 6)
    >>> x.redistribute([Replicate()]).to_local()              # every rank: the (8, 6) tensor

The spec (layout, shapes, padding of uneven dims, a pending reduction's summand dim) is
``axedist.spec.DTensorSpec``; torch ops run through the class's ``dispatcher``
(``axedist.ops``), and the differentiable moves are in ``axedist.autograd``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import autograd
from .caches import memo
from .env import read as read_environment
from .layout import Layout, LayoutError
from .mesh import DeviceMesh, MeshError, as_mesh
from .peers import (MAX_DIMS, RankDisagreementError, TensorReport, agree, announce_failure, compare_tensors,
                    gather_texts, rank_listing, tensor_report, together)
from .ops.dispatcher import OpDispatcher
from .ops.specs import placements_or_none
from .ops.state import wrap
from .planning import Redistribution, plan_redistribute
from .planning.boxes import global_box
from .runtime import checks, true_local_shape
from .runtime.deferred import fused_choice, fused_gemm_stats, pending_product
from .spec import (DTensorSpec, contiguous_strides, element_table, even_shape_from_local, is_placements,
                   layout_from_placements, make_spec, placements_from_layout, placements_of, replicated_layout,
                   row_major_iters, spec_for_layout, spec_from_placements, target_spec, without_summands)
from .tracing import ALL_DIMS, compiling, outside_tracing, static_sizes, unusable_here

__all__ = [
    "DTensor",
    "plan",
    "distribute",
    "distribute_tensor",
    "zeros", "ones", "empty", "full", "rand", "randn",
    "from_torch",
    "local_map",
    "fused_gemm_stats",
    "layout_from_placements",
    "placements_from_layout",
]


# ---------------------------------------------------------------------------
# Agreement across ranks (so a mistake on one rank is an error on all)
# ---------------------------------------------------------------------------


def _check_dims(t: torch.Tensor) -> None:
    if t.dim() > MAX_DIMS:
        raise LayoutError(f"axedist DTensors have at most {MAX_DIMS} dims, got {t.dim()}")


def _compare_on_mesh(mesh: DeviceMesh, report: TensorReport, what: str) -> dict[int, TensorReport]:
    """Every rank's report of its tensor (``peers.compare_tensors`` over the whole mesh)."""
    return compare_tensors(report, group=mesh.group(), ranks=mesh.ranks, device=mesh.device,
                           what=f"{what}'s check of every rank's tensor (all_gather over {mesh.axis_names})")


# (id(mesh), placements, local shape, dtype) every rank of the mesh agreed on -> the mesh (kept
# alive, so its id stays its own; hashing a mesh costs microseconds)
_AGREED_LOCALS: dict = memo("dtensor agreed local shapes")


def _agree_on_inferred(mesh: DeviceMesh, placements, local: torch.Tensor, spec, failure) -> None:
    """``from_local`` without ``run_check`` whose global shape each rank inferred from its own
    local shape: the first time this rank sees these placements, local shape and dtype, every
    rank compares what it inferred (``peers.agree``), before any collective can meet tensors
    of mismatched sizes. Raises on every rank when they differ (or when ``failure`` happened here)."""
    key = (id(mesh), tuple(placements), tuple(local.shape), local.dtype)
    if failure is None and key in _AGREED_LOCALS:
        return
    text = "" if failure is not None else f"local {tuple(local.shape)} {local.dtype} -> {spec.canonical_text()}"
    agree(mesh.ranks, "from_local", text, failed=failure)
    if failure is not None:
        raise failure
    _AGREED_LOCALS[key] = mesh


def _check_every_local(mesh: DeviceMesh, local: torch.Tensor, target, spec, ok: bool, failure) -> None:
    """``from_local(run_check=True)``: every rank's local shape fits ``spec`` and every rank has
    the same dtype and global shape, else ``RankDisagreementError`` on every rank. In eager one
    small all_gather of each rank's description; while torch.compile traces, the same question
    once at trace time through the job's store (``peers.agree``), outside the graph: a compiled
    graph then holds no check, as torch's DTensor traces none for shapes that agree."""
    if compiling():
        fits = "" if ok else f": local {tuple(local.shape)} does not fit" + (
            f" (the layout gives it {element_table(spec).local_shapes[mesh.position()]})" if spec else "")
        text = f"{local.dtype} {spec.canonical_text()}{fits}" if spec else ""
        agree(mesh.ranks, f"from_local({spec or target}, run_check=True)", text, failed=failure)
        return
    # each rank's local shape and dtype, and the global shape it inferred
    reports = _compare_on_mesh(mesh, tensor_report(local, ok, spec.shape if spec else ()),
                               "from_local(run_check=True)")
    first = reports[mesh.ranks[0]]
    bad = {r: report for r, report in reports.items()
           if not report.ok or report.dtype != first.dtype or report.dtype is None
           or report.inferred != first.inferred}
    if bad:
        lines = [f"rank {r}: local {report.local_text()} (global {report.inferred})"
                 + (f", the layout gives it {element_table(spec).local_shapes[mesh.position(r)]}" if spec else "")
                 for r, report in sorted(bad.items())]
        here = f" (here: {failure})" if failure else ""
        raise RankDisagreementError(f"from_local({spec or target}): local tensors do not fit "
                                    f"the layout{here}:\n  " + "\n  ".join(lines))


def _broadcast_replicas(local: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """``from_local(run_check=True)``, as torch's: along each ``Replicate()`` axis, every rank's
    ``local`` becomes (in place) the one at coordinate 0 of that axis, so the replicas agree. On
    a 2x2 mesh with ``[Shard(0), Replicate()]``, ranks 0 and 1 hold rank 0's piece, ranks 2 and 3
    rank 2's."""
    local = local.contiguous()
    for axis, placement in zip(mesh.axis_names, placements):
        if not isinstance(placement, Replicate) or mesh.size(axis) == 1:
            continue
        ranks = mesh.group_ranks(axis)
        with torch.no_grad():  # the caller's leaf may require grad; the values are taken as given
            together(f"from_local(run_check=True)'s broadcast over ({axis!r},)", ranks,
                     lambda: dist.broadcast(local, src=ranks[0], group=mesh.group(axis)))
    return local


def _is_torch_mesh(value) -> bool:
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    return isinstance(value, TorchMesh)


def _torch_spelling(what: str, mesh, device_mesh, target, placements) -> tuple[DeviceMesh, object]:
    """``(mesh, target)`` from axedist's arguments or torch's keywords (``device_mesh=``,
    ``placements=``): a torch mesh converted, no placements meaning Replicate on every axis."""
    if mesh is not None and device_mesh is not None:
        raise TypeError(f"{what}: the mesh given twice (mesh and device_mesh=)")
    if target is not None and placements is not None:
        raise TypeError(f"{what}: the target given twice (a layout or placements, and placements=)")
    mesh = mesh if mesh is not None else device_mesh
    if mesh is None:
        raise TypeError(f"{what} needs a mesh (axedist keeps no current mesh): pass an axedist or torch DeviceMesh")
    mesh = as_mesh(mesh)
    target = target if target is not None else placements
    return mesh, (target if target is not None else (Replicate(),) * mesh.ndim)


# ---------------------------------------------------------------------------
# The tensor
# ---------------------------------------------------------------------------

_dynamo_tracing = torch.compiler.is_dynamo_compiling


@outside_tracing
def _first_of(local: torch.Tensor) -> torch.Tensor:
    return local[0]


@outside_tracing
def _resolved(dt) -> torch.Tensor:
    return dt._local


def graph_node(method):
    """``method`` of a DTensor as ONE node of a Dynamo graph: the methods call it first thing
    while Dynamo traces, so Dynamo records the call (placements or a layout as constants)
    instead of tracing into the planning code, and AOTAutograd then traces the method's body
    on fake tensors, collectives and all (Dynamo is not tracing then: the body runs). In the
    Dynamo graph of ``x.redistribute([Replicate()])``: ``dtensor_redistribute(x, [Replicate()])``."""
    def node(*args, **kwargs):
        return method(*(_placements_from_text(a) for a in args),
                      **{k: _placements_from_text(v) for k, v in kwargs.items()})

    node.__name__ = node.__qualname__ = f"dtensor_{method.__name__}"
    recorded = torch._dynamo.allow_in_graph(node)

    def call(*args, **kwargs):
        # placements reach the node as text: Dynamo proxies strings on every torch release, while
        # torch 2.11 has no proxy for a placement argument (the whole-model compile failed there)
        return recorded(*(_placements_as_text(a) for a in args),
                        **{k: _placements_as_text(v) for k, v in kwargs.items()})

    return call


_PLACEMENT_TEXT = "axedist-placements"  # marks a tuple of placements written as text
_LAYOUT_TEXT = "axedist-layout"  # marks a layout written in its notation
_REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def _placements_as_text(value):
    """``[Shard(0), Partial("sum")]`` -> ``("axedist-placements", ("S", 0), ("P", "sum"))``; a layout
    -> ``("axedist-layout", "S[(4, 8):(1@gpuid, 1)]")`` (torch 2.11 has no proxy for it either);
    anything else as it is."""
    if isinstance(value, Layout):
        return (_LAYOUT_TEXT, str(value))
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(p, Placement) for p in value):
        return value
    words = []
    for p in value:
        if isinstance(p, _StridedShard):
            words.append(("T", p.dim, p.split_factor))
        elif isinstance(p, Shard):
            words.append(("S", p.dim))
        elif isinstance(p, Partial):
            # is_partial(op), not p.reduce_op: torch 2.11's dynamo folds the method to a constant,
            # the attribute to an access that a graph node's argument cannot hold
            words.append(("P", next((op for op in _REDUCE_OPS if p.is_partial(op)), p.reduce_op)))
        else:
            words.append(("R",))
    return (_PLACEMENT_TEXT, *words)


def _placements_from_text(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _LAYOUT_TEXT:
        return Layout.parse(value[1])
    if not (isinstance(value, tuple) and value and value[0] == _PLACEMENT_TEXT):
        return value
    made = {"S": lambda d: Shard(d), "T": lambda d, f: _StridedShard(d, split_factor=f), "P": lambda op: Partial(op),
            "R": lambda: Replicate()}
    return tuple(made[word[0]](*word[1:]) for word in value[1:])


class DTensor(torch.Tensor):
    """A global tensor whose elements sit on a mesh as an Axe layout says.

    A wrapper subclass (like torch's DTensor): ``shape``/``dtype``/``device``/``requires_grad``
    describe the global tensor; the data is ``to_local()`` on each rank. Torch ops run on it
    through the class's ``dispatcher`` (``axedist.ops``: sharding rules per op family; ops
    without one gather, with a one-time warning): ``(x + y).sum()`` works on DTensors as on
    tensors, autograd included.
    """

    _spec: DTensorSpec
    _pending = None   # an async redistribute or a deferred GEMM: waited for on first use of the data
    _tag = None       # the dispatcher's Tag of (spec, dtype, stride), set on first use
    _traced_as = None  # (local, the local torch.compile sees for it): see _traced
    # A view (to autograd) whose local tensor is not a view of its base's: a view op that had to
    # move its input (``x.diagonal(0, 1, 2)`` of ``[Shard(1)]`` gathers first) or computes the
    # view's values (``z.conj()``), or a view of such a view. Writing to it in place would not
    # reach the base: the dispatcher refuses that.
    _copied_view = False
    dispatcher: OpDispatcher  # set below, once the class exists
    __torch_function__ = torch._C._disabled_torch_function_impl  # the fast path's handler when enabled

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False, *, stride=None, pending=None):
        if local.is_conj() or local.is_neg():
            # the wrapper has no conjugate / negative bit to report, and collectives read raw
            # memory: the piece holds its values (see ops/complex.py)
            local = local.resolve_conj().resolve_neg()
        self = wrap(cls, local, spec, stride, local.dtype, local.device, requires_grad)
        if pending is not None:
            self._pending = pending
        return self

    # -- tracing (torch.compile) -----------------------------------------------------
    # A traceable wrapper subclass: Dynamo and AOTAutograd see the local tensor as the data and
    # the spec as metadata (hashable; a compiled graph is guarded on its equality), run the
    # dispatcher's rules on fake local tensors, and rebuild DTensors from (local, spec).

    # Every dim static for Dynamo (what torch.mark_static sets per tensor): specs and plans
    # are made for concrete shapes, so a new shape recompiles rather than going symbolic.
    _dynamo_static_indices = ALL_DIMS

    def __tensor_flatten__(self):
        if not _NODES:  # Dynamo is at work: the first DTensor it meets comes through here
            _register_graph_nodes()
        return ["_traced"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        spec, requires_grad = meta
        if tuple(outer_size) != spec.shape:
            raise LayoutError(f"a traced DTensor of shape {tuple(outer_size)} has the spec {spec}: axedist DTensors "
                              f"trace with static shapes (every dim of a DTensor is marked static)")
        traced = local = inner["_traced"]
        if spec.reduce_op and local.dim() == len(spec.shape):
            local = local.unsqueeze(0)  # the summand dim _traced leaves out
        out = DTensor(local, spec, requires_grad, stride=tuple(outer_stride))
        out._traced_as = (local, traced)
        return out

    @property
    def _traced(self) -> torch.Tensor:
        """The local tensor as torch.compile sees it: a pending sum's without its local summand
        dim of extent 1, so a gradient has its parameter's local rank (Dynamo fakes a
        parameter's ``.grad`` with the parameter's shape information)."""
        pending = self._pending
        # work left pending in eager (a deferred GEMM, an async move) runs on its real tensors,
        # outside the fake mode Dynamo may read inputs under
        local = _resolved(self) if pending is not None and not getattr(pending, "traced", False) else self._local
        if not (self._spec.reduce_op and local.dim() > len(self._spec.shape) and local.shape[0] == 1):
            return static_sizes(local)
        known = self._traced_as
        if known is not None and known[0] is local:  # one object every time (Dynamo guards inputs by
            return known[1]                            # identity), and no op where modes are off
        if unusable_here(local):  # as it is: __tensor_unflatten__ takes a pending sum's local either way
            return local
        # a real tensor's view is made outside the trace's fake mode (Dynamo reads inputs under it)
        traced = _first_of(local) if type(local) is torch.Tensor else local[0]
        self._traced_as = (local, static_sizes(traced))
        return traced

    @_traced.setter
    def _traced(self, traced: torch.Tensor) -> None:
        # AOTAutograd hands a gradient's local back in the memory format its compiled backward
        # was traced with (a contiguous copy of an expanded ``ones``): the same values and shape
        old = self._traced
        if traced.shape != old.shape:
            raise LayoutError(f"a traced DTensor's local of shape {tuple(old.shape)} cannot be replaced by one of "
                              f"shape {tuple(traced.shape)}")
        local = traced.unsqueeze(0) if self._spec.reduce_op and traced.dim() < self._value.dim() else traced
        self._value = local
        self._traced_as = (local, traced)

    def _stable_hash_for_caching(self) -> str:
        """The key of this input in torch.compile's on-disk caches (the spec's text, its mesh's
        ranks and axes, requires_grad): a process group cannot be pickled into one."""
        spec, mesh = self._spec, self._spec.mesh
        text = repr((spec, spec.padded, spec.true_index, mesh.device_type, mesh.shape, mesh.axis_names, mesh.ranks,
                     self.dtype, self.requires_grad))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def __coerce_tangent_metadata__(self):
        """The tangent a compiled backward expects for this output: a pending reduction's
        gradient is replicated on its axes (as in eager autograd)."""
        target = without_summands(self._spec)
        return self if target is self._spec else autograd.move(self, target)

    def __coerce_same_metadata_as_tangent__(self, meta, expected_type=None):
        """This runtime tangent in the layout the compiled backward was traced with."""
        if expected_type is not None:
            return None
        spec = meta[0]
        return self if spec == self._spec else autograd.move(self, spec)

    @property
    def _local(self) -> torch.Tensor:
        if self._pending is not None:
            self._value = self._pending.wait()
            self._pending = None
        return self._value

    # -- construction ----------------------------------------------------------

    @staticmethod
    def from_local(local: torch.Tensor, mesh: DeviceMesh | None = None, layout_or_placements=None,
                   shape: Sequence[int] | None = None, *, padded_shape: Sequence[int] | None = None,
                   reduce_op: str | None = None, run_check: bool = False, device_mesh=None, placements=None,
                   stride: Sequence[int] | None = None, grad_placements=None) -> "DTensor":
        """This rank's piece of a global tensor (no data moves).

        torch's spelling works too: ``DTensor.from_local(local, device_mesh=mesh, placements=[Shard(0)],
        shape=..., stride=...)`` with a torch or axedist mesh; no placements means Replicate on
        every axis (as torch); ``stride`` must be the global shape's contiguous strides.

        With placements, ``local`` follows torch's convention (``shape`` for uneven dims;
        default: every shard as large as this one). With a layout, ``shape`` is required
        (a layout alone does not say where dims begin), ``padded_shape`` is what it admits
        when that differs, and ``reduce_op`` marks its leading dim as pending summands.
        ``run_check=True`` compares every rank's local shape and dtype (one all_gather)
        and raises on every rank when any differs from the layout's; then, as torch, along each
        ``Replicate()`` axis the local tensor at coordinate 0 is broadcast (into ``local``). Without it, a global
        shape inferred from each rank's local shape (placements, no ``shape``) is compared
        once per local shape, dtype and placements (one exchange on the job's store), so ranks
        whose local tensors disagree all raise ``RankDisagreementError`` instead of meeting in
        a collective of mismatched sizes. (Once per rank, a known limit: when only some ranks meet
        a local shape they have not checked, e.g. one rank's smaller last batch, the others skip
        the check. Their next unchecked move then meets those ranks' check, and every rank raises
        ``RankDisagreementError``; a move they checked before runs its collective at once, and the
        checking ranks raise ``PeerError`` after the collective timeout while the others wait in
        that collective.) ``grad_placements`` (torch's): the placements the
        DTensor's gradient is brought to before its piece becomes ``local``'s gradient (default:
        this tensor's own, a pending sum's axes replicated); its piece here must be ``local``'s shape.
        """
        mesh, layout_or_placements = _torch_spelling("from_local", mesh, device_mesh, layout_or_placements,
                                                     placements)
        if _dynamo_tracing():  # one graph node; the mesh by its number (a graph takes no process groups)
            _make_graph_nodes()
            return _NODES["from_local"](local, mesh.number, layout_or_placements, shape, padded_shape=padded_shape,
                                        reduce_op=reduce_op, run_check=run_check, stride=stride,
                                        grad_placements=grad_placements)
        mesh.position()
        failure = None
        inferred = shape is None and is_placements(layout_or_placements)
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
            # the other arguments' checks, here too: an error on one rank only joins the check below
            if local.device != mesh.device:
                raise LayoutError(f"local tensor is on {local.device}, the mesh's device here is {mesh.device}")
            if stride is not None and tuple(stride) != tuple(contiguous_strides(spec.shape)):
                raise LayoutError(f"from_local: stride {tuple(stride)} is not the contiguous stride "
                                  f"{tuple(contiguous_strides(spec.shape))} of the global shape {tuple(spec.shape)}: "
                                  f"axedist DTensors are row-major in their global shape")
            grad = None if grad_placements is None else _gradient_target(
                "from_local", spec, tuple(grad_placements), tuple(local.shape), default=without_summands(spec))
        except LayoutError as e:
            if not run_check and not inferred:  # no check here: posted, so the peers' next check names it
                agree(mesh.ranks, "from_local", "", failed=e)
                raise
            failure, spec, expected = e, None, None  # still join the check, so no peer waits forever
        ok = failure is None and tuple(local.shape) == expected
        if inferred and not run_check:
            _agree_on_inferred(mesh, layout_or_placements, local, spec, failure)
        if run_check:
            _check_every_local(mesh, local, layout_or_placements, spec, ok, failure)
        elif not ok:
            error = LayoutError(f"from_local({spec}): rank {dist.get_rank()}'s local tensor has shape "
                                f"{tuple(local.shape)}, the layout gives it {expected}")
            agree(mesh.ranks, "from_local", "", failed=error)  # as above: the peers' next check names it
            raise error
        if failure is not None:  # (a check that joined it raises on every rank; this rank's own error here)
            raise failure
        if run_check and is_placements(layout_or_placements) and not compiling():
            local = _broadcast_replicas(local, mesh, layout_or_placements)
        return autograd.from_local(DTensor, local, spec, bool(spec.reduce_op) and is_placements(layout_or_placements),
                                   grad)

    # -- reading -------------------------------------------------------------------

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece, in torch's shape. A pending reduction's piece is what this rank
        contributes to it, as torch's ``Partial`` local tensor: the summand it holds (a view of
        the local tensor without its summand dim), or, where a layout puts several summands on
        each rank, their reduction here with the pending op (sum, mean, max, min), so the op
        over the ranks' pieces is the value. On 2 ranks, ``b`` (4, 6) ``[Shard(1)]`` and ``w``
        (6, 3) ``[Shard(0)]``::

            >>> (b @ w).to_local()            # (4, 3): b's 3 columns here @ w's 3 rows here, as torch's
            >>> p = x.to_partial()            # x (4, 8) replicated: 4 summands on each rank
            >>> p.to_local()                  # (8,): x.sum(0) on every rank

        Differentiable: the gradient of the piece comes back as a DTensor in this layout (a
        pending reduction's axes replicated, as torch: each summand held here gets the piece's
        gradient, divided by their count for ``avg``), or, as torch's keyword says, in
        ``grad_placements`` (e.g. ``[Partial()]`` when the ranks' pieces of a replicated tensor
        get different gradients). A ``grad_placements`` whose piece here has another shape than
        this one is refused, as is an integer ``avg`` over several summands a rank (no rank
        contribution rounds to the value) and the gradient of a ``max`` / ``min`` over several.

            >>> w.to_local(grad_placements=[Partial()])   # w Replicate: each rank's grad a summand
        """
        if _dynamo_tracing():
            return _NODES["to_local"](self, grad_placements=grad_placements)
        spec = self._spec
        grad = None if grad_placements is None else _gradient_target(
            "to_local", spec, tuple(grad_placements), tuple(self._local.shape)[1 if spec.reduce_op else 0:],
            default=without_summands(spec))
        return autograd.to_local(self, grad)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank of the mesh (pending reductions applied).
        ``grad_placements`` as for ``to_local``: e.g. ``[Partial()]`` when each rank's use of the
        whole tensor gives it a different gradient (default: the same on every rank). Value
        checks still pending (``runtime/checks.py``) are settled first: no value built on bad input
        leaves as a whole tensor without its error."""
        if _dynamo_tracing():
            return _NODES["full_tensor"](self, grad_placements=grad_placements)
        checks.settle()
        return self.redistribute(replicated_layout(self._spec.shape, self.mesh)).to_local(
            grad_placements=grad_placements)

    @property
    def axe_layout(self) -> Layout:
        """The Axe layout of this tensor over its global shape: ``S[(4,2,6):(1@gpuid,6,1)]`` for an
        ``(8, 6)`` tensor in ``[Shard(0)]`` on 4 ranks. (``layout`` keeps torch's meaning,
        ``torch.strided``: torch's own code, ``torch.masked`` among it, reads it.)"""
        return self._spec.layout

    @property
    def mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """torch's name for ``mesh``."""
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

    def redistribute(self, layout_or_placements=None, placements=None, *, device_mesh=None,
                     padded_shape: Sequence[int] | None = None, reduce_op: str | None = None,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> "DTensor":
        """The same global tensor in another layout (or placements) on the same mesh.

        Differentiable: the gradient goes back to this tensor's layout (a pending reduction's
        gradient is replicated on its axes, as in torch). ``async_op=True`` starts the
        communication and returns at once; the result's data is waited for on its first use
        (any op, ``to_local``, ``full_tensor``), so independent work can overlap it.
        torch's spelling works too: ``x.redistribute(x.device_mesh, [Replicate()])`` or
        ``x.redistribute(device_mesh=mesh, placements=[Shard(1)])`` (the mesh must be this
        tensor's; no placements: no move). As torch's: ``forward_dtype`` casts before the move
        (the result has that dtype), ``backward_dtype`` is the dtype the gradient moves in (it
        comes back in this tensor's dtype).
        """
        if isinstance(layout_or_placements, DeviceMesh) or _is_torch_mesh(layout_or_placements):
            if device_mesh is not None:
                raise TypeError("redistribute: the mesh given twice (positionally and as device_mesh=)")
            device_mesh, layout_or_placements = layout_or_placements, None
        if device_mesh is not None and as_mesh(device_mesh) != self.mesh:
            error = MeshError(f"redistribute moves a tensor within its mesh {self.mesh}; device_mesh= names "
                              f"{as_mesh(device_mesh)}")
            agree(self.mesh.ranks, "redistribute", "", failed=error)  # the peers' check names it, at once
            raise error
        if layout_or_placements is not None and placements is not None:
            raise TypeError("redistribute: the target given twice (a layout or placements, and placements=)")
        layout_or_placements = layout_or_placements if layout_or_placements is not None else placements
        dtypes = (None if forward_dtype in (None, self.dtype) else forward_dtype,
                  None if backward_dtype in (None, self.dtype) else backward_dtype)
        if layout_or_placements is None:  # torch: no placements, no move (nothing to agree on: it sends nothing)
            return self if dtypes[0] is None else self.to(dtypes[0])
        if _dynamo_tracing():
            return _NODES["redistribute"](self, layout_or_placements, padded_shape=padded_shape, reduce_op=reduce_op,
                                          async_op=async_op, forward_dtype=forward_dtype,
                                          backward_dtype=backward_dtype)
        try:
            dst = target_spec(self._spec, layout_or_placements, padded_shape, reduce_op)
        except (ValueError, TypeError) as error:  # told to the other ranks, which raise too where they check
            agree(self.mesh.ranks, "redistribute", "", failed=error)
            raise
        if dst == self._spec:  # no move: a rank may ask for it alone (agree_on_move checks only moves that send)
            return self if dtypes[0] is None else self.to(dtypes[0])
        return autograd.redistribute(self, dst, async_op, *dtypes)

    def to_partial(self, reduce_op: str = "sum") -> "DTensor":
        """Read the leading dim as pending summands (no data moves): shape ``(k, *s)`` -> ``s``.

        Fig. 8: ``x`` of shape (4,64,64) in ``S[(4,64,64):(1@gpuid,64,1)]``;
        ``x.to_partial().redistribute(S[(4,16,64):(1@gpuid,64,1)])`` is a reduce-scatter.
        """
        if _dynamo_tracing():
            return _NODES["to_partial"](self, reduce_op)
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
        local = autograd.rank_summand(self._local, self._spec.reduce_op) if self._spec.reduce_op else self._local
        return TorchDTensor.from_local(local, self.mesh.to_torch(), placements, run_check=False,
                                       shape=torch.Size(self.shape), stride=contiguous_strides(self.shape))

    # -- torch.distributed.checkpoint: each rank's piece by its box in the global tensor ------------

    def _box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        box = global_box(self._spec, self.mesh.position())
        if box is None:
            raise LayoutError(f"torch.distributed.checkpoint stores each rank's piece as one box of the global "
                              f"tensor; {self._spec} is not (a pending sum, or elements spread over the tensor): "
                              f"redistribute it first")
        return box

    def __create_write_items__(self, fqn: str, object) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        offsets, sizes = self._box()
        if 0 in sizes:
            return []
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(
                              self._local), size=torch.Size(self.shape)))]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        offsets, sizes = self._box()
        return [] if 0 in sizes else [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self._local  # the load narrows into it and copies in place

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"DTensor({dtype}{self._spec}, mesh={self.mesh})"


# The methods Dynamo records as one graph node each (see graph_node); made when Dynamo first
# meets a DTensor or a from_local: importing torch._dynamo as axedist loads would import Triton.
_NODES: dict = {}


def _register_graph_nodes() -> None:
    for name in ("to_local", "full_tensor", "redistribute", "to_partial"):
        _NODES[name] = graph_node(getattr(DTensor, name))
    _NODES["from_local"] = graph_node(_from_numbered_mesh)


def _from_numbered_mesh(local, mesh_number: int, layout_or_placements, shape, **kwargs):
    """``DTensor.from_local`` with the mesh given by its number (``DeviceMesh.numbered``). A
    local tensor whose sizes Dynamo made symbolic (a plain input it saw with two shapes, after
    a graph break) is first viewed with its sizes as constants (a guard each): specs and plans
    are for concrete shapes, as a DTensor's own dims are static."""
    if any(isinstance(n, torch.SymInt) for n in local.shape):
        local = local.view(tuple(int(n) for n in local.shape))
    return DTensor.from_local(local, DeviceMesh.numbered(mesh_number), layout_or_placements, shape, **kwargs)


_from_numbered_mesh.__name__ = "from_local"


def _make_graph_nodes() -> None:
    """Make the graph nodes (see graph_node) if Dynamo has not met a DTensor yet: a compiled
    function whose first DTensor is the one its ``from_local`` makes. Dynamo calls this function
    for real while it traces (not symbolically) and takes its result as a constant: what torch's
    ``assume_constant_result`` marks, set here by its attribute, since importing torch._dynamo
    to decorate would import Triton with axedist. Code that calls it then reads ``_NODES``."""
    if not _NODES:
        _register_graph_nodes()


_make_graph_nodes._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result's mark


def _layouts_as_graph_constants() -> bool:
    """Layouts are constants of a traced graph (guarded by ==, the same map), so
    ``redistribute(layout)`` traces: an opaque value type where this torch takes one, else (torch
    2.11 takes only classes of its own metaclass) a pytree constant, which 2.11's Dynamo folds
    ``x.redistribute(layout)``'s arguments with (a layout made before the compiled region). Where
    this torch has neither, compiled code cannot take a layout argument (placements still work)
    and eager is unaffected."""
    try:
        from torch._library.opaque_object import register_opaque_type
    except ImportError:
        register_opaque_type = None
    if register_opaque_type is not None:
        for spelling in ({"typ": "value"}, {"value_type": True}):
            try:
                register_opaque_type(Layout, **spelling)
                return True
            except TypeError:
                continue
    register_constant = getattr(torch.utils._pytree, "register_constant", None)
    if register_constant is not None:
        register_constant(Layout)
    return register_constant is not None


LAYOUTS_TRACE = _layouts_as_graph_constants()

# Torch ops reach the dispatcher (axedist.ops) through these two handlers; the class owns it.
DTensor.dispatcher = OpDispatcher(DTensor)
DTensor.__torch_dispatch__ = classmethod(DTensor.dispatcher.torch_dispatch)
DTensor.dispatcher.fastpath.enable(read_environment("AXEDIST_FASTPATH"))


def plan(src, dst, *, mesh: DeviceMesh | None = None, shape: Sequence[int] | None = None,
         itemsize: int | None = None) -> Redistribution:
    """The route (``axedist.Redistribution``) that moves ``src`` to ``dst``: every step it runs; nothing moves.

    ``src``: a DTensor, or a layout / placements with ``mesh=`` and ``shape=``; ``dst``: a
    layout or placements (or a DTensor, whose layout is the target). Example, 4 ranks::

        >>> print(ax.plan(x, [Replicate()]))        # x: (8, 6) in [Shard(0)]
        plan S[(4,2,6):(1@gpuid,6,1)] -> S[(8,6):(6,1)] + R[4:1@gpuid], ...
          1. all-gather over gpuid (1 group of 4): each member sends 144 B, receives 144 B

    ``src`` the pending sum of a deferred ``mm``/``addmm`` (``runtime/deferred.py``; also a view
    of one, or a sum of several) and ``dst`` its rows sharded on the summed axis: the route's
    ``fused`` step says whether the fused GEMM + reduce-scatter runs; its text is ``fused GEMM +
    reduce-scatter: ...``, or the GEMM, the route, and why not fused.
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
    route = plan_redistribute(src_spec, dst_spec, itemsize)
    if isinstance(src, DTensor) and src._pending is not None and pending_product(src._pending) is not None:
        step = fused_choice(src_spec, src._pending, dst_spec)
        if step is not None:
            return dataclasses.replace(route, fused=step)
    return route


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
    failure = None
    try:
        dst = _distribute_target(tensor, mesh, layout_or_placements, padded_shape, src_rank)
    except (ValueError, TypeError) as error:  # LayoutError, MeshError, junk arguments: told to every rank
        dst, failure = None, error
    target = (f"{dst.canonical_text()} from rank {src_rank}" if failure is None
              else f"raised {type(failure).__name__}: {failure}")
    # one small all_gather: each rank's shape, dtype and a digest of its target
    reports = _compare_on_mesh(mesh, tensor_report(tensor, failure is None, text=target), "distribute")
    first = reports[mesh.ranks[0]]
    if all(report == first for report in reports.values()) and failure is not None:
        raise failure  # the same mistake on every rank
    if any(not report.ok or dataclasses.replace(report, ok=first.ok) != first for report in reports.values()):
        texts = gather_texts(mesh.group(), mesh.ranks, f"{tensor_report(tensor).local_text()} -> {target}")
        here = f" (here: {failure})" if failure is not None else ""
        raise RankDisagreementError(f"distribute needs the same shape and dtype, and the same target, on every rank "
                                    f"of the mesh{here}; got:\n" + rank_listing(texts))
    shape = tuple(tensor.shape)
    if tensor.is_meta:  # a model built on the meta device: no values to send, the local tensor's shape only
        return DTensor(torch.empty(true_local_shape(dst), dtype=tensor.dtype, device="meta"), dst)
    if src_rank is None:
        src = make_spec(mesh, replicated_layout(shape, mesh), shape)
    else:
        src = make_spec(mesh, Layout(row_major_iters(shape), (), mesh.coordinates(src_rank)), shape)
    if src_rank is None or dist.get_rank() == src_rank:
        local = tensor.to(mesh.device)
    else:
        local = tensor.new_empty((0,) * len(shape), device=mesh.device)  # other ranks' data is never read
    return autograd.distribute(DTensor, tensor, local, src, dst)


def distribute_tensor(tensor: torch.Tensor, device_mesh=None, placements=None, *, src_data_rank: int | None = 0) -> DTensor:
    """torch's ``distribute_tensor``, spelled as torch spells it: a torch or axedist mesh, no
    placements meaning Replicate on every axis, the values from the rank at index
    ``src_data_rank`` of every mesh axis (0: the mesh's first rank; None: every rank keeps its
    own values, nothing is sent).

        >>> distribute_tensor(torch.arange(8.), init_device_mesh("cpu", (4,)), [Shard(0)]).to_local()  # rank 3
        tensor([6., 7.])
    """
    mesh, placements = _torch_spelling("distribute_tensor", None, device_mesh, None, placements)
    src = None if src_data_rank is None else mesh.rank_at({axis: src_data_rank for axis in mesh.axis_names})
    return distribute(tensor, mesh, placements, src_rank=src)


# -- torch's DTensor factories ---------------------------------------------------------------


def zeros(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout=torch.strided,
          device_mesh=None, placements=None) -> DTensor:
    """torch's ``zeros`` for DTensors: each rank allocates its own piece (nothing is sent).
    ``placements``: torch placements or an axedist Layout; none: Replicate on every axis.

        >>> zeros(8, 6, device_mesh=mesh, placements=[Shard(0)]).to_local().shape   # 4 ranks
        torch.Size([2, 6])
    """
    return _filled("zeros", size, 0, dtype, layout, requires_grad, device_mesh, placements)


def ones(*size, dtype: torch.dtype | None = None, layout=torch.strided, requires_grad: bool = False,
         device_mesh=None, placements=None) -> DTensor:
    """torch's ``ones`` for DTensors (see ``zeros``)."""
    return _filled("ones", size, 1, dtype, layout, requires_grad, device_mesh, placements)


def empty(*size, dtype: torch.dtype | None = None, layout=torch.strided, requires_grad: bool = False,
          device_mesh=None, placements=None) -> DTensor:
    """torch's ``empty`` for DTensors: each piece uninitialized (see ``zeros``)."""
    return _filled("empty", size, None, dtype, layout, requires_grad, device_mesh, placements)


def full(size, fill_value, *, dtype: torch.dtype | None = None, layout=torch.strided, requires_grad: bool = False,
         device_mesh=None, placements=None) -> DTensor:
    """torch's ``full`` for DTensors (see ``zeros``); the dtype defaults as ``torch.full``'s does."""
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    return _filled("full", (size,), fill_value, dtype, layout, requires_grad, device_mesh, placements)


def rand(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout=torch.strided,
         device_mesh=None, placements=None) -> DTensor:
    """torch's ``rand`` for DTensors: the global tensor is ``torch.rand(size)`` drawn from the
    generator of the mesh's device, which every rank must have seeded alike (``torch.manual_seed``);
    each rank draws it whole and keeps its piece, so the generators stay in step and nothing is
    sent (torch's values differ: its pieces come from an offset-based generator on CUDA)."""
    return _drawn("rand", torch.rand, size, requires_grad, dtype, layout, device_mesh, placements)


def randn(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout=torch.strided,
          device_mesh=None, placements=None) -> DTensor:
    """torch's ``randn`` for DTensors (see ``rand``): the global tensor is ``torch.randn(size)``."""
    return _drawn("randn", torch.randn, size, requires_grad, dtype, layout, device_mesh, placements)


def _factory_spec(what: str, size, layout, device_mesh, placements) -> tuple[DTensorSpec, object]:
    """The new tensor's spec, and its placements (or layout) as given."""
    if layout is not torch.strided:
        raise LayoutError(f"{what}: only torch.strided tensors are distributed, got layout={layout}")
    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise TypeError(f"{what}: the size must be non-negative ints, got {size}")
    mesh, target = _torch_spelling(what, None, device_mesh, None, placements)
    spec = spec_from_placements(shape, mesh, target) if is_placements(target) else make_spec(mesh, target, shape)
    if spec.reduce_op:
        raise LayoutError(f"{what}: Partial placements have no single meaning for a new tensor; make it, then "
                          f"to_partial()")
    return spec, target


def _gradient_target(what: str, spec: DTensorSpec, placements: tuple, local_shape: tuple, *,
                     default: DTensorSpec) -> DTensorSpec | None:
    """``grad_placements`` of ``to_local`` / ``from_local`` as the spec of the gradient of the
    local tensor (None: ``default``, what the gradient gets anyway). Its piece here must have
    ``local_shape`` (``to_local``'s result: a pending reduction's without its summand dim);
    ``from_local`` to a pending reduction is refused."""
    target = spec_from_placements(spec.shape, spec.mesh, placements)
    if target == default:
        return None
    if what == "from_local" and target.reduce_op:
        raise LayoutError(f"from_local(grad_placements={list(placements)}): a gradient cannot be brought to a pending "
                          f"reduction; give placements without Partial")
    here = element_table(target).local_shapes[spec.mesh.position()]
    here = here[1:] if target.reduce_op else here  # a placements Partial's summand dim is added to the piece
    if tuple(here) != local_shape:
        error = LayoutError(f"{what}(grad_placements={list(placements)}): a gradient so placed has a piece of shape "
                            f"{tuple(here)} on this rank, the local tensor is {local_shape} ({spec})")
        announce_failure(what, error)  # a peer left waiting on this rank then says why
        raise error
    return target


def _filled(what, size, value, dtype, layout, requires_grad, device_mesh, placements) -> DTensor:
    spec, _ = _factory_spec(what, size, layout, device_mesh, placements)
    here = element_table(spec).local_shapes[spec.mesh.position()]
    dtype = dtype or torch.get_default_dtype()
    local = torch.empty(here, dtype=dtype, device=spec.mesh.device)
    if value is not None:
        local.fill_(value)
    return DTensor(local, spec, requires_grad=requires_grad)


def _drawn(what, draw, size, requires_grad, dtype, layout, device_mesh, placements) -> DTensor:
    spec, target = _factory_spec(what, size, layout, device_mesh, placements)
    whole = draw(spec.shape, dtype=dtype or torch.get_default_dtype(), device=spec.mesh.device)
    return distribute(whole, spec.mesh, target, src_rank=None).requires_grad_(requires_grad)


def _distribute_target(tensor: torch.Tensor, mesh: DeviceMesh, layout_or_placements, padded_shape,
                       src_rank) -> DTensorSpec:
    """Where ``distribute`` puts ``tensor`` (the checks that may fail on one rank only)."""
    _check_dims(tensor)
    if src_rank is not None and not mesh.contains(src_rank):
        raise MeshError(f"distribute: src_rank {src_rank} is not in mesh {mesh}")
    shape = tuple(tensor.shape)
    if not is_placements(layout_or_placements):
        return make_spec(mesh, layout_or_placements, shape, padded_shape)
    if padded_shape is not None:
        raise LayoutError("padded_shape goes with a layout; placements imply it")
    dst = spec_from_placements(shape, mesh, layout_or_placements)
    if dst.reduce_op:
        raise LayoutError("distribute to Partial placements has no single meaning; distribute, then to_partial()")
    return dst


def from_torch(torch_dtensor) -> DTensor:
    """The axedist DTensor equal to a torch DTensor (same local tensors; mesh axes keep their names)."""
    mesh = DeviceMesh.from_torch(torch_dtensor.device_mesh)
    spec = spec_from_placements(torch_dtensor.shape, mesh, torch_dtensor.placements)
    local = torch_dtensor.to_local()
    if spec.reduce_op:
        local = local.unsqueeze(0)
    expected = element_table(spec).local_shapes[mesh.position()]
    if tuple(local.shape) != expected:
        raise LayoutError(f"from_torch: torch's local shape {tuple(local.shape)} differs from the layout's {expected} "
                          f"for {spec}")
    return DTensor(local, spec, requires_grad=torch_dtensor.requires_grad)


# -- torch's local_map ---------------------------------------------------------------------------


def local_map(func=None, out_placements=None, in_placements=None, in_grad_placements=None, device_mesh=None, *,
              redistribute_inputs: bool = False):
    """torch's ``local_map`` (``torch.distributed.tensor.experimental``): ``func``, written for
    plain tensors, called on the local pieces of DTensor arguments, its tensor outputs read as
    this rank's pieces of DTensors in ``out_placements``. Without ``func``: a decorator.

    The positional arguments are flattened (torch's pytree); ``in_placements`` has one entry per
    flattened argument: for a DTensor, the placements (or an axedist Layout) its piece must be in
    (another layout: ``ValueError``, or with ``redistribute_inputs=True`` a redistribute first),
    for a plain tensor anything (not checked), for anything else ``None``. ``in_grad_placements``:
    per DTensor argument, the placements its gradient is in (``to_local(grad_placements=)``: e.g.
    ``[Partial()]`` for a replicated input whose pieces get different gradients). ``out_placements``:
    placements for a single output, else a tuple with one entry per flattened output (``None`` for
    a non-tensor). The mesh is ``device_mesh`` or the first DTensor argument's. Keyword arguments
    go to ``func`` as they are, and without a DTensor argument ``func``'s outputs come back as
    they are (both as torch). An output's global shape is inferred as ``from_local`` infers it
    (every piece as large as this rank's): uneven pieces are a ``RankDisagreementError`` on every
    rank. On 2 ranks, ``w`` (6, 3) ``[Shard(0)]`` and ``x`` (4, 6) ``[Shard(1)]``::

        >>> mm = local_map(torch.mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]))
        >>> mm(x, w).full_tensor()          # x @ w: each rank's product of its pieces is a summand
    """
    if func is None:
        return lambda f: local_map(f, out_placements, in_placements, in_grad_placements, device_mesh,
                                   redistribute_inputs=redistribute_inputs)
    if not callable(func):
        raise TypeError(f"local_map takes a function, got {type(func).__name__}")

    def run(*args, **kwargs):
        flat, tree = tree_flatten(args)
        for what, given in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
            if given is not None and len(given) != len(flat):
                raise ValueError(f"local_map: {what} has {len(given)} entries for {len(flat)} arguments "
                                 f"(one per flattened positional argument, None for a non-tensor)")
        mesh = None if device_mesh is None else as_mesh(device_mesh)
        local_args, seen = [], False
        for i, arg in enumerate(flat):
            if isinstance(arg, DTensor):
                seen = True
                mesh = arg.mesh if mesh is None else mesh
                if in_placements is not None:
                    arg = _local_map_input(arg, in_placements[i], i, redistribute_inputs)
                grad = None if in_grad_placements is None else in_grad_placements[i]
                if in_grad_placements is not None and grad is None:
                    raise ValueError(f"local_map: argument {i} is a DTensor, its in_grad_placements entry None")
                arg = arg.to_local(grad_placements=grad)
            elif in_placements is not None and not isinstance(arg, torch.Tensor) and in_placements[i] is not None:
                raise ValueError(f"local_map: argument {i} ({type(arg).__name__}) is not a tensor; its "
                                 f"in_placements entry must be None, got {in_placements[i]}")
            local_args.append(arg)
        out = func(*tree_unflatten(local_args, tree), **kwargs)
        if not seen:
            return out
        return _local_map_outputs(out, out_placements, mesh)

    return functools.wraps(func)(run)


def _local_map_input(arg: DTensor, want, index: int, redistribute_inputs: bool) -> DTensor:
    if want is None:
        raise ValueError(f"local_map: argument {index} is a DTensor ({arg._spec}); its in_placements entry is None")
    if isinstance(want, Placement):
        raise TypeError(f"local_map: in_placements[{index}] is one placement {want}; give a sequence "
                        f"([{want}]) or a Layout")
    target = target_spec(arg._spec, want if isinstance(want, Layout) else tuple(want), None, None)
    if target == arg._spec:
        return arg
    if not redistribute_inputs:
        where = placements_or_none(arg._spec)
        where = arg._spec.layout if where is None else list(where)
        raise ValueError(f"local_map: argument {index} is in {where}, its in_placements entry is {want}; "
                         f"redistribute it first or pass redistribute_inputs=True")
    return arg.redistribute(want)


def _local_map_outputs(out, out_placements, mesh: DeviceMesh):
    flat, tree = tree_flatten(out)
    wanted = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(wanted) != len(flat):
        raise ValueError(f"local_map: out_placements has {len(wanted)} entries for the function's {len(flat)} "
                         f"outputs (one per flattened output as a tuple; a single output's placements as a list)")
    result = []
    for i, (value, want) in enumerate(zip(flat, wanted)):
        if isinstance(value, DTensor):
            raise TypeError(f"local_map: the function returned a DTensor as output {i}; it computes on local "
                            f"tensors, which local_map makes DTensors by out_placements")
        if not isinstance(value, torch.Tensor):
            if want is not None:
                raise ValueError(f"local_map: output {i} ({type(value).__name__}) is not a tensor; its "
                                 f"out_placements entry must be None, got {want}")
            result.append(value)
            continue
        if want is None or isinstance(want, Placement):
            raise TypeError(f"local_map: output {i} is a tensor; its out_placements entry must be a sequence "
                            f"of placements, got {want!r}" + (" (a single output's placements go in a list, "
                            "a tuple holds one entry per output)" if isinstance(want, Placement) else ""))
        result.append(DTensor.from_local(value, mesh, want))
    return tree_unflatten(result, tree)

