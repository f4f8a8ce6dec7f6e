"""The same collectives through torch.distributed (NCCL on CUDA, gloo on CPU): always correct,
used where symmetric memory is unavailable or slower (backend="torch")."""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the one-tensor collectives (the old names warn on every call); 2.11 has only
# the old ones. One spelling for the whole package, the current one where it exists.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(x: torch.Tensor, group=None, out: torch.Tensor | None = None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.dim() == 0 or x.shape[0] % world != 0:
        raise ValueError(f"reduce_scatter: dim 0 of shape {tuple(x.shape)} is not divisible by "
                         f"the group size {world}")
    x = x.contiguous()
    if out is None:
        out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x, group=group)
    return out


def all_gather(x: torch.Tensor, group=None, out: torch.Tensor | None = None) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    if out is None:
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group=group)
    return out


def all_reduce(x: torch.Tensor, group=None, out: torch.Tensor | None = None) -> torch.Tensor:
    out = x.clone() if out is None else out.copy_(x)
    dist.all_reduce(out, group=group)
    return out


def product_out(op: str, out: torch.Tensor | None, shape, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | None:
    """The out= tensor of a fused call (``op``) whose product a torch path computes, as the
    tensor of the product's shape to write it into (None where no out was given). out must hold
    the product's elements in row-major order, as the fused kernels take it: the product's
    shape or its rows flattened ([rows, N]), its dtype and device, unit column stride; anything
    else is refused, not reshaped into."""
    if out is None:
        return None
    shape = tuple(shape)
    rows = torch.Size(shape).numel() // shape[-1] if shape[-1] else 0
    accepted = (shape, (rows, shape[-1]))
    if (out.dtype != dtype or out.device != device or tuple(out.shape) not in accepted
            or out.dim() == 0 or out.stride(-1) != 1):
        raise ValueError(f"{op}: out must be a {dtype} tensor on {device} of shape {list(shape)} "
                         f"or [{rows}, {shape[-1]}] with unit column stride, got {out.dtype} "
                         f"{list(out.shape)} strides {out.stride()} on {out.device}")
    if tuple(out.shape) == shape:
        return out
    try:
        return out.view(shape)
    except RuntimeError:
        raise ValueError(f"{op}: out {list(out.shape)} strides {out.stride()} cannot be viewed "
                         f"as the product's {list(shape)}") from None


def matmul_reduce_scatter(op: str, a: torch.Tensor, b: torch.Tensor, group, scatter_dim: int,
                          out: torch.Tensor | None, world: int | None = None) -> torch.Tensor:
    """reduce_scatter(a @ b, scatter_dim) (a [..., K], b [K, N]) as a program calls the pair. Over
    dim 0 the product's rows are already in scatter order: one ``torch.mm`` of a's rows, and the
    collective writes straight into ``out`` (or a fresh tensor) where its rows are contiguous, no
    other op around the pair (results/probe_auto_host.md). Over another dim the product is moved
    to dim 0 for the collective and back. ``out`` as ``product_out`` takes it; a bad one raises
    after the collective, as ``copy_out``'s does, so that its peers get their results. ``world``:
    the group's size where the caller has it (a planned call), else asked of the group."""
    world = dist.get_world_size(group) if world is None else world
    dim = scatter_dim % a.dim()
    if dim == 0:
        rows = torch.mm(a if a.dim() == 2 else a.reshape(-1, a.shape[-1]), b)
    else:
        rows = torch.matmul(a, b).movedim(dim, 0).contiguous()
    if rows.shape[0] % world:
        raise ValueError(f"{op}: dim {dim} of the product {list(rows.shape)} (moved first) is not divisible "
                         f"by the group size {world}")
    shape = [*a.shape[:-1], b.shape[-1]]
    shape[dim] //= world
    try:
        into, refused = product_out(op, out, shape, rows.dtype, rows.device), None
    except ValueError as error:
        into, refused = None, error
    if dim == 0 and refused is None:  # the collective writes the result in place: nothing after it
        if into is None:
            into = torch.empty(shape, dtype=rows.dtype, device=rows.device)
        if into.is_contiguous():
            reduce_scatter_into(into if into.dim() == 2 else into.view(-1, rows.shape[-1]), rows, group=group)
            return into
    result = reduce_scatter(rows, group)
    if refused is not None:
        raise refused
    result = result.view(shape) if dim == 0 else result.movedim(0, dim).contiguous()
    return result if into is None else into.copy_(result)


def matmul_out(op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """a @ b, into ``out`` where one is given (``product_out``'s check): no copy after the
    product. Only where no collective follows (a bad out raises before the product)."""
    into = product_out(op, out, (*a.shape[:-1], b.shape[-1]), torch.result_type(a, b), a.device)
    return torch.matmul(a, b) if into is None else torch.matmul(a, b, out=into)


def copy_out(op: str, result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result`` (a collective's, on this rank), copied into ``out`` where one is given and
    ``product_out`` accepts it: checked after the collective, so that a rank given a bad out
    raises while its peers, given good ones, get their results (nobody waits in a collective a
    rank never joined)."""
    into = product_out(op, out, result.shape, result.dtype, result.device)
    return result if into is None else into.copy_(result)


def product_rows(op: str, out: torch.Tensor | None, shape, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor | None:
    """out= of a fused call whose kernel writes the product as [rows, N]: a 2-D out as given
    (the kernel's launch checks it), else ``product_out``'s tensor viewed as [rows, N] (never a
    copy: the kernel must write into out itself)."""
    if out is None or out.dim() == 2:
        return out
    into = product_out(op, out, shape, dtype, device)
    try:
        return into.view(-1, into.shape[-1])
    except RuntimeError:
        raise ValueError(f"{op}: out {list(out.shape)} strides {out.stride()} cannot be viewed as "
                         f"the kernel's [rows, {into.shape[-1]}]") from None
