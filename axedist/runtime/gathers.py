"""Copy steps as one collective per group: all-gather, broadcast, all-to-all.

An all-gather's chunk ``j`` is the member with group rank ``j`` (the ``j``-th smallest global
rank), whatever order the mesh lists ranks in; pieces of different sizes (an uneven dim) are
padded to the largest while that adds at most ``PAD_LIMIT`` to the bytes.
"""

from __future__ import annotations

import torch

from ..planning.steps import Step
from .indices import Index, reduce_into
from .steps import Collective

__all__ = ["PAD_LIMIT", "AllGather", "Broadcast", "AllToAll"]

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


class AllGather(Collective):
    """One ``all_gather_into_tensor`` (or the p2p kernels). Pieces of different sizes are padded
    to the largest (each member sends the largest piece's size; the padding is never read), as
    long as that adds at most PAD_LIMIT to the bytes (a (31, 6) ``Shard(0) -> Replicate()`` on 4
    ranks: pieces of 8, 8, 8, 7 rows sent as 8, instead of point-to-point sends)."""

    how = "all_gather_into_tensor"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        self.send = Index(self.message_source(me, self.any_peer(me)), ctx.device)
        counts = _piece_counts(step, self.members)
        self.n = max(counts)
        if min(counts) != self.n:
            self.how = "all_gather_into_tensor (pieces padded to the largest)"
        chunks, slots = [], []
        for j, d in enumerate(self.members):
            if d != me:
                chunks.append(torch.arange(j * self.n, j * self.n + counts[j]))
                slots.append(self.message_target(d, me))
        self.chunk = Index(torch.cat(chunks), ctx.device)
        self.slots = Index(torch.cat(slots), ctx.device)

    @staticmethod
    def fits(step: Step, group) -> bool:
        counts = _piece_counts(step, sorted(group))
        if counts is None or sum(counts) == 0:
            return False
        return max(counts) * len(counts) <= (1 + PAD_LIMIT) * sum(counts)

    def bytes_sent(self) -> int:
        """The padded piece to every other member."""
        return self.n * self.step.itemsize * (len(self.members) - 1)

    def start(self, x, async_op, carrier):
        send = self.send.take(x)
        if send.numel() != self.n:
            send = torch.cat([send, send.new_zeros(self.n - send.numel())])
        gathered, works = carrier.all_gather(self, send.contiguous(), async_op)

        def finish():
            out = self.local_out(x)
            self.slots.put(out, self.chunk.take(gathered))
            return out
        return works, finish


class Broadcast(Collective):
    how = "broadcast"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        (self.root,) = {a for (a, _) in step.messages if a in self.members}
        receiver = next(d for d in self.members if d != self.root)
        self.root_rank = ctx.rank_of(self.root)
        self.send = Index(self.message_source(self.root, receiver), ctx.device)
        self.n = self.send.count
        if me != self.root:
            self.land = Index(self.message_target(self.root, me), ctx.device)

    def start(self, x, async_op, carrier):
        if self.ctx.me == self.root:
            values = self.send.fresh(x)
        else:
            values = torch.empty(self.n, dtype=x.dtype, device=x.device)
        values, works = carrier.broadcast(self, values, self.root_rank, async_op)

        def finish():
            out = self.local_out(x)
            if self.ctx.me != self.root:
                self.land.put(out, values)
            return out
        return works, finish


class AllToAll(Collective):
    """all_to_all_single with per-member split sizes (group-rank order); a reduce step reduces after."""

    how = "all_to_all_single"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        empty = torch.empty(0, dtype=torch.int64)
        sends, receives, self.in_splits, self.out_splits = [], [], [], []
        for d in self.members:
            out_index = self.message_source(me, d) if (me, d) in step.messages else empty
            in_slots = self.message_target(d, me) if (d, me) in step.messages else empty
            sends.append(out_index)
            receives.append(in_slots)
            self.in_splits.append(out_index.numel())
            self.out_splits.append(in_slots.numel())
        self.send = Index(torch.cat(sends), ctx.device)
        received = torch.cat(receives)
        self.land = Index(received, ctx.device)
        if self.reduce is not None:
            self.slots = torch.cat([self.local_dst_raw, received]).to(ctx.device)

    def start(self, x, async_op, carrier):
        values = self.send.take(x).contiguous()
        incoming, works = carrier.all_to_all(self, values, self.out_splits, self.in_splits, async_op)

        def finish():
            if self.reduce is None:
                out = self.local_out(x)
                self.land.put(out, incoming)
                return out
            every = torch.cat([self.local_src.take(x), incoming])
            return reduce_into(self.step.out_size, every, self.slots, self.reduce, self.count, x)
        return works, finish
