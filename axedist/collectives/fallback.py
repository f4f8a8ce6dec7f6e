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
