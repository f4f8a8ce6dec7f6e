"""Eager fusion: the dispatcher's one home for deferred work (runtime/deferred.py).

Three things happen here, each asked for by one hook of the dispatcher:

* :func:`defer_product` (a plan with ``defer``): an mm/addmm whose output is a pending sum keeps
  its local GEMM unrun, so that the reduce-scatter or all-reduce that follows can run it fused.
* :func:`take_pending` (any op while work is outstanding, ``PENDING.outstanding``): an op with a
  handler in :data:`PENDING_USERS` may take the deferred work as it stands (keep it pending, or
  run it fused); an op that writes a tensor first computes the deferred work that reads it.
* the handlers themselves, registered per op with :func:`pending_user` by the module that owns
  the op's math: mm/addmm of a deferred row all-gather (ops/matmul.py), and here the add of two
  pending products and the views of pending work.

Two ranks, a sequence-parallel ``x [8, 4]`` in ``[Shard(0)]`` (CUDA bf16) moved to
``[Replicate()]``: the all-gather is deferred; ``x @ w`` with ``w [4, 6]`` in ``[Shard(1)]``
reaches the mm handler, which runs one fused all-gather + GEMM giving each rank its ``[8, 3]``
columns and the gathered ``[8, 4]`` rows.
"""

from __future__ import annotations

import torch

from ..runtime.deferred import (PENDING, DeferredProduct, DeferredTranspose, defer, defer_sum, gather_rows,
                                pending_gather, pending_product, placeholder, transposed)
from ..runtime.tails import DeferredTail, fused_tail_norm, pending_tail, with_residual
from ..tracing import may_defer
from .call_plan import CallPlan, op_info, scan, written

__all__ = ["PENDING_USERS", "pending_user", "take_pending", "planned_as_is", "planned_unmoved", "defer_product"]

aten = torch.ops.aten
_HALF = (torch.bfloat16, torch.float16)

# aten op -> handler(dispatcher, func, args): the op's output taking the deferred work of its
# arguments as it stands (a DTensor), or None (then the op runs as usual, on computed values)
PENDING_USERS: dict = {}


def pending_user(*ops):
    """Register the decorated handler for ``ops``: ``@pending_user(aten.mm.default)``."""

    def add(handler):
        for op in ops:
            if op in PENDING_USERS:
                raise ValueError(f"{op} already has a pending-work handler ({PENDING_USERS[op].__name__})")
            PENDING_USERS[op] = handler
        return handler

    return add


def take_pending(dispatcher, func, args, kwargs):
    """While deferred work is outstanding: ``func``'s output from its handler (it took the work as
    it stands), else None, after computing the deferred work that reads what ``func`` writes (it
    must see the old values)."""
    if not kwargs:
        handler = PENDING_USERS.get(func)
        if handler is not None:
            kept = handler(dispatcher, func, args)
            if kept is not None:
                return kept
    info = op_info(func)
    if info.inplace or info.out_names or info.written:
        PENDING.flush(_written_locals(dispatcher.cls, args, kwargs, info))
    return None


def _written_locals(cls, args, kwargs, info) -> list:
    """The local tensors (computed, if pending) that an op with ``info`` writes."""
    tensors = list(written(args, kwargs, info))
    if info.inplace:
        first = args[0]
        tensors.extend(first if isinstance(first, (list, tuple)) else [first])
    tensors.extend(kwargs[name] for name in info.out_names if name in kwargs)
    flat = []
    for t in tensors:
        flat.extend(t if isinstance(t, (list, tuple)) else [t])
    return [t._local if type(t) is cls else t for t in flat if isinstance(t, torch.Tensor)]


def planned_as_is(dispatcher, func, args) -> tuple[CallPlan, dict] | tuple[None, None]:
    """The plan of a call that a handler may run on pending work (one output, no deferral, no
    in-place reduction) and its targets by DTensor id; ``(None, None)`` otherwise."""
    dts, mesh, key = scan(dispatcher.cls, func, args, {})
    plan = dispatcher.plan(func, args, {}, dts, mesh, key, op_info(func))
    if plan is None or plan.defer or plan.structure != "single" or plan.reduce_self is not None:
        return None, None
    return plan, {id(d): t for d, t in zip(dts, plan.targets)}


def planned_unmoved(dispatcher, func, args) -> CallPlan | None:
    """:func:`planned_as_is`'s plan when it moves no argument (the op runs on the local values as
    they stand, the pending ones included), else None."""
    plan, _ = planned_as_is(dispatcher, func, args)
    return plan if plan is not None and all(t is None for t in plan.targets) else None


@pending_user(aten.view.default, aten._unsafe_view.default)
def view_of_pending(dispatcher, func, args):
    """A view of a deferred row all-gather as its rows' matrix ([S, B, H] -> [S * B, H], how
    linear reaches mm), or any view of a deferred product (the input gradient [S * B, H] that
    linear's backward views as [S, B, H]) or of a deferred decode all-reduce (the row-parallel
    output [S * B, H] seen as [S, B, H]): it stays pending on the same work."""
    if len(args) != 2:
        return None
    a, cls = args[0], dispatcher.cls
    if type(a) is not cls or a._pending is None:
        return None
    gather, tail = pending_gather(a._pending), pending_tail(a._pending)
    if gather is None and tail is None and pending_product(a._pending) is None:
        return None
    plan = planned_unmoved(dispatcher, func, args)
    if plan is None:
        return None  # a view that moves data first is not the op on the pending value
    out = plan.outputs[0]
    # a gather's view serves the fused all-gather + GEMM only as the rows' matrix
    if gather is not None and (out.unsqueeze or len(out.local_shape) != 2):
        return None
    return cls(placeholder(a.dtype, a.device), out.spec, stride=out.stride, pending=a._pending.view(out.local_shape))


@pending_user(aten.t.default)
def transpose_of_pending(dispatcher, func, args):
    """``t`` of a deferred row all-gather's rows matrix, or of pending work made from one (a
    :class:`DeferredProduct`, a transpose): it stays pending. torch's ``mm`` backward computes a
    linear's weight gradient first, as ``grad.t().mm(input).t()``, then the input gradient
    ``grad @ W``; kept pending, the gather then runs fused with the input gradient's GEMM
    (ops/matmul.py), and the weight gradient reads the rows it leaves."""
    if len(args) != 1 or not may_defer():
        return None
    a, cls = args[0], dispatcher.cls
    if type(a) is not cls or a._pending is None:
        return None
    pending = a._pending
    if pending_gather(pending) is not None:
        if not gather_rows(pending):
            return None
    elif type(pending) not in (DeferredProduct, DeferredTranspose) or pending.value is not None:
        return None
    plan = planned_unmoved(dispatcher, func, args)
    if plan is None or plan.outputs[0].unsqueeze:
        return None  # a transpose that moves data first is not the op on the pending value
    out = plan.outputs[0]
    return cls(placeholder(a.dtype, a.device), out.spec, stride=out.stride, pending=transposed(pending))


@pending_user(aten.add.Tensor)
def sum_of_pending(dispatcher, func, args):
    """The sum of two pending products of one spec (the gradients autograd adds up) stays
    pending, as a DeferredSum: the add itself, on the local values as they stand. A residual plus
    a deferred decode all-reduce stays pending too (:func:`residual_of_tail`)."""
    if len(args) != 2:
        return None
    (a, b), cls = args, dispatcher.cls
    if (type(b) is cls and pending_tail(b._pending) is not None) or \
            (type(a) is cls and pending_tail(a._pending) is not None):
        return residual_of_tail(dispatcher, func, args)
    if type(a) is not cls or a._pending is None:
        return None
    if type(b) is not cls or pending_product(a._pending) is None or pending_product(b._pending) is None \
            or a._spec != b._spec or a.dtype != b.dtype:
        return None
    plan = planned_unmoved(dispatcher, func, args)
    if plan is None:
        return None  # an add that moves data first is not the op on the pending values
    out = plan.outputs[0]
    # nothing moves, no rule's own code
    if plan.sharding.local is not None or out.spec != a._spec or tuple(out.local_shape) != tuple(a._pending.shape):
        return None
    pending = defer_sum(a._pending, b._pending)
    return None if pending is None else cls(placeholder(a.dtype, a.device), out.spec, stride=out.stride,
                                            pending=pending)


def _computed(dt) -> bool:
    """Whether ``dt``'s value exists: no pending work, or work already run (a fused tail fills
    the residual stream's value before the DTensor holding it is read)."""
    return dt._pending is None or getattr(dt._pending, "value", None) is not None


def residual_of_tail(dispatcher, func, args):
    """``x + t`` (or ``t + x``) where ``t`` is a deferred decode all-reduce and ``x`` a computed
    tensor of the same spec, shape and dtype (the block's residual stream): stays pending as
    ``residual + all_reduce(...)``, for an RMSNorm to run fused (:func:`norm_of_tail`)."""
    (a, b), cls = args, dispatcher.cls
    holder, residual = (b, a) if type(b) is cls and pending_tail(b._pending) is not None else (a, b)
    tail = holder._pending
    if type(residual) is not cls or not _computed(residual) or residual.dtype != holder.dtype \
            or residual._spec != holder._spec:
        return None
    plan = planned_unmoved(dispatcher, func, args)
    if plan is None or plan.sharding.local is not None:
        return None  # an add that moves data or broadcasts is not the residual add
    out = plan.outputs[0]
    if out.spec != holder._spec or out.unsqueeze or tuple(out.local_shape) != tail.shape:
        return None
    pending = with_residual(tail, residual._local)
    return None if pending is None else cls(placeholder(residual.dtype, residual._local.device), out.spec,
                                            stride=out.stride, pending=pending)


@pending_user(aten.rms_norm.default)
def norm_of_tail(dispatcher, func, args):
    """``rms_norm(residual + all_reduce(x), [hidden], weight, eps)`` of a deferred decode tail:
    one all-reduce + residual add + RMSNorm (the residual stream's new value fills the tail)."""
    cls = dispatcher.cls
    if not 2 <= len(args) <= 4 or type(args[0]) is not cls:
        return None
    tail = pending_tail(args[0]._pending)
    if type(tail) is not DeferredTail or tail.kind != "residual":
        return None
    normalized, weight = list(args[1]), args[2] if len(args) > 2 else None
    eps = args[3] if len(args) > 3 else None
    dtype = tail.residual.dtype
    if normalized != [tail.shape[-1]] or type(weight) is not cls or not _computed(weight) \
            or weight.dtype != dtype or not dispatcher.arg_spec(weight).is_replicated():
        return None
    spec = args[0]._spec
    if spec.shape[-1] != tail.shape[-1] or spec.reduce_op:
        return None  # the normalized dim split over devices: each rank would norm part of a row
    # (rms_norm is decomposed, not planned: its output is laid out as its input, rows whole)
    eps = torch.finfo(dtype).eps if eps is None else eps
    return cls(fused_tail_norm(tail, weight._local, eps), spec)


def defer_product(dispatcher, func, plan: CallPlan, local_args, local_kwargs):
    """The pending-sum output of mm/addmm with its local GEMM deferred (runtime/deferred.py),
    or None when ``dispatcher.defer_gemm`` says to run it now: ``"auto"`` defers only where the
    fused kernel can run (CUDA, bf16/fp16 operands)."""
    local, call = plan.sharding.local, plan.call
    if func is aten.mm.default:
        (a, b), bias, alpha, beta = local_args[:2], None, 1, 1
    else:
        bias, a, b = local_args[:3]
        beta, alpha = local_kwargs.get("beta", 1), local_kwargs.get("alpha", 1)
    policy = dispatcher.defer_gemm
    if policy != "always" and (policy == "never" or not a.is_cuda or a.dtype not in _HALF) or not may_defer():
        return None

    def compute():
        value = local(call, *local_args, **local_kwargs) if local is not None else func(*local_args, **local_kwargs)
        return value.unsqueeze(0)

    out = plan.outputs[0]
    pending = defer(compute, a, b, bias, alpha, beta, out.local_shape, even=plan.even)
    return dispatcher.cls(placeholder(a.dtype, a.device), out.spec, stride=out.stride, pending=pending)
