"""A plan's step compiled for one rank: the base programs (local copies, batched send/recv) and
the set-up every collective shares.

A program's ``start(x, async_op, carrier)`` issues its communication through ``carrier``
(``runtime/carriers.py``: in-place torch.distributed calls in eager, functional collectives
while torch.compile traces) and returns ``(works, finish)``; ``finish()`` gives this rank's
output buffer. Index tensors are built once, when the program is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..collectives.backend import one_host, select_backend
from ..layout import LayoutError
from ..planning.holdings import box_index
from ..planning.steps import Step
from ..tracing import outside_tracing
from .indices import Index, reduce_into
from .pins import plan_backend

__all__ = ["RankContext", "StepProgram", "PointToPoint", "Collective", "group_of"]


@dataclass
class RankContext:
    """This rank on one mesh: its coordinates, device, backend, and how coordinates map to ranks."""

    mesh: object
    device: torch.device
    me: tuple
    rank_of: Callable
    backend: str


@outside_tracing
def _real_slots(transfers, device) -> torch.Tensor:
    return box_index(transfers, "target").to(device)


class StepProgram:
    """One step, for one rank: ``start(x, async_op, carrier) -> works, finish``; ``finish() -> output buffer``."""

    how = "local copies"
    covers = 1  # plan steps this program runs

    @property
    def reads_input_at_finish(self) -> bool:
        """Whether ``finish()`` reads this rank's own values (its local copies) out of the input
        rather than out of what the step's communication returned: a (7, 5) ``Shard(0) ->
        Replicate()`` on 4 ranks runs as send/recv, whose finish copies rows 0-1 out of the input.
        A collective whose own values travel in it overrides this."""
        return bool(self.local_src.count)

    def __init__(self, step: Step, ctx: RankContext):
        self.step, self.ctx = step, ctx
        self.local = step.local(ctx.me)
        self.local_src = Index.of(self.local, "source", ctx.device)
        self.local_dst = Index.of(self.local, "target", ctx.device)
        self.reduce = step.reduce
        self._local_slots = None  # a local reduction's per-element slots, built on its first run only
        # a reduction whose own values land once in every slot (a sum over one summand: a data
        # axis of one rank) is a copy: no per-element slots (8 bytes per element, kept with the plan)
        self.one_summand = step.reduce is not None and self.local_dst.spans(0, step.out_size) and \
            not step.receives(ctx.me)  # (a run of slots: each once)
        self.count = None
        if step.reduce == "avg" and not self.one_summand:
            incoming = box_index([t for t in step.transfers if t.target == ctx.me], "target")
            self.count = torch.bincount(incoming, minlength=step.out_size).clamp_(min=1).to(ctx.device)

    def bytes_sent(self) -> int:
        """Bytes this rank sends for the step this program runs (the plan's direct count)."""
        return self.step.bytes_sent.get(self.ctx.me, 0)

    def local_out(self, x: torch.Tensor) -> torch.Tensor:
        """A fresh output buffer holding this rank's local copies of ``x``."""
        out = torch.empty(self.step.out_size, dtype=x.dtype, device=x.device)
        self.local_dst.put(out, self.local_src.take(x))
        return out

    @property
    def local_dst_raw(self) -> torch.Tensor:
        """This rank's local copies' target slots, one per element (for reductions, which scatter)."""
        return box_index(self.local, "target")

    def start(self, x: torch.Tensor, async_op: bool, carrier=None):
        if self.reduce is None or self.one_summand:
            return [], (lambda: self.local_out(x))
        if self._local_slots is None:  # real, also when first run inside a trace (the trace takes a constant)
            self._local_slots = _real_slots(self.local, self.ctx.device)
        return [], (lambda: reduce_into(self.step.out_size, self.local_src.take(x), self._local_slots, self.reduce,
                                        self.count, x))


class PointToPoint(StepProgram):
    """Any step: batched isend/irecv of each message, then copies or a reduce into place."""

    how = "batch_isend_irecv"

    def __init__(self, step: Step, ctx: RankContext):
        super().__init__(step, ctx)
        me = ctx.me
        peers = sorted({b for (a, b) in step.messages if a == me})
        senders = sorted({a for (a, b) in step.messages if b == me})
        self.sends = [(ctx.rank_of(p), Index.of(step.messages[(me, p)], "source", ctx.device)) for p in peers]
        self.receives = [(ctx.rank_of(p), Index.of(step.messages[(p, me)], "target", ctx.device)) for p in senders]
        if self.reduce is not None:
            self.slots = torch.cat([self.local_dst_raw] + [box_index(step.messages[(p, me)], "target")
                                                           for p in senders]).to(ctx.device)
        self.group = ctx.mesh.group()

    def start(self, x: torch.Tensor, async_op: bool, carrier):
        sends = [(rank, index.take(x)) for rank, index in self.sends]
        landing, works = carrier.exchange(self, sends, [(rank, index.count) for rank, index in self.receives], x)

        def finish():
            if self.reduce is None:
                out = self.local_out(x)
                for (_, index), incoming in zip(self.receives, landing):
                    index.put(out, incoming)
                return out
            values = torch.cat([self.local_src.take(x)] + landing)
            return reduce_into(self.step.out_size, values, self.slots, self.reduce, self.count, x)
        return works, finish


def group_of(step: Step, me):
    """The group of ``step`` this rank belongs to, or None (its mesh slice sits the step out)."""
    return next((g for g in step.groups if me in g), None)


class Collective(StepProgram):
    """Shared set-up: this rank's group, its members in group-rank order, the process group."""

    ran = None  # which implementation the last call used: "torch" (torch.distributed) or "p2p"/"multimem" (api)

    def __init__(self, step: Step, ctx: RankContext):
        super().__init__(step, ctx)
        group = group_of(step, ctx.me)
        self.members = sorted(group, key=ctx.rank_of)  # group rank j = j-th smallest global rank
        self.ranks = [ctx.rank_of(d) for d in self.members]
        self.position = self.members.index(ctx.me)
        self.group = ctx.mesh.group(step.axes)
        if sorted(ctx.mesh.group_ranks(step.axes)) != sorted(self.ranks):
            raise LayoutError(f"step {step} group {group} is not this rank's mesh group over {step.axes}")

    def through_api(self, op: str, tensor: torch.Tensor, async_op: bool) -> bool:
        """Whether this call goes through ``axedist.collectives.api`` (CUDA, NCCL, a sum, synchronous);
        sets ``ran`` to the backend ``select_backend`` picks for :func:`plan_backend` ("auto": the measured
        table; "torch" for a group that spans hosts, where a pin to the p2p kernels cannot hold)."""
        if self.ctx.backend != "nccl" or async_op or tensor.device.type != "cuda" or \
                self.reduce not in (None, "sum", "avg"):
            self.ran = "torch"
            return False
        self.ran = select_backend(op, tensor, self.group, plan_backend() if self.one_host else "torch")
        return True

    @property
    def one_host(self) -> bool:
        """Whether this step's group sits on one host (only then may the p2p kernels carry it)."""
        return one_host(self.group)[0]

    def message(self, sender, receiver) -> tuple:
        """The transfers (boxes) ``sender`` sends ``receiver`` in this step."""
        return self.step.messages[(sender, receiver)]

    def message_target(self, sender, receiver) -> torch.Tensor:
        return box_index(self.step.messages[(sender, receiver)], "target")

    def any_peer(self, device):
        return next(d for d in self.members if d != device)
