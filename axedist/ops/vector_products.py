"""Products with vectors: ``dot``, ``vdot``, ``mv``, ``addmv``, ``addr`` (the matrix products,
``mm``/``bmm``/``addmm``, are ``matmul.py``'s).

Per mesh axis, as for matrices: a contraction dim sharded in either operand is sharded alike in
both (a replicated operand is sliced locally: free), and the local products are a pending sum;
``mv``'s rows sharded with the vector replicated give rows of the output; ``addr``'s outer
product keeps either vector's shard as the output's rows or columns. 2 ranks, ``a``, ``b`` (5,)
in ``[Shard(0)]``: ``a.dot(b)`` is each rank's 3- or 2-element dot, ``[Partial("sum")]``.

Pending inputs are applied first (a pending output is made only by a sharded contraction), and
``addmv``'s ``self`` is added on one rank of each pending sum's group, so the sum counts it once
(``added_once_per_sum``, which ``addmm`` shares; a pending average adds it on every rank).

Layouts with no placement form run where they are: the dot of two vectors laid out alike (each
device holds the same indices of both, e.g. dealt round-robin in pairs) is each device's local
dot, a pending sum over the axes that deal them (``specs.pending_in_place``); ``mv`` of a matrix
whose layout deals whole rows (``specs.reduced_in_place`` over its columns) with a replicated
vector gives each device its own rows' products, in the rows' map. Other layouts are moved to
placements first.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .registry import ArgSpec, OpCall, Sharding, moved_to, register
from .specs import layout_only, pending_in_place, reduced_in_place
from .tensor_ops import is_plain_shard, placements_of

aten = torch.ops.aten


def _sharded(spec: ArgSpec, axis: int, dim: int) -> bool:
    p = placements_of(spec)[axis]
    return is_plain_shard(p) and p.dim % spec.ndim == dim and spec.shape[dim] > 1


@register(aten.dot.default, aten.vdot.default)
def dot_rule(call: OpCall) -> Sharding | None:
    """``a.dot(b)``: a shard of either vector (the other sliced alike) gives a pending sum."""
    a, b = call.args[0], call.args[1]
    if not (isinstance(a, ArgSpec) and isinstance(b, ArgSpec)) or a.ndim != 1 or b.ndim != 1:
        return None
    alike = _dot_in_place(a, b)
    if alike is not None:
        return Sharding(inputs=[None, None], outputs=alike, note="laid out alike: local dots, pending sum")
    wa, wb, out = [], [], []
    for axis in range(call.mesh.ndim):
        if _sharded(a, axis, 0) or _sharded(b, axis, 0):
            wa.append(Shard(0)), wb.append(Shard(0)), out.append(Partial("sum"))
        else:
            wa.append(Replicate()), wb.append(Replicate()), out.append(Replicate())
    return Sharding(inputs=[moved_to(a, wa), moved_to(b, wb)], outputs=tuple(out))


def _dot_in_place(a: ArgSpec, b: ArgSpec):
    """The output placements of ``a.dot(b)`` computed where the vectors are: both laid out by the
    same layout with no placement form (so every device holds the same indices of each, in the
    same order), unpadded, nothing pending, and summable in place (``pending_in_place``). None
    otherwise."""
    if a.layout != b.layout or a.shape != b.shape or not layout_only(b):
        return None
    return pending_in_place(a, "sum")


def _mv_in_place(mat: ArgSpec, vec: ArgSpec):
    """The output layout of ``mat.mv(vec)`` computed where ``mat`` is: its layout (no placement
    form) deals whole rows, every column of them innermost (``reduced_in_place`` over dim 1), and
    ``vec`` is replicated, so each device multiplies its own rows. None otherwise."""
    if not vec.is_replicated():
        return None
    return reduced_in_place(mat, [1])


def _mv_placements(mat: ArgSpec, vec: ArgSpec, mesh):
    """Per axis: rows (mat Shard(0), vec Replicate -> out Shard(0)), contraction (mat Shard(1),
    vec Shard(0) -> out Partial), or nothing sharded."""
    wm, wv, out = [], [], []
    for axis in range(mesh.ndim):
        if _sharded(mat, axis, 0):
            wm.append(Shard(0)), wv.append(Replicate()), out.append(Shard(0))
        elif _sharded(mat, axis, 1) or _sharded(vec, axis, 0):
            wm.append(Shard(1)), wv.append(Shard(0)), out.append(Partial("sum"))
        else:
            wm.append(Replicate()), wv.append(Replicate()), out.append(Replicate())
    return wm, wv, tuple(out)


@register(aten.mv.default)
def mv_rule(call: OpCall) -> Sharding | None:
    """``A.mv(x)``, ``A`` (6, 4) ``[Shard(0)]``: each rank's rows, output ``[Shard(0)]``; ``A`` in
    ``[Shard(1)]`` (or ``x`` in ``[Shard(0)]``): local products of the pieces, ``[Partial("sum")]``."""
    mat, vec = call.args[0], call.args[1]
    if not (isinstance(mat, ArgSpec) and isinstance(vec, ArgSpec)) or mat.ndim != 2 or vec.ndim != 1:
        return None
    rows = _mv_in_place(mat, vec)
    if rows is not None:
        return Sharding(inputs=[None, None], outputs=rows, note="rows dealt by a layout: each device's own rows")
    wm, wv, out = _mv_placements(mat, vec, call.mesh)
    return Sharding(inputs=[moved_to(mat, wm), moved_to(vec, wv)], outputs=out)


def added_once_per_sum(call: OpCall, out: tuple):
    """The local function of ``addmm``/``baddbmm``/``addmv`` with a pending output: ``self``
    (times ``beta``) added on the rank at coordinate 0 of every axis pending a sum, ``beta = 0``
    elsewhere, so the sum counts it once. An average counts it on every rank (the average of
    ``x_i + b`` is that of ``x_i`` plus ``b``): axes pending an "avg" do not pick a rank. None
    where no axis pends a sum (``self`` added everywhere: the plain op)."""
    sum_axes = [name for name, p in zip(call.mesh.axis_names, out)
                if isinstance(p, Partial) and p.reduce_op == "sum"]
    if not sum_axes:
        return None
    mesh, func = call.mesh, call.func

    def local(call_, *args, **kwargs):
        coords = mesh.coordinates()
        if all(coords[axis] == 0 for axis in sum_axes):
            return func(*args, **kwargs)
        return func(*args, **{**kwargs, "beta": 0})

    return local


def _self_like(self: ArgSpec, out: tuple, out_shape: tuple) -> list:
    """``self`` (broadcast against the output) sharded like the output where it has that dim
    at full extent, else replicated."""
    lead = len(out_shape) - self.ndim
    want = []
    for p in out:
        d = p.dim - lead if isinstance(p, Shard) else -1
        want.append(Shard(d) if d >= 0 and self.shape[d] == out_shape[p.dim] else Replicate())
    return want


@register(aten.addmv.default)
def addmv_rule(call: OpCall) -> Sharding | None:
    """``beta * self + alpha * A.mv(x)``: ``mv``'s sharding; ``self`` added once per pending sum."""
    self, mat, vec = call.args[:3]
    if not all(isinstance(s, ArgSpec) for s in (self, mat, vec)) or mat.ndim != 2 or vec.ndim != 1:
        return None
    wm, wv, out = _mv_placements(mat, vec, call.mesh)
    ws = _self_like(self, out, (mat.shape[0],))
    return Sharding(inputs=[moved_to(self, ws), moved_to(mat, wm), moved_to(vec, wv)], outputs=out,
                    local=added_once_per_sum(call, out))


@register(aten.addr.default)
def addr_rule(call: OpCall) -> Sharding | None:
    """``beta * self + alpha * outer(u, v)``: ``u``'s shard gives the output's rows, ``v``'s its
    columns (per mesh axis, ``u`` first); no pending sum."""
    self, u, v = call.args[:3]
    if not all(isinstance(s, ArgSpec) for s in (self, u, v)) or u.ndim != 1 or v.ndim != 1:
        return None
    wu, wv, out = [], [], []
    for axis in range(call.mesh.ndim):
        if _sharded(u, axis, 0):
            wu.append(Shard(0)), wv.append(Replicate()), out.append(Shard(0))
        elif _sharded(v, axis, 0):
            wu.append(Replicate()), wv.append(Shard(0)), out.append(Shard(1))
        else:
            wu.append(Replicate()), wv.append(Replicate()), out.append(Replicate())
    out = tuple(out)
    ws = _self_like(self, out, (u.shape[0], v.shape[0]))
    return Sharding(inputs=[moved_to(self, ws), moved_to(u, wu), moved_to(v, wv)], outputs=out)
