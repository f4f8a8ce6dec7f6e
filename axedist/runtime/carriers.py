"""What carries a plan step's communication: the same step programs run on either carrier.

* :data:`IN_PLACE` (eager): torch.distributed's in-place calls, asynchronous handles included,
  and on CUDA the p2p kernels through ``collectives.api`` where its table picks them.
* :data:`FUNCTIONAL` (while torch.compile traces): torch's functional collectives
  (``torch.distributed._functional_collectives``), which return new tensors that Inductor can
  schedule and overlap, and axedist's own p2p collectives as custom ops where the same table
  picks them. Collectives that have no functional form run as one that does: a send/recv
  exchange as one ``all_to_all_single`` with zero-sized splits for the ranks that exchange
  nothing, a reduce to one rank as an all-reduce.

Each call returns ``(result, works)``: ``result`` is valid once every handle in ``works`` has
been waited for (the functional carrier returns none). A 2-rank ``all_gather`` of ``[a0, a1]``
and ``[b0, b1]`` gives ``[a0, a1, b0, b1]`` on both, either way.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..collectives import api
from ..collectives.fallback import all_gather_into, reduce_scatter_into
from ..tracing import compiling

__all__ = ["InPlace", "Functional", "IN_PLACE", "FUNCTIONAL", "current", "all_reduce_"]

# dtypes gloo's collectives refuse ("Invalid scalar type"); data that only moves goes as bytes
_GLOO_LACKS = frozenset(getattr(torch, name) for name in ("int16", "uint16", "uint32", "uint64")
                        if hasattr(torch, name))
_NATIVE_OP = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
_FUNCTIONAL_OP = {"sum": "sum", "avg": "sum", "max": "max", "min": "min", "product": "product"}


def _op(reduce: str):
    return getattr(dist.ReduceOp, _NATIVE_OP[reduce])


class InPlace:
    """torch.distributed's in-place collectives (eager)."""

    name = "torch.distributed (in place)"

    def all_gather(self, program, send, async_op):
        if program.ctx.backend == "gloo" and send.dtype in _GLOO_LACKS:
            # gloo has no such dtype: gathering moves bytes, so gather them as bytes
            program.ran = "torch"
            raw = send.contiguous().view(torch.uint8)
            gathered = torch.empty(raw.numel() * len(program.members), dtype=torch.uint8, device=send.device)
            work = all_gather_into(gathered, raw, group=program.group, async_op=async_op)
            return gathered.view(send.dtype), _handles(work, async_op)
        gathered = torch.empty(send.numel() * len(program.members), dtype=send.dtype, device=send.device)
        if program.through_api("all_gather", send, async_op):
            api.run_all_gather(send, program.group, backend=program.ran, out=gathered)
            return gathered, []
        work = all_gather_into(gathered, send, group=program.group, async_op=async_op)
        return gathered, _handles(work, async_op)

    def reduce_scatter(self, program, packed, async_op):
        n = packed.numel() // len(program.members)
        if program.ctx.backend == "gloo":  # gloo: all_reduce of the packed input, then this rank's chunk
            program.ran = "torch"
            work = dist.all_reduce(packed, op=_op(program.reduce), group=program.group, async_op=async_op)
            return packed[program.position * n:(program.position + 1) * n], _handles(work, async_op)
        reduced = torch.empty(n, dtype=packed.dtype, device=packed.device)
        if program.through_api("reduce_scatter", packed, async_op):
            api.run_reduce_scatter(packed, program.group, backend=program.ran, out=reduced)
            return reduced, []
        work = reduce_scatter_into(reduced, packed, op=_op(program.reduce), group=program.group,
                                          async_op=async_op)
        return reduced, _handles(work, async_op)

    def all_reduce(self, program, values, async_op):
        """``values`` may be a view of the step's input: the api's kernels reduce out of place,
        torch.distributed's in-place all-reduce runs on a copy."""
        if program.through_api("all_reduce", values, async_op):
            return api.run_all_reduce(values, program.group, backend=program.ran), []
        values = values.clone()
        work = dist.all_reduce(values, op=_op(program.reduce), group=program.group, async_op=async_op)
        return values, _handles(work, async_op)

    def reduce(self, program, values, root_rank, async_op):
        work = dist.reduce(values, dst=root_rank, op=_op(program.reduce), group=program.group, async_op=async_op)
        return values, _handles(work, async_op)

    def broadcast(self, program, values, root_rank, async_op):
        work = dist.broadcast(values, src=root_rank, group=program.group, async_op=async_op)
        return values, _handles(work, async_op)

    def all_to_all(self, program, values, out_splits, in_splits, async_op):
        incoming = torch.empty(sum(out_splits), dtype=values.dtype, device=values.device)
        work = dist.all_to_all_single(incoming, values, out_splits, in_splits, group=program.group,
                                      async_op=async_op)
        return incoming, _handles(work, async_op)

    def exchange(self, program, sends, receives, like):
        """Send ``sends`` (``[(global rank, values)]``), receive ``receives`` (``[(global rank,
        count)]``): the received tensors in ``receives`` order."""
        _warm(program.group, program.ctx.backend)
        ops, landing = [], []
        for rank, values in sends:
            ops.append(dist.P2POp(dist.isend, values.contiguous(), rank, program.group))
        for rank, count in receives:
            incoming = torch.empty(count, dtype=like.dtype, device=like.device)
            ops.append(dist.P2POp(dist.irecv, incoming, rank, program.group))
            landing.append(incoming)
        return landing, (dist.batch_isend_irecv(ops) if ops else [])


class Functional:
    """torch's functional collectives (and axedist's p2p kernels as custom ops): traceable."""

    name = "functional collectives"

    def all_gather(self, program, send, async_op):
        if program.through_api("all_gather", send, False) and program.ran != "torch":
            return torch.ops.axedist.all_gather(send, program.group.group_name, program.ran), []
        return funcol.all_gather_tensor(send, 0, program.group), []

    def reduce_scatter(self, program, packed, async_op):
        n = packed.numel() // len(program.members)
        op = _FUNCTIONAL_OP[program.reduce]
        if program.ctx.backend == "gloo":  # gloo has no reduce_scatter: the all_reduce substitute, as in eager
            program.ran = "torch"
            reduced = funcol.all_reduce(packed, op, program.group)
            return reduced[program.position * n:(program.position + 1) * n], []
        if program.through_api("reduce_scatter", packed, False) and program.ran != "torch":
            return torch.ops.axedist.reduce_scatter(packed, program.group.group_name, program.ran), []
        return funcol.reduce_scatter_tensor(packed, op, 0, program.group), []

    def all_reduce(self, program, values, async_op):
        if program.through_api("all_reduce", values, False) and program.ran != "torch":
            return torch.ops.axedist.all_reduce(values, program.group.group_name, program.ran), []
        return funcol.all_reduce(values, _FUNCTIONAL_OP[program.reduce], program.group), []

    def reduce(self, program, values, root_rank, async_op):
        # no functional reduce to one rank: every member gets the reduction (the root reads it)
        return funcol.all_reduce(values, _FUNCTIONAL_OP[program.reduce], program.group), []

    def broadcast(self, program, values, root_rank, async_op):
        return funcol.broadcast(values, dist.get_group_rank(program.group, root_rank), program.group), []

    def all_to_all(self, program, values, out_splits, in_splits, async_op):
        return funcol.all_to_all_single(values, list(out_splits), list(in_splits), program.group), []

    def exchange(self, program, sends, receives, like):
        members = sorted(program.ctx.mesh.ranks)  # the mesh group's ranks in group-rank order
        outgoing = dict(sends)
        incoming_counts = dict(receives)
        pieces = [outgoing[r].reshape(-1) for r in members if r in outgoing]
        values = torch.cat(pieces) if pieces else like.new_empty(0)
        in_splits = [outgoing[r].numel() if r in outgoing else 0 for r in members]
        out_splits = [incoming_counts.get(r, 0) for r in members]
        received = funcol.all_to_all_single(values, out_splits, in_splits, program.group)
        starts, offset = {}, 0
        for r, count in zip(members, out_splits):
            starts[r] = offset
            offset += count
        return [received[starts[r]:starts[r] + count] for r, count in receives], []


# (weak: a group destroyed leaves, so a new group at its address is warmed too)
_WARM: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()


def _warm(group, backend: str) -> None:
    """NCCL: the first call on a group must include every member; p2p may not, so make it a collective."""
    if backend != "nccl" or group in _WARM:
        return
    _WARM.add(group)
    dist.barrier(group=group)


def _handles(work, async_op) -> list:
    return [work] if async_op and work is not None else []


IN_PLACE = InPlace()
FUNCTIONAL = Functional()


def current():
    """The carrier for a step run now: functional while torch.compile traces, else in place."""
    return FUNCTIONAL if compiling() else IN_PLACE


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """``tensor`` reduced over ``group`` in place (``op``: sum, max, min, product), as a sharding
    rule's local function needs it: ``dist.all_reduce`` in eager, a functional all-reduce copied
    back while torch.compile traces. Two ranks holding 1 and 2: both hold 3."""
    if compiling():
        return tensor.copy_(funcol.all_reduce(tensor, _FUNCTIONAL_OP[op], group))
    dist.all_reduce(tensor, op=_op(op), group=group)
    return tensor
