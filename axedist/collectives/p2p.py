"""Host side of the symmetric-memory collectives (p2p, or multimem where allowed).

Each call copies the input into this rank's half of the group's workspace (skipped when the
caller already wrote it there through `symmetric_input`), then launches one kernel that starts
with a block-wise barrier and pulls the peers' data over NVLink, summing in fp32.

    >>> out = reduce_scatter(x, group)      # x: [W * m, ...] bf16 on cuda -> [m, ...]
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .symmetric import get_workspace

ROWS, COLS = 8, 1024  # one program iteration covers 8192 elements, 32 per thread at 8 warps
BLOCK = ROWS * COLS
NUM_WARPS = 8
ONE_SHOT_ALL_REDUCE_MAX_BYTES = 1 << 19  # measured switch point (benchmarks/results/)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


_processors: dict[int, int] = {}


def _programs(elements_per_rank_pass: int, device: torch.device) -> int:
    processors = _processors.get(device.index)
    if processors is None:
        processors = _processors[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    # at most one program per SM: always co-resident, so the block-wise barrier cannot deadlock
    return max(1, min((elements_per_rank_pass + BLOCK - 1) // BLOCK, processors))


def _check_input(x: torch.Tensor, op: str) -> None:
    if not x.is_cuda:
        raise ValueError(f"{op}: tensor must be on a CUDA device, got {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{op}: dtype must be bf16, fp16 or fp32, got {x.dtype}")
    if x.numel() >= (1 << 31):
        raise ValueError(f"{op}: {x.numel()} elements exceed the kernels' int32 indexing")


def _common(workspace, epoch):
    return dict(abort_ptr=workspace.abort, error_address=workspace.error_address(),
                timeout_ns=workspace.timeout_ns(epoch))


def _layout_numel(op: str, shape, world: int) -> tuple[int, int]:
    """(elements a rank places in its workspace half, chunk stride) for op on `shape`."""
    numel = 1
    for size in shape:
        numel *= size
    if op == "reduce_scatter":
        stride = _round_up(numel // world, 16)
        return world * stride, stride
    if op == "all_gather":
        return numel, numel
    stride = _round_up((numel + world - 1) // world, 16)
    return world * stride, stride


def symmetric_input(shape, dtype: torch.dtype, group=None, op: str = "reduce_scatter"):
    """A tensor in this rank's workspace half that the NEXT `op` call on `group` reads in place
    (no copy-in). Write it on the current stream after the previous call on the group was
    issued. Returns None when the op pads chunks in the workspace (reduce-scatter chunks whose
    size is not a multiple of 16 elements): then the call copies.
    """
    world = dist.get_world_size(group)
    numel, stride = _layout_numel(op, shape, world)
    count = 1
    for size in shape:
        count *= size
    if op == "reduce_scatter" and stride * world != count:
        return None
    workspace = get_workspace(group, numel * dtype.itemsize)
    half = (workspace.epoch + 1) % 2
    return workspace.local_data(half, dtype, numel)[:count].view(shape)


def _stage(x: torch.Tensor, flat: torch.Tensor, world: int, stride: int, op: str) -> None:
    """Copy x into the workspace half `flat` in the op's layout unless it is already there."""
    if x.data_ptr() == flat.data_ptr() and (op != "reduce_scatter" or stride * world == x.numel()):
        return
    if op == "reduce_scatter":
        chunk = x.numel() // world
        flat.view(world, stride)[:, :chunk].copy_(x.reshape(world, chunk))
    else:
        flat[:x.numel()].copy_(x.reshape(-1))


def reduce_scatter(x: torch.Tensor, group=None, out: torch.Tensor | None = None,
                   multimem: bool = False, timeout_s: float | None = None) -> torch.Tensor:
    """Sum x over the group's ranks and keep this rank's slice of dim 0.

    >>> x = torch.randn(8, 5, device="cuda", dtype=torch.bfloat16)   # W = 4
    >>> reduce_scatter(x, group).shape                              # torch.Size([2, 5])
    """
    from ..kernels.collective_kernels import reduce_scatter_kernel

    _check_input(x, "reduce_scatter")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.dim() == 0 or x.shape[0] % world != 0:
        raise ValueError(f"reduce_scatter: dim 0 of shape {tuple(x.shape)} is not divisible by "
                         f"the group size {world}")
    x = x.contiguous()
    numel, stride = _layout_numel("reduce_scatter", x.shape, world)
    chunk = x.numel() // world
    workspace = get_workspace(group, numel * x.element_size(), x.device)
    epoch, half = workspace.begin_call("reduce_scatter", timeout_s)
    _stage(x, workspace.local_data(half, x.dtype, numel), world, stride, "reduce_scatter")
    if out is None:
        out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if chunk == 0:
        return out
    reduce_scatter_kernel[(_programs(chunk, x.device),)](
        out, *workspace.data_addresses(half), workspace.multicast_address(half) if multimem
        else 0, *workspace.flag_addresses(), chunk, stride, rank, epoch,
        WORLD=world, ROWS=ROWS, COLS=COLS, MULTIMEM=multimem, ALIGNED=True,
        num_warps=NUM_WARPS, **_common(workspace, epoch))
    return out


def all_gather(x: torch.Tensor, group=None, out: torch.Tensor | None = None,
               timeout_s: float | None = None) -> torch.Tensor:
    """Concatenate every rank's x along dim 0 (rank order).

    >>> all_gather(torch.ones(2, 3, device="cuda"), group).shape   # W = 4: torch.Size([8, 3])
    """
    from ..kernels.collective_kernels import all_gather_kernel

    _check_input(x, "all_gather")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    chunk = x.numel()
    workspace = get_workspace(group, chunk * x.element_size(), x.device)
    epoch, half = workspace.begin_call("all_gather", timeout_s)
    _stage(x, workspace.local_data(half, x.dtype, chunk), world, chunk, "all_gather")
    if out is None:
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if chunk == 0:
        return out
    all_gather_kernel[(_programs(chunk, x.device),)](
        out, *workspace.data_addresses(half), *workspace.flag_addresses(), chunk, rank, epoch,
        WORLD=world, ROWS=ROWS, COLS=COLS, ALIGNED=True, num_warps=NUM_WARPS,
        **_common(workspace, epoch))
    return out


def all_reduce(x: torch.Tensor, group=None, out: torch.Tensor | None = None,
               algorithm: str = "auto", multimem: bool = False,
               timeout_s: float | None = None) -> torch.Tensor:
    """Sum x over the group's ranks (out of place). algorithm: "one_shot" (every rank pulls
    everything: lowest latency), "two_shot" (reduce-scatter + all-gather: least traffic) or
    "auto" (one-shot up to ONE_SHOT_ALL_REDUCE_MAX_BYTES).
    """
    from ..kernels.collective_kernels import (all_reduce_one_shot_kernel,
                                              all_reduce_two_shot_kernel)

    _check_input(x, "all_reduce")
    if algorithm not in ("auto", "one_shot", "two_shot"):
        raise ValueError(f"algorithm must be auto, one_shot or two_shot, got {algorithm!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    numel, stride = _layout_numel("all_reduce", x.shape, world)
    if algorithm == "auto":
        nbytes = x.numel() * x.element_size()
        algorithm = "one_shot" if nbytes <= ONE_SHOT_ALL_REDUCE_MAX_BYTES else "two_shot"
    workspace = get_workspace(group, numel * x.element_size(), x.device)
    epoch, half = workspace.begin_call(f"all_reduce/{algorithm}", timeout_s)
    _stage(x, workspace.local_data(half, x.dtype, numel), world, stride, "all_reduce")
    out = torch.empty_like(x) if out is None else out
    if x.numel() == 0:
        return out
    multicast = workspace.multicast_address(half) if multimem else 0
    common = dict(WORLD=world, ROWS=ROWS, COLS=COLS, MULTIMEM=multimem, ALIGNED=True,
                  num_warps=NUM_WARPS, **_common(workspace, epoch))
    if algorithm == "one_shot":
        all_reduce_one_shot_kernel[(_programs(x.numel(), x.device),)](
            out, *workspace.data_addresses(half), multicast, *workspace.flag_addresses(),
            x.numel(), rank, epoch, **common)
    else:
        all_reduce_two_shot_kernel[(_programs(stride, x.device),)](
            out, *workspace.data_addresses(half), multicast, *workspace.flag_addresses(),
            x.numel(), stride, rank, epoch, **common)
    return out
