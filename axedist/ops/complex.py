"""Complex numbers: the conjugate and negative views, and complex <-> real views.

torch marks ``z.conj()`` (``aten._conj``) and ``_neg_view`` with a bit on the result instead
of computing it; ops read the bit later. A DTensor's wrapper never carries these bits (it is
made by ``_make_wrapper_subclass``), so a local tensor must not either: a collective reads
raw memory and would drop the bit, and the wrapper's ``is_conj()`` would say False over a
conjugated piece. So here these views compute their values (``conj_physical``, ``neg``), and
``DTensor`` materializes any bit a local tensor arrives with (``DTensor.__new__``). Both are
linear over the reals, so a pending sum stays pending: ``conj(a + b) = conj(a) + conj(b)``.

``view_as_complex`` reads the last dim (2: real, imaginary) as one complex element and
``view_as_real`` splits it out again; every other dim keeps its shard. Example, 4 ranks:
``x`` of shape ``(8, 3, 2)`` in ``[Shard(0)]`` -> ``view_as_complex(x)`` of shape ``(8, 3)`` in
``[Shard(0)]``, local ``(2, 3)``, no communication; a shard of the last dim is gathered first
(one element must stay whole on one device).
"""

from __future__ import annotations

import torch

from .registry import LINEAR_REDUCE_OPS, OpCall, Partial, Replicate, Sharding, register
from .tensor_ops import renumber, shard_dim

aten = torch.ops.aten

__all__ = ["conjugate_rule", "view_as_complex_rule", "view_as_real_rule"]


def _linear_places(spec) -> tuple | None:
    """Placements kept by a map linear over the reals: every shard, pending sums and averages."""
    if spec.placements is None:
        return None
    return tuple(Replicate() if isinstance(p, Partial) and p.reduce_op not in LINEAR_REDUCE_OPS else p
                 for p in spec.placements)


def _materialized(func):
    """The values of a bit-marking view, computed (``_conj`` -> ``conj_physical``)."""
    compute = torch.conj_physical if func is aten._conj.default else torch.neg

    def local(call, x):
        return compute(x)

    return local


@register(aten._conj.default, aten._neg_view.default)
def conjugate_rule(call: OpCall) -> Sharding:
    """``z.conj()`` of ``[Shard(0)]`` -> ``[Shard(0)]``, values conjugated on each rank."""
    (spec,) = call.specs
    places = _linear_places(spec)
    if places is None or places == spec.placements:  # exactly the input's spec (padding and all)
        return Sharding(inputs=[None], outputs=spec, local=_materialized(call.func), copies=True)
    return Sharding(inputs=[places], outputs=places, local=_materialized(call.func), copies=True)


def _complex_local(call, x):
    # torch's view needs stride 1 on the pair and even strides elsewhere; a local piece that
    # is not laid out so is copied (a view of a gathered tensor already is a fresh buffer)
    try:
        return torch.view_as_complex(x)
    except RuntimeError:
        return torch.view_as_complex(x.contiguous())


@register(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall) -> Sharding:
    """``(..., n, 2)`` real -> ``(..., n)`` complex: the pair dim whole, other shards kept."""
    (spec,) = call.specs
    last = spec.ndim - 1
    places = _linear_places(spec) or (Replicate(),) * call.mesh.ndim
    places = tuple(Replicate() if shard_dim(p, spec.ndim) == last else p for p in places)
    out = renumber(places, spec.ndim, lambda d: d)
    return Sharding(inputs=[None if places == spec.placements else places], outputs=out, local=_complex_local)


@register(aten.view_as_real.default)
def view_as_real_rule(call: OpCall) -> Sharding:
    """``(..., n)`` complex -> ``(..., n, 2)`` real: every shard kept."""
    (spec,) = call.specs
    places = _linear_places(spec) or (Replicate(),) * call.mesh.ndim
    out = renumber(places, spec.ndim, lambda d: d)  # dims made non-negative: the output has one more
    return Sharding(inputs=[None if places == spec.placements else places], outputs=out)
