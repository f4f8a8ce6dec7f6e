"""Sharding rules of ops that act on each position of leading *batch* dims on its own and mix
only a trailing *core*: the matrix functions of ``torch.linalg`` (factorizations, solves,
inverses, ``tril``/``triu``: core = the last 2 dims), pools, upsampling, reflection and
replication padding (core = the spatial dims; batch and channel dims pass through),
``grid_sample``, ``pixel_shuffle``, ``im2col`` (core = all but the batch dim), and
convolution (batch dim only; the weight gradient summed over a sharded batch is a pending sum).

A mesh axis that shards a batch dim keeps it sharded (in every argument that has that dim at
full extent; an argument that broadcasts there is replicated on that axis), and every output
is sharded on the same leading dim; a mesh axis that shards a core dim is gathered on that axis
only. 2 ranks, ``A`` (6, 4, 4) in ``[Shard(0)]``: ``torch.linalg.inv(A)`` inverts each rank's
(3, 4, 4) matrices, (6, 4, 4) ``[Shard(0)]``; in ``[Shard(1)]`` the rows are gathered first.

A pending reduction is applied first (none of these is linear, but for the transposes of the
linear ops: kept out for simplicity). Rules decline (the gather fallback runs) where an output
does not lead with the batch dims or an op would raise on some ranks only (``check_errors``).

The matrix functions also run where a layout with no placement form deals whole matrices
(``matrices_in_place``): ``A`` (8, 4, 4) whose matrices go round-robin in pairs to 2 devices,
``S[(2,2,2,4,4):(32,1@gpuid,16,4,1)]``: ``torch.linalg.inv(A)`` inverts each device's 4
matrices where they are and keeps the deal; placements would gather ``A`` first.

Pools, upsampling, padding, ``grid_sample``, ``pixel_shuffle``, convolution and group norm
(``ops/norm.py``) likewise run where such a layout deals the samples (dim 0), every other dim
whole in each piece (``samples_in_place``): ``x`` (8, 3, 4, 4) whose samples go round-robin to 2
devices, ``S[(4,2,3,4,4):(48,1@gpuid,16,4,1)]``: ``F.avg_pool2d(x, 2)`` pools each device's 4
samples, (8, 3, 2, 2) ``S[(4,2,3,2,2):(12,1@gpuid,4,2,1)]``; a replicated weight's gradient is
each device's sum over its own samples, ``[Partial("sum")]``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import torch.distributed as dist

from ..layout import with_inner_dims
from ..runtime.carriers import all_reduce_
from ..spec import chunk_ranges
from ..tracing import compiling
from .call_plan import DispatchError
from .registry import ArgSpec, OpCall, Sharding, moved_to, overload_named, register
from .specs import layout_only, local_shape_of, pending_in_place, reduced_in_place
from .tensor_ops import is_plain_shard, placements_of, renumber, self_stays, unshard, without_partial

aten = torch.ops.aten


def batch_sharding(call: OpCall, cores: list[int], local=None) -> Sharding | None:
    """The batched rule with ``cores[i]`` trailing core dims of ``call.specs[i]``.

    The batch shapes (each spec's dims before its core) broadcast, aligned from the right like
    torch's batched linalg. Per mesh axis, the first spec with a plain ``Shard`` of a batch dim
    at the broadcast extent picks that dim: specs holding it at that extent take the shard,
    the others (broadcast, or missing the dim) are replicated on the axis. Outputs must lead
    with the broadcast batch shape (or be empty), else None (the fallback)."""
    specs = call.specs
    mesh = call.mesh
    if len(cores) != len(specs) or any(c > s.ndim for c, s in zip(cores, specs)):
        return None
    batches = [tuple(s.shape[:s.ndim - c]) for s, c in zip(specs, cores)]
    try:
        batch = list(torch.broadcast_shapes(*batches))
    except RuntimeError:
        return None  # batch dims that do not broadcast: the op itself refuses them
    nb = len(batch)
    targets = [[] for _ in specs]
    out = []
    for axis in range(mesh.ndim):
        chosen = None
        for s, b in zip(specs, batches):
            p = placements_of(s)[axis]
            if is_plain_shard(p) and p.dim % s.ndim < len(b) and b[p.dim % s.ndim] == batch[nb - len(b) + p.dim % s.ndim] \
                    and batch[nb - len(b) + p.dim % s.ndim] > 1:
                chosen = nb - len(b) + p.dim % s.ndim
                break
        for t, s, b in zip(targets, specs, batches):
            d = None if chosen is None else chosen - (nb - len(b))
            t.append(Shard(d) if d is not None and d >= 0 and b[d] == batch[chosen] else Replicate())
        out.append(Replicate() if chosen is None else Shard(chosen))
    dropped = _emptied(out, batch, mesh)
    if dropped:
        targets = [[Replicate() if axis in dropped else p for axis, p in enumerate(t)] for t in targets]
        out = [Replicate() if axis in dropped else p for axis, p in enumerate(out)]
    out = tuple(out)
    entries = []
    if any(isinstance(p, Shard) for p in out):
        flat = call.meta_outputs()
        if flat is None:
            return None
        for value in flat:
            if not isinstance(value, torch.Tensor):
                entries.append(None)
            elif value.numel() == 0 and tuple(value.shape[:nb]) != tuple(batch):
                entries.append((Replicate(),) * mesh.ndim)  # an output the call does not compute
            elif tuple(value.shape[:nb]) == tuple(batch):
                entries.append(out)
            else:
                return None
        outputs = entries[0] if len(entries) == 1 else tuple(entries)
    else:
        flat = call.meta_outputs()
        if flat is None:
            return None
        outputs = out if len(flat) == 1 else tuple(None if not isinstance(v, torch.Tensor) else out for v in flat)
    inputs = [None if s.placements == tuple(t) else tuple(t) for s, t in zip(specs, targets)]
    return Sharding(inputs=inputs, outputs=outputs, local=local)


def _batch_map(spec: ArgSpec, core: int):
    """The map of ``spec``'s batch entries where its layout (no placement form, unpadded, nothing
    pending) holds its ``core`` trailing dims whole and innermost in every piece; None otherwise."""
    if core == 0:
        return spec.layout if layout_only(spec) else None
    return reduced_in_place(spec, range(spec.ndim - core, spec.ndim))


def matrices_in_place(call: OpCall, cores: list[int | None], local=None, summed=()) -> Sharding | None:
    """The batched rule where a layout with no placement form deals whole matrices: the map of
    batch entries of the first argument with no placement form (``_batch_map``) is asked of every
    argument (one laid out otherwise, a replicated one say, is cut where it is), each device runs
    the op on its own matrices and every output keeps the map. None (the placement way) where no
    argument lacks a placement form, the first one's layout splits a matrix, batch shapes differ
    (broadcasting), a matrix is empty or an output does not lead with the batch shape.

    ``cores[i]`` None: an argument with no batch (a convolution's weight), asked replicated and
    left out of those checks. The outputs numbered in ``summed`` (a weight's gradient) sum over
    the batch entries: each device's sum over its own, pending over the axes that deal them
    (``specs.pending_in_place``; None where it is None)."""
    specs = call.specs
    if len(cores) != len(specs):
        return None
    batched = [(s, c) for s, c in zip(specs, cores) if c is not None]
    if any(c > s.ndim for s, c in batched) or any(s.reduce_op for s, _ in batched):
        return None
    batches = {tuple(s.shape[:s.ndim - c]) for s, c in batched}
    if len(batches) != 1:
        return None
    (batch,) = batches
    if not batch or any(0 in s.shape[len(batch):] for s, _ in batched):
        return None
    maps = [(s, _batch_map(s, c)) for s, c in batched if s.placements is None]
    if not maps or maps[0][1] is None:
        return None
    source, batch_map = maps[0]
    inputs = [(Replicate(),) * call.mesh.ndim if c is None else with_inner_dims(batch_map, batch, s.shape[len(batch):])
              for s, c in zip(specs, cores)]
    if any(laid is None for laid in inputs):
        return None
    pending = pending_in_place(source, "sum") if summed else None
    flat = call.meta_outputs()
    if flat is None or (summed and pending is None):
        return None
    outputs = []
    for index, value in enumerate(flat):
        if not isinstance(value, torch.Tensor):
            outputs.append(None)
        elif index in summed:
            outputs.append(pending)
        elif value.numel() == 0 and tuple(value.shape[:len(batch)]) != batch:
            outputs.append((Replicate(),) * call.mesh.ndim)  # an output the call does not compute
        elif tuple(value.shape[:len(batch)]) == batch and value.numel():
            laid = with_inner_dims(batch_map, batch, tuple(value.shape[len(batch):]))
            if laid is None:
                return None
            outputs.append(laid)
        else:
            return None
    return Sharding(inputs=inputs,
                    outputs=outputs[0] if len(outputs) == 1 else tuple(outputs), local=local,
                    note="whole matrices dealt by a layout: each device's own")


def samples_in_place(call: OpCall, core: int, batched: int | None = None, summed=(), local=None) -> Sharding | None:
    """``matrices_in_place`` for ops on images and signals, the samples (dim 0) the batch: where a
    layout with no placement form deals the samples of the first ``batched`` arguments (all by
    default), every other dim whole in each piece, each device runs the op on its own samples;
    the other arguments (weights, biases) are asked replicated and the outputs numbered in
    ``summed`` (their gradients) are pending sums. None where such an argument has fewer than
    ``core`` dims after dim 0 (an unbatched image of an op that mixes all its dims) or where some
    device holds no samples (a kernel refuses the all-empty piece of a device a layout skips).

    ``F.conv2d(x, w, b, padding=1)``, ``x`` (8, 3, 5, 5) whose samples go round-robin to 2
    devices, ``S[(4,2,3,5,5):(75,1@gpuid,25,5,1)]``, ``w`` (4, 3, 3, 3) and ``b`` replicated: each
    device convolves its 4 samples, the (8, 4, 5, 5) output ``S[(4,2,4,5,5):(100,1@gpuid,25,5,1)]``;
    ``w``'s gradient is each device's sum over its samples, ``[Partial("sum")]``."""
    specs = call.specs
    batched = len(specs) if batched is None else batched
    if any(s.ndim - 1 < core for s in specs[:batched]):
        return None
    first = next((s for s in specs[:batched] if s.placements is None), None)
    if first is None or pending_in_place(first, "sum") is None:
        return None
    cores = [s.ndim - 1 if i < batched else None for i, s in enumerate(specs)]
    return matrices_in_place(call, cores, local=local, summed=summed)


def _emptied(out, shape, mesh) -> set[int]:
    """The mesh axes (indices) of ``out``'s shards that would leave some rank an empty piece of a
    dim (5 over 2x2: 2, 1, 1, 1 is fine; 2 over 2x2 leaves two ranks none): kernels of pools,
    padding and upsampling refuse an empty channel dim, so such a dim is not kept sharded."""
    dropped: set[int] = set()
    for dim in {p.dim for p in out if isinstance(p, Shard)}:
        axes = [i for i, p in enumerate(out) if isinstance(p, Shard) and p.dim == dim]
        sizes = [mesh.shape[i] for i in axes]
        if any(size == 0 for _, size in chunk_ranges(shape[dim], sizes).values()):
            dropped.update(axes)
    return dropped


# ---------------------------------------------------------------------------
# torch.linalg and friends: matrices in the last 2 dims
# ---------------------------------------------------------------------------

# op -> core dims of each tensor argument (schema order); 2 = a matrix, 1 = a vector per matrix
# (pivots, tau), 0 = one number per matrix
_MATRIX_OPS = {
    "tril.default": (2,), "triu.default": (2,), "_linalg_svd.default": (2,), "_linalg_eigh.default": (2,),
    "linalg_qr.default": (2,), "_linalg_slogdet.default": (2,), "_linalg_det.default": (2,),
    "linalg_matrix_exp.default": (2,), "cholesky_inverse.default": (2,),
    "linalg_solve_triangular.default": (2, 2), "cholesky_solve.default": (2, 2),
    "triangular_solve.default": (2, 2), "linalg_lu_solve.default": (2, 1, 2), "lu_unpack.default": (2, 1),
    "linalg_ldl_solve.default": (2, 1, 2), "linalg_householder_product.default": (2, 1),
    "ormqr.default": (2, 1, 2), "linalg_eig.default": (2,), "linalg_pinv.atol_rtol_tensor": (2, 0, 0), "linalg_lu.default": (2,),
}
# the same with a ``check_errors`` flag: it raises where a matrix fails, which must be every rank or none
# (``torch.cholesky``, which always raises for a matrix that is not positive definite, stays gathered)
_CHECKED = {"linalg_lu_factor_ex.default": (2,), "linalg_ldl_factor_ex.default": (2,),
            "linalg_cholesky_ex.default": (2,), "linalg_inv_ex.default": (2,)}


def _cores_by_schema(call: OpCall, per_argument: tuple) -> list[int]:
    """``per_argument`` (one per tensor argument of the schema) for the ArgSpecs present."""
    schema = call.func._schema.arguments
    values = [call.args[i] if i < len(call.args) else call.kwargs.get(a.name) for i, a in enumerate(schema)]
    tensors = [v for a, v in zip(schema, values) if "Tensor" in str(a.type)]
    return [core for value, core in zip(tensors, per_argument) if isinstance(value, ArgSpec)]


_MATRIX_RULES = {op: cores for op, cores in ((overload_named(n), c) for n, c in _MATRIX_OPS.items()) if op is not None}
_CHECKED_RULES = {op: cores for op, cores in ((overload_named(n), c) for n, c in _CHECKED.items()) if op is not None}


# ops that raise for a matrix whose iteration fails to converge (NaN or inf input): sharded by
# batch, only the rank holding it would raise; the others would go on to their next collective
_MAY_NOT_CONVERGE = {op for op in (overload_named("_linalg_svd.default"), overload_named("_linalg_eigh.default"),
                                   overload_named("linalg_eig.default")) if op is not None}


def raising_together(call_, *args, **kwargs):
    """``call_.func`` on this rank's matrices; where it raises on any rank of the mesh, every rank
    raises a ``DispatchError`` naming the ranks that failed (one small all-reduce per call)."""
    failure, out = None, None
    try:
        out = call_.func(*args, **kwargs)
    except RuntimeError as error:
        failure = error
    if compiling():  # a traced graph has no per-rank failure to agree on here
        if failure is not None:
            raise failure
        return out
    group = call_.mesh.group()
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    failed = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
    failed[dist.get_rank(group)] = failure is not None
    all_reduce_(failed, "sum", group=group)
    ranks = [r for r, bad in enumerate(failed.tolist()) if bad]
    if ranks:
        what = f"here: {failure}" if failure is not None else "not here"
        raise DispatchError(f"{call_.func} failed on the matrices of mesh rank(s) {ranks} of {call_.mesh} "
                            f"(each rank computes its own batch; {what})") from failure
    return out


@register(*_MATRIX_RULES)
def matrix_rule(call: OpCall) -> Sharding | None:
    """``torch.linalg.inv(A)`` of (6, 4, 4) ``[Shard(0)]``: each rank's matrices, ``[Shard(0)]``.
    svd / eigh / eig, which raise where a matrix does not converge, raise on every rank or none
    (:func:`raising_together`)."""
    local = raising_together if call.func in _MAY_NOT_CONVERGE else None
    cores = _cores_by_schema(call, _MATRIX_RULES[call.func])
    return matrices_in_place(call, cores, local=local) or batch_sharding(call, cores, local=local)


@register(*_CHECKED_RULES)
def checked_matrix_rule(call: OpCall) -> Sharding | None:
    """As ``matrix_rule``; with ``check_errors=True`` gathered (a rank alone must not raise)."""
    if call.arg(len(call.func._schema.arguments) - 1, "check_errors", False):
        return None
    cores = _cores_by_schema(call, _CHECKED_RULES[call.func])
    return matrices_in_place(call, cores) or batch_sharding(call, cores)


@register(aten.tril_.default, aten.triu_.default)
def tril_inplace_rule(call: OpCall) -> Sharding | None:
    """``A.tril_()``: in place where the last 2 dims are whole (``self`` cannot move)."""
    return self_stays(batch_sharding(call, [2]), call.args[0])


def _solve_cores(call: OpCall) -> list[int]:
    """``_linalg_solve_ex(A, B)``: B is a batch of vectors when it is 1-D or A's shape without
    its last dim (torch's ``linalg_solve_is_vector_rhs``)."""
    a, b = call.args[0], call.args[1]
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    return [2, 1 if vector else 2]


@register(aten._linalg_solve_ex.default)
def solve_rule(call: OpCall) -> Sharding | None:
    """``torch.linalg.solve(A, B)``: A's matrices and B's right-hand sides by batch."""
    a, b = call.args[0], call.args[1]
    if not (isinstance(a, ArgSpec) and isinstance(b, ArgSpec)) or call.arg(3, "check_errors", False):
        return None
    cores = _solve_cores(call)
    return matrices_in_place(call, cores) or batch_sharding(call, cores)


@register(aten._linalg_check_errors.default)
def check_errors_rule(call: OpCall) -> Sharding:
    """``_linalg_check_errors(info, ...)`` raises for a failed matrix: ``info`` (one int per
    matrix, small) is replicated so that every rank raises or none does."""
    return Sharding(inputs=[None if s.is_replicated() else (Replicate(),) * call.mesh.ndim for s in call.specs],
                    outputs=None)


# ---------------------------------------------------------------------------
# diagonals: the two dims the diagonal runs over are whole; the others keep their shards
# ---------------------------------------------------------------------------


def _dims(ndim: int, dim1: int, dim2: int) -> tuple[int, int]:
    return dim1 % ndim, dim2 % ndim


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_rule(call: OpCall) -> Sharding | None:
    """``x.diagonal(0, 1, 2)`` of (5, 4, 4) ``[Shard(0)]``: (5, 4) ``[Shard(0)]``; dims 1 and 2
    whole. The diagonal goes last; the other dims keep their order (and a pending sum: a
    diagonal only selects)."""
    x = call.args[0]
    if x.ndim < 2:
        return None
    d1, d2 = _dims(x.ndim, call.arg(2, "dim1", 0), call.arg(3, "dim2", 1))
    if x.placements is None and {d1, d2} == {x.ndim - 2, x.ndim - 1}:
        # whole matrices dealt by a layout: each device's own diagonals, a view (autograd's
        # formulas write through it: linalg.qr's backward halves a diagonal in place)
        matrices = reduced_in_place(x, [x.ndim - 2, x.ndim - 1])
        length = torch.empty(x.shape[-2:], device="meta").diagonal(call.arg(1, "offset", 0), d1 - x.ndim + 2,
                                                                    d2 - x.ndim + 2).shape[0]
        laid = None if matrices is None or not length else with_inner_dims(matrices, x.shape[:-2], (length,))
        if laid is not None:
            return Sharding(inputs=[None], outputs=laid)
    target = unshard(placements_of(x), [d1, d2], x.ndim)
    rest = [e for e in range(x.ndim) if e not in (d1, d2)]
    out = renumber(target, x.ndim, lambda e: rest.index(e) if e in rest else None)
    return Sharding(inputs=[target], outputs=out)


@register(aten.diagonal_backward.default)
def diagonal_backward_rule(call: OpCall) -> Sharding | None:
    """The gradient of ``x.diagonal(o, d1, d2)``: zeros of ``x``'s size with ``grad`` on the
    diagonal. ``grad``'s last dim (the diagonal) whole, its other dims keep their shards, which
    land where they were in ``x``; the local op gets this rank's sizes. A pending sum stays."""
    grad, sizes, offset, dim1, dim2 = call.args[:5]
    ndim = len(sizes)
    d1, d2 = _dims(ndim, dim1, dim2)
    target = unshard(placements_of(grad), [grad.ndim - 1], grad.ndim)
    rest = [e for e in range(ndim) if e not in (d1, d2)]
    out = renumber(target, grad.ndim, lambda e: rest[e] if e < len(rest) else None)
    local_sizes = local_shape_of(tuple(sizes), call.mesh, out)

    def local(call_, g, _sizes, *args, **kwargs):
        return aten.diagonal_backward.default(g, list(local_sizes), *args, **kwargs)

    return Sharding(inputs=[target], outputs=out, local=local)


@register(aten.diag_embed.default)
def diag_embed_rule(call: OpCall) -> Sharding | None:
    """``torch.diag_embed(x, o, d1, d2)``: x's last dim becomes the diagonal of dims d1, d2 of
    the output (whole); x's other dims fill the output's remaining dims in order, shards kept.
    Where a layout with no placement form deals whole vectors and the diagonal's dims are the
    output's last two, each device embeds its own vectors and the matrices keep their map
    (``matrices_in_place``; its backward, ``diagonal``, takes them back where they are)."""
    x = call.args[0]
    if x.ndim < 1:
        return None
    ndim = x.ndim + 1
    d1, d2 = _dims(ndim, call.arg(2, "dim1", -2), call.arg(3, "dim2", -1))
    in_place = matrices_in_place(call, [1]) if {d1, d2} == {ndim - 2, ndim - 1} else None
    if in_place is not None:
        return in_place
    target = without_partial(unshard(placements_of(x), [x.ndim - 1], x.ndim))
    rest = [e for e in range(ndim) if e not in (d1, d2)]
    out = renumber(target, x.ndim, lambda e: rest[e] if e < len(rest) else None)
    return Sharding(inputs=[target], outputs=out)


@register(aten.diagonal_scatter.default)
def diagonal_scatter_rule(call: OpCall) -> Sharding | None:
    """``x.diagonal_scatter(src, o, d1, d2)``: ``x`` with dims d1, d2 whole; ``src`` (x's other
    dims, then the diagonal) sharded alike on x's other dims."""
    x, src = call.args[0], call.args[1]
    if not (isinstance(x, ArgSpec) and isinstance(src, ArgSpec)) or x.ndim < 2:
        return None
    d1, d2 = _dims(x.ndim, call.arg(3, "dim1", 0), call.arg(4, "dim2", 1))
    rest = [e for e in range(x.ndim) if e not in (d1, d2)]
    xt = list(without_partial(unshard(placements_of(x), [d1, d2], x.ndim)))
    st = []
    for axis, p in enumerate(xt):
        e = p.dim % x.ndim if is_plain_shard(p) else None
        if e is not None and src.shape[rest.index(e)] == x.shape[e]:
            st.append(Shard(rest.index(e)))
        else:
            xt[axis] = Replicate()
            st.append(Replicate())
    inputs = [None if x.placements == tuple(xt) else tuple(xt), None if src.placements == tuple(st) else tuple(st)]
    return Sharding(inputs=inputs, outputs=tuple(xt))


# ---------------------------------------------------------------------------
# images and signals: batch and channel dims pass through, the spatial dims are the core
# ---------------------------------------------------------------------------

# op -> its spatial dims (the core of every tensor argument)
_SPATIAL_NAMES = {1: ("reflection_pad1d", "replication_pad1d", "upsample_nearest1d", "upsample_linear1d",
                      "_upsample_nearest_exact1d"),
                  2: ("avg_pool2d", "max_pool2d_with_indices", "_adaptive_avg_pool2d", "adaptive_max_pool2d",
                      "max_unpool2d", "reflection_pad2d", "replication_pad2d", "upsample_nearest2d",
                      "upsample_bilinear2d", "upsample_bicubic2d", "_upsample_nearest_exact2d",
                      "_upsample_bilinear2d_aa"),
                  3: ("avg_pool3d", "max_pool3d_with_indices", "_adaptive_avg_pool3d", "adaptive_max_pool3d",
                      "max_unpool3d", "reflection_pad3d", "replication_pad3d", "upsample_nearest3d",
                      "upsample_trilinear3d", "_upsample_nearest_exact3d")}
_SPATIAL = {op: k for k, names in _SPATIAL_NAMES.items() for name in names for suffix in ("", "_backward")
            if (op := overload_named(f"{name}{suffix}.default")) is not None}


def _is_upsample_backward(func) -> bool:
    name = func._schema.name
    return "upsample" in name and name.endswith("_backward")


@register(*_SPATIAL)
def spatial_rule(call: OpCall) -> Sharding | None:
    """``F.avg_pool2d(x, 2)`` of (N, C, H, W) ``[Shard(0)]`` or ``[Shard(1)]``: local, the output
    sharded alike; of ``[Shard(2)]``: H gathered first; samples dealt by a layout with no
    placement form: each device's own (``samples_in_place``). An upsample's backward gets this
    rank's ``input_size`` (its batch and channel dims are this rank's)."""
    k = _SPATIAL[call.func]
    local = None
    if _is_upsample_backward(call.func):
        spatial = list(call.arg(2, "input_size"))[-k:]

        def local(call_, grad, output_size, _input_size, *args, **kwargs):
            # the batch and channel dims as this rank holds them (the local grad's); the spatial ones whole
            return call_.func(grad, output_size, [*grad.shape[:grad.dim() - k], *spatial], *args, **kwargs)

    return samples_in_place(call, k, local=local) or batch_sharding(call, [k] * len(call.specs), local=local)


@register(aten.grid_sampler_2d.default, aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d.default,
          aten.grid_sampler_3d_backward.default)
def grid_sampler_rule(call: OpCall) -> Sharding | None:
    """``F.grid_sample(x (N, C, H, W), grid (N, Ho, Wo, 2))``: by batch N only (the grid's
    gradient sums over the channels), the samples dealt by placements or by a layout."""
    k = 3 if "2d" in call.func._schema.name else 4
    if any(s.ndim != k + 1 for s in call.specs):
        return None
    return samples_in_place(call, k) or batch_sharding(call, [k] * len(call.specs))


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default, aten.channel_shuffle.default,
          aten.im2col.default, aten.col2im.default)
def per_image_rule(call: OpCall) -> Sharding | None:
    """Ops that mix channels and pixels of one image: by the leading batch dims only
    (pixel_shuffle's (*, C, H, W): 3 core dims; im2col's (N?, C, H, W): 3; col2im's (N?, C*k, L): 2;
    channel_shuffle's (N, C, *): all but N), or by samples dealt by a layout (dim 0; an
    unbatched image, with no dim beside its core, declines that way)."""
    x = call.specs[0]
    if call.func is aten.col2im.default:
        core = 2
    elif call.func is aten.channel_shuffle.default:
        core = x.ndim - 1
    else:
        core = 3
    return samples_in_place(call, core) or batch_sharding(call, [core])


# ---------------------------------------------------------------------------
# convolution: by batch; weight and bias replicated; their gradients pending sums
# ---------------------------------------------------------------------------


def _batch_axes(x: ArgSpec) -> tuple:
    """Per mesh axis: ``Shard(0)`` where ``x`` is sharded on its batch dim (and every rank holds
    some of it), else Replicate."""
    out = [Shard(0) if is_plain_shard(p) and p.dim % x.ndim == 0 and x.shape[0] > 1 else Replicate()
           for p in placements_of(x)]
    dropped = _emptied(out, x.shape, x.mesh)
    return tuple(Replicate() if axis in dropped else p for axis, p in enumerate(out))


@register(aten.convolution.default)
def convolution_rule(call: OpCall) -> Sharding | None:
    """``F.conv2d(x, w, b)``, ``x`` (N, C, H, W) ``[Shard(0)]``: each rank's images with the
    replicated ``w``, ``b``; output ``[Shard(0)]``; likewise for images dealt by a layout with no
    placement form, the output in their map (``samples_in_place``)."""
    x, w = call.args[0], call.args[1]
    bias = call.arg(2, "bias")
    if not isinstance(x, ArgSpec) or not isinstance(w, ArgSpec) or x.ndim != w.ndim:
        return None
    in_place = samples_in_place(call, 1, batched=1)
    if in_place is not None:
        return in_place
    batch = _batch_axes(x)
    full = (Replicate(),) * call.mesh.ndim
    inputs = [moved_to(x, batch), moved_to(w, full)] + ([moved_to(bias, full)] if isinstance(bias, ArgSpec) else [])
    return Sharding(inputs=inputs, outputs=batch)


@register(aten.convolution_backward.default)
def convolution_backward_rule(call: OpCall) -> Sharding | None:
    """``grad_out`` and ``x`` by batch, ``w`` replicated: grad_input by batch; grad_weight and
    grad_bias sum over the images, a pending sum over the batch's axes (over the axes that deal
    them, for images dealt by a layout with no placement form)."""
    grad, x, w = call.args[:3]
    if not all(isinstance(s, ArgSpec) for s in (grad, x, w)) or x.ndim != w.ndim or grad.ndim != x.ndim:
        return None
    in_place = samples_in_place(call, 1, batched=2, summed=(1, 2))
    if in_place is not None:
        return in_place
    batch = _batch_axes(x)
    full = (Replicate(),) * call.mesh.ndim
    summed = tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in batch)
    inputs = [moved_to(grad, batch), moved_to(x, batch), moved_to(w, full)]
    return Sharding(inputs=inputs, outputs=(batch, summed, summed))
