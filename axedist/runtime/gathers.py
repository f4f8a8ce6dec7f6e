"""Copy steps as one collective per group: all-gather, broadcast, all-to-all.

An all-gather's chunk ``j`` is the member with group rank ``j`` (the ``j``-th smallest global
rank), whatever order the mesh lists ranks in; pieces of different sizes (an uneven dim) are
padded to the largest while that adds at most ``PAD_LIMIT`` to the bytes.
"""

from __future__ import annotations

import torch

from ..planning.holdings import box_index
from ..planning.steps import Step
from .indices import Index, reduce_into
from .steps import Collective

__all__ = ["PAD_LIMIT", "AllGather", "Broadcast", "AllToAll"]

# an all-gather of pieces of different sizes (an uneven dim) pads them to the largest and runs
# as one collective while that adds at most this fraction to the bytes; above it, send/recv
PAD_LIMIT = 0.125


def _same_sources(local, sent) -> bool:
    """Whether this rank's local copies read exactly its sent piece, box for box, in order."""
    return len(local) == len(sent) and all(
        (a.source_offset, a.extents, a.source_strides) == (b.source_offset, b.extents, b.source_strides)
        for a, b in zip(local, sent))


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
    ranks: pieces of 8, 8, 8, 7 rows sent as 8, instead of point-to-point sends).

    The output is read off the gathered buffer alone, this rank's own piece included, with one
    index that is the same on every member: the program each rank runs (and the graph
    torch.compile traces on each rank) does not depend on where the rank sits in its group. In
    the common case (an even ``Shard -> Replicate``) that index is the identity and the gathered
    buffer is the output, with no copy."""

    how = "all_gather_into_tensor"

    @property
    def reads_input_at_finish(self) -> bool:
        return self.keep_local and bool(self.local_src.count)  # (else the own piece comes back gathered)

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        sent = self.message(me, self.any_peer(me))
        self.send = Index.of(sent, "source", ctx.device)
        counts = _piece_counts(step, self.members)
        self.n = max(counts)
        if min(counts) != self.n:
            self.how = "all_gather_into_tensor (pieces padded to the largest)"
        # the own piece read back from the gathered buffer like the peers' ones (rank-independent
        # code), where this rank's local copies are exactly its sent piece; else copied from x first
        own = list(self.local) if _same_sources(self.local, sent) else None
        self.keep_local = own is None
        self.pieces = []  # (start in the gathered buffer, count, where it lands here)
        for j, d in enumerate(self.members):
            boxes = (own if d == me else self.message(d, me))
            if boxes is not None:
                self.pieces.append((j * self.n, counts[j], Index.of(boxes, "target", ctx.device)))
        self.whole = (not self.keep_local and step.out_size == self.n * len(self.members)
                      and all(count == self.n and index.spans(start, start + count)
                              for start, count, index in self.pieces))

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
            if self.whole:
                return gathered
            out = self.local_out(x) if self.keep_local else torch.empty(self.step.out_size, dtype=x.dtype,
                                                                        device=x.device)
            for start, count, index in self.pieces:
                index.put(out, gathered[start:start + count])
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
        self.send = Index.of(self.message(self.root, receiver), "source", ctx.device)
        self.n = self.send.count
        if me != self.root:
            self.land = Index.of(self.message(self.root, me), "target", ctx.device)

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
    """all_to_all_single with per-member split sizes (group-rank order); a reduce step reduces after.

    Where this rank's local copies fill the gap that makes the received pieces one run over the
    whole output (``Shard(0) -> Shard(1)``: row blocks landing in order), they travel in the
    collective as the message to itself, and the received buffer is the output: one copy packs
    the send buffer (the W column blocks as one strided box), and nothing is copied after."""

    how = "all_to_all_single"

    @property
    def reads_input_at_finish(self) -> bool:
        return not self.whole and bool(self.local_src.count)  # (whole: the own copies travel as a message)

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        outgoing = [self.message(me, d) if (me, d) in step.messages else () for d in self.members]
        incoming = [self.message(d, me) if (d, me) in step.messages else () for d in self.members]
        # this rank's local copies in its place: do the received pieces then fill the output in order?
        own = tuple(self.local) if self.reduce is None else ()
        with_own = [t for d, boxes in zip(self.members, incoming) for t in (own if d == me else boxes)]
        self.whole = bool(own) and Index.of(with_own, "target", torch.device("cpu")).spans(0, step.out_size)
        if self.whole:
            self.how = "all_to_all_single (own piece sent to itself: received in place)"
            outgoing[self.position] = incoming[self.position] = own
        self.in_splits = [sum(t.count for t in boxes) for boxes in outgoing]
        self.out_splits = [sum(t.count for t in boxes) for boxes in incoming]
        self.send = Index.of([t for boxes in outgoing for t in boxes], "source", ctx.device)
        receives = [t for boxes in incoming for t in boxes]
        self.land = Index.of(receives, "target", ctx.device)
        if self.reduce is not None:
            self.slots = torch.cat([box_index(self.local, "target"), box_index(receives, "target")]).to(ctx.device)

    def start(self, x, async_op, carrier):
        values = self.send.take(x).contiguous()
        incoming, works = carrier.all_to_all(self, values, self.out_splits, self.in_splits, async_op)

        def finish():
            if self.whole:
                return incoming
            if self.reduce is None:
                out = self.local_out(x)
                self.land.put(out, incoming)
                return out
            every = torch.cat([self.local_src.take(x), incoming])
            return reduce_into(self.step.out_size, every, self.slots, self.reduce, self.count, x)
        return works, finish
