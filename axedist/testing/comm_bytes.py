"""Bytes torch DTensor sends, counted from the collectives it issues (``CommDebugMode``).

    result, sent = torch_comm_bytes(lambda: x.redistribute(mesh, [Replicate()]).to_local())

For comparing axedist's routes with torch's in tests and benchmarks.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed.tensor.placement_types as placement_types
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor.debug import CommDebugMode

__all__ = ["torch_comm_bytes"]


class _Count:
    """Bytes sent so far, and how deep inside a call counted as a whole (its collectives not again)."""

    def __init__(self):
        self.sent, self.paused = 0, 0


def _size_of(group) -> int:
    return _resolve_process_group(group).size() if isinstance(group, str) else group.size()


def _c10d_bytes(name: str, args) -> int | None:
    """Bytes of the process-group calls torch's FSDP2 makes (``c10d::`` ops: output first, then
    input, then the group), in the same model; None for other names."""
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    members = lambda group: torch.distributed.ProcessGroup.unbox(group).size()  # noqa: E731
    if name == "_allgather_base_":
        return size(args[1]) * (members(args[2]) - 1)
    if name == "_reduce_scatter_base_":
        g = members(args[2])
        return size(args[1]) * (g - 1) // g
    if name == "allgather_into_tensor_coalesced_":
        return sum(size(t) for t in args[1]) * (members(args[2]) - 1)
    if name == "reduce_scatter_tensor_coalesced_":
        g = members(args[2])
        return sum(size(t) for t in args[1]) * (g - 1) // g
    if name == "allreduce_":
        g = members(args[1])
        return sum(2 * size(t) * (g - 1) // g for t in args[0])
    return None


def _collective_bytes(name: str, args, tensor: torch.Tensor) -> int:
    """Bytes this rank sends for one collective, in the direct model the planner uses."""
    nbytes = tensor.numel() * tensor.element_size()
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
        return nbytes * (args[1] - 1)
    if name == "reduce_scatter_tensor":
        return nbytes * (args[2] - 1) // args[2]
    if name in ("all_reduce", "all_reduce_"):
        g = _size_of(args[2])
        return 2 * nbytes * (g - 1) // g
    if name == "all_to_all_single":
        g, splits = _size_of(args[3]), args[2]
        me = _resolve_process_group(args[3]).rank() if isinstance(args[3], str) else 0
        own = splits[me] if splits else tensor.shape[0] // g
        return nbytes - own * (nbytes // max(tensor.shape[0], 1))
    if name == "shard_dim_alltoall":
        g = _size_of(args[3])
        return nbytes * (g - 1) // g
    if name in ("broadcast", "broadcast_"):
        g = _size_of(args[2])
        return nbytes * (g - 1) if _resolve_process_group(args[2]).rank() == args[1] else 0
    return 0


class _Counting(CommDebugMode):
    def __init__(self, count: _Count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not self.count.paused and not any(issubclass(t, torch.distributed.tensor.DTensor) for t in types):
            c10d = _c10d_bytes(name, args)
            if c10d is not None:
                self.count.sent += c10d
            elif tensor is not None:
                self.count.sent += _collective_bytes(name, args, tensor)
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _alltoall_as_on_nccl(count: _Count):
    """torch's CPU shard-dim all-to-all all-gathers instead (gloo lacked alltoall when it was
    written); count what its NCCL path sends (the padded input but its own chunk), so a CPU
    test sees NCCL's bytes."""
    alltoall = placement_types.shard_dim_alltoall

    def counted(input, gather_dim, shard_dim, mesh, mesh_dim):
        if mesh.device_type != "cpu":
            return alltoall(input, gather_dim, shard_dim, mesh, mesh_dim)
        g = mesh.size(mesh_dim)
        count.sent += input.numel() * input.element_size() * (g - 1) // g
        count.paused += 1
        try:
            return alltoall(input, gather_dim, shard_dim, mesh, mesh_dim)
        finally:
            count.paused -= 1

    placement_types.shard_dim_alltoall = counted
    try:
        yield
    finally:
        placement_types.shard_dim_alltoall = alltoall


def torch_comm_bytes(fn: Callable, *args, **kwargs) -> tuple[object, int]:
    """Run ``fn(*args, **kwargs)`` under torch's ``CommDebugMode``; return (result, bytes this rank sends).

    Bytes per collective in the direct model the planner uses: all-gather ``n*(g-1)``,
    reduce-scatter ``N*(g-1)/g``, all-reduce ``2*N*(g-1)/g``, all-to-all the input minus
    the own chunk, broadcast ``n*(g-1)`` at the root. A shard-dim all-to-all counts as on NCCL
    (``n*(g-1)/g`` of its padded input) also on CPU, where torch all-gathers instead: the bytes
    are those of torch's NCCL path on every backend.
    """
    count = _Count()
    with _alltoall_as_on_nccl(count), _Counting(count):
        result = fn(*args, **kwargs)
    return result, count.sent
