"""The differentiable moves of a DTensor: from and to local tensors, between layouts, from a global tensor.

Each function takes the DTensor class (or a DTensor) from its caller, so this module never
imports ``axedist.dtensor``. Gradients go back where the input was: ``redistribute`` of a
``(Shard(0),)`` tensor to ``(Replicate(),)`` sends its ``(Replicate(),)`` gradient back to
``(Shard(0),)``; a pending sum's gradient is replicated on its axes (d sum / d summand = 1).
"""

from __future__ import annotations

import torch

from .runtime import agree_on_move, redistribute_local
from .layout import LayoutError
from .runtime.deferred import defer_gather, fused_collective, pending_product, placeholder
from .runtime.tails import defer_tail, tail_axis
from .tracing import compiling
from .spec import DTensorSpec, make_spec, replicated_layout, without_summands

__all__ = ["requires_grad", "from_local", "to_local", "rank_summand", "redistribute", "move", "distribute"]


def requires_grad(dt) -> bool:
    """``dt.requires_grad`` without a trip through ``__torch_function__`` (a getter costs ~2 us
    there; DTensor's own methods read it on every call)."""
    with torch._C.DisableTorchFunctionSubclass():
        return dt.requires_grad


def from_local(cls, local: torch.Tensor, spec: DTensorSpec, unsqueeze: bool, grad: DTensorSpec | None = None):
    """A ``cls`` DTensor in ``spec`` holding ``local`` (``unsqueeze``: add the summand dim of a
    placements ``Partial``); the gradient of ``local`` is the DTensor gradient's piece, the
    gradient first brought to ``grad`` when given."""
    if local.requires_grad and torch.is_grad_enabled():
        return _FromLocal.apply(cls, local, spec, unsqueeze, grad)
    return cls(local.unsqueeze(0) if unsqueeze else local, spec)


def to_local(dt, grad: DTensorSpec | None = None) -> torch.Tensor:
    """``dt``'s local tensor (a pending reduction's: ``rank_summand``, torch's shape); its
    gradient comes back as a DTensor in ``dt``'s layout (a pending reduction's: replicated where
    its summands were, ``without_summands``, as torch's), or in ``grad`` (same global shape and
    piece shape here; a placements ``Partial`` gets its summand dim)."""
    spec = dt._spec
    differentiable = torch.is_grad_enabled() and requires_grad(dt)
    if spec.reduce_op and spec.local_padded[0] > 1:
        _check_rank_summand(spec, dt.dtype, differentiable)
    if differentiable:
        return _ToLocal.apply(dt, grad)
    return rank_summand(dt._local, spec.reduce_op) if spec.reduce_op else dt._local


def rank_summand(local: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """What this rank contributes to a pending ``reduce_op`` whose local tensor ``local`` leads
    with its summand dim: torch's ``Partial`` local tensor, whose ``reduce_op`` over the ranks
    is the value. One summand here: that summand, a view (``(1, 3, 4)`` -> ``(3, 4)``). Several
    (a layout with part of its summand dim in memory): reduced here with the same op, so 4
    summands ``s0..s3`` summed, two a rank, give rank 0 ``s0 + s1`` and rank 1 ``s2 + s3``
    (``avg``: their mean, every rank holding as many)."""
    count = local.shape[0]
    if count == 1:
        return local[0]
    if count == 0:  # a device the layout does not reach: nothing here, every dim empty
        return local.reshape(local.shape[1:])
    if reduce_op == "sum":
        return local.sum(0, dtype=local.dtype)  # (an integer sum keeps its dtype)
    if reduce_op == "avg":
        return local.mean(0)
    return local.amax(0) if reduce_op == "max" else local.amin(0)


def _check_rank_summand(spec: DTensorSpec, dtype: torch.dtype, differentiable: bool) -> None:
    """Refuse ``to_local`` where this rank holds several summands (the same count on every rank:
    the layout's) and its contribution has no torch form: an integer average (the mean here,
    then the mean over the ranks, rounds twice), or the gradient of a max / min (it goes to the
    largest / smallest summand of each element, which a DTensor gradient cannot say)."""
    op, here = spec.reduce_op, spec.local_padded[0]
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise LayoutError(f"to_local() of a pending integer avg with {here} summands on each rank ({spec}): the mean "
                          f"of a rank's summands rounds, then the mean over the ranks rounds again, so no rank "
                          f"contribution gives the value; redistribute to a layout with one summand a rank (e.g. "
                          f"placements with Partial('avg')) or reduce it first (full_tensor(), redistribute)")
    if differentiable and op in ("max", "min"):
        raise NotImplementedError(
            f"to_local() of a pending {op} with {here} summands on each rank ({spec}) is not differentiable: the "
            f"gradient of a rank's {op} goes to one summand of each element, which a DTensor gradient cannot say; "
            f"redistribute to a layout with one summand a rank (e.g. placements with Partial({op!r})), reduce it "
            f"first (full_tensor(), redistribute), or call it under torch.no_grad()")


def redistribute(dt, dst: DTensorSpec, async_op: bool = False, forward_dtype: torch.dtype | None = None,
                 backward_dtype: torch.dtype | None = None):
    """``dt`` moved to ``dst``, cast to ``forward_dtype`` first when given (differentiable: the
    gradient goes back to ``dt``'s layout, moved in ``backward_dtype``, or ``dt``'s dtype, and
    comes back in ``dt``'s dtype)."""
    if torch.is_grad_enabled() and requires_grad(dt):
        return _Redistribute.apply(dt, dst, async_op, forward_dtype, backward_dtype)
    return move(dt if forward_dtype is None else dt.to(forward_dtype), dst, async_op)


def move(dt, dst: DTensorSpec, async_op: bool = False):
    """``dt`` moved to ``dst``, outside autograd: a deferred product's (or a sum or view of
    deferred products') row reduce-scatter or all-reduce runs fused where it can; a row
    all-gather of a CUDA bf16/fp16 matrix is deferred (an mm with column-sharded weights then
    runs it fused); ``async_op`` returns at once and waits on the first use of the data.
    Gradients move through here too (``redistribute``'s backward)."""
    cls = type(dt)
    pending = dt._pending
    async_op = async_op and not compiling()  # a traced graph's collectives are scheduled by the compiler
    product = pending_product(pending) if pending is not None else None
    if not async_op and dt._spec.reduce_op == "sum" and torch.is_inference_mode_enabled():
        # at decode: the all-reduce ending a row-parallel layer waits for the residual add and
        # RMSNorm that follow (ops/fusion.py runs the three as one kernel). A product still
        # pending runs unfused first: cuBLAS, then the fused tail, beats the fused GEMM +
        # all-reduce, then the add and the norm (benchmarks/results/decode_w4.md)
        shape = pending.shape if product is not None else dt._local.shape
        axis = tail_axis(dt._spec, dst, tuple(shape), dt.dtype, dt.device)
        if axis is not None:
            agree_on_move(dt._spec, dst, dt._value.element_size())
            tail = defer_tail(dt._local, dt._spec, dst, axis)
            return cls(placeholder(dt.dtype, tail.local.device), dst, pending=tail)
    if product is not None:
        agree_on_move(dt._spec, dst, dt._value.element_size())  # (redistribute_local does it on the unfused path)
        fused = fused_collective(dt._spec, pending, dst)
        if fused is not None:
            return cls(fused, dst)
    if pending is None and not async_op:
        gather = defer_gather(dt._value, dt._spec, dst)
        if gather is not None:
            agree_on_move(dt._spec, dst, dt._value.element_size())
            return cls(placeholder(dt.dtype, dt._value.device), dst, pending=gather)
    if async_op:
        pending = redistribute_local(dt._local, dt._spec, dst, async_op=True)
        return cls(placeholder(dt.dtype, dt.mesh.device), dst, pending=pending)
    return cls(redistribute_local(dt._local, dt._spec, dst), dst)


def distribute(cls, tensor: torch.Tensor, local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec):
    """``local`` (``tensor``'s data where ``src`` holds it) moved to a ``cls`` DTensor in ``dst``.
    With ``tensor.requires_grad``, every rank reads ``tensor`` as the same global tensor, so each
    rank's gradient is the whole (replicated) gradient."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Distribute.apply(cls, tensor, local, src, dst)
    return cls(redistribute_local(local, src, dst), dst)


def _grad_local(cls, grad, spec: DTensorSpec, placements_partial: bool, target: DTensorSpec | None = None):
    """The gradient of a local tensor that was given in ``spec``, from a DTensor gradient (moved
    to ``target`` first when given)."""
    if not isinstance(grad, cls):
        raise LayoutError(f"the gradient of a DTensor output must be a DTensor, got {type(grad).__name__}")
    if target is not None:
        if grad._spec != target:
            return redistribute_local(grad._local, grad._spec, target)
        return grad._local
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
    target = without_summands(spec)
    if grad._spec == target:  # no move, no check (agree_on_move checks moves that send)
        local = grad._local
    else:
        local = redistribute_local(grad._local, grad._spec, target)
    return local[0] if target.reduce_op else local


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cls, local, spec, unsqueeze, grad_target):
        ctx.cls, ctx.spec, ctx.unsqueeze, ctx.grad_target = cls, spec, unsqueeze, grad_target
        return cls(local.unsqueeze(0) if unsqueeze else local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad):
        return None, _grad_local(ctx.cls, grad, ctx.spec, ctx.unsqueeze, ctx.grad_target), None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, grad_target):
        spec, local = dt._spec, dt._local
        # the result's gradient is each rank's piece of the value's gradient, replicated where the
        # summands were (torch's Partial -> Replicate; a layout's summands in memory dropped)
        ctx.cls, ctx.spec = type(dt), without_summands(spec) if grad_target is None else grad_target
        ctx.unsqueeze = grad_target is not None and grad_target.reduce_op is not None
        # the gradient of each summand held here: the result's (sum, max, min), its share of the mean (avg)
        ctx.divisor = local.shape[0] if spec.reduce_op == "avg" and grad_target is None else None
        if not spec.reduce_op:
            return local.view_as(local)
        return rank_summand(local, spec.reduce_op)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.unsqueeze:
            grad = grad.unsqueeze(0)
        elif ctx.divisor is not None and ctx.divisor > 1:
            grad = grad / ctx.divisor
        return ctx.cls(grad, ctx.spec), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, dst, async_op, forward_dtype, backward_dtype):
        ctx.cls, ctx.src, ctx.dtype = type(dt), dt._spec, dt.dtype
        ctx.backward_dtype = backward_dtype or dt.dtype
        return move(dt if forward_dtype is None else dt.to(forward_dtype), dst, async_op)

    @staticmethod
    def backward(ctx, grad):
        target = without_summands(ctx.src)
        if not isinstance(grad, ctx.cls):
            raise LayoutError(f"the gradient of a DTensor output must be a DTensor, got {type(grad).__name__}")
        if grad._spec == target:
            # no move (nothing to check), but rounded through backward_dtype all the same, as torch's
            return _cast(_cast(grad, ctx.backward_dtype), ctx.dtype), None, None, None, None
        if grad.dtype != ctx.backward_dtype:  # torch's backward_dtype: the gradient moves in it
            return _cast(move(grad.to(ctx.backward_dtype), target), ctx.dtype), None, None, None, None
        # through move: a gradient that is a deferred product (a column-parallel linear's input
        # gradient, reduce-scattered back to sequence shards) reaches the fused GEMM + RS
        return _cast(move(grad, target), ctx.dtype), None, None, None, None


def _cast(grad, dtype: torch.dtype):
    return grad if grad.dtype == dtype else grad.to(dtype)


class _Distribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cls, tensor, local, src, dst):
        ctx.cls, ctx.shape, ctx.mesh = cls, tuple(tensor.shape), dst.mesh
        return cls(redistribute_local(local.detach(), src, dst), dst)

    @staticmethod
    def backward(ctx, grad):
        full = make_spec(ctx.mesh, replicated_layout(ctx.shape, ctx.mesh), ctx.shape)
        return None, _grad_local(ctx.cls, grad, full, False), None, None, None
