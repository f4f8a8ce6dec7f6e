"""Matrix products: mm, bmm, addmm, baddbmm.

Per mesh axis the rule picks one of the product's shardings and moves the operands
there as cheaply as possible (the elements a device sends, ``planning.cost.placement_move_elements``;
slicing a replicated operand is free):

* rows:     ``a`` Shard(rows), ``b`` Replicate      -> output Shard(rows)
* columns:  ``a`` Replicate,  ``b`` Shard(cols)     -> output Shard(cols)
* batch:    both Shard(0) (bmm)                     -> output Shard(0)
* contract: ``a`` Shard(K), ``b`` Shard(K)          -> output Partial("sum")
* linear:   one operand Partial(sum/avg), the other Replicate -> output Partial
* replicate everything                              -> output Replicate

Example, 4 ranks: ``x`` ``(8, 16)`` in ``[Shard(1)]`` times ``w`` ``(16, 6)`` in
``[Shard(0)]`` is the row-parallel product: no data moves, the output ``(8, 6)`` is a
pending sum (``[Partial()]``); ``w`` in ``[Replicate()]`` instead is sliced locally to
``[Shard(0)]`` (free) for the same result. ``addmm``'s bias is added on one rank of each
pending sum's group only, so the sum counts it once; a pending average (``Partial("avg")``
operand, kept) gets it on every rank, as the average of ``x_i + b`` is that of ``x_i`` plus ``b``.

Layout ways: ``a`` whose rows have no placement form (the rows of ``h.view(B*S, H)`` for ``h``
``[B, S, H]`` in ``[Shard(1)]``: ``S[(B,4,S/4,H):(..,1@gpuid,..,1)]``) times a replicated ``b``
keeps ``a``'s row map (no data moves) instead of gathering ``a`` into placements; a replicated
``a`` times ``b`` whose columns have no placement form (the transposed weight of a
``ColwiseParallel(weight_layout=...)`` that deals output features round-robin) keeps ``b``'s
column map, and ``addmm``'s bias is added where it is laid out as those columns; a contraction
dim dealt the same way in both operands (that weight's input gradient) gives a pending sum.
Where the operand that a layout way needs replicated is a pending sum, smaller than the other
(the output of a vocab-parallel embedding times a tied, dealt output layer), it is reduced first
and the layout way kept (``_reduced_first``), rather than gathering the larger operand.

Eager fusion: mm/addmm of a deferred row all-gather runs the fused all-gather + GEMM
(``gathered_product``, a handler of ops/fusion.py).

Decode products: an mm of at most 64 rows on CUDA runs its local product through the skinny
GEMM (kernels/skinny_gemm.py, one launch that streams the weight) where that kernel's measured
table chose it for the local shape, else ``torch.mm`` (``_decode_product``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import env
from ..caches import cached
from ..layout import MEMORY_AXIS, Iter, Layout, one_dim_iters, with_inner_dims
from ..planning.cost import placement_move_elements
from ..runtime.deferred import (defer_product_of_gather, fused_gather_product, gather_rows_transposed,
                                pending_gather, placeholder)
from ..tracing import compiling, may_defer
from .call_plan import local_of
from .fusion import pending_user, planned_as_is, planned_unmoved
from .registry import LINEAR_REDUCE_OPS, ArgSpec, OpCall, Partial, Replicate, Shard, Sharding, moved_to, register
from .shard_ranges import without_partial
from .specs import padded, reduced_in_place
from .vector_products import added_once_per_sum

aten = torch.ops.aten


def _candidates(batched: bool):
    """(a placement, b placement, output placement) per strategy, dims of a [B?,M,K], b [B?,K,N]."""
    o = 1 if batched else 0
    out = [
        (Shard(o), Replicate(), Shard(o)),                   # rows
        (Replicate(), Shard(o + 1), Shard(o + 1)),           # columns
        (Shard(o + 1), Shard(o), Partial("sum")),            # contraction
        (Replicate(), Replicate(), Replicate()),
    ]
    if batched:
        out.insert(0, (Shard(0), Shard(0), Shard(0)))
    return out


def _product_strategy(a: ArgSpec, b: ArgSpec, mesh, batched: bool):
    """Per mesh axis: the cheapest (a, b, out) placements; linear partials are kept."""
    wa, wb, wo = [], [], []
    for axis in range(mesh.ndim):
        pa = a.placements[axis] if a.placements is not None else None
        pb = b.placements[axis] if b.placements is not None else None
        options = list(_candidates(batched))
        for p, other_first in ((pa, True), (pb, False)):
            if isinstance(p, Partial) and p.reduce_op in LINEAR_REDUCE_OPS:
                options.append((p, Replicate(), p) if other_first else (Replicate(), p, p))
        # cheapest first; among equals, the one that changes fewest operands (R x R stays R)
        n = mesh.shape[axis]
        best = min(options, key=lambda c: (placement_move_elements(pa, c[0], math.prod(a.shape), n)
                                           + placement_move_elements(pb, c[1], math.prod(b.shape), n),
                                           (pa != c[0]) + (pb != c[1])))
        wa.append(best[0])
        wb.append(best[1])
        wo.append(best[2])
    return tuple(wa), tuple(wb), tuple(wo)


def _rows_layout_way(a: ArgSpec, b: ArgSpec, n: int):
    """The output layout of ``a @ b`` when ``a``'s rows have a layout with no placement form
    (e.g. the flattened rows of a sequence-sharded ``[B, S, H]``) and ``b`` is replicated:
    each device multiplies its own rows, so the output keeps ``a``'s row map and its columns
    are local and whole. None when that does not hold (``a``'s columns split over devices,
    padding, a pending sum): then the placement strategies (which move ``a``) apply."""
    spec = a.spec
    if (a.placements is not None or b.placements is None or not b.is_replicated() or a.reduce_op
            or padded(a)):
        return None
    rows = one_dim_iters(a.layout, spec.shape, 0)
    if rows is None:
        return None  # the contraction dim is not whole and innermost in every local tensor
    return Layout([*_memory_times(rows, n), Iter(n, 1)], a.layout.replica, a.layout.offset)


def _memory_times(iters, factor: int) -> list[Iter]:
    """``iters`` with their memory strides times ``factor`` (a dim's iters placed as the rows
    of a row-major 2-D tensor ``factor`` wide)."""
    return [Iter(it.extent, it.stride * factor, it.axis) if it.axis == MEMORY_AXIS else it for it in iters]


def _columns_layout_way(a: ArgSpec, b: ArgSpec, m: int):
    """The output layout of ``a @ b`` when ``a`` is replicated and ``b``'s columns have a layout
    with no placement form (e.g. ``S[(6,2,2,2):(4,2,1@gpuid,1)]``, the transpose of a [8, 6]
    weight whose rows go round-robin in pairs to 2 ranks): each device multiplies by its own
    columns, so the output keeps ``b``'s column map and its rows are local and whole. None when
    that does not hold (``b``'s rows split over devices or not outermost locally, padding, a
    pending sum): then the placement strategies (which move ``b``) apply."""
    spec = b.spec
    if (b.placements is not None or not a.is_replicated() or b.reduce_op or padded(b)
            or (a.spec is not None and a.spec.padded != a.spec.shape)):
        return None
    cols = one_dim_iters(b.layout, spec.shape, 1)
    if cols is None:
        return None  # the contraction dim is not whole and outermost in every local tensor
    local_n = math.prod(it.extent for it in cols if it.axis == MEMORY_AXIS)
    return Layout([Iter(m, local_n), *cols], b.layout.replica, b.layout.offset)


def _reduced_first(a: ArgSpec, b: ArgSpec) -> Sharding | None:
    """``a @ b`` where one operand is a pending sum and the other, the larger, has a layout with no
    placement form that a layout way keeps: a pending ``a`` (the output of a vocab-parallel
    embedding) times ``b`` with dealt columns (the tied output layer's ``W.t()``), or ``a`` with
    dealt rows times a pending ``b`` (that layer's weight gradient, ``grad.t() @ h``, with ``h`` as
    autograd saved it). The pending one is reduced (an all-reduce of it) and the product keeps
    the other's map, rather than gathering the larger one. None otherwise."""
    for pending, other, way in ((a, b, "columns"), (b, a, "rows")):
        if not pending.reduce_op or pending.placements is None or other.placements is not None or \
                math.prod(pending.shape) > math.prod(other.shape):
            continue
        whole = without_partial(pending.placements)
        reduced = dataclasses.replace(pending, placements=whole, reduce_op=None)
        out = _columns_layout_way(reduced, b, a.shape[0]) if way == "columns" else \
            _rows_layout_way(a, reduced, b.shape[1])
        if out is not None:
            return Sharding(inputs=[whole, None] if way == "columns" else [None, whole], outputs=out)
    return None


def _contraction_layout_way(a: ArgSpec, b: ArgSpec, mesh) -> Sharding | None:
    """``a @ b`` when the contraction dim is dealt over the devices with no placement form, the
    same way in ``a``'s columns and ``b``'s rows (the input gradient of a dealt column-parallel
    weight: ``grad_out [M, N] @ w [N, K]``), or dealt in one and replicated in the other (then the
    replicated one is sliced to match, locally): each device multiplies its own slice, and the
    output is a pending sum over the mesh. None when the dealings differ, a device holds no
    distinct slice, or an operand has padding, replicas or a pending sum."""
    if a.placements is not None and b.placements is not None:
        return None  # the placement strategies cover it
    (m, _), n = a.shape, b.shape[1]
    dealt_a = None if a.is_replicated() else _contraction_iters(a, 1, mesh)
    dealt_b = None if b.is_replicated() else _contraction_iters(b, 0, mesh)
    if dealt_a is None and dealt_b is None:
        return None
    summed = (Partial("sum"),) * mesh.ndim
    if dealt_a is None:  # a replicated: its columns sliced as b's rows are dealt
        if not a.is_replicated() or padded(a):
            return None
        local_k = math.prod(it.extent for it in dealt_b if it.axis == MEMORY_AXIS)
        return Sharding(inputs=[Layout([Iter(m, local_k), *dealt_b]), None], outputs=summed)
    if dealt_b is None:  # b replicated: its rows sliced as a's columns are dealt
        if not b.is_replicated() or padded(b):
            return None
        return Sharding(inputs=[None, Layout([*_memory_times(dealt_a, n), Iter(n, 1)])], outputs=summed)
    return Sharding(inputs=[None, None], outputs=summed) if dealt_a == dealt_b else None


def _contraction_iters(arg: ArgSpec, dim: int, mesh):
    """``one_dim_iters`` of dim ``dim`` of a 2-D operand when only that dim is split over the
    devices, every mesh axis once over its whole extent (each device a distinct slice); None
    otherwise."""
    if arg.reduce_op or padded(arg) or arg.layout.replica or arg.layout.offset:
        return None
    iters = one_dim_iters(arg.layout, arg.shape, dim)
    if iters is None:
        return None
    axes = sorted((it.axis, it.stride, it.extent) for it in iters if it.axis != MEMORY_AXIS)
    if axes != sorted((axis, 1, size) for axis, size in zip(mesh.axis_names, mesh.shape)):
        return None
    return iters


def _columns_only(layout: Layout) -> Layout:
    """The column map of a ``[M, N]`` output of ``_columns_layout_way``: how a ``[N]`` bias
    must be laid out to add locally."""
    return Layout(list(layout.shard[1:]), layout.replica, layout.offset)


def _batches_in_place(a: ArgSpec, b: ArgSpec) -> Sharding | None:
    """``bmm(a, b)`` where a layout with no placement form deals whole batch entries of one
    operand (each ``[M, K]`` of ``a`` or ``[K, N]`` of ``b`` whole and local in its piece:
    ``reduced_in_place`` over the last two dims): the other is asked for the same map of batch
    entries (a replicated one is cut where it is), each device multiplies its own, and the output
    keeps the map (attention's per-head products of heads dealt round-robin, ``einsum`` over
    dealt rows). None otherwise: the placement strategies apply."""
    if a.reduce_op or b.reduce_op or a.shape[0] != b.shape[0]:
        return None
    inners = (tuple(a.shape[1:]), tuple(b.shape[1:]), (a.shape[1], b.shape[2]))
    if any(math.prod(inner) < 1 for inner in inners):
        return None  # (an empty matrix has no layout of its own: the placement way)
    batches = reduced_in_place(a, [1, 2])
    if batches is None:
        batches = reduced_in_place(b, [1, 2])
    if batches is None:
        return None
    laid = [with_inner_dims(batches, (a.shape[0],), inner) for inner in inners]
    if any(layout is None for layout in laid):
        return None
    return Sharding(inputs=laid[:2], outputs=laid[2])


@register(aten.mm.default, aten.bmm.default)
def mm(call: OpCall) -> Sharding:
    a, b = call.specs
    if call.func is aten.bmm.default:
        batches = _batches_in_place(a, b)
        if batches is not None:
            return batches
    if call.func is aten.mm.default:
        rows = _rows_layout_way(a, b, b.shape[1])
        if rows is not None:
            return Sharding(inputs=[None, None], outputs=rows)
        columns = _columns_layout_way(a, b, a.shape[0])
        if columns is not None:
            return Sharding(inputs=[None, None], outputs=columns)
        reduced = _reduced_first(a, b)
        if reduced is not None:
            return reduced
        summed = _contraction_layout_way(a, b, call.mesh)
        if summed is not None:
            return summed
    wa, wb, wo = _product_strategy(a, b, call.mesh, call.func is aten.bmm.default)
    sharding = Sharding(inputs=[moved_to(a, wa), moved_to(b, wb)], outputs=wo)
    if call.func is aten.mm.default and decode_sized(call):
        return dataclasses.replace(sharding, local=_decode_product)
    return sharding


def decode_sized(call: OpCall) -> bool:
    """Whether an mm's local products may run the skinny GEMM (kernels/skinny_gemm.py): CUDA,
    bf16 / fp16, at most its MAX_ROWS rows (a decode step's tokens), no fewer columns and no
    shallower contraction than the least its table chose it for at that many rows,
    AXEDIST_DECODE_GEMM=auto (the default). Planned from what every rank has (global shapes);
    each call then looks its local shape up in the table."""
    a, b = call.specs
    if call.mesh.device_type != "cuda" or a.dtype not in (torch.bfloat16, torch.float16) \
            or env.read("AXEDIST_DECODE_GEMM") != "auto":
        return False
    skinny = _skinny()
    if not 1 <= a.shape[0] <= skinny.MAX_ROWS:
        return False
    least_n, least_k = skinny.smallest_chosen(a.shape[0])  # a shard is no larger than the whole
    return b.shape[1] >= least_n and a.shape[1] >= least_k


def _decode_product(call: OpCall, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A decode-sized local product: the skinny GEMM where its tuned table measured it faster
    than cuBLAS at this local shape (K innermost in both operands, as a linear's input and
    ``weight.t()``: what the table measured), else ``torch.mm``; ``torch.mm`` while tracing (a
    traced graph holds aten ops, not a kernel launch on fake tensors)."""
    skinny = _skinny()
    if compiling() or a.dim() != 2 or b.dim() != 2 or not a.is_cuda or a.stride(1) != 1 or b.stride(0) != 1 \
            or a.dtype != b.dtype or not 1 <= a.shape[0] <= skinny.MAX_ROWS:
        return torch.mm(a, b)
    config = skinny.skinny_config(a.shape[0], b.shape[1], a.shape[1])
    return torch.mm(a, b) if config is None else skinny.skinny_mm(a, b, config=config)


def _decode_linear(input: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear(x, weight)`` on the plain local tensors as the normal route computes it where
    its mm is decode-sized: the rows flattened, ``_decode_product`` with ``weight.t()``, the
    leading dims restored (the fast path's entry for the whole call, ops/fastpath.py). A bias
    takes addmm (no decode product) or an in-place add there: not this computation."""
    if bias is not None:
        raise TypeError("the decode product's linear has no bias")
    rows = _decode_product(None, input.reshape(-1, input.shape[-1]), weight.t())
    return rows.view(*input.shape[:-1], weight.shape[0])


# The torch function whose whole call a decode product stands for, and that call on the plain
# local tensors (a kernel choice, the same computation: the fast path may serve the call with it)
_decode_product.torch_twins = {torch.nn.functional.linear: _decode_linear}


@cached(maxsize=None)
def _skinny():
    """kernels.skinny_gemm, imported on first use (it imports Triton; CPU meshes never ask)."""
    from ..kernels import skinny_gemm
    return skinny_gemm


def _bias_placements(bias: ArgSpec, out: tuple, out_ndim: int) -> tuple:
    """The bias (broadcast against the output) sharded like the output; replicated on partial axes."""
    want = []
    for p in out:
        if isinstance(p, Shard):
            d = p.dim - (out_ndim - bias.ndim)
            want.append(Shard(d) if d >= 0 and bias.shape[d] != 1 else Replicate())
        else:
            want.append(Replicate())
    return tuple(want)


@register(aten.addmm.default, aten.baddbmm.default)
def addmm(call: OpCall) -> Sharding:
    """``beta * bias + alpha * (a @ b)``: the product's sharding; the bias added once per pending sum
    (on every rank of a pending average: ``added_once_per_sum``)."""
    bias, a, b = call.specs
    batched = call.func is aten.baddbmm.default
    rows = None if batched else _rows_layout_way(a, b, b.shape[1])
    if (rows is not None and bias.is_replicated() and bias.ndim in (1, 2) and bias.shape[-1] == b.shape[1]
            and (bias.ndim == 1 or bias.shape[0] == 1)):
        return Sharding(inputs=[None, None, None], outputs=rows)  # each device its own rows, plus the bias
    columns = None if batched else _columns_layout_way(a, b, a.shape[0])
    if (columns is not None and bias.ndim == 1 and not bias.reduce_op and bias.spec is not None
            and bias.spec.padded == bias.spec.shape and bias.layout == _columns_only(columns)):
        return Sharding(inputs=[None, None, None], outputs=columns)
    wa, wb, wo = _product_strategy(a, b, call.mesh, batched)
    out_ndim = 3 if batched else 2
    want_bias = _bias_placements(bias, wo, out_ndim)
    inputs = [moved_to(bias, want_bias), moved_to(a, wa), moved_to(b, wb)]
    return Sharding(inputs=inputs, outputs=wo, local=added_once_per_sum(call, wo))


@pending_user(aten.mm.default, aten.addmm.default)
def gathered_product(dispatcher, func, args):
    """mm / addmm (alpha = beta = 1) of a deferred row all-gather (its left operand, or a view
    of it as the rows' matrix) with column-sharded weights: one fused all-gather + GEMM that
    also resolves the gather (ops/fusion.py). None when the call is not that, or the kernel
    does not run (then mm gathers and multiplies as usual)."""
    cls = dispatcher.cls
    if func is aten.mm.default and len(args) == 2 and type(args[0]) is cls \
            and gather_rows_transposed(args[0]._pending):
        return _product_of_transposed_gather(dispatcher, func, args)
    if func is aten.mm.default and len(args) == 2:
        (a, b), bias = args, None
    elif func is aten.addmm.default and len(args) == 3 and type(args[0]) is cls:
        bias, a, b = args
    else:
        return None
    if type(a) is not cls or a._pending is None or pending_gather(a._pending) is None:
        return None
    plan, targets = planned_as_is(dispatcher, func, args)
    if plan is None or targets[id(a)] is not None:
        return None
    out = plan.outputs[0]
    if out.unsqueeze or type(b) is not cls or targets[id(b)] is not None:
        return None
    value = fused_gather_product(a._pending, b._local, b._spec, out.local_shape)
    if value is None:
        return None
    if bias is not None:
        value.add_(local_of(bias, targets[id(bias)]))
    return cls(value, out.spec, stride=out.stride)


def _product_of_transposed_gather(dispatcher, func, args):
    """``grad.t() @ input`` (a linear's weight gradient, which torch's ``mm`` backward computes
    before the input gradient) with ``grad`` a deferred row all-gather: kept unrun, a
    DeferredProduct, so that the input gradient's mm can run the gather fused; None when the
    call moves data or runs a rule's own code (then it runs as usual)."""
    (a, b), cls = args, dispatcher.cls
    if type(b) is not cls or b._pending is not None or a.dtype != b.dtype or not may_defer():
        return None
    plan = planned_unmoved(dispatcher, func, args)
    if plan is None or plan.sharding.local is not None:
        return None
    out = plan.outputs[0]
    if out.unsqueeze:
        return None
    pending = defer_product_of_gather(a._pending, b._local, out.local_shape)
    return cls(placeholder(a.dtype, a.device), out.spec, stride=out.stride, pending=pending)
