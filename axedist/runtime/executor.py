"""Run plans with ``torch.distributed``: each step as one collective per group where its kind
allows, else batched ``isend``/``irecv`` (always correct). Nothing is planned here.

``execute_plan(plan, buffer, mesh)`` maps this rank's flat buffer under ``plan.source`` to its
flat buffer under ``plan.target`` (an ``(8, 6)`` ``Shard(0) -> Replicate()`` on 4 ranks: rank r's
``arange(12.) + 12 r`` becomes ``arange(48.)`` everywhere); ``redistribute_local(local, src_spec,
dst_spec)`` runs the route ``plan_redistribute`` gives on true local tensors.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..caches import memo, register
from ..layout import LayoutError
from ..peers import agree, is_peer_failure, peer_error
from ..planning import Plan, buffer_size
from ..planning.holdings import true_boxes
from ..planning.redistribution import Redistribution, plan_redistribute
from ..planning.repad import side_of
from ..planning.steps import Step
from ..tracing import outside_tracing
from .buffers import from_buffer, to_buffer
from .carriers import IN_PLACE, current
from .gathers import AllGather, AllToAll, Broadcast
from .reductions import AllReduce, FusedAllReduce, Reduce, ReduceScatter
from .steps import Collective, PointToPoint, RankContext, StepProgram, group_of

__all__ = ["FORCE_P2P", "execute_plan", "explain_execution", "execution_bytes", "backend_notes", "PendingBuffer",
           "record", "redistribute_local", "agree_on_move", "programs", "true_local_shape"]

# Set to True (tests do) to run every step as batched isend/irecv: the reference path.
FORCE_P2P = False

# How each step kind runs per backend (gloo's substitutes, stated so explain can show them).
_GLOO_SUBSTITUTES = {
    "reduce_scatter": "all_reduce of the packed input, then this rank's chunk (gloo: 2x the bytes of a ring RS)",
    "avg": "sum, then divided by the number of values per slot (gloo has no AVG everywhere)",
}
_RAN_TEXT = {
    "torch": "torch.distributed",
    "p2p": "axedist.collectives.api (p2p symmetric-memory kernels)",
    "multimem": "axedist.collectives.api (multimem kernels)",
}


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


def _is_swap(step: Step) -> bool:
    """In every group, every member sends to every other (pairs exchanging, e.g. an uneven
    all-to-all over a 2-device axis): one ``all_to_all_single`` with split sizes per group, not
    send/recv. Decided over all groups, so every rank picks the same kind of call."""
    return all(len(g) > 1 and all((a, b) in step.messages for a in g for b in g if a != b) for g in step.groups)


def _choose(steps: Sequence[Step], i: int, ctx: RankContext) -> StepProgram:
    """The program for step ``i`` on this rank (it may cover step ``i + 1`` too: ``covers``)."""
    step = steps[i]
    if step.kind == "local" or not step.messages:
        return StepProgram(step, ctx)
    if FORCE_P2P or not step.mesh_axis_groups:
        return PointToPoint(step, ctx)
    group = group_of(step, ctx.me)
    if group is None:  # this rank sits this step out (its mesh slice is idle): local copies only
        return StepProgram(step, ctx)
    kind = step.kind
    if kind == "reduce_scatter" and step.fused == "all_reduce" and i + 1 < len(steps) \
            and FusedAllReduce.fits(step, steps[i + 1], group):
        return FusedAllReduce(step, steps[i + 1], ctx)
    fitting = {"all_gather": AllGather, "reduce_scatter": ReduceScatter, "all_reduce": AllReduce}
    if kind in fitting and fitting[kind].fits(step, group):
        return fitting[kind](step, ctx)
    if kind == "reduce":
        return Reduce(step, ctx)
    if kind == "broadcast":
        return Broadcast(step, ctx)
    if kind in ("all_to_all", "all_to_all_v") or (kind == "permute" and _is_swap(step)):
        return AllToAll(step, ctx)
    return PointToPoint(step, ctx)


class _Program:
    """A plan compiled for one rank: the step programs in order."""

    def __init__(self, plan: Plan, ctx: RankContext):
        self.plan, self.steps = plan, []
        i = 0
        while i < len(plan.steps):
            program = _choose(plan.steps, i, ctx)
            self.steps.append(program)
            i += program.covers


_PROGRAMS: OrderedDict = OrderedDict()  # plan -> this rank's compiled programs, least recently used first
_PROGRAM_LIMIT = 512
register("runtime.executor programs", _PROGRAMS.clear)


def programs() -> list:
    """The step programs this rank compiled and still keeps (most recently used last): what a
    test or a memory audit inspects (each program's ``steps`` and their indices)."""
    return list(_PROGRAMS.values())


def _context(plan: Plan, mesh) -> RankContext:
    names = tuple(a for a, _ in plan.mesh)
    if names != tuple(mesh.axis_names) or tuple(n for _, n in plan.mesh) != tuple(mesh.shape):
        raise LayoutError(f"plan's mesh {plan.mesh} is not mesh {mesh} (axes {mesh.axis_names}, shape {mesh.shape})")
    coords = mesh.coordinates()
    me = tuple(coords[a] for a in names)
    backend = dist.get_backend(mesh.group())
    return RankContext(mesh, mesh.device, me, lambda d: mesh.rank_at(dict(zip(names, d))), backend)


def _program(plan: Plan, mesh) -> _Program:
    key = (id(plan), mesh, mesh.device)
    entry = _PROGRAMS.get(key)
    if entry is not None and entry.plan is plan:
        _PROGRAMS.move_to_end(key)
        return entry
    program = _new_program(plan, mesh)
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _PROGRAM_LIMIT:
        _PROGRAMS.popitem(last=False)
    return program


def _failed_step(program, plan: Plan, mesh, error: RuntimeError) -> RuntimeError:
    """The ``PeerError`` for a peer's failure (timeout, closed connection) in a step's collective:
    it names the step and the ranks that did not arrive."""
    ranks = getattr(program, "ranks", None) or mesh.ranks
    what = f"{program.step.kind} over {program.step.axes} ({program.how}; plan {plan.source} -> {plan.target})"
    return peer_error(what, ranks, error)


@outside_tracing
def _new_program(plan: Plan, mesh) -> _Program:
    """Built on real tensors (index tensors, counts) even while torch.compile traces."""
    return _Program(plan, _context(plan, mesh))


class PendingBuffer:
    """What ``execute_plan(..., async_op=True)`` returns: ``wait()`` gives the output buffer.

    The first step's collective is in flight; ``wait()`` completes it and runs the rest.
    """

    def __init__(self, works, finish, rest: Callable, failed: Callable | None = None):
        self._works, self._finish, self._rest, self._value = works, finish, rest, None
        self._failed = failed

    def is_completed(self) -> bool:
        return self._value is not None or all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        if self._value is None:
            try:
                for w in self._works:
                    w.wait()
                value = self._finish()
            except RuntimeError as error:
                if self._failed is None or not is_peer_failure(error):
                    raise
                raise self._failed(error) from error
            self._value = self._rest(value)
        return self._value


def execute_plan(plan: Plan, buffer: torch.Tensor, mesh, async_op: bool = False):
    """This rank's flat buffer under ``plan.target`` from its flat buffer under ``plan.source``.

    ``buffer`` has ``plan.steps[0].in_size`` slots (or ``buffer_size(plan.source)`` when
    there are no steps), on ``mesh.device``. Every rank of the mesh calls this with the
    same plan. ``async_op=True`` returns a ``PendingBuffer`` (``.wait()`` -> tensor); nothing
    done at ``wait()`` reads ``buffer``, so a write to it once the collective has run does not
    reach the result (as with torch's, a collective still in flight may read it; a plan of no
    steps gives ``buffer`` itself, as the synchronous call does).
    """
    program = _program(plan, mesh)
    x = buffer.reshape(-1)
    expected = plan.steps[0].in_size if plan.steps else plan.in_size
    if x.numel() != expected:
        raise LayoutError(f"execute_plan: buffer has {x.numel()} slots, the plan's first step reads {expected}")

    carrier = current()

    def run_from(index: int, value: torch.Tensor) -> torch.Tensor:
        for step in program.steps[index:]:
            try:
                works, finish = step.start(value, False, carrier)
                for w in works:
                    w.wait()
                value = finish()
            except RuntimeError as error:
                if not is_peer_failure(error):
                    raise
                raise _failed_step(step, plan, mesh, error) from error
        return value

    if not async_op or carrier is not IN_PLACE:  # a traced graph's collectives are functional: no handles
        return run_from(0, x)
    if not program.steps:
        return PendingBuffer([], lambda: x, lambda v: v)
    first = program.steps[0]
    if first.reads_input_at_finish:
        # its finish, at wait(), copies this rank's own values out of x, which may be the caller's
        # tensor (to_buffer does not copy an unpadded local tensor): an in-place write to it made
        # between this call and wait() must not reach the result
        x = x.clone()
    try:
        works, finish = first.start(x, True, carrier)
    except RuntimeError as error:
        if not is_peer_failure(error):
            raise
        raise _failed_step(first, plan, mesh, error) from error
    works = [w for w in (works or []) if w is not None]
    return PendingBuffer(works, finish, lambda v: run_from(1, v), lambda e: _failed_step(first, plan, mesh, e))


def _plans(what: Plan | Redistribution) -> tuple[Plan, ...]:
    return what.plans if isinstance(what, Redistribution) else (what,)


def execution_bytes(what: Plan | Redistribution, mesh) -> int:
    """Bytes this rank sends when a plan (or every plan of a route) runs here: the plans' count,
    except that a direct all-reduce step runs as ``all_reduce`` (ring: ``2 (g-1)/g`` of the buffer)
    and an all-gather of unequal pieces sends the largest piece's size (padding, <= PAD_LIMIT
    more). Algorithmic bytes, as NCCL moves them (gloo's substitutes are noted in ``backend_notes``)."""
    return sum(step.bytes_sent() for plan in _plans(what) for step in _program(plan, mesh).steps)


def explain_execution(what: Plan | Redistribution, mesh) -> str:
    """Per plan: ``str(plan)``, then the torch.distributed call this rank makes for each step."""
    return "\n".join(_explain_plan(plan, mesh) for plan in _plans(what))


def _explain_plan(plan: Plan, mesh) -> str:
    program = _program(plan, mesh)
    backend = dist.get_backend(mesh.group())
    lines = [str(plan), f"  executed on {backend} ({mesh}); this rank:"]
    index = 1
    for step in program.steps:
        label = f"{index}" if step.covers == 1 else f"{index}-{index + step.covers - 1}"
        group = f" on the mesh's {step.step.axes} group" if isinstance(step, Collective) else ""
        ran = f"; last call ran on {_RAN_TEXT[step.ran]}" if getattr(step, "ran", None) else ""
        lines.append(f"    {label}. {step.step.kind}: {step.how}{group}{ran}{_carrier(step, backend, mesh)}")
        index += step.covers
    if backend == "gloo":
        lines.append("  gloo: " + "; ".join(f"{k}: {v}" for k, v in _GLOO_SUBSTITUTES.items()))
    return "\n".join(lines)


def _carrier(program, backend: str, mesh) -> str:
    """What carries a collective step on a mesh that spans hosts: ``; nccl (crosses hosts)``, or
    ``; nccl or p2p kernels (one host)`` (nothing on one host, where every step is alike)."""
    if not isinstance(program, Collective) or not mesh.inter_node_axes:
        return ""
    if not program.one_host:
        return f"; {backend} (crosses hosts)"
    return f"; {backend}{' or p2p kernels' if backend == 'nccl' else ''} (one host)"


_RECORDS: list = []


class Ran(list):
    """The routes a ``record()`` block ran, in order. ``storages[i]``: the storage address of
    route i's source local tensor (a parameter and its transpose share one), None where it has
    none to read (a fake tensor while torch.compile traces)."""

    def __init__(self):
        super().__init__()
        self.storages: list[int | None] = []


def _storage_address(local: torch.Tensor) -> int | None:
    try:
        return local.untyped_storage().data_ptr()
    except Exception:  # a fake or functional tensor of a trace: no storage to name (a record must not fail a move)
        return None


@contextlib.contextmanager
def record():
    """Collect the ``Redistribution`` of every ``redistribute_local`` this rank runs inside the block.

        >>> with record() as ran:
        ...     y = x.redistribute([Replicate()])
        >>> execution_bytes(ran[0], x.mesh), ran[0].kinds      # e.g. (144, ('all_gather',))
    """
    ran = Ran()
    _RECORDS.append(ran)
    try:
        yield ran
    finally:  # by identity: an enclosing record with the same routes so far is an equal list
        del _RECORDS[next(i for i, r in enumerate(_RECORDS) if r is ran)]


class _Unpadding:
    """A pending route: ``wait()`` completes its plan, then reads the true local tensor out."""

    def __init__(self, pending, finish):
        self._pending, self._finish = pending, finish

    def is_completed(self) -> bool:
        return self._pending.is_completed()

    def wait(self) -> torch.Tensor:
        return self._finish(self._pending.wait())


def _homed(moved, home: torch.device, async_op: bool):
    """A route's result (``async_op``: its handle) on ``home``, the device its input piece was on."""
    return _Unpadding(moved, lambda t: t.to(home)) if async_op else moved.to(home)


def redistribute_local(local: torch.Tensor, src, dst, async_op: bool = False):
    """This rank's local tensor under spec ``dst`` from its local tensor under spec ``src``.

    ``local`` is the true (unpadded) local tensor (with the leading summand dim for a
    pending reduction); the result is the true local tensor under ``dst``. Example,
    ``(7,)`` on 4 ranks, ``Shard(0)`` (padded to 8: local sizes 2, 2, 2, 1) to
    ``Replicate()``: ranks send their 2, 2, 2 and 1 real values to every peer, then every
    rank keeps the 7 true values.
    """
    if local.is_meta:  # no values to move (a model built on the meta device): the local tensor's shape under dst
        return torch.empty(true_local_shape(dst), dtype=local.dtype, device="meta")
    route = _planned(src, dst, local.element_size())
    if id(route) not in _AGREED_ROUTES:
        agree_on_move(route.src, route.dst, local.element_size())
        if len(_AGREED_ROUTES) > 4096:
            _AGREED_ROUTES.clear()
        _AGREED_ROUTES[id(route)] = route
    if _RECORDS:
        storage = _storage_address(local)
        for ran in _RECORDS:
            ran.append(route)
            ran.storages.append(storage)
    return run_route(route, local, async_op)


def true_local_shape(spec) -> tuple[int, ...]:
    """This rank's true (unpadded) local shape under ``spec`` (no pending reduction)."""
    if spec.reduce_op:
        raise LayoutError(f"true_local_shape: {spec.layout} is pending a {spec.reduce_op}")
    side = side_of(spec)
    return true_boxes(side.layout, side.full, side.rows, spec.mesh)[spec.mesh.position()]


_AGREED: dict = memo("runtime.executor agreed moves")  # (src, dst, item size) -> True: checked (or sends nothing)
_AGREED_ROUTES: dict = memo("runtime.executor agreed routes")   # id(route) -> route: the fast answer for route objects seen (kept alive, ids unique)


def _planned(src, dst, itemsize: int) -> Redistribution:
    """``plan_redistribute(src, dst, itemsize)``; a target the planner refuses on this rank is
    posted to the peers' agreement check before it is raised, so they raise at once naming it
    (``rank 0: raised LayoutError: ...``) instead of waiting out the timeout."""
    try:
        return plan_redistribute(src, dst, itemsize)
    except LayoutError as error:
        agree(src.mesh.ranks, "redistribute", "", failed=error)
        raise


def _communicates(route: Redistribution) -> bool:
    """Whether any step of ``route`` sends between devices (``Replicate -> Shard`` keeps a local
    chunk: no step does). Read off the plan, which every rank derives alike from the specs."""
    return any(step.messages for step in route.steps)


def agree_on_move(src, dst, itemsize: int) -> None:
    """Before this rank first moves a tensor from spec ``src`` to ``dst``: every rank of the mesh
    is about to make the same move (``peers.agree``: one exchange on the job's store), else every
    rank raises ``RankDisagreementError`` naming each rank's source and target. Later moves pay
    a set lookup (``redistribute_local``: a dict lookup by route). Keyed by the specs, not by a
    cached route object, so the check never repeats on one rank only (a plan cache that evicts
    differently on another rank).

    A move that sends nothing (no move at all, or ``Replicate -> Shard``'s local chunk) is not
    checked: a rank may make it alone, as torch lets it (``if rank == 0: print(loss.full_tensor())``),
    without waiting for peers or shifting the count of checks its peers share."""
    if src is dst or src == dst:  # no move
        return
    key = (src, dst, itemsize)
    if key not in _AGREED:
        if _communicates(_planned(src, dst, itemsize)):
            agree(src.mesh.ranks, "redistribute",
                  f"{src.canonical_text()} -> {dst.canonical_text()}, {itemsize}-byte elements")
        _AGREED[key] = True


def run_route(route: Redistribution, local: torch.Tensor, async_op: bool = False):
    """Run ``route`` on this rank's true local tensor: pad, the plans (a local re-pad between
    two), unpad. ``async_op=True`` returns a handle whose ``wait()`` gives the tensor."""
    mesh = route.src.mesh
    p = mesh.position()
    home = local.device
    if home != mesh.device:  # a piece kept on the CPU (FSDP's CPU offload) moves on the mesh's device, then comes back
        return _homed(run_route(route, local.to(mesh.device), async_op), home, async_op)
    buffer = to_buffer(local, route.first, p, route.src_boxes[p], buffer_size(route.first.layout))
    if route.repad is None:
        out = execute_plan(route.plans[0], buffer, mesh, async_op=async_op)
        if async_op:
            return _Unpadding(out, lambda b: from_buffer(b, route.last, p, route.dst_boxes[p]))
        return from_buffer(out, route.last, p, route.dst_boxes[p])
    repad = route.repad
    full = execute_plan(route.plans[0], buffer, mesh)
    true = from_buffer(full, repad.gathered, p, repad.boxes[p])
    again = to_buffer(true, repad.repadded, p, repad.boxes[p], buffer_size(repad.repadded.layout))
    out = execute_plan(route.plans[1], again, mesh)
    value = from_buffer(out, route.last, p, route.dst_boxes[p])
    return _Unpadding(PendingBuffer([], lambda: value, lambda v: v), lambda v: v) if async_op else value
