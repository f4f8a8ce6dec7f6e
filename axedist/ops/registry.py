"""Sharding rules: what an op's inputs must look like and what its outputs are.

One module per op family (``pointwise``, ``matmul``, ``view``, ...) registers a rule
for each aten overload it knows with ``@register``. A rule sees the op's arguments with
every DTensor replaced by an :class:`ArgSpec` (shape, dtype, placements, layout: no
data) and returns a :class:`Sharding`:

    >>> @register(aten.mm.default)
    ... def mm(call):                                   # x: [Shard(1)], w: [Shard(0)]
    ...     return Sharding(inputs=([Shard(1)], [Shard(0)]), outputs=[Partial()])

The dispatcher (``ops/dispatcher.py``) redistributes each DTensor argument to the rule's
``inputs`` (``None``: leave it as it is), runs the op on the local tensors (or the rule's
``local`` function), and wraps the results with ``outputs``. Rules are pure: they never
communicate, so their results are cached per (op, argument specs).

An op with no rule runs through the fallback (gather every argument, run the op on the
whole tensors, lay the result out replicated) with a one-time warning naming the op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..layout import Layout
from ..mesh import DeviceMesh

__all__ = ["ArgSpec", "OpCall", "collect_leaves", "Sharding", "register", "rule_for", "overload_named", "moved_to",
           "RULES", "LINEAR_REDUCE_OPS", "Partial", "Replicate", "Shard"]

Placements = tuple[Placement, ...]

# The pending reductions a linear map commutes with: f(sum of summands) = sum of f(summand),
# the same for avg; so p + q, p * 2, p @ w keep such a pending value pending.
LINEAR_REDUCE_OPS = ("sum", "avg")


@dataclass(frozen=True)
class ArgSpec:
    """What a rule knows of one DTensor argument: ``f32[8,6] (Shard(0),) on gpuid=4``.

    ``placements`` is None when the layout has no placement form (block-cyclic, a subset
    of the mesh, ...); a rule may then ask for placements and the dispatcher moves the data.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh
    layout: Layout
    placements: Placements | None
    reduce_op: str | None = None            # pending reduction (a Partial placement)
    spec: Any = field(default=None, compare=False, hash=False, repr=False)  # dtensor's full spec

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def sharded_dims(self) -> dict[int, list[str]]:
        """``{dim: [mesh axes sharding it, outermost first]}`` (from placements)."""
        out: dict[int, list[str]] = {}
        for axis, p in zip(self.mesh.axis_names, self.placements or ()):
            if isinstance(p, Shard):
                out.setdefault(p.dim % max(self.ndim, 1), []).append(axis)
        return out

    def is_replicated(self) -> bool:
        return self.placements is not None and all(isinstance(p, Replicate) for p in self.placements)

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        where = self.placements if self.placements is not None else self.layout
        return f"{dtype}{list(self.shape)} {where}"


def collect_leaves(value, kinds: tuple, found: list) -> None:
    """Append ``value``'s leaves of ``kinds`` to ``found`` (lists and tuples flattened). A module
    function, not a closure that calls itself: such a closure is a reference cycle, which kept
    what it found (an op's tensors) alive until the garbage collector ran."""
    if isinstance(value, kinds):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            collect_leaves(v, kinds, found)


@dataclass
class OpCall:
    """An op call as rules see it: DTensor arguments are ArgSpecs, everything else as given."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    mesh: DeviceMesh

    def leaves(self, kinds: tuple = (ArgSpec,)) -> list:
        """The arguments of these types in argument order (args, then kwargs; lists flattened)."""
        found: list = []
        for value in list(self.args) + list(self.kwargs.values()):
            collect_leaves(value, kinds, found)
        return found

    @property
    def specs(self) -> list[ArgSpec]:
        """The ArgSpecs in argument order (args, then kwargs; lists flattened)."""
        return self.leaves()

    def arg(self, index: int, name: str, default=None):
        """The argument at position ``index``, else the keyword ``name``, else ``default``:
        ``call.arg(2, "keepdim", False)`` of ``x.sum(1)`` is False."""
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)

    def meta_outputs(self) -> list | None:
        """The op's outputs on meta tensors of the global shapes, flattened (None: no meta
        kernel): the shapes the local results must have, e.g. ``cudnn_batch_norm``'s empty
        statistics in eval mode where ``native_batch_norm``'s are (C,)."""
        try:
            out = self.func(*_on_meta(self.args), **{k: _on_meta(v) for k, v in self.kwargs.items()})
        except (NotImplementedError, RuntimeError):
            return None
        return list(out) if isinstance(out, (list, tuple)) else [out]


def _on_meta(value):
    """An argument with its ArgSpecs (and plain tensors: 0-dim scalars) as meta tensors."""
    if isinstance(value, ArgSpec):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    return value


@dataclass
class Sharding:
    """A rule's answer.

    ``inputs``: one entry per ArgSpec of the call (``OpCall.specs`` order): the placements
    that argument must have, or ``None`` to take it as it is. ``outputs``: placements for
    the single output, or a tuple with one entry per output (``None`` for a non-tensor
    output). An output entry may also be a ``Layout`` (the map of the output over its
    global shape, e.g. a view of a block-cyclic tensor). ``local``: run this instead of the
    op on the local tensors, ``local(call, *args, **kwargs)`` with DTensors replaced by
    their local tensors (a rule that must communicate, e.g. cross-entropy over sharded
    classes, does it here). ``out_shape``: the global output shape(s) when meta execution
    of the op cannot give them (rarely needed). ``copies``: for a view op, ``local`` computes
    the view's values anew (``z.conj()``): the output is a view of a copy, as where the
    input moves (``DTensor._copied_view``).
    """

    inputs: Sequence[Placements | None]
    outputs: Any
    local: Callable | None = None
    out_shape: Any = None
    note: str = ""
    copies: bool = False


RULES: dict[torch._ops.OpOverload, Callable[[OpCall], Sharding]] = {}


def register(*ops: torch._ops.OpOverload):
    """Register the decorated rule for each aten overload (or every overload of a packet)."""

    def add(rule: Callable[[OpCall], Sharding]):
        for op in ops:
            overloads = [getattr(op, name) for name in op.overloads()] if isinstance(op, torch._ops.OpOverloadPacket) \
                else [op]
            for overload in overloads:
                if overload in RULES and RULES[overload] is not rule:
                    raise ValueError(f"two sharding rules for {overload}: {RULES[overload].__name__} and {rule.__name__}")
                RULES[overload] = rule
        return rule

    return add


def rule_for(func: torch._ops.OpOverload) -> Callable[[OpCall], Sharding] | None:
    return RULES.get(func)


def moved_to(spec: ArgSpec | None, want) -> tuple | None:
    """A rule's input target for ``spec``: the placements ``want``, or None where the argument
    already is there (or is no DTensor): nothing to move."""
    return None if spec is None or spec.placements == tuple(want) else tuple(want)


def overload_named(name: str) -> torch._ops.OpOverload | None:
    """``aten.<packet>.<overload>`` from ``"packet.overload"``, or None where this torch lacks it
    (rule tables name ops that only some torch versions have)."""
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload, None)
