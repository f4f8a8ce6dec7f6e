"""torch's ``register_sharding`` (``torch.distributed.tensor.experimental``): an op's sharding
given as strategies for one mesh axis, made an axedist rule.

The user's function takes the op's arguments, each DTensor replaced by its ``ArgSpec`` (``shape``,
``ndim``, ``dtype``, ``placements``, ``mesh``), and returns the acceptable shardings, each a pair
``(output placements, input placements)``: one placement per output and per argument (``None``
for a non-tensor), each for a single mesh axis. As torch does, every combination over the mesh's
axes is a candidate; candidates that mix pending-reduction kinds, shard a dim into more pieces
than it has elements, or (for an in-place op) move ``self`` are dropped; of the rest, the one
whose input moves send the fewest bytes wins (the first among equals). Softmax along the last
dim, sharded anywhere else::

    >>> @register_sharding(torch.ops.aten._softmax.default)
    ... def softmax_sharding(x, dim, half_to_float):
    ...     dim = dim % x.ndim
    ...     return [([Replicate()], [Replicate(), None, None])] + [
    ...         ([Shard(d)], [Shard(d), None, None]) for d in range(x.ndim) if d != dim]
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Shard

from ..caches import reset
from ..layout import LayoutError
from ..planning import plan_redistribute
from ..spec import target_spec
from .registry import RULES, ArgSpec, OpCall, Sharding, moved_to

__all__ = ["register_sharding"]


def register_sharding(op):
    """Decorator: the function gives ``op``'s shardings (an overload, a list of them, or a packet:
    all its overloads); it replaces axedist's own rule for them, as torch's replaces DTensor's.
    Call it on every rank at the same point (it clears the process's cached plans)."""
    ops = op if isinstance(op, (list, tuple)) else [op]
    overloads = []
    for o in ops:
        if isinstance(o, torch._ops.OpOverloadPacket):
            overloads += [getattr(o, name) for name in o.overloads()]
        elif isinstance(o, torch._ops.OpOverload):
            overloads.append(o)
        else:
            raise TypeError(f"register_sharding takes ops (torch.ops.<namespace>.<op>[.<overload>]), got {o!r}")

    def wrap(fn: Callable):
        if not callable(fn):
            raise TypeError(f"register_sharding decorates a function, got {type(fn).__name__}")
        for overload in overloads:
            RULES[overload] = _rule_from(fn)
        reset()  # plans cached from the rules replaced
        return fn

    return wrap


def _rule_from(fn: Callable) -> Callable[[OpCall], Sharding]:
    def rule(call: OpCall) -> Sharding:
        return _choose(call, fn(*call.args, **call.kwargs), fn.__name__)

    rule.__name__ = f"register_sharding({fn.__name__})"
    return rule


def _choose(call: OpCall, shardings, name: str) -> Sharding:
    returns = len(call.func._schema.returns)
    specs = call.specs
    axes = call.mesh.ndim
    rows = [_row(s, returns, name) for s in shardings]
    in_place = _mutates_self(call)
    if not rows:
        raise ValueError(f"{call.func}: {name} gave no sharding")
    best, best_cost = None, None
    for combo in itertools.product(rows, repeat=axes):
        outputs = [_per_axis(column) for column in zip(*(r[0] for r in combo))]
        inputs = [p for p in (_per_axis(column) for column in zip(*(r[1] for r in combo))) if p is not None]
        if len(inputs) != len(specs):
            raise ValueError(f"{call.func}: {name} gave placements for {len(inputs)} tensor arguments; the call "
                             f"has {len(specs)} DTensor arguments ({specs})")
        if any(_mixed_partials(p) for p in outputs + inputs if p is not None):
            continue
        if not all(_fits(spec, p) for spec, p in zip(specs, inputs)):
            continue
        if in_place and (inputs[0] != specs[0].placements or outputs[0] != specs[0].placements):
            continue
        cost = sum(_bytes_to(spec, p) for spec, p in zip(specs, inputs))
        if best_cost is None or cost < best_cost:
            best, best_cost = (outputs, inputs), cost
    if best is None:
        where = [s.placements for s in specs]
        raise ValueError(f"{call.func}: none of {name}'s shardings fits arguments in {where} on mesh "
                         f"{call.mesh.axis_names} (an in-place op keeps self's placements)")
    outputs, inputs = best
    return Sharding(inputs=[moved_to(spec, p) for spec, p in zip(specs, inputs)],
                    outputs=tuple(outputs) if returns > 1 else outputs[0],
                    note=f"register_sharding: {name}")


def _row(sharding, returns: int, name: str) -> tuple[list, list]:
    """One acceptable sharding as (output entries, argument entries)."""
    try:
        outs, ins = sharding
    except (TypeError, ValueError):
        raise ValueError(f"{name} returned {sharding!r} among its shardings; each is a pair "
                         f"(output placements, input placements)") from None
    outs, ins = list(outs), list(ins)
    if len(outs) != returns:
        raise ValueError(f"{name}: {len(outs)} output placements for an op with {returns} outputs")
    return outs, ins


def _per_axis(column: Sequence) -> tuple | None:
    """One entry's placements over the mesh axes (``None``: a non-tensor, as the first axis says)."""
    return None if column[0] is None else tuple(column)


def _mixed_partials(placements: tuple) -> bool:
    kinds = {p.reduce_op for p in placements if isinstance(p, Partial)}
    return len(kinds) > 1 and kinds != {"sum", "avg"}


def _fits(spec: ArgSpec, placements: tuple) -> bool:
    """Whether each sharded dim has at least as many elements as pieces (torch's test)."""
    pieces: dict[int, int] = {}
    for size, p in zip(spec.mesh.shape, placements):
        if isinstance(p, Shard):
            if not -spec.ndim <= p.dim < spec.ndim:
                return False
            d = p.dim % spec.ndim
            pieces[d] = pieces.get(d, 1) * size
    return all(spec.shape[d] >= n for d, n in pieces.items())


def _mutates_self(call: OpCall) -> bool:
    arguments = call.func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _bytes_to(spec: ArgSpec, placements: tuple) -> int:
    """The bytes a device sends at most to move the argument to ``placements`` (0: it is there)."""
    if spec.placements == placements:
        return 0
    try:
        dst = target_spec(spec.spec, placements, None, None)
    except (LayoutError, ValueError):
        return 1 << 62  # a move the planner cannot make is the last choice
    if dst == spec.spec:
        return 0
    plan = plan_redistribute(spec.spec, dst, spec.dtype.itemsize)
    return max(plan.bytes_sent.values(), default=0)
