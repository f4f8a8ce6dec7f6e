"""Reducing steps as one collective per group: reduce-scatter, all-reduce, reduce.

On gloo a reduce-scatter runs as an ``all_reduce`` of the packed input, then this rank's chunk
(what gloo's own reduce_scatter does internally); a reduce-scatter + all-gather pair marked
``fused="all_reduce"`` runs as one ``all_reduce``; ``avg`` is a sum divided by the count.
"""

from __future__ import annotations

import torch

from ..planning.holdings import box_index
from ..planning.steps import Step
from .indices import Index, finish_avg, identity, inverse, reduce_into
from .steps import Collective, StepProgram

__all__ = ["ReduceScatter", "FusedAllReduce", "AllReduce", "Reduce"]


class ReduceScatter(Collective):
    """Pack every member's part in group-rank order (own part: the local boxes); reduce-scatter."""

    how = "reduce_scatter_tensor"
    reads_input_at_finish = False  # the own part travels in the collective

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        self.pack = Index.of([t for d in self.members for t in (self.local if d == me else self.message(me, d))],
                             "source", ctx.device)
        self.n = self.pack.count // len(self.members)
        self.land_index = self.local_dst
        # one contiguous run of slots lands each value once: no per-element index of a flat FSDP
        # buffer (millions of slots, seconds of a first step) to prove it
        run = self.land_index.tensor is None and self.land_index.boxes is None
        landing = None if run else self.local_dst_raw
        self.unique = run or inverse(landing, step.out_size) is not None
        if not self.unique:  # slots that several reduced values land in
            self.land = landing.to(ctx.device)
            self.land_count = torch.bincount(landing, minlength=step.out_size).clamp_(min=1).to(ctx.device)
        if ctx.backend == "gloo":
            self.how = "all_reduce + own chunk (gloo)"

    @staticmethod
    def fits(step: Step, group) -> bool:
        counts = {sum(t.count for t in step.local(d)) for d in group}
        counts |= {sum(t.count for t in step.messages[(a, b)]) for a in group for b in group if a != b}
        return len(counts) == 1

    def _land(self, reduced, x):
        if self.reduce == "avg":
            reduced = finish_avg(reduced, len(self.members))
        if self.unique:
            out = torch.empty(self.step.out_size, dtype=x.dtype, device=x.device)
            self.land_index.put(out, reduced)
            return out
        return reduce_into(self.step.out_size, reduced, self.land, self.reduce, self.land_count, x)

    def start(self, x, async_op, carrier):
        # gloo reduces the packed buffer in place (its all_reduce substitute): a fresh copy of x
        packed = self.pack.fresh(x) if self.ctx.backend == "gloo" else self.pack.take(x).contiguous()
        mine, works = carrier.reduce_scatter(self, packed, async_op)
        return works, (lambda: self._land(mine, x))


class FusedAllReduce(ReduceScatter):
    """A reduce-scatter + all-gather pair as one all_reduce: every member's reduced chunk lands here."""

    how = "all_reduce (reduce-scatter + all-gather pair)"
    covers = 2

    def __init__(self, step, gather_step: Step, ctx):
        super().__init__(step, ctx)
        self.how = type(self).how  # one all_reduce on every backend
        self.gather_step = gather_step
        me = ctx.me
        select, slots = [], []
        # my own part of the gather step reads my reduced chunk through my landing slots
        for d in self.members:
            where = inverse(box_index(step.local(d), "target"), step.out_size)
            reads = gather_step.local(me) if d == me else gather_step.messages[(d, me)]
            j = self.members.index(d)
            select.append(j * self.n + where[box_index(reads, "source")])
            slots.append(box_index(reads, "target"))
        self.select = Index(torch.cat(select), ctx.device)
        self.slots = Index(torch.cat(slots), ctx.device)
        # every reduced value read once, in place (P -> R): the reduced buffer is the output
        self.whole = self.select.spans(0, self.n * len(self.members)) and self.slots.spans(0, gather_step.out_size)
        if self.whole:
            self.how = "all_reduce (reduce-scatter + all-gather pair; the reduced buffer is the output)"

    @staticmethod
    def fits(step: Step, gather_step: Step, group) -> bool:
        if not ReduceScatter.fits(step, group) or gather_step.groups != step.groups:
            return False
        for d in group:
            where = inverse(box_index(step.local(d), "target"), step.out_size)
            if where is None:
                return False
            reads = [box_index(gather_step.local(d), "source")]
            reads += [box_index(gather_step.messages[(d, p)], "source") for p in group if (d, p) in gather_step.messages]
            reads = torch.cat(reads)
            if reads.numel() and bool((where[reads] < 0).any()):
                return False
        return True

    def bytes_sent(self) -> int:
        """The plan's direct count over both steps it runs."""
        return sum(s.bytes_sent.get(self.ctx.me, 0) for s in (self.step, self.gather_step))

    def start(self, x, async_op, carrier):
        packed, works = carrier.all_reduce(self, self.pack.take(x).contiguous(), async_op)

        def finish():
            reduced = finish_avg(packed, len(self.members)) if self.reduce == "avg" else packed
            if self.whole:
                return reduced
            out = torch.empty(self.gather_step.out_size, dtype=x.dtype, device=x.device)
            self.slots.put(out, self.select.take(reduced))
            return out
        return works, finish


class AllReduce(Collective):
    """Direct all-reduce: every member's message is aligned with its own landing boxes."""

    how = "all_reduce"
    reads_input_at_finish = False  # the own values travel in the collective

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        self.send = Index.of(self.message(me, self.any_peer(me)), "source", ctx.device)
        self.land = Index.of(self.message(self.any_peer(me), me), "target", ctx.device)
        self.whole = self.land.spans(0, step.out_size)
        if self.whole:
            self.how = "all_reduce (the reduced buffer is the output)"

    @staticmethod
    def fits(step: Step, group) -> bool:
        for b in group:
            a = next(d for d in group if d != b)
            sent = box_index(step.messages[(b, a)], "source")
            landing = box_index(step.messages[(a, b)], "target")
            local_src, local_dst = box_index(step.local(b), "source"), box_index(step.local(b), "target")
            where = inverse(local_dst, step.out_size)
            if where is None or inverse(landing, step.out_size) is None or len(local_dst) != len(landing):
                return False
            own = where[landing]  # where b's own value for each landing slot sits among its local copies
            if bool((own < 0).any()) or not torch.equal(local_src[own], sent):
                return False
        return True

    def bytes_sent(self) -> int:
        g = len(self.members)  # a ring all-reduce: 2 (g-1)/g of the buffer, not (g-1) direct copies
        return 2 * (g - 1) * self.send.count * self.step.itemsize // g

    def start(self, x, async_op, carrier):
        values, works = carrier.all_reduce(self, self.send.take(x).contiguous(), async_op)

        def finish():
            reduced = finish_avg(values, len(self.members)) if self.reduce == "avg" else values
            if self.whole:
                return reduced
            out = torch.empty(self.step.out_size, dtype=x.dtype, device=x.device)
            self.land.put(out, reduced)
            return out
        return works, finish


class Reduce(Collective):
    """One receiver: senders reduce their (equal-boxed) messages onto it; it adds its own values after."""

    how = "reduce"

    def __init__(self, step, ctx):
        super().__init__(step, ctx)
        me = ctx.me
        (self.root,) = {b for (_, b) in step.messages if b in self.members}
        self.root_rank = ctx.rank_of(self.root)
        sender = next(d for d in self.members if d != self.root)
        self.n = sum(t.count for t in step.messages[(sender, self.root)])
        if me != self.root:
            self.send = Index.of(self.message(me, self.root), "source", ctx.device)
        else:
            landing = self.message_target(sender, self.root)
            self.slots = torch.cat([landing, self.local_dst_raw]).to(ctx.device)

    def start(self, x, async_op, carrier):
        if self.ctx.me != self.root:
            values = self.send.fresh(x)
        else:
            values = torch.full((self.n,), identity(self.reduce, x.dtype), dtype=x.dtype, device=x.device)
        values, works = carrier.reduce(self, values, self.root_rank, async_op)

        def finish():
            if self.ctx.me != self.root:
                return StepProgram.start(self, x, False, carrier)[1]()
            every = torch.cat([values, self.local_src.take(x)])
            if self.reduce in ("max", "min"):
                return reduce_into(self.step.out_size, every, self.slots, self.reduce, None, x)
            return reduce_into(self.step.out_size, every, self.slots, self.reduce, self.count, x)
        return works, finish
