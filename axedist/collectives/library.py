"""axedist's collectives and fused kernels as ``torch.library`` custom ops: what torch.compile
puts in a graph for them, with fake (shape-only) implementations and gradients.

Each op takes the process group by its name (``backend.group_name``) and runs the eager
implementation (``api.run_*``, ``fused.run_gemm_reduce_scatter``, ``fused_tp.run_*``), which
picks the kernel or torch.distributed per size as in eager. The public functions
(``reduce_scatter``, ``gemm_reduce_scatter``, ...) go through these ops while torch.compile
traces or when autograd records the call. W = 2, ``a`` [8, 3] and ``b`` [3, 4] on each rank::

    >>> torch.ops.axedist.gemm_reduce_scatter(a, b, group_name(group), 0, "auto").shape
    torch.Size([4, 4])                      # this rank's rows of the summed [8, 4] product

Gradients, for the tensor-parallel uses these ops serve: ``gemm_reduce_scatter`` -> all-gather
of the output's gradient, then its two GEMMs (the first as the fused ``all_gather_gemm``);
``all_gather_gemm`` -> the input's gradient reduce-scattered (the fused
``gemm_reduce_scatter``), the weight's from the gathered rows; ``reduce_scatter`` <->
``all_gather``; ``all_reduce`` and ``gemm_all_reduce`` pass the gradient through (their output
is the same on every rank and so is its gradient, as in Megatron's row-parallel linear).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import api
from .backend import resolve_group
from .fused import run_gemm_reduce_scatter
from .fused_tp import run_all_gather_gemm, run_gemm_all_reduce

__all__ = ["OPS"]

Tensor = torch.Tensor


def _world(name: str) -> int:
    return dist.get_world_size(resolve_group(name))


def _gathered_shape(shape, dim: int, world: int) -> tuple[int, ...]:
    shape = list(shape) or [1]
    shape[dim % len(shape)] *= world
    return tuple(shape)


# -- collectives ------------------------------------------------------------------------------

@torch.library.custom_op("axedist::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, group: str, backend: str) -> Tensor:
    """Sum ``x`` over the group, keep this rank's slice of dim 0."""
    return api.run_reduce_scatter(x, resolve_group(group), backend)


@reduce_scatter.register_fake
def _(x, group, backend):
    return x.new_empty((x.shape[0] // _world(group), *x.shape[1:]))


@torch.library.custom_op("axedist::all_gather", mutates_args=())
def all_gather(x: Tensor, group: str, backend: str) -> Tensor:
    """Every rank's ``x`` concatenated along dim 0, in group-rank order."""
    return api.run_all_gather(x, resolve_group(group), backend)


@all_gather.register_fake
def _(x, group, backend):
    return x.new_empty(_gathered_shape(x.shape, 0, _world(group)))


@torch.library.custom_op("axedist::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str, backend: str) -> Tensor:
    """The sum of ``x`` over the group (a new tensor)."""
    return api.run_all_reduce(x, resolve_group(group), backend)


@all_reduce.register_fake
def _(x, group, backend):
    return torch.empty_like(x)


def _keep_args(ctx, inputs, output):
    ctx.shape = inputs[0].shape
    ctx.group, ctx.backend = inputs[1], inputs[2]


def _reduce_scatter_grad(ctx, grad):
    return torch.ops.axedist.all_gather(grad.contiguous(), ctx.group, ctx.backend).reshape(ctx.shape), None, None


def _all_gather_grad(ctx, grad):
    return torch.ops.axedist.reduce_scatter(grad.contiguous(), ctx.group, ctx.backend).reshape(ctx.shape), None, None


def _all_reduce_grad(ctx, grad):
    return grad, None, None


reduce_scatter.register_autograd(_reduce_scatter_grad, setup_context=_keep_args)
all_gather.register_autograd(_all_gather_grad, setup_context=_keep_args)
all_reduce.register_autograd(_all_reduce_grad, setup_context=_keep_args)


# -- fused GEMM + collective ------------------------------------------------------------------

@torch.library.custom_op("axedist::gemm_reduce_scatter", mutates_args=())
def gemm_reduce_scatter(a: Tensor, b: Tensor, group: str, scatter_dim: int, backend: str) -> Tensor:
    """reduce_scatter(a @ b) along ``scatter_dim``: this rank's slice of the summed product."""
    return run_gemm_reduce_scatter(a, b, resolve_group(group), scatter_dim, backend)


@gemm_reduce_scatter.register_fake
def _(a, b, group, scatter_dim, backend):
    shape = [*a.shape[:-1], b.shape[1]]
    shape[scatter_dim % len(shape)] //= _world(group)
    return a.new_empty(shape)


def _gemm_rs_context(ctx, inputs, output):
    a, b, ctx.group, ctx.scatter_dim, ctx.backend = inputs
    ctx.save_for_backward(a, b)


def _gemm_rs_grad(ctx, grad):
    a, b = ctx.saved_tensors
    # d(a @ b) = gathered grad: its product with b^T is the fused all-gather + GEMM, which also
    # hands back the gathered rows for b's gradient
    grad_a, rows = torch.ops.axedist.all_gather_gemm(grad.contiguous(), b.t(), ctx.group, ctx.scatter_dim,
                                                     ctx.backend)
    grad_b = a.reshape(-1, a.shape[-1]).t() @ rows.reshape(-1, rows.shape[-1])
    return grad_a, grad_b, None, None, None


gemm_reduce_scatter.register_autograd(_gemm_rs_grad, setup_context=_gemm_rs_context)


@torch.library.custom_op("axedist::all_gather_gemm", mutates_args=())
def all_gather_gemm(a: Tensor, b: Tensor, group: str, gather_dim: int, backend: str) -> tuple[Tensor, Tensor]:
    """(all_gather(a) @ b, all_gather(a)): the product and the gathered rows."""
    process_group = resolve_group(group)
    gathered = a.new_empty(_gathered_shape(a.shape, gather_dim, dist.get_world_size(process_group)))
    out = run_all_gather_gemm(a, b, process_group, gather_dim, backend, gathered=gathered)
    return out, gathered


@all_gather_gemm.register_fake
def _(a, b, group, gather_dim, backend):
    gathered = _gathered_shape(a.shape, gather_dim, _world(group))
    return a.new_empty((*gathered[:-1], b.shape[1])), a.new_empty(gathered)


def _ag_gemm_context(ctx, inputs, output):
    a, b, ctx.group, ctx.gather_dim, ctx.backend = inputs
    ctx.save_for_backward(b, output[1])


def _ag_gemm_grad(ctx, grad_out, grad_rows):
    b, rows = ctx.saved_tensors
    grad_b = rows.reshape(-1, rows.shape[-1]).t() @ grad_out.reshape(-1, grad_out.shape[-1])
    if grad_rows is None:  # only the product was used: its input gradient is one fused GEMM + reduce-scatter
        grad_a = torch.ops.axedist.gemm_reduce_scatter(grad_out.contiguous(), b.t(), ctx.group, ctx.gather_dim,
                                                       ctx.backend)
    else:
        partial = (grad_out @ b.t() + grad_rows).movedim(ctx.gather_dim, 0).contiguous()
        collective = "auto" if ctx.backend == "symm" else ctx.backend  # (the fused ops' backend only)
        grad_a = torch.ops.axedist.reduce_scatter(partial, ctx.group, collective).movedim(0, ctx.gather_dim)
    return grad_a, grad_b, None, None, None


all_gather_gemm.register_autograd(_ag_gemm_grad, setup_context=_ag_gemm_context)


@torch.library.custom_op("axedist::gemm_all_reduce", mutates_args=())
def gemm_all_reduce(a: Tensor, b: Tensor, group: str, backend: str, algorithm: str) -> Tensor:
    """all_reduce(a @ b): the summed product on every rank."""
    return run_gemm_all_reduce(a, b, resolve_group(group), backend, algorithm)


@gemm_all_reduce.register_fake
def _(a, b, group, backend, algorithm):
    return a.new_empty((*a.shape[:-1], b.shape[1]))


def _gemm_ar_context(ctx, inputs, output):
    a, b = inputs[:2]
    ctx.save_for_backward(a, b)


def _gemm_ar_grad(ctx, grad):
    a, b = ctx.saved_tensors
    grad_b = a.reshape(-1, a.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])
    return grad @ b.t(), grad_b, None, None, None


gemm_all_reduce.register_autograd(_gemm_ar_grad, setup_context=_gemm_ar_context)

OPS = (reduce_scatter, all_gather, all_reduce, gemm_reduce_scatter, all_gather_gemm, gemm_all_reduce)
