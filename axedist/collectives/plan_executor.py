"""Run a layout-inference ``Plan`` with ``torch.distributed`` (the executing half of issue 4).

``execute_plan(plan, buffer, mesh)`` takes this rank's flat local buffer (``in_size``
slots of the first step, the ``m`` axis of the source layout) and returns its flat buffer
under the target layout. Every step runs one collective per group where the step's
kind allows it, else batched ``isend``/``irecv`` (always correct). Example, 4 ranks,
a ``(8, 6)`` tensor sharded on dim 0 gathered everywhere::

    >>> plan = plan_layouts(Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"),
    ...                     Layout.parse("S[(8,6):(6,1)] + R[4:1@gpuid]"), mesh, (8, 6))
    >>> execute_plan(plan, torch.arange(12.) + 12 * rank, mesh)     # every rank: arange(48.)
    >>> print(explain_execution(plan, mesh))        # str(plan), then per step on this rank:
      executed on gloo (DeviceMesh(...)); this rank:
        1. all_gather: all_gather_into_tensor on the mesh's ('gpuid',) group; last call ran on torch.distributed

``redistribute_local(local, src_spec, dst_spec)`` is the DTensor-facing call: it pads the
true local tensor into the source buffer, runs the plans, and unpads, exactly as DTensor's
uneven shapes say. ``plan_for(src_spec, dst_spec)`` returns what it runs (a
``Redistribution``); ``with record() as ran:`` collects those of the calls made inside.
The specs are read by attribute only (``mesh``, ``layout``, ``shape``, ``full_shape``,
``full_true``, ``full_true_index``, ``reduce_op``, ``summands``): nothing here imports
``axedist.dtensor``, which sits above collectives.

Padding (uneven shapes) is never sent: the planner plans on padded layouts, then the
executor drops every transfer of a padded slot (``Plan.with_transfers``; realness follows
the values step by step) and picks, among ``plan_alternatives`` (one gather step, or one
per mesh axis in each order, or one step per changed mesh axis in each order), the one whose
real bytes are fewest (``Plan.cost``). When the two sides pad a dim differently, a route that
gathers and re-pads competes with ``plan_direct``: the true elements only, in one
all-to-all-v. A pending reduction may keep part of its summands (``[Partial, Partial] ->
[Replicate, Partial]``): the dropped ones are reduced, the kept ones stay in place.

On CUDA (NCCL) a synchronous all-gather, reduce-scatter or all-reduce (sum/avg) calls
``axedist.collectives.api`` with ``backend="auto"``: its ``select_backend`` picks the
symmetric-memory kernels or torch.distributed from the measured table per size, and
``explain_execution`` says which ran last. On gloo, and for max/min or ``async_op``,
the torch.distributed call below runs.

How each kind runs (``backend_notes`` returns this table per backend):

* ``all_gather`` -> ``all_gather_into_tensor``; chunk ``j`` is the member with group rank
  ``j`` (the ``j``-th smallest global rank), whatever order the mesh lists ranks in. Pieces of
  different sizes (an uneven dim) are padded to the largest when that adds <= PAD_LIMIT bytes.
* ``reduce_scatter`` -> ``reduce_scatter_tensor`` on NCCL. gloo: ``all_reduce`` of the
  packed input, then this rank's chunk (what gloo's own reduce_scatter does internally:
  twice the bytes of a ring reduce-scatter).
* a ``reduce_scatter`` + ``all_gather`` pair marked ``fused="all_reduce"`` -> one
  ``all_reduce`` of the packed input; each rank unpacks every member's reduced chunk.
* ``all_reduce``, ``reduce``, ``broadcast`` -> the collective of that name.
* ``all_to_all``, ``all_to_all_v`` -> ``all_to_all_single`` with split sizes (reduced
  afterwards when the step reduces); so is a ``permute`` in which every member of a mesh
  slice sends to every other (a pair swapping); other ``permute`` -> ``batch_isend_irecv``.
* groups that are not whole slices of the mesh (``mesh_axis_groups == False``), all-gathers
  whose padding would add more than PAD_LIMIT, and collectives whose packing the plan does not
  line up -> ``batch_isend_irecv``.
* ``avg`` is a sum, divided by the number of values each slot received.

Index tensors are built once per (plan, rank, device) and cached; a cached call does
one gather per message, the collective, and one scatter.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import api
from .backend import select_backend
from ..layout import Iter, Layout, LayoutError, row_major_memory
from ..layout_inference import Plan, Step, Transfer, buffer_size, plan_alternatives, plan_direct, plan_layouts

__all__ = [
    "execute_plan",
    "redistribute_local",
    "explain_execution",
    "execution_bytes",
    "backend_notes",
    "PendingBuffer",
    "Redistribution",
    "plan_for",
    "record",
    "torch_comm_bytes",
]

MEMORY = "m"
_NATIVE_OP = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
_SCATTER_OP = {"max": "amax", "min": "amin"}

# How each step kind runs per backend (gloo's substitutes, stated so explain can show them).
_GLOO_SUBSTITUTES = {
    "reduce_scatter": "all_reduce of the packed input, then this rank's chunk (gloo: 2x the bytes of a ring RS)",
    "avg": "sum, then divided by the number of values per slot (gloo has no AVG everywhere)",
}
# Set to True (tests do) to run every step as batched isend/irecv: the reference path.
FORCE_P2P = False
# What a CUDA all-gather / reduce-scatter / all-reduce step asks collectives.api for: "auto" (the
# measured table per size), or "torch" / "p2p" to pin one (AXEDIST_PLAN_BACKEND sets the default).
BACKEND = os.environ.get("AXEDIST_PLAN_BACKEND", "auto")


def backend_notes(backend: str) -> dict[str, str]:
    """``{kind: how it runs}`` on ``backend`` (``"nccl"`` or ``"gloo"``)."""
    via_api = " through collectives.api (backend='auto': p2p kernels or NCCL per size; sum/avg, synchronous)"
    notes = {
        "all_gather": "all_gather_into_tensor (unequal pieces padded to the largest)" + via_api,
        "reduce_scatter": "reduce_scatter_tensor" + via_api,
        "fused all_reduce": "all_reduce (one call for the reduce-scatter + all-gather pair)" + via_api,
        "all_reduce": "all_reduce" + via_api,
        "reduce": "reduce",
        "broadcast": "broadcast",
        "all_to_all": "all_to_all_single",
        "all_to_all_v": "all_to_all_single with split sizes",
        "permute": "batch_isend_irecv (all_to_all_single with split sizes when mesh-slice pairs swap)",
        "other groups": "batch_isend_irecv (groups that are not whole mesh slices)",
        "avg": "sum, then divided by the number of values per slot",
    }
    if backend == "gloo":
        notes.update({k: v.replace(via_api, "") for k, v in notes.items()})
        notes.update(_GLOO_SUBSTITUTES)
    return notes


# ---------------------------------------------------------------------------
# Index tensors
# ---------------------------------------------------------------------------


def _box_index(transfers: Sequence, side: str) -> torch.Tensor:
    """Flat slots of the boxes of ``transfers`` on ``side`` ("source"/"target"), row-major, concatenated."""
    parts = []
    for t in transfers:
        offset, strides = (t.source_offset, t.source_strides) if side == "source" else (t.target_offset, t.target_strides)
        index = torch.tensor(offset, dtype=torch.int64)
        for extent, stride in zip(t.extents, strides):
            index = index.unsqueeze(-1) + torch.arange(extent, dtype=torch.int64) * stride
        parts.append(index.reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


class _Index:
    """A gather/scatter index on one device: a slice when the slots are one contiguous run."""

    __slots__ = ("tensor", "start", "stop", "count")

    def __init__(self, index: torch.Tensor, device: torch.device):
        self.count = index.numel()
        self.start = self.stop = None
        if self.count == 0 or torch.equal(index, torch.arange(int(index[0]), int(index[0]) + self.count)):
            self.start = int(index[0]) if self.count else 0
            self.stop = self.start + self.count
            self.tensor = None
        else:
            self.tensor = index.to(device)

    def take(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.start:self.stop] if self.tensor is None else buffer.index_select(0, self.tensor)

    def fresh(self, buffer: torch.Tensor) -> torch.Tensor:
        """A new tensor (never a view of ``buffer``): collectives write into it in place."""
        return buffer[self.start:self.stop].clone() if self.tensor is None else buffer.index_select(0, self.tensor)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        if self.tensor is None:
            out[self.start:self.stop] = values
        else:
            out.index_copy_(0, self.tensor, values)


def _inverse(index: torch.Tensor, size: int) -> torch.Tensor | None:
    """``slot -> position in index`` (-1 elsewhere); None when a slot repeats."""
    if index.numel() and torch.unique(index).numel() != index.numel():
        return None
    inverse = torch.full((size,), -1, dtype=torch.int64)
    inverse[index] = torch.arange(index.numel())
    return inverse


# ---------------------------------------------------------------------------
# Compiling a plan for one rank
# ---------------------------------------------------------------------------


@dataclass
class _Context:
    mesh: object
    device: torch.device
    me: tuple
    rank_of: Callable
    backend: str


def _reduce_into(out_size: int, values: torch.Tensor, slots: torch.Tensor, op: str, count: torch.Tensor | None,
                 like: torch.Tensor) -> torch.Tensor:
    """Each slot = ``op`` over the values sent to it (``avg``: their sum / ``count``)."""
    if op in ("sum", "avg"):
        out = torch.zeros(out_size, dtype=like.dtype, device=like.device)
        out.index_add_(0, slots, values)
        if op == "avg":
            out = out / count if out.is_floating_point() or out.is_complex() else out.div_(count, rounding_mode="floor")
        return out
    out = torch.empty(out_size, dtype=like.dtype, device=like.device)
    return out.scatter_reduce_(0, slots, values, _SCATTER_OP[op], include_self=False)


def _finish_avg(values: torch.Tensor, divisor) -> torch.Tensor:
    if values.is_floating_point() or values.is_complex():
        return values / divisor
    return torch.div(values, divisor, rounding_mode="floor")


def _identity(op: str, dtype: torch.dtype) -> float:
    if op in ("sum", "avg"):
        return 0
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.min if op == "max" else info.max


class _StepProgram:
    """One step, for one rank: ``start(x) -> works, finish``; ``finish() -> output buffer``."""

    how = "local copies"

    def __init__(self, step: Step, ctx: _Context):
        self.step, self.ctx = step, ctx
        me = ctx.me
        local = step.local(me)
        self.local_src = _Index(_box_index(local, "source"), ctx.device)
        self.local_dst = _Index(_box_index(local, "target"), ctx.device)
        self.local_dst_raw = _box_index(local, "target")
        self.reduce = step.reduce
        self.count = None
        if step.reduce == "avg":
            incoming = _box_index([t for t in step.transfers if t.target == me], "target")
            self.count = torch.bincount(incoming, minlength=step.out_size).clamp_(min=1).to(ctx.device)

    def bytes_sent(self) -> int:
        """Bytes this rank sends for the step(s) this program covers (the plan's direct count)."""
        steps = [self.step] + ([self.gather_step] if hasattr(self, "gather_step") else [])
        return sum(s.bytes_sent.get(self.ctx.me, 0) for s in steps)

    def _local_out(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.step.out_size, dtype=x.dtype, device=x.device)
        self.local_dst.put(out, self.local_src.take(x))
        return out

    def start(self, x: torch.Tensor, async_op: bool):
        if self.reduce is None:
            return [], (lambda: self._local_out(x))
        slots = self.local_dst_raw.to(x.device)
        return [], (lambda: _reduce_into(self.step.out_size, self.local_src.take(x), slots, self.reduce, self.count, x))


class _PointToPoint(_StepProgram):
    """Any step: batched isend/irecv of each message, then copies or a reduce into place."""

    how = "batch_isend_irecv"

    def __init__(self, step: Step, ctx: _Context):
        super().__init__(step, ctx)
        me = ctx.me
        peers = sorted({b for (a, b) in step.messages if a == me})
        senders = sorted({a for (a, b) in step.messages if b == me})
        self.sends = [(ctx.rank_of(p), _Index(_box_index(step.messages[(me, p)], "source"), ctx.device)) for p in peers]
        receives = [(ctx.rank_of(p), _box_index(step.messages[(p, me)], "target")) for p in senders]
        self.receives = [(rank, _Index(slots, ctx.device)) for rank, slots in receives]
        if self.reduce is not None:
            self.slots = torch.cat([self.local_dst_raw] + [s for _, s in receives]).to(ctx.device)
        self.group = ctx.mesh.group()

    def start(self, x: torch.Tensor, async_op: bool):
        _warm(self.group, self.ctx.backend)
        ops, landing = [], []
        for rank, index in self.sends:
            ops.append(dist.P2POp(dist.isend, index.take(x).contiguous(), rank, self.group))
        for rank, index in self.receives:
            incoming = torch.empty(index.count, dtype=x.dtype, device=x.device)
            ops.append(dist.P2POp(dist.irecv, incoming, rank, self.group))
            landing.append((index, incoming))
        works = dist.batch_isend_irecv(ops) if ops else []

        def finish():
            if self.reduce is None:
                out = self._local_out(x)
                for index, incoming in landing:
                    index.put(out, incoming)
                return out
            values = torch.cat([self.local_src.take(x)] + [incoming for _, incoming in landing])
            return _reduce_into(self.step.out_size, values, self.slots, self.reduce, self.count, x)
        return works, finish


_WARM: set = set()


def _warm(group, backend: str) -> None:
    """NCCL: the first call on a group must include every member; p2p may not, so make it a collective."""
    if backend != "nccl" or id(group) in _WARM:
        return
    _WARM.add(id(group))
    dist.barrier(group=group)


def _group_of(step: Step, me):
    return next((g for g in step.groups if me in g), None)


class _Collective(_StepProgram):
    """Shared set-up: this rank's group, its members in group-rank order, the process group."""

    def __init__(self, step: Step, ctx: _Context):
        super().__init__(step, ctx)
        group = _group_of(step, ctx.me)
        self.members = sorted(group, key=ctx.rank_of)  # group rank j = j-th smallest global rank
        self.ranks = [ctx.rank_of(d) for d in self.members]
        self.position = self.members.index(ctx.me)
        self.group = ctx.mesh.group(step.axes)
        if sorted(ctx.mesh.group_ranks(step.axes)) != sorted(self.ranks):
            raise LayoutError(f"step {step} group {group} is not this rank's mesh group over {step.axes}")

    ran = None  # which implementation the last call used: "torch" (torch.distributed) or "p2p"/"multimem" (api)

    def _through_api(self, op: str, tensor: torch.Tensor, async_op: bool) -> bool:
        """Whether this call goes through ``axedist.collectives.api`` (CUDA, NCCL, a sum, synchronous);
        sets ``ran`` to the backend ``select_backend(BACKEND)`` picks ("auto": the measured table)."""
        if self.ctx.backend != "nccl" or async_op or tensor.device.type != "cuda" or \
                self.reduce not in (None, "sum", "avg"):
            self.ran = "torch"
            return False
        self.ran = select_backend(op, tensor, self.group, BACKEND)
        return True

    def message_source(self, sender, receiver) -> torch.Tensor:
        return _box_index(self.step.messages[(sender, receiver)], "source")

    def message_target(self, sender, receiver) -> torch.Tensor:
        return _box_index(self.step.messages[(sender, receiver)], "target")

    def any_peer(self, device):
        return next(d for d in self.members if d != device)


# an all-gather of pieces of different sizes (an uneven dim) pads them to the largest and runs
# as one collective while that adds at most this fraction to the bytes; above it, send/recv
PAD_LIMIT = 0.125


def _piece_counts(step: Step, members) -> list[int] | None:
    """Elements each member sends to every other in an all-gather step, in member order; None
    if some member sends different amounts to different peers (not an all-gather's pattern)."""
    counts = []
    for a in members:
        sizes = {sum(t.count for t in step.messages.get((a, b), ())) for b in members if b != a}
        if len(sizes) != 1:
            return None
        counts.append(sizes.pop())
    return counts


class _AllGather(_Collective):
    """One ``all_gather_into_tensor`` (or the p2p kernels). Pieces of different sizes are padded
    to the largest (each member sends the largest piece's size; the padding is never read), as
    long as that adds at most PAD_LIMIT to the bytes (a (31, 6) ``Shard(0) -> Replicate()`` on 4
    ranks: pieces of 8, 8, 8, 7 rows sent as 8, instead of point-to-point sends)."""

    how = "all_gather_into_tensor"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        self.send = _Index(self.message_source(me, self.any_peer(me)), ctx.device)
        counts = _piece_counts(step, self.members)
        self.n = max(counts)
        self.padded = min(counts) != self.n
        if self.padded:
            self.how = "all_gather_into_tensor (pieces padded to the largest)"
        chunks, slots = [], []
        for j, d in enumerate(self.members):
            if d != me:
                chunks.append(torch.arange(j * self.n, j * self.n + counts[j]))
                slots.append(self.message_target(d, me))
        self.chunk = _Index(torch.cat(chunks), ctx.device)
        self.slots = _Index(torch.cat(slots), ctx.device)

    @staticmethod
    def fits(step: Step, group) -> bool:
        counts = _piece_counts(step, sorted(group))
        if counts is None or sum(counts) == 0:
            return False
        return max(counts) * len(counts) <= (1 + PAD_LIMIT) * sum(counts)

    def bytes_sent(self) -> int:
        """The padded piece to every other member."""
        return self.n * self.step.itemsize * (len(self.members) - 1)

    def start(self, x, async_op):
        gathered = torch.empty(self.n * len(self.members), dtype=x.dtype, device=x.device)
        send = self.send.take(x)
        if send.numel() != self.n:
            send = torch.cat([send, send.new_zeros(self.n - send.numel())])
        send = send.contiguous()
        work = None
        if self._through_api("all_gather", send, async_op):
            api.all_gather(send, self.group, backend=self.ran, out=gathered)
        else:
            work = dist.all_gather_into_tensor(gathered, send, group=self.group, async_op=async_op)

        def finish():
            out = self._local_out(x)
            self.slots.put(out, self.chunk.take(gathered))
            return out
        return [work] if async_op and work is not None else [], finish


class _ReduceScatter(_Collective):
    """Pack every member's part in group-rank order (own part: the local boxes); reduce-scatter."""

    how = "reduce_scatter_tensor"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        self.pack = _Index(torch.cat([_box_index(step.local(me), "source") if d == me else self.message_source(me, d)
                                      for d in self.members]), ctx.device)
        self.n = self.pack.count // len(self.members)
        self.land = self.local_dst_raw.to(ctx.device)
        self.land_index = _Index(self.local_dst_raw, ctx.device)
        self.unique = _inverse(self.local_dst_raw, step.out_size) is not None
        if ctx.backend == "gloo":
            self.how = "all_reduce + own chunk (gloo)"

    @staticmethod
    def fits(step: Step, group) -> bool:
        counts = {sum(t.count for t in step.local(d)) for d in group}
        counts |= {sum(t.count for t in step.messages[(a, b)]) for a in group for b in group if a != b}
        return len(counts) == 1

    def _land(self, reduced, x):
        if self.reduce == "avg":
            reduced = _finish_avg(reduced, len(self.members))
        if self.unique:
            out = torch.empty(self.step.out_size, dtype=x.dtype, device=x.device)
            self.land_index.put(out, reduced)
            return out
        op = "avg" if self.reduce == "avg" else self.reduce
        count = torch.bincount(self.land.cpu(), minlength=self.step.out_size).clamp_(min=1).to(x.device)
        return _reduce_into(self.step.out_size, reduced, self.land, op, count, x)

    def start(self, x, async_op):
        op = getattr(dist.ReduceOp, _NATIVE_OP[self.reduce])
        if self.ctx.backend == "gloo":
            self.ran = "torch"
            packed = self.pack.fresh(x)
            work = dist.all_reduce(packed, op=op, group=self.group, async_op=async_op)
            mine = lambda: packed[self.position * self.n:(self.position + 1) * self.n]
        else:
            reduced = torch.empty(self.n, dtype=x.dtype, device=x.device)
            packed = self.pack.take(x).contiguous()
            if self._through_api("reduce_scatter", packed, async_op):
                api.reduce_scatter(packed, self.group, backend=self.ran, out=reduced)
                work = None
            else:
                work = dist.reduce_scatter_tensor(reduced, packed, op=op, group=self.group, async_op=async_op)
            mine = lambda: reduced
        return [work] if async_op and work is not None else [], (lambda: self._land(mine(), x))


class _FusedAllReduce(_ReduceScatter):
    """A reduce-scatter + all-gather pair as one all_reduce: every member's reduced chunk lands here."""

    how = "all_reduce (reduce-scatter + all-gather pair)"

    def __init__(self, step, gather_step: Step, ctx):
        super().__init__(step, ctx)
        self.how = type(self).how  # one all_reduce on every backend
        self.gather_step = gather_step
        me = ctx.me
        select, slots = [], []
        # my own part of the gather step reads my reduced chunk through my landing slots
        for d in self.members:
            inverse = _inverse(_box_index(step.local(d), "target"), step.out_size)
            if d == me:
                src, dst = _box_index(gather_step.local(me), "source"), _box_index(gather_step.local(me), "target")
            else:
                src = _box_index(gather_step.messages[(d, me)], "source")
                dst = _box_index(gather_step.messages[(d, me)], "target")
            j = self.members.index(d)
            select.append(j * self.n + inverse[src])
            slots.append(dst)
        self.select = _Index(torch.cat(select), ctx.device)
        self.slots = _Index(torch.cat(slots), ctx.device)

    @staticmethod
    def fits(step: Step, gather_step: Step, group) -> bool:
        if not _ReduceScatter.fits(step, group) or gather_step.groups != step.groups:
            return False
        for d in group:
            inverse = _inverse(_box_index(step.local(d), "target"), step.out_size)
            if inverse is None:
                return False
            reads = [_box_index(gather_step.local(d), "source")]
            reads += [_box_index(gather_step.messages[(d, p)], "source") for p in group if (d, p) in gather_step.messages]
            reads = torch.cat(reads)
            if reads.numel() and bool((inverse[reads] < 0).any()):
                return False
        return True

    def start(self, x, async_op):
        packed = self.pack.fresh(x)
        op = getattr(dist.ReduceOp, _NATIVE_OP[self.reduce])
        work = None
        if self._through_api("all_reduce", packed, async_op):
            packed = api.all_reduce(packed, self.group, backend=self.ran)
        else:
            work = dist.all_reduce(packed, op=op, group=self.group, async_op=async_op)

        def finish():
            reduced = _finish_avg(packed, len(self.members)) if self.reduce == "avg" else packed
            out = torch.empty(self.gather_step.out_size, dtype=x.dtype, device=x.device)
            self.slots.put(out, self.select.take(reduced))
            return out
        return [work] if async_op and work is not None else [], finish


class _AllReduce(_Collective):
    """Direct all-reduce: every member's message is aligned with its own landing boxes."""

    how = "all_reduce"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        self.send = _Index(self.message_source(me, self.any_peer(me)), ctx.device)
        self.land = _Index(self.message_target(self.any_peer(me), me), ctx.device)

    @staticmethod
    def fits(step: Step, group) -> bool:
        for b in group:
            a = next(d for d in group if d != b)
            sent = _box_index(step.messages[(b, a)], "source")
            landing = _box_index(step.messages[(a, b)], "target")
            local_src, local_dst = _box_index(step.local(b), "source"), _box_index(step.local(b), "target")
            inverse = _inverse(local_dst, step.out_size)
            if inverse is None or _inverse(landing, step.out_size) is None or len(local_dst) != len(landing):
                return False
            own = inverse[landing]  # where b's own value for each landing slot sits among its local copies
            if bool((own < 0).any()) or not torch.equal(local_src[own], sent):
                return False
        return True

    def bytes_sent(self) -> int:
        g = len(self.members)  # a ring all-reduce: 2 (g-1)/g of the buffer, not (g-1) direct copies
        return 2 * (g - 1) * self.send.count * self.step.itemsize // g

    def start(self, x, async_op):
        values = self.send.fresh(x)
        op = getattr(dist.ReduceOp, _NATIVE_OP[self.reduce])
        work = None
        if self._through_api("all_reduce", values, async_op):
            values = api.all_reduce(values, self.group, backend=self.ran)
        else:
            work = dist.all_reduce(values, op=op, group=self.group, async_op=async_op)

        def finish():
            reduced = _finish_avg(values, len(self.members)) if self.reduce == "avg" else values
            out = torch.empty(self.step.out_size, dtype=x.dtype, device=x.device)
            self.land.put(out, reduced)
            return out
        return [work] if async_op and work is not None else [], finish


class _Reduce(_Collective):
    """One receiver: senders reduce their (equal-boxed) messages onto it; it adds its own values after."""

    how = "reduce"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        receivers = {b for (_, b) in step.messages if b in self.members}
        (self.root,) = receivers
        self.root_rank = ctx.rank_of(self.root)
        sender = next(d for d in self.members if d != self.root)
        self.n = sum(t.count for t in step.messages[(sender, self.root)])
        if me != self.root:
            self.send = _Index(self.message_source(me, self.root), ctx.device)
        else:
            landing = self.message_target(sender, self.root)
            self.slots = torch.cat([landing, self.local_dst_raw]).to(ctx.device)

    def start(self, x, async_op):
        if self.ctx.me != self.root:
            values = self.send.fresh(x)
        else:
            values = torch.full((self.n,), _identity(self.reduce, x.dtype), dtype=x.dtype, device=x.device)
        op = getattr(dist.ReduceOp, _NATIVE_OP[self.reduce])
        work = dist.reduce(values, dst=self.root_rank, op=op, group=self.group, async_op=async_op)

        def finish():
            if self.ctx.me != self.root:
                return _StepProgram.start(self, x, False)[1]()
            every = torch.cat([values, self.local_src.take(x)])
            if self.reduce in ("max", "min"):
                return _reduce_into(self.step.out_size, every, self.slots, self.reduce, None, x)
            return _reduce_into(self.step.out_size, every, self.slots, self.reduce, self.count, x)
        return [work] if async_op else [], finish


class _Broadcast(_Collective):
    how = "broadcast"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        (self.root,) = {a for (a, _) in step.messages if a in self.members}
        receiver = next(d for d in self.members if d != self.root)
        self.root_rank = ctx.rank_of(self.root)
        self.send = _Index(self.message_source(self.root, receiver), ctx.device)
        self.n = self.send.count
        if me != self.root:
            self.land = _Index(self.message_target(self.root, me), ctx.device)

    def start(self, x, async_op):
        if self.ctx.me == self.root:
            values = self.send.fresh(x)
        else:
            values = torch.empty(self.n, dtype=x.dtype, device=x.device)
        work = dist.broadcast(values, src=self.root_rank, group=self.group, async_op=async_op)

        def finish():
            out = self._local_out(x)
            if self.ctx.me != self.root:
                self.land.put(out, values)
            return out
        return [work] if async_op else [], finish


class _AllToAll(_Collective):
    """all_to_all_single with per-member split sizes (group-rank order); a reduce step reduces after."""

    how = "all_to_all_single"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        sends, receives, self.in_splits, self.out_splits = [], [], [], []
        for d in self.members:
            out_index = self.message_source(me, d) if (me, d) in step.messages else torch.empty(0, dtype=torch.int64)
            in_slots = self.message_target(d, me) if (d, me) in step.messages else torch.empty(0, dtype=torch.int64)
            sends.append(out_index)
            receives.append(in_slots)
            self.in_splits.append(out_index.numel())
            self.out_splits.append(in_slots.numel())
        self.send = _Index(torch.cat(sends), ctx.device)
        received = torch.cat(receives)
        self.land = _Index(received, ctx.device)
        if self.reduce is not None:
            self.slots = torch.cat([self.local_dst_raw, received]).to(ctx.device)

    def start(self, x, async_op):
        values = self.send.take(x).contiguous()
        incoming = torch.empty(sum(self.out_splits), dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(incoming, values, self.out_splits, self.in_splits, group=self.group,
                                      async_op=async_op)

        def finish():
            if self.reduce is None:
                out = self._local_out(x)
                self.land.put(out, incoming)
                return out
            every = torch.cat([self.local_src.take(x), incoming])
            return _reduce_into(self.step.out_size, every, self.slots, self.reduce, self.count, x)
        return [work] if async_op else [], finish


def _choose(steps: Sequence[Step], i: int, ctx: _Context):
    """The program for step ``i`` on this rank, and how many steps it covers."""
    step = steps[i]
    if step.kind == "local" or not step.messages:
        return _StepProgram(step, ctx), 1
    if FORCE_P2P or not step.mesh_axis_groups:
        return _PointToPoint(step, ctx), 1
    group = _group_of(step, ctx.me)
    if group is None:  # this rank sits this step out (its mesh slice is idle): local copies only
        return _StepProgram(step, ctx), 1
    kind = step.kind
    if kind == "reduce_scatter" and step.fused == "all_reduce" and i + 1 < len(steps) \
            and _FusedAllReduce.fits(step, steps[i + 1], group):
        program = _FusedAllReduce(step, steps[i + 1], ctx)
        return program, 2
    if kind == "all_gather" and _AllGather.fits(step, group):
        return _AllGather(step, ctx), 1
    if kind == "reduce_scatter" and _ReduceScatter.fits(step, group):
        return _ReduceScatter(step, ctx), 1
    if kind == "all_reduce" and _AllReduce.fits(step, group):
        return _AllReduce(step, ctx), 1
    if kind == "reduce":
        return _Reduce(step, ctx), 1
    if kind == "broadcast":
        return _Broadcast(step, ctx), 1
    if kind in ("all_to_all", "all_to_all_v") or (kind == "permute" and _is_swap(step)):
        return _AllToAll(step, ctx), 1
    return _PointToPoint(step, ctx), 1


def _is_swap(step: Step) -> bool:
    """In every group, every member sends to every other (pairs exchanging, e.g. an uneven
    all-to-all over a 2-device axis): one ``all_to_all_single`` with split sizes per group, not
    send/recv. Decided over all groups, so every rank picks the same kind of call."""
    return all(len(g) > 1 and all((a, b) in step.messages for a in g for b in g if a != b) for g in step.groups)


class _Program:
    """A plan compiled for one rank: the step programs in order."""

    def __init__(self, plan: Plan, ctx: _Context):
        self.plan, self.steps = plan, []
        i = 0
        while i < len(plan.steps):
            program, covered = _choose(plan.steps, i, ctx)
            self.steps.append(program)
            i += covered


_PROGRAMS: OrderedDict = OrderedDict()
_PROGRAM_LIMIT = 512


def _context(plan: Plan, mesh) -> _Context:
    names = tuple(a for a, _ in plan.mesh)
    if names != tuple(mesh.axis_names) or tuple(n for _, n in plan.mesh) != tuple(mesh.shape):
        raise LayoutError(f"plan's mesh {plan.mesh} is not mesh {mesh} (axes {mesh.axis_names}, shape {mesh.shape})")
    coords = mesh.coordinates()
    me = tuple(coords[a] for a in names)
    backend = dist.get_backend(mesh.group())
    return _Context(mesh, mesh.device, me, lambda d: mesh.rank_at(dict(zip(names, d))), backend)


def _program(plan: Plan, mesh) -> _Program:
    device = mesh.device
    key = (id(plan), mesh, device)
    entry = _PROGRAMS.get(key)
    if entry is not None and entry.plan is plan:
        _PROGRAMS.move_to_end(key)
        return entry
    program = _Program(plan, _context(plan, mesh))
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _PROGRAM_LIMIT:
        _PROGRAMS.popitem(last=False)
    return program


class PendingBuffer:
    """What ``execute_plan(..., async_op=True)`` returns: ``wait()`` gives the output buffer.

    The first step's collective is in flight; ``wait()`` completes it and runs the rest.
    """

    def __init__(self, works, finish, rest: Callable):
        self._works, self._finish, self._rest, self._value = works, finish, rest, None

    def is_completed(self) -> bool:
        return self._value is not None or all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        if self._value is None:
            for w in self._works:
                w.wait()
            self._value = self._rest(self._finish())
        return self._value


def execute_plan(plan: Plan, buffer: torch.Tensor, mesh, async_op: bool = False):
    """This rank's flat buffer under ``plan.target`` from its flat buffer under ``plan.source``.

    ``buffer`` has ``plan.steps[0].in_size`` slots (or ``buffer_size(plan.source)`` when
    there are no steps), on ``mesh.device``. Every rank of the mesh calls this with the
    same plan. ``async_op=True`` returns a ``PendingBuffer`` (``.wait()`` -> tensor).
    """
    program = _program(plan, mesh)
    x = buffer.reshape(-1)
    expected = plan.steps[0].in_size if plan.steps else plan.in_size
    if x.numel() != expected:
        raise LayoutError(f"execute_plan: buffer has {x.numel()} slots, the plan's first step reads {expected}")

    def run_from(index: int, value: torch.Tensor) -> torch.Tensor:
        for step in program.steps[index:]:
            works, finish = step.start(value, False)
            for w in works:
                w.wait()
            value = finish()
        return value

    if not async_op:
        return run_from(0, x)
    if not program.steps:
        return PendingBuffer([], lambda: x, lambda v: v)
    works, finish = program.steps[0].start(x, True)
    works = [w for w in (works or []) if w is not None]
    return PendingBuffer(works, finish, lambda v: run_from(1, v))


_RAN_TEXT = {
    "torch": "torch.distributed",
    "p2p": "axedist.collectives.api (p2p symmetric-memory kernels)",
    "multimem": "axedist.collectives.api (multimem kernels)",
}


def execution_bytes(plan: Plan, mesh) -> int:
    """Bytes this rank sends when ``plan`` runs here: the plan's count, except that a direct
    all-reduce step runs as ``all_reduce`` (ring: ``2 (g-1)/g`` of the buffer) and an all-gather
    of unequal pieces sends the largest piece's size (padding, <= PAD_LIMIT more). Algorithmic
    bytes, as NCCL moves them (gloo's substitutes are noted in ``backend_notes``)."""
    return sum(step.bytes_sent() for step in _program(plan, mesh).steps)


def explain_execution(plan: Plan, mesh) -> str:
    """``str(plan)`` plus, per step, the torch.distributed call this rank makes for it."""
    program = _program(plan, mesh)
    backend = dist.get_backend(mesh.group())
    lines = [str(plan), f"  executed on {backend} ({mesh}); this rank:"]
    index = 1
    for step in program.steps:
        covered = 2 if isinstance(step, _FusedAllReduce) else 1
        label = f"{index}" if covered == 1 else f"{index}-{index + 1}"
        group = f" on the mesh's {step.step.axes} group" if isinstance(step, _Collective) else ""
        ran = f"; last call ran on {_RAN_TEXT[step.ran]}" if getattr(step, "ran", None) else ""
        lines.append(f"    {label}. {step.step.kind}: {step.how}{group}{ran}")
        index += covered
    if backend == "gloo":
        lines.append("  gloo: " + "; ".join(f"{k}: {v}" for k, v in _GLOO_SUBSTITUTES.items()))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# DTensor-facing: padded specs in, true local tensors out
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Side:
    """A layout over ``full`` (padded) shape and, per dim, where the true rows sit (None: leading)."""

    layout: Layout
    full: tuple[int, ...]
    positions: tuple[tuple[int, ...] | None, ...]  # per full dim: padded index of true row r, if re-padded
    rows: tuple[tuple[int, ...], ...]  # per full dim: padded index of each true row (the common map)

    @functools.cached_property
    def local_padded(self) -> tuple[int, ...]:
        blocks = self.layout.blocks(self.full)
        return tuple(math.prod(it.extent for it in block if it.axis == MEMORY) for block in blocks)

    def position_index(self, dim: int, device: torch.device) -> torch.Tensor:
        """``positions[dim]`` as an index tensor on ``device``, built once per side and device: a
        cached redistribute must not turn thousands of Python ints into a tensor and copy it to
        the GPU on every call (~0.4 ms per 4096 ints on the 2-core dev machine; the cached
        (4095, 4098) ``[S1,S1] -> [R,S0]`` spent 1.77 ms of host time per call on 4x H200, of
        which these conversions were a part)."""
        cache = self.__dict__.setdefault("_position_index", {})
        index = cache.get((dim, device))
        if index is None:
            index = cache[(dim, device)] = torch.tensor(self.positions[dim], device=device)
        return index


def _true_rows(spec) -> tuple[tuple[int, ...], ...]:
    """Per full dim (summand dim first if any), the padded index holding each true row."""
    rows = []
    for n, padded, mapping in zip(spec.full_true, spec.full_shape, spec.full_true_index):
        if mapping is None:
            rows.append(tuple(range(n)))
        else:
            where = {t: p for p, t in enumerate(mapping) if t >= 0}
            rows.append(tuple(where[t] for t in range(n)))
    return tuple(rows)


def _moved(rows) -> tuple:
    """Positions for a side holding whole dims: the true rows' padded indices where not leading."""
    return tuple(None if r == tuple(range(len(r))) else r for r in rows)


def _free_dims(layout: Layout, full) -> set[int]:
    """Dims entirely in local memory (every device holding any of the dim holds all of it)."""
    return {d for d, block in enumerate(layout.blocks(full)) if all(it.axis == MEMORY for it in block)}


def _repad(layout: Layout, full, changes: dict[int, int]) -> Layout:
    """The same map with free dim ``d`` grown to ``changes[d]`` (row-major local memory kept)."""
    blocks = [list(b) for b in layout.blocks(full)]
    for d, extent in changes.items():
        blocks[d] = [Iter(extent, 1)]
    return _from_blocks(blocks, layout.replica, layout.offset)


def _replicated(full, mesh) -> Layout:
    strides, step = [], 1
    for s in reversed(full):
        strides.append(step)
        step *= s
    return Layout([Iter(s, st) for s, st in zip(full, reversed(strides))],
                  [Iter(k, 1, a) for a, k in zip(mesh.axis_names, mesh.shape)])


def _common_sides(src_layout, src_full, src_rows, dst_layout, dst_full, dst_rows, lead: int = 0):
    """Re-pad free dims so both sides use one padded index map; None when a dim cannot be matched.

    ``lead`` = 1 when the source has a leading summand dim the target lacks (it stays as it is).
    """
    src_changes, dst_changes = {}, {}
    src_free, dst_free = _free_dims(src_layout, src_full), _free_dims(dst_layout, dst_full)
    src_pos, dst_pos = [None] * len(src_full), [None] * len(dst_full)
    src_new, dst_new, rows = list(src_full), list(dst_full), list(src_rows)
    for d, (pd, rd) in enumerate(zip(dst_full, dst_rows)):
        e = d + lead
        ps, rs = src_full[e], src_rows[e]
        if ps == pd and rs == rd:
            continue
        if e in src_free:
            src_changes[e], src_pos[e], src_new[e], rows[e] = pd, rd, pd, rd
        elif d in dst_free:
            dst_changes[d], dst_pos[d], dst_new[d] = ps, rs, ps
        else:
            return None
    src = _Side(_repad(src_layout, src_full, src_changes) if src_changes else src_layout, tuple(src_new),
                tuple(src_pos), tuple(rows))
    dst = _Side(_repad(dst_layout, dst_full, dst_changes) if dst_changes else dst_layout, tuple(dst_new),
                tuple(dst_pos), tuple(rows[lead:]))
    return src, dst


def _from_blocks(blocks, replica, offset) -> Layout:
    """The layout of per-dim iter blocks with row-major local memory (``m`` strides recomputed)."""
    _, strides = row_major_memory(blocks)
    shard = [Iter(it.extent, stride) if stride is not None else it
             for block, row in zip(blocks, strides) for it, stride in zip(block, row)]
    return Layout(shard, replica, offset)


def _held_rows(layout: Layout, full, rows, mesh, everywhere: bool = False
               ) -> list[tuple[tuple[int, ...], ...]]:
    """Per mesh position, per dim: the true rows it holds along that dim, in local order.

    The true local tensor of a device is the product of these (a local tensor is row-major
    over its dims); two layouts whose lists agree everywhere hold the same true local tensors.
    Coordinates are sums of per-dim terms (each shard iter reads the digits of one dim), so the
    layout is evaluated on each dim's own indices only: O(sum of dims x mesh size), not
    O(elements) (a (4095, 4098) tensor took minutes the other way). everywhere=True forces the
    element-wise evaluation (the tests compare the two).
    """
    held = None if everywhere or ELEMENTWISE else _held_rows_per_dim(layout, full, rows, mesh)
    return held if held is not None else _held_rows_everywhere(layout, full, rows, mesh)


def _dim_placements(layout: Layout, full, mesh):
    """Where each index of each dim puts its element, per dim: ``(device0, shifts, local_padded,
    per_dim)`` with ``per_dim[d] = (device terms, local rows)`` (lists over the indices of dim
    ``d``). An element sits at ``device0 + sum of its dims' device terms + shift`` (one shift per
    replica point), at local index ``local rows[d][i_d]`` along each dim of the row-major local
    tensor. None where the layout's memory is not per-dim row-major (an ``m`` offset, or a dim
    whose ``m`` term is not its local row, its memory digits row-major, times the row-major
    stride of the dim): then only the element-wise evaluation knows. Raises LayoutError where
    the layout has no per-dim blocks.
    ``S[(2,4,6):(1@x,6,1)]`` over ``(8, 6)`` on 2x2 (x, y): dim 0's device terms are 0 for rows
    0-3 and 2 for rows 4-7 (x = 1 is flat position 2), its local rows 0,1,2,3,0,1,2,3; dim 1's
    terms are all 0, local rows 0..5; device0 0, shifts [0], local_padded (4, 6).
    """
    blocks = layout.blocks(full)
    if layout.offset.get(MEMORY, 0) != 0:
        return None
    local_padded = tuple(math.prod(it.extent for it in block if it.axis == MEMORY) for block in blocks)
    strides = mesh.strides()
    device0, shifts = _offset_and_shifts(layout, mesh)
    per_dim = []
    for d, block in enumerate(blocks):
        device, memory, digits = _dim_terms(list(block), full[d], strides)  # the terms dim d adds
        inner = math.prod(local_padded[d + 1:])
        local = memory // inner
        # the m term must be the dim's local row (its memory digits row-major) times its stride
        if bool((memory % inner != 0).any()) or not torch.equal(local, digits):
            return None
        per_dim.append((device, local))
    return device0, shifts, local_padded, per_dim


def _held_rows_per_dim(layout: Layout, full, rows, mesh):
    """_held_rows from per-dim evaluations, or None where the memory offsets of a dim are not
    its row-major digit (then the element-wise route decides)."""
    placed = _dim_placements(layout, full, mesh)
    if placed is None:
        return None
    device0, shifts, _, per_dim = placed
    per_dim = [(device.tolist(), local.tolist()) for device, local in per_dim]
    held = [[() for _ in full] for _ in range(mesh.size)]
    for d in range(len(full)):
        others = {0}  # every sum of the other dims' device terms
        for e in range(len(full)):
            if e != d:
                others = {o + c for o in others for c in set(per_dim[e][0])}
        true_of = {row: k for k, row in enumerate(rows[d])}
        pairs: dict[int, set] = {}
        for i, (term, local) in enumerate(zip(*per_dim[d])):
            if i in true_of:
                for o in others:
                    for shift in shifts:
                        pairs.setdefault(device0 + term + o + shift, set()).add((local, true_of[i]))
        for p, found in pairs.items():
            held[p][d] = tuple(sorted(found))
    return [tuple(row) for row in held]


def _held_rows_everywhere(layout: Layout, full, rows, mesh) -> list[tuple[tuple[int, ...], ...]]:
    """_held_rows by evaluating the layout on every element (O(elements)): the reference, and
    the route for layouts whose memory offsets are not per-dim row-major."""
    n = math.prod(full)
    x = torch.arange(n, dtype=torch.int64)
    coords = layout.shard_coordinates(x)
    strides = mesh.strides()
    on = lambda a: coords[a] if isinstance(coords.get(a), torch.Tensor) else torch.full((n,), int(coords.get(a, 0)))
    device = sum((on(a) * strides[a] for a in mesh.axis_names), torch.zeros(n, dtype=torch.int64))
    blocks = layout.blocks(full)
    local_padded = [math.prod(it.extent for it in block if it.axis == MEMORY) for block in blocks]
    index, local, rest, m = [], [], x, on(MEMORY)
    for extent, lp in zip(reversed(full), reversed(local_padded)):
        index.append(rest % extent)
        rest = rest // extent
        local.append(m % lp)
        m = m // lp
    index, local = index[::-1], local[::-1]
    _, shifts = _offset_and_shifts(layout, mesh)
    held = [[() for _ in full] for _ in range(mesh.size)]
    for d in range(len(full)):
        true_of = torch.full((full[d],), -1, dtype=torch.int64)
        true_of[list(rows[d])] = torch.arange(len(rows[d]))
        t = true_of[index[d]]
        real = t >= 0
        # (device, local row, true row) triples, deduplicated through one int64 key: a 1-D
        # unique (a sort) is linear-time in practice where unique(dim=0) on rows was not
        span_local, span_true = local_padded[d] + 1, len(rows[d]) + 1
        for shift in shifts:
            key = ((device[real] + shift) * span_local + local[d][real]) * span_true + t[real]
            per: dict[int, list] = {}
            for code in torch.unique(key).tolist():
                rest_code, r = divmod(code, span_true)
                p, l_ = divmod(rest_code, span_local)
                per.setdefault(p, []).append((l_, r))
            for p, pairs in per.items():
                held[p][d] = tuple(sorted(pairs))
    return [tuple(row) for row in held]


def _gather_inner(src, dst, lead: int, mesh):
    """No common padding: keep the outer chunks both sides cut a conflicting dim into; gather
    the source's inner ones (a copy: a pending reduction's summand dim is kept), re-pad each
    device's local tensor in place to the target's padding (its inner chunks still local),
    and plan on from there (reducing then, if pending).

    ``(5, 6)`` on 2x2, ``[Shard(0), Shard(0)] -> [Shard(0), Replicate]``: dim 0 is chunked by
    x then y in the source (padded 8: rows 0,1 | 2,- | 3,- | 4,-), by x in the target
    (padded 6: rows 0,1,2 | 3,4,-). Gathering the y iter only (an all-gather over y) leaves
    x=0 with rows 0,1,2,- and x=1 with 3,-,4,-: the target's rows per device, padded
    differently, so a local copy finishes (48 B a device, not a gather of all 30 values).
    The other way round (``[Shard(1), Shard(0)] -> [Shard(1), Shard(1)]`` of ``(2, 5)`` on
    2x4) nothing is gathered: each x chunk of 3 columns is re-padded to the target's 4 slots
    (one per y) before the plan moves rows and columns over y.
    Returns (gathered side, re-padded side, true box here) or None when some device would
    hold other rows (then the caller gathers everything).
    """
    src_full, src_rows, dst_full, dst_rows = src.full_shape, _true_rows(src), dst.full_shape, _true_rows(dst)
    src_blocks, dst_blocks = [list(b) for b in src.layout.blocks(src_full)], dst.layout.blocks(dst_full)
    src_free, dst_free = _free_dims(src.layout, src_full), _free_dims(dst.layout, dst_full)
    gathered, repadded, full, rows, extra = [list(b) for b in src_blocks], [list(b) for b in src_blocks], \
        list(src_full), list(src_rows), []
    for d in range(len(dst_full)):  # a summand dim (lead = 1) stays as it is on both sides
        e = d + lead
        if (src_full[e], src_rows[e]) == (dst_full[d], dst_rows[d]) or e in src_free or d in dst_free:
            continue
        src_mesh = [it for it in src_blocks[e] if it.axis != MEMORY]
        dst_mesh = [it for it in dst_blocks[d] if it.axis != MEMORY]
        shared = 0  # the outer chunks both sides cut this dim into
        while shared < min(len(src_mesh), len(dst_mesh)) and src_mesh[shared] == dst_mesh[shared]:
            shared += 1
        gather, split = src_mesh[shared:], dst_mesh[shared:]
        gathered[e] = [Iter(it.extent, 1) if it in gather else it for it in src_blocks[e]]
        repadded[e] = [Iter(it.extent, 1) if it in split else it for it in dst_blocks[d]]
        full[e], rows[e] = dst_full[d], dst_rows[d]
        extra += gather
    replica, offset = list(src.layout.replica) + extra, src.layout.offset
    try:
        middle = _from_blocks(gathered, replica, offset)
        after = _from_blocks(repadded, replica, offset)
        if not (middle.is_injective() and after.is_injective()):
            return None
        held_middle = _held_rows(middle, src_full, src_rows, mesh)
        held_after = _held_rows(after, full, rows, mesh)
    except LayoutError:
        return None
    if any(tuple(tuple(r for _, r in dim) for dim in a) != tuple(tuple(r for _, r in dim) for dim in b)
           for a, b in zip(held_middle, held_after)):
        return None  # some device would hold other rows: not a local re-pad
    me = mesh.position()

    def positions(held):
        return tuple(None if [l_ for l_, _ in dim] == list(range(len(dim))) else tuple(l_ for l_, _ in dim)
                     for dim in held[me])

    box = tuple(len(dim) for dim in held_middle[me])
    gathered_side = _Side(middle, tuple(src_full), positions(held_middle), tuple(src_rows))
    after_side = _Side(after, tuple(full), positions(held_after), tuple(rows))
    return gathered_side, after_side, box

def _to_buffer(local: torch.Tensor, side: _Side, box, size: int) -> torch.Tensor:
    """The true local tensor (``box``) placed in the padded row-major local tensor, flattened."""
    padded = side.local_padded
    if tuple(local.shape) == padded and all(p is None for p in side.positions):
        return local.reshape(-1)  # nothing padded here: the local tensor is the buffer (never written to)
    out = torch.zeros(padded, dtype=local.dtype, device=local.device)
    if math.prod(box) == 0 or local.numel() == 0:
        return out.reshape(-1) if out.numel() == size else torch.zeros(size, dtype=local.dtype, device=local.device)
    t = local.reshape(box)
    for d, positions in enumerate(side.positions):
        if positions is not None:
            grown = list(t.shape)
            grown[d] = padded[d]
            t = torch.zeros(grown, dtype=t.dtype, device=t.device).index_copy_(
                d, side.position_index(d, t.device), t)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out.reshape(-1)


def _from_buffer(buffer: torch.Tensor, side: _Side, box) -> torch.Tensor:
    """The true local tensor (``box``) read out of the flat padded buffer."""
    if math.prod(box) == 0:
        return buffer.new_empty(box)
    t = buffer.reshape(side.local_padded)
    for d, positions in enumerate(side.positions):
        if positions is not None:
            t = t.index_select(d, side.position_index(d, t.device))
    return t[tuple(slice(0, n) for n in box)].contiguous()


@dataclass(frozen=True, repr=False)
class Redistribution:
    """How one rank moves a DTensor from spec ``src`` to spec ``dst``: the plans it runs, and the
    pad/unpad sides around them (what ``plan_for`` returns and ``record`` collects).

    ``plans`` is one plan when the two sides share one padded index map (always for even
    shapes), else two with a local re-pad between them (``middle``). With padding, the plans
    move only real elements (``plan.note`` says how many bytes of padding were left out).
    Example, ``(7,)`` on 4 ranks, ``Shard(0)`` (padded to 8: real sizes 2, 2, 2, 1) to
    ``Replicate()``: one all-gather-like step; rank 3 sends its 1 real value, the others 2.
    """

    first: _Side
    last: _Side
    plans: tuple[Plan, ...]
    middle: tuple[_Side, _Side] | None  # fallback: all-gathered on src's padding, then on dst's
    src_box: tuple[int, ...]
    dst_box: tuple[int, ...]
    reduce_op: str | None
    middle_box: tuple[int, ...] | None = None  # this rank's true local shape between the two plans

    def bytes_sent(self, mesh) -> int:
        """Bytes this rank sends when it runs (``execution_bytes`` summed over the plans)."""
        return sum(execution_bytes(p, mesh) for p in self.plans)

    def explain(self, mesh) -> str:
        """Each plan as ``explain_execution`` prints it: the plan, then the call each step makes here."""
        return "\n".join(explain_execution(p, mesh) for p in self.plans)

    def __repr__(self) -> str:
        kinds = " | ".join(" + ".join(p.kinds) or "local" for p in self.plans)
        return f"Redistribution({self.first.layout} -> {self.last.layout}: {kinds})"


_ROUTES: OrderedDict = OrderedDict()
_RECORDS: list = []


@contextlib.contextmanager
def record():
    """Collect the ``Redistribution`` of every ``redistribute_local`` this rank runs inside the block.

        >>> with record() as ran:
        ...     y = x.redistribute([Replicate()])
        >>> ran[0].bytes_sent(x.mesh), ran[0].plans[0].kinds      # e.g. (144, ('all_gather',))
    """
    ran: list = []
    _RECORDS.append(ran)
    try:
        yield ran
    finally:
        _RECORDS.remove(ran)


def _dim_terms(block, extent: int, strides) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each index of one dim: its mesh-position term, its ``m`` term and its local index
    along the dim (each iter of a grouped layout belongs to one dim, so these add up per dim)."""
    index = torch.arange(extent, dtype=torch.int64)
    device = torch.zeros(extent, dtype=torch.int64)
    memory = torch.zeros(extent, dtype=torch.int64)
    local = torch.zeros(extent, dtype=torch.int64)
    inner = 1
    for it in reversed(block):  # row-major within the block: the last iter is fastest
        digit = (index // inner) % it.extent
        inner *= it.extent
        if it.axis == MEMORY:
            memory += digit * it.stride
            local = local + digit * math.prod(i.extent for i in block[block.index(it) + 1:] if i.axis == MEMORY)
        else:
            device += digit * it.stride * strides[it.axis]
    return device, memory, local


def _spread(terms, ndim: int) -> torch.Tensor:
    """Sum of 1-D tensors, the ``d``-th along dim ``d`` of an ``ndim``-dim grid, flattened row-major."""
    total = torch.zeros((), dtype=torch.int64)
    for d, t in enumerate(terms):
        shape = [1] * ndim
        shape[d] = -1
        total = total + t.view(shape)
    return total.reshape(-1)


# Set to True (tests do) to answer every padding question element by element: the reference the
# per-dim route is checked against (also the route for layouts whose memory is not per-dim).
ELEMENTWISE = False


class _Holdings:
    """Which buffer slots of each mesh position hold real (unpadded) elements, and each
    position's true local box, for one (layout, padded shape, true rows, mesh).

    Per dim (``real``): when each position is one choice of per-dim device terms and replica
    point, what it holds is a product of per-dim index sets, so its real slots are the row-major
    product of ``real[p][d]`` (a bool per local row of dim ``d``): O(sum of dims x mesh size).
    Else ``dense``: a ``[position, slot]`` bool tensor built from every element (O(elements)),
    the reference. Example, ``(3,)`` padded to 4 as ``S[(2,2):(1@gpuid,1)]`` on 2 devices:
    position 0 holds rows 0, 1 (real ``[True, True]``), position 1 rows 2, 3 (``[True, False]``);
    boxes ``((2,), (1,))``; masks ``[[True, True], [True, False]]``.
    """

    def __init__(self, layout: Layout, full, rows, size: int, boxes, local_padded=None, real=None, dense=None):
        self.layout, self.full, self.rows, self.size, self.boxes = layout, tuple(full), rows, size, boxes
        self.local_padded, self.real, self._dense = local_padded, real, dense
        if real is not None:
            self.inner = tuple(math.prod(local_padded[d + 1:]) for d in range(len(local_padded)))

    def masks(self) -> torch.Tensor:
        """``[position, slot]``: whether the slot holds a real element (built once from ``real``)."""
        if self._dense is None:
            masks = torch.zeros(len(self.real), self.size, dtype=torch.bool)
            for p, dims in enumerate(self.real):
                if dims is not None:
                    masks[p] = _outer(dims).reshape(-1)[:self.size]
            self._dense = masks
        return self._dense

    @functools.cached_property
    def all_real(self) -> bool:
        if self.real is None:
            return bool(self._dense.all())
        return math.prod(self.local_padded) == self.size and \
            all(dims is not None and all(bool(v.all()) for v in dims) for dims in self.real)

    def keep(self, position: int, t: Transfer) -> tuple[Transfer, list[tuple[tuple[int, ...], torch.Tensor]]]:
        """Which elements of ``t``'s source box (on ``position``) are real: ``(box, groups)``, where
        ``box`` is ``t`` or the same box with a dim that runs over the end of a tensor dim's local
        rows cut in two (``(24,)`` at stride 7 over local rows of 14 slots -> ``(12, 2)`` at strides
        ``(14, 7)``), and ``groups`` are ``(box dims, bool grid over them)`` whose outer product is
        the answer: one group per tensor dim the box walks (per dim), else one of all box dims."""
        if self.real is not None:
            found = self._keep_per_dim(position, t)
            if found is not None:
                return found
        grid = self.masks()[position][_slots_of(t, "source")].reshape(t.extents)
        return t, [(tuple(range(len(t.extents))), grid)]

    def _keep_per_dim(self, position: int, t: Transfer):
        """``keep`` from the per-dim rows, or None where a box dim does not walk one tensor dim's
        local rows (after cutting at their ends), or two box dims together run past its end."""
        dims, lp, inner = self.real[position], self.local_padded, self.inner
        if dims is None:  # the layout puts nothing here
            return t, [(tuple(range(len(t.extents))), torch.zeros(t.extents, dtype=torch.bool))]
        if not 0 <= t.source_offset < math.prod(lp):
            return None
        start = [(t.source_offset // inner[d]) % lp[d] for d in range(len(lp))]
        box = []  # (extent, source stride, target stride) per box dim, cut where a walk carries
        for walk in zip(t.extents, t.source_strides, t.target_strides):
            cut = self._cut(*walk, start)
            if cut is None:
                return None
            box += cut
        if len(box) != len(t.extents):
            t = Transfer(t.source, t.target, tuple(e for e, _, _ in box), t.source_offset,
                         tuple(s for _, s, _ in box), t.target_offset, tuple(s for _, _, s in box))
        walks: dict[int, list] = {}
        groups = []
        for k, (extent, stride, _) in enumerate(box):
            d = self._walked(extent, stride)
            if d is None:
                groups.append(((k,), torch.ones(extent, dtype=torch.bool)))
            else:
                walks.setdefault(d, []).append((k, extent, stride // inner[d]))
        for d, members in walks.items():
            if not self._within(d, start[d], [(e, c) for _, e, c in members]):
                return None
            index = torch.tensor(start[d], dtype=torch.int64)
            for _, e, c in members:
                index = index.unsqueeze(-1) + torch.arange(e, dtype=torch.int64) * c
            groups.append((tuple(k for k, _, _ in members), dims[d][index]))
        # a dim no box dim walks stays at its start row: real or not for the whole box
        groups += [((), dims[d][start[d]]) for d in range(len(lp)) if d not in walks]
        return t, groups

    def _walked(self, extent: int, stride: int) -> int | None:
        """The tensor dim a box dim walks: the outermost whose row-major stride divides its stride
        (the only one it can walk without carrying); None for a box dim that stays in place."""
        if extent == 1 or stride == 0:
            return None
        return next((d for d in range(len(self.local_padded))
                     if self.local_padded[d] > 1 and stride % self.inner[d] == 0), -1)

    def _within(self, d: int, start: int, steps) -> bool:
        """Whether local row ``start`` plus any ``j * c`` (``j < e``, per ``(e, c)``) stays in dim ``d``."""
        low = start + sum(min(0, (e - 1) * c) for e, c in steps)
        high = start + sum(max(0, (e - 1) * c) for e, c in steps)
        return 0 <= low and high < self.local_padded[d]

    def _cut(self, extent: int, stride: int, target_stride: int, start) -> list | None:
        """A box dim as box dims that each walk one tensor dim: itself, or, where it runs from dim
        ``d``'s first rows over its end into the dim before (a coalesced box), an outer dim at
        ``run`` times the stride and an inner one of ``run`` steps; None where neither is exact."""
        d = self._walked(extent, stride)
        if d is None:
            return [(extent, stride, target_stride)]
        if d < 0:
            return None
        c = stride // self.inner[d]
        if self._within(d, start[d], [(extent, c)]):
            return [(extent, stride, target_stride)]
        if c <= 0 or self.local_padded[d] % c or start[d] >= c:
            return None
        run = self.local_padded[d] // c  # steps until the walk carries into dim d - 1
        if run <= 1 or extent % run:
            return None
        outer = self._cut(extent // run, run * stride, run * target_stride, start)
        return None if outer is None else outer + [(run, stride, target_stride)]

    def __repr__(self) -> str:
        how = "per dim" if self.real is not None else "element-wise"
        return f"_Holdings({self.layout} over {list(self.full)}, {how})"


def _outer(vectors) -> torch.Tensor:
    """The outer AND of 1-D bool tensors: a grid of ``len(vectors)`` dims."""
    grid = torch.ones((), dtype=torch.bool)
    for v in vectors:
        grid = grid.unsqueeze(-1) & v
    return grid


def _holdings(layout: Layout, full, rows, mesh, everywhere: bool = False) -> _Holdings:
    """What each position holds of the true rows (``rows[d]``: the padded indices of dim ``d``
    holding true rows): per dim where it factors (``_holdings_per_dim``), else element by element.
    Cached: a spec pair's first plan asks about each side several times."""
    full, rows = tuple(full), tuple(tuple(r) for r in rows)  # the cache's key
    held = None if everywhere else _holdings_per_dim(layout, full, rows, mesh)
    return held if held is not None else _holdings_everywhere(layout, full, rows, mesh)


@functools.lru_cache(maxsize=32)
def _holdings_per_dim(layout: Layout, full, rows, mesh) -> _Holdings | None:
    """``_Holdings`` from each dim's own indices, or None where a position is not one product of
    per-dim index sets (two choices of per-dim device terms, or of replica points, land on it)
    or the memory is not per-dim row-major."""
    try:
        placed = _dim_placements(layout, full, mesh)
    except LayoutError:
        return None
    if placed is None:
        return None
    device0, shifts, local_padded, per_dim = placed
    terms = [sorted(set(device.tolist())) for device, _ in per_dim]
    choice = {device0: ()}  # position -> the device term of each dim that puts elements there
    for ts in terms:
        widened = {p + t: c + (t,) for p, c in choice.items() for t in ts}
        if len(widened) != len(choice) * len(ts):
            return None
        choice = widened
    at = {p + shift: c for shift in shifts for p, c in choice.items()}
    if len(at) != len(choice) * len(shifts) or not all(0 <= p < mesh.size for p in at):
        return None
    real_of, box_of = [], []  # per dim: {device term: real local rows}, {device term: box extent}
    for d, (device, local) in enumerate(per_dim):
        true = torch.tensor(sorted(rows[d]), dtype=torch.int64)
        true_device, true_local = device[true], local[true]
        reals, boxes = {}, {}
        for t in terms[d]:
            mine = true_local[true_device == t]
            reals[t] = torch.zeros(local_padded[d], dtype=torch.bool).index_fill_(0, mine, True)
            boxes[t] = int(mine.max()) + 1 if mine.numel() else 0  # the true box is leading
        real_of.append(reals)
        box_of.append(boxes)
    real, boxes = [None] * mesh.size, [(0,) * len(full)] * mesh.size
    for p, c in at.items():
        real[p] = tuple(real_of[d][t] for d, t in enumerate(c))
        boxes[p] = tuple(box_of[d][t] for d, t in enumerate(c))
    return _Holdings(layout, full, rows, buffer_size(layout), tuple(boxes), local_padded, tuple(real))


@functools.lru_cache(maxsize=4)  # O(elements) each: few
def _holdings_everywhere(layout: Layout, full, rows, mesh) -> _Holdings:
    """``_Holdings`` from every element: each dim's iters give it a device term and an ``m`` term;
    the real elements' slots are their sums over a grid of the real rows (O(elements))."""
    strides = mesh.strides()
    blocks = layout.blocks(full)
    ndim = len(full)
    terms = [_dim_terms(list(block), extent, strides) for block, extent in zip(blocks, full)]
    real = [torch.tensor(sorted(r), dtype=torch.int64) for r in rows]
    base_device, shifts = _offset_and_shifts(layout, mesh)
    base_m = layout.offset.get(MEMORY, 0)
    device = base_device + _spread([t[0][r] for t, r in zip(terms, real)], ndim)
    memory = base_m + _spread([t[1][r] for t, r in zip(terms, real)], ndim)
    masks = torch.zeros(mesh.size, buffer_size(layout), dtype=torch.bool)
    for shift in shifts:
        masks[device + shift, memory] = True
    boxes = torch.zeros(mesh.size, ndim, dtype=torch.int64)
    for d in range(ndim):  # along dim d a box counts the true rows of d alone (any index elsewhere)
        on_d = base_device + _spread([t[0][real[e]] if e == d else t[0] for e, t in enumerate(terms)], ndim)
        sizes = [len(real[e]) if e == d else full[e] for e in range(ndim)]
        view = [1] * ndim
        view[d] = -1
        local = terms[d][2][real[d]].view(view).expand(sizes).reshape(-1)
        for shift in shifts:  # the true box is leading (DTensor checks it): its extent is the largest index + 1
            boxes[:, d].scatter_reduce_(0, on_d + shift, local + 1, "amax")
    return _Holdings(layout, full, rows, buffer_size(layout), tuple(tuple(b) for b in boxes.tolist()), dense=masks)


def _true_box(spec, side: _Side) -> tuple[int, ...]:
    """This rank's true (unpadded) local shape under ``spec`` (``side`` is its layout over padded dims)."""
    mesh = spec.mesh
    position = mesh.position()
    unpadded = spec.full_shape == spec.full_true and all(m is None for m in spec.full_true_index)
    if unpadded:  # the padded local tensor where the layout reaches this device, else empty
        return side.local_padded if position in _reached(side.layout, mesh) else (0,) * len(side.full)
    return _holdings(spec.layout, spec.full_shape, _true_rows(spec), mesh, ELEMENTWISE).boxes[position]


def _offset_and_shifts(layout: Layout, mesh) -> tuple[int, list[int]]:
    """The flat mesh position the offset ``O`` adds, and the one each replica point adds (``[0]``
    without replicas): ``O = {x: 1}`` and ``R = 2:1@y`` on 2x2 (x, y) give ``(2, [0, 1])``."""
    strides = mesh.strides()
    flat = lambda point: sum(point.get(a, 0) * strides[a] for a in mesh.axis_names)
    return flat(layout.offset), [flat(r) for r in layout.replica_offsets or ({},)]


def _reached(layout: Layout, mesh) -> set[int]:
    """Mesh positions holding any element: the mesh iters' digits (at most the mesh's size), plus replicas."""
    strides = mesh.strides()
    iters = [it for it in layout.shard if it.axis != MEMORY]
    base, offsets = _offset_and_shifts(layout, mesh)
    points = {base}
    for it in iters:
        points = {p + k * it.stride * strides[it.axis] for p in points for k in range(it.extent)}
    return {p + o for p in points for o in offsets}


def _slots_of(transfer, side: str) -> torch.Tensor:
    return _box_index([transfer], side)


def _drop_padding(plan: Plan, held: _Holdings, mesh, everywhere: bool = False) -> Plan:
    """``plan`` moving only the real elements (``held``: which slots of its first input buffers are real).

    Realness follows the values through the steps: a step's input is real where its source layout
    holds a true element (per dim, ``_holdings``), or, where that layout does not factor per dim
    (or ``everywhere``), where a real value landed in the step before. A box that is partly padding
    is cut into boxes of its real part (``_real_boxes``). Output slots of padding are then never
    written (garbage that nothing reads).
    """
    strides = mesh.strides()
    names = [a for a, _ in plan.mesh]
    position = lambda d: sum(c * strides[a] for a, c in zip(names, d))
    kept_steps, dropped, real = [], 0, held
    for i, step in enumerate(plan.steps):
        last = i + 1 == len(plan.steps)
        after = None if last or everywhere else _step_holdings(plan.steps[i + 1].source, held, plan, mesh)
        out = None if last or after is not None else torch.zeros(mesh.size, step.out_size, dtype=torch.bool)
        kept = []
        for t in step.transfers:
            box, groups = real.keep(position(t.source), t)
            count = math.prod(int(grid.sum()) for _, grid in groups)
            if out is not None and count:
                out[position(t.target), _slots_of(box, "target")[_expand(groups, box.extents).reshape(-1)]] = True
            # local copies are cut the same way (they cost nothing, but a collective's own part must
            # line up with what it sends: an all-reduce stays an all-reduce)
            if count == t.count:
                kept.append(t)
            elif count:
                kept.extend(_real_boxes(box, groups))
                dropped += 0 if t.is_local else t.count - count
            else:
                dropped += 0 if t.is_local else t.count
        kept_steps.append(kept)
        real = after if after is not None else _Holdings(step.target, (), (), step.out_size, None, dense=out)
    if not dropped:
        return plan
    return plan.with_transfers(kept_steps, note=f"padding left out: {dropped} slot(s) not sent")


def _step_holdings(layout: Layout | None, held: _Holdings, plan: Plan, mesh) -> _Holdings | None:
    """The per-dim holdings of an intermediate layout of ``plan`` (over the first input's padded
    shape, or the plan's shape once a pending reduction is done), or None where that layout does
    not factor per dim (an element-level intermediate, a partly reduced summand dim)."""
    if layout is None:
        return None
    lead = len(held.full) - len(plan.shape)
    for full, rows in ((held.full, held.rows), (held.full[lead:], held.rows[lead:])):
        if layout.size == math.prod(full):
            return _holdings_per_dim(layout, full, rows, mesh)
    return None


def _expand(groups, extents) -> torch.Tensor:
    """The bool grid over the box ``extents`` that ``_Holdings.keep``'s groups stand for."""
    grid = torch.ones(tuple(extents), dtype=torch.bool)
    for dims, part in groups:
        shape = [1] * len(extents)
        for k in dims:
            shape[k] = extents[k]
        grid = grid & part.reshape(shape)
    return grid


def _real_boxes(t, groups) -> list:
    """The real part of box ``t`` as boxes: per group of box dims, its real cells as boxes
    (``_pieces``), and the product of those over the groups."""
    pieces = [_pieces(grid) for _, grid in groups]
    boxes = []
    for choice in itertools.product(*pieces):
        runs = [None] * len(t.extents)
        for (dims, _), piece in zip(groups, choice):
            for k, run in zip(dims, piece):
                runs[k] = run
        starts = [r[0] for r in runs]
        boxes.append(Transfer(t.source, t.target, tuple(r[1] for r in runs),
                              t.source_offset + sum(s * st for s, st in zip(starts, t.source_strides)),
                              t.source_strides,
                              t.target_offset + sum(s * st for s, st in zip(starts, t.target_strides)),
                              t.target_strides))
    return boxes


def _pieces(grid: torch.Tensor) -> list[tuple[tuple[int, int], ...]]:
    """The True cells of a bool grid as boxes, ``(start, length)`` per dim: the product of each
    dim's runs when the grid is that product, else, per run of equal slices along dim 0, that
    run times the slice's boxes. ``[[1,1,0],[1,1,0],[1,0,0]]`` -> ``((0,2),(0,2))``, ``((2,1),(0,1))``."""
    if grid.dim() == 0:
        return [()] if bool(grid) else []
    if not bool(grid.any()):
        return []
    along = [grid.movedim(k, 0).reshape(grid.shape[k], -1).any(1) for k in range(grid.dim())]
    if torch.equal(_outer(along), grid):
        return list(itertools.product(*(_runs_of(a) for a in along)))
    pieces, i, n = [], 0, grid.shape[0]
    while i < n:
        j = i + 1
        while j < n and torch.equal(grid[j], grid[i]):
            j += 1
        pieces += [((i, j - i),) + piece for piece in _pieces(grid[i])]
        i = j
    return pieces


def _runs_of(flags: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of True in a 1-D bool tensor."""
    edges = torch.diff(flags.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    return list(zip(starts.tolist(), (ends - starts).tolist()))


def _cheapest(src: Layout, dst: Layout, full, itemsize: int, partial, held: _Holdings | None, mesh) -> Plan:
    """The plan to run: ``plan_layouts``' own on even shapes; with padding (``held`` says which
    slots are real), the ``plan_alternatives`` candidate that moves least once its padding is left out."""
    if held is None or held.all_real:
        return plan_layouts(src, dst, mesh, full, itemsize, partial)
    alternatives = plan_alternatives(src, dst, mesh, full, itemsize, partial)
    pruned = [_drop_padding(p, held, mesh, ELEMENTWISE) for p in alternatives]
    return min(pruned, key=lambda p: p.cost)


def _real_slots(side: _Side, mesh) -> _Holdings | None:
    """Which slots of ``side``'s buffers are real; None when nothing is padded."""
    if all(len(r) == f for r, f in zip(side.rows, side.full)):
        return None
    return _holdings(side.layout, side.full, side.rows, mesh, ELEMENTWISE)


def _inner_gather_route(src, dst, lead: int, mesh):
    """``_gather_inner``'s sides, and the target side its second plan runs to; None if none.

    The re-padded side may still re-pad dims it holds whole (``_common_sides``): those
    take that positions map, the conflicting dims keep their per-device one.
    """
    inner = _gather_inner(src, dst, lead, mesh)
    if inner is None:
        return None
    gathered, after, box = inner
    ends = _common_sides(after.layout, after.full, after.rows, dst.layout, dst.full_shape, _true_rows(dst), lead)
    if ends is None:
        return None
    middle, last = ends
    positions = tuple(p if p is not None else q for p, q in zip(middle.positions, after.positions))
    return gathered, _Side(middle.layout, middle.full, positions, middle.rows), last, box


def _full_gather_route(src, dst, lead: int, mesh):
    """Every device gathers the whole tensor on the source's padding, then re-pads it to the target's."""
    src_rows, dst_rows = _true_rows(src), _true_rows(dst)
    kept, kept_rows = src.full_shape[lead:], src_rows[lead:]
    gathered = _Side(_replicated(kept, mesh), kept, _moved(kept_rows), kept_rows)
    middle, _ = _common_sides(gathered.layout, kept, kept_rows, dst.layout, dst.full_shape, dst_rows)
    middle = _Side(middle.layout, middle.full, _moved(middle.rows), middle.rows)
    return gathered, middle, tuple(len(r) for r in kept_rows)


@dataclass(frozen=True)
class _Held:
    """What the routes read of a spec: a layout over padded dims and where the true rows sit."""

    layout: Layout
    full_shape: tuple[int, ...]
    full_true: tuple[int, ...]
    full_true_index: tuple


def _reduced_in_place(src) -> _Held:
    """``src`` after its pending reduction, with the data where it is: the summand axes become
    replicas (an all-reduce over them), the summand dim goes."""
    blocks = src.layout.blocks(src.full_shape)
    replica = list(src.layout.replica) + [it for it in blocks[0] if it.axis != MEMORY]
    offset = {a: v for a, v in src.layout.offset.items() if a != MEMORY}
    return _Held(_from_blocks(blocks[1:], replica, offset), src.full_shape[1:], src.full_true[1:],
                 src.full_true_index[1:])


def _repad_route(src, dst, lead: int, partial, itemsize: int, mesh):
    """(two plans, (gathered, re-padded, target) sides, true box between them) for specs without a
    common padding: the inner gather when it applies, else a gather of everything."""
    first = _Side(src.layout, src.full_shape, (None,) * len(src.full_shape), _true_rows(src))
    inner = _inner_gather_route(src, dst, lead, mesh)
    if inner is not None:  # copy (summands kept), re-pad, then reduce if pending
        gathered, middle, last, box = inner
        partials = (None, partial)
    else:  # reduce while gathering, re-pad, then copy
        gathered, middle, box = _full_gather_route(src, dst, lead, mesh)
        last = _common_sides(middle.layout, middle.full, middle.rows, dst.layout, dst.full_shape, _true_rows(dst))[1]
        partials = (partial, None)
    plans = (_cheapest(src.layout, gathered.layout, gathered.full, itemsize, partials[0],
                       _real_slots(first, mesh), mesh),
             _cheapest(middle.layout, last.layout, last.full, itemsize, partials[1], _real_slots(middle, mesh), mesh))
    return plans, (gathered, middle, last), box


def _route_cost(plans) -> tuple:
    """(most bytes one device sends, all bytes, steps) over consecutive plans."""
    sent: dict = {}
    for plan in plans:
        for d, b in plan.sent_per_device.items():
            sent[d] = sent.get(d, 0) + b
    return (max(sent.values(), default=0), sum(sent.values()), sum(len(p.steps) for p in plans))


@dataclass(frozen=True)
class _SplitPending:
    """A spec with a pending reduction, seen with two summand dims: (reduced, kept) (the kept
    ones stay pending, in the order the target holds them). The same map, local buffer and
    true local tensor as the spec it comes from; ``plan_for`` reduces its leading dim."""

    mesh: object
    layout: Layout
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    full_true: tuple[int, ...]
    full_true_index: tuple
    reduce_op: str
    summands: int


def _split_summands(src, dst) -> _SplitPending:
    """``src``'s summand dim cut into (the summands ``dst`` no longer has, those it keeps).

    The kept part is made of the source's summand iters that the target's summand dim has
    (same axis, stride, extent), so kept summands stay where they are: ``[Partial, Partial]``
    on 2x2 (summand iters ``2:1@x, 2:1@y``) to ``[Replicate, Partial]`` (``2:1@y``) reduces
    over ``x`` and keeps ``y``; with no such match, the inner part of the summand dim is kept
    and the plan moves it into the target's places.
    """
    summand = list(src.layout.blocks(src.full_shape)[0])
    rest = [it for block in src.layout.blocks(src.full_shape)[1:] for it in block]
    reduced, kept = list(summand), []
    for it in dst.layout.blocks(dst.full_shape)[0]:
        if it not in reduced:
            kept = None
            break
        reduced.remove(it)
        kept.append(it)
    if kept is None or math.prod(it.extent for it in kept) != dst.summands:
        outer, inner = Layout(summand).blocks((src.summands // dst.summands, dst.summands))
        reduced, kept = list(outer), list(inner)
    layout = Layout(reduced + kept + rest, src.layout.replica, src.layout.offset)
    lead = (src.summands // dst.summands, dst.summands)
    return _SplitPending(src.mesh, layout, src.shape, lead + tuple(src.full_shape[1:]), lead + tuple(src.full_true[1:]),
                         (None, None) + tuple(src.full_true_index[1:]), src.reduce_op, lead[0])


def plan_for(src, dst, itemsize: int = 4) -> Redistribution:
    """The cached ``Redistribution`` this rank runs for DTensor specs ``src -> dst`` (no data moves).

    ``src``/``dst`` are what ``redistribute_local`` takes (DTensor's specs: ``mesh``, ``layout``,
    ``shape``, ``full_shape``, ``full_true``, ``full_true_index``, ``reduce_op``, ``summands``).
    """
    mesh = src.mesh
    key = (src, dst, mesh.position(), itemsize, ELEMENTWISE)
    route = _ROUTES.get(key)
    if route is not None:
        _ROUTES.move_to_end(key)
        return route
    if src.mesh != dst.mesh or src.shape != dst.shape:
        raise LayoutError(f"redistribute keeps the mesh and shape: {src} -> {dst}")
    reduce = src.reduce_op is not None and dst.reduce_op is None
    if dst.reduce_op is not None and (src.reduce_op, src.summands) != (dst.reduce_op, dst.summands):
        if src.reduce_op != dst.reduce_op or src.summands % dst.summands:
            raise LayoutError(f"cannot redistribute to a pending {dst.reduce_op} over {dst.summands} summands from "
                              f"{src}; a pending reduction can keep part of its summands (the same op, a divisor of "
                              f"their count), else use to_partial() on a tensor whose leading dim holds the summands")
        # reduce some summands, keep the others pending: [Partial, Partial] -> [Replicate, Partial]
        src, reduce = _split_summands(src, dst), True
    partial = src.reduce_op if reduce else None
    src_full, src_rows = src.full_shape, _true_rows(src)
    dst_full, dst_rows = dst.full_shape, _true_rows(dst)
    own_src = _Side(src.layout, src_full, (None,) * len(src_full), src_rows)
    own_dst = _Side(dst.layout, dst_full, (None,) * len(dst_full), dst_rows)
    src_box, dst_box = _true_box(src, own_src), _true_box(dst, own_dst)
    lead = 1 if reduce else 0  # a reduced summand dim has no counterpart in the target
    sides = _common_sides(src.layout, src_full, src_rows, dst.layout, dst_full, dst_rows, lead)
    if sides is not None:
        first, last = sides
        plans = (_cheapest(first.layout, last.layout, last.full, itemsize, partial, _real_slots(first, mesh), mesh),)
        route = Redistribution(first, last, plans, None, src_box, dst_box, partial)
    else:
        # no common padding (torch chunks a dim two different ways): gather, re-pad locally, go on;
        # with a pending reduction, reduce first or last, whichever moves fewer bytes
        candidates = [_repad_route(src, dst, lead, partial, itemsize, mesh)]
        if reduce:
            reduced = _reduced_in_place(src)
            in_place = _cheapest(src.layout, reduced.layout, reduced.full_shape, itemsize, partial,
                                 _real_slots(own_src, mesh), mesh)
            plans, sides, box = _repad_route(reduced, dst, 0, None, itemsize, mesh)
            candidates.append(((in_place.then(plans[0]), plans[1]), sides, box))
        plans, (gathered, middle, last), box = min(candidates, key=lambda c: _route_cost(c[0]))
        route = Redistribution(own_src, last, plans, (gathered, middle), src_box, dst_box, partial, box)
        # or every true element straight from its holder into place: an all-to-all-v with no
        # padding (an uneven digit swap: (3, 6) [S1, S1] -> [S1, S0] on 2x2 sends 8 B a device
        # where gathering the inner chunks over y sends 24 B)
        direct = plan_direct(src.layout, src_full, src_rows, dst.layout, dst_full, dst_rows, mesh, itemsize, partial)
        if _route_cost((direct,)) < _route_cost(plans):
            route = Redistribution(own_src, own_dst, (direct,), None, src_box, dst_box, partial)
    _ROUTES[key] = route
    while len(_ROUTES) > _PROGRAM_LIMIT:
        _ROUTES.popitem(last=False)
    return route


def redistribute_local(local: torch.Tensor, src, dst, async_op: bool = False):
    """This rank's local tensor under spec ``dst`` from its local tensor under spec ``src``.

    ``local`` is the true (unpadded) local tensor (with the leading summand dim for a
    pending reduction); the result is the true local tensor under ``dst``. Example,
    ``(7,)`` on 4 ranks, ``Shard(0)`` (padded to 8: local sizes 2, 2, 2, 1) to
    ``Replicate()``: ranks send their 2, 2, 2 and 1 real values to every peer, then every
    rank keeps the 7 true values.
    """
    route = plan_for(src, dst, local.element_size())
    for ran in _RECORDS:
        ran.append(route)
    mesh = src.mesh
    buffer = _to_buffer(local.to(mesh.device), route.first, route.src_box, buffer_size(route.first.layout))
    if route.middle is None:
        out = execute_plan(route.plans[0], buffer, mesh, async_op=async_op)
        if async_op:
            return _Unpadding(out, lambda b: _from_buffer(b, route.last, route.dst_box))
        return _from_buffer(out, route.last, route.dst_box)
    gathered, middle_dst = route.middle
    full = execute_plan(route.plans[0], buffer, mesh)
    true = _from_buffer(full, gathered, route.middle_box)
    again = _to_buffer(true, middle_dst, route.middle_box, buffer_size(middle_dst.layout))
    out = execute_plan(route.plans[1], again, mesh)
    value = _from_buffer(out, route.last, route.dst_box)
    return _Unpadding(PendingBuffer([], lambda: value, lambda v: v), lambda v: v) if async_op else value


class _Unpadding:
    def __init__(self, pending, finish):
        self._pending, self._finish = pending, finish

    def is_completed(self) -> bool:
        return self._pending.is_completed()

    def wait(self) -> torch.Tensor:
        return self._finish(self._pending.wait())


# ---------------------------------------------------------------------------
# Measuring torch DTensor's traffic (for tests and launch/bench_redistribute.py)
# ---------------------------------------------------------------------------


def torch_comm_bytes(fn: Callable, *args, **kwargs) -> tuple[object, int]:
    """Run ``fn(*args, **kwargs)`` under torch's ``CommDebugMode``; return (result, bytes this rank sends).

    Bytes per collective in the direct model the planner uses: all-gather ``n*(g-1)``,
    reduce-scatter ``N*(g-1)/g``, all-reduce ``2*N*(g-1)/g``, all-to-all the input minus
    the own chunk, broadcast ``n*(g-1)`` at the root. A shard-dim all-to-all counts as on NCCL
    (``n*(g-1)/g`` of its padded input) also on CPU, where torch all-gathers instead: the bytes
    are those of torch's NCCL path on every backend.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor.debug import CommDebugMode

    import torch.distributed.tensor.placement_types as placement_types

    sent, paused = [0], [0]
    alltoall = placement_types.shard_dim_alltoall

    def alltoall_as_on_nccl(input, gather_dim, shard_dim, mesh, mesh_dim):
        # torch's CPU path all-gathers instead (gloo lacked alltoall when it was written); count what
        # the NCCL path sends (the padded input but its own chunk), so a CPU test sees NCCL's bytes
        if mesh.device_type != "cpu":
            return alltoall(input, gather_dim, shard_dim, mesh, mesh_dim)
        g = mesh.size(mesh_dim)
        sent[0] += input.numel() * input.element_size() * (g - 1) // g
        paused[0] += 1
        try:
            return alltoall(input, gather_dim, shard_dim, mesh, mesh_dim)
        finally:
            paused[0] -= 1

    def size_of(name) -> int:
        return _resolve_process_group(name).size() if isinstance(name, str) else name.size()

    class _Counting(CommDebugMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = getattr(func, "_overloadpacket", None)
            name = getattr(packet, "__name__", "")
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if tensor is not None and not paused[0] and \
                    not any(issubclass(t, torch.distributed.tensor.DTensor) for t in types):
                nbytes = tensor.numel() * tensor.element_size()
                if name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
                    sent[0] += nbytes * (args[1] - 1)
                elif name == "reduce_scatter_tensor":
                    g = args[2]
                    sent[0] += nbytes * (g - 1) // g
                elif name in ("all_reduce", "all_reduce_"):
                    g = size_of(args[2])
                    sent[0] += 2 * nbytes * (g - 1) // g
                elif name == "all_to_all_single":
                    g = size_of(args[3])
                    splits = args[2]
                    me = _resolve_process_group(args[3]).rank() if isinstance(args[3], str) else 0
                    own = splits[me] if splits else tensor.shape[0] // g
                    row = nbytes // max(tensor.shape[0], 1)
                    sent[0] += nbytes - own * row
                elif name == "shard_dim_alltoall":
                    g = size_of(args[3])
                    sent[0] += nbytes * (g - 1) // g
                elif name in ("broadcast", "broadcast_"):
                    g = size_of(args[2])
                    sent[0] += nbytes * (g - 1) if _resolve_process_group(args[2]).rank() == args[1] else 0
            return super().__torch_dispatch__(func, types, args, kwargs)

    placement_types.shard_dim_alltoall = alltoall_as_on_nccl
    try:
        with _Counting():
            result = fn(*args, **kwargs)
    finally:
        placement_types.shard_dim_alltoall = alltoall
    return result, sent[0]
