"""Elementwise ops: the output is sharded like the inputs, broadcasting included.

The rule reads which mesh axis shards which dim of each input, aligned to the output's
dims from the right (torch broadcasting), and keeps every shard it can: ``x + b`` with
``x`` ``(8, 6)`` in ``[Shard(0)]`` and ``b`` ``(6,)`` in ``[Replicate()]`` runs locally
(output ``[Shard(0)]``); with ``x`` in ``[Replicate()]`` and ``y`` in ``[Shard(1)]`` the
output is ``[Shard(1)]`` and ``x`` is sliced locally (no communication). A dim of extent
1 that broadcasts is never sharded (its single element is needed by every shard).

Pending sums (``Partial``) stay pending only where the op is linear in them:
``p + q`` of two partial sums, ``p * r`` or ``p / r`` for a non-partial ``r`` (or a
Python scalar), ``-p``, ``threshold_backward(p, x, 0)`` (linear in the incoming grad),
casts and copies between floating dtypes. Anything else (``p + 1``, ``exp(p)``, ``p * q``,
``p.to(torch.int64)``) reduces first.

In-place ops cannot move ``self``, so an affine one keeps its pending value exact by
acting on the summands: ``p.add_(1)`` of a ``Partial("sum")`` adds 1 on one rank of the
partial axes (coordinate 0 on each) and leaves the others; ``p.masked_fill_(m, v)`` writes
``v`` there and 0 on the others; on a pending avg/max/min both act on every rank (as do
``mul_``/``div_`` by a positive number and ``clamp_``, which commute with max and min).
2 ranks holding 3 and 4 of ``p = 7``: ``p.add_(1)`` leaves 4 and 4 (8 = 7 + 1). A
non-affine in-place op (``p.exp_()``) has the dispatcher apply the pending reduction in
``p``'s own buffer first (``p`` becomes ``Replicate`` on those axes).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import _StridedShard

from ..runtime import checks
from ..runtime.carriers import all_reduce_
from ..spec import REDUCE_OPS
from .registry import LINEAR_REDUCE_OPS, ArgSpec, OpCall, Partial, Replicate, Shard, Sharding, register
from ..layout import with_inner_dims, without_dims
from .specs import layout_only, padded, reduced_in_place
from .tensor_ops import placements_of, unshard, without_partial

aten = torch.ops.aten

# Linear in all tensor arguments together (kept partial when every tensor argument is).
_LINEAR_ALL = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.neg.default,
               aten.neg_.default, aten.clone.default, aten._to_copy.default, aten.zero_.default,
               aten._foreach_add.List, aten._foreach_add_.List, aten._foreach_sub.List,
               aten._foreach_sub_.List, aten._foreach_neg.default, aten._foreach_neg_.default,
               aten._foreach_zero_.default, aten.positive.default,
               aten.copy_.default}  # copy_(p, q) of two pending sums: p's summands become q's
# Linear in one argument at the given positions (of the tensor arguments), the others not partial.
_LINEAR_ONE = {aten.mul.Tensor: (0, 1), aten.mul_.Tensor: (0,), aten.mul.Scalar: (0,), aten.mul_.Scalar: (0,),
               aten.div.Tensor: (0,), aten.div_.Tensor: (0,), aten.div.Scalar: (0,), aten.div_.Scalar: (0,),
               aten._foreach_mul.List: (0, 1), aten._foreach_mul_.List: (0,), aten._foreach_mul.Scalar: (0,),
               aten._foreach_mul_.Scalar: (0,), aten._foreach_mul.Tensor: (0,), aten._foreach_mul_.Tensor: (0,),
               aten._foreach_div.List: (0,), aten._foreach_div_.List: (0,), aten._foreach_div.Scalar: (0,),
               aten._foreach_div_.Scalar: (0,), aten._foreach_div_.Tensor: (0,), aten._foreach_div.Tensor: (0,),
               aten._foreach_mul.ScalarList: (0,), aten._foreach_mul_.ScalarList: (0,),
               aten._foreach_div.ScalarList: (0,), aten._foreach_div_.ScalarList: (0,),
               aten.threshold_backward.default: (0,), aten.sigmoid_backward.default: (0,),
               aten.tanh_backward.default: (0,), aten.gelu_backward.default: (0,),
               aten.silu_backward.default: (0,), aten.hardtanh_backward.default: (0,),
               aten.leaky_relu_backward.default: (0,)}

# In-place ops on a pending self that the summands can carry exactly (the other tensor
# arguments not pending on that axis): "shift" self += c, "fill" self[mask] = v (sum: on one
# summand, the others unchanged / 0; avg, max, min: on every summand), "scale" self *= c > 0
# and "monotone" clamps (max, min only: a nondecreasing map commutes with max and min).
_INPLACE_KINDS = {aten.add_.Tensor: "shift", aten.add_.Scalar: "shift", aten.sub_.Tensor: "shift",
                  aten.sub_.Scalar: "shift", aten.masked_fill_.Scalar: "fill", aten.masked_fill_.Tensor: "fill",
                  aten.fill_.Scalar: "fill", aten.fill_.Tensor: "fill", aten.copy_.default: "fill",
                  aten.mul_.Scalar: "scale", aten.div_.Scalar: "scale", aten.mul_.Tensor: "scale",
                  aten.div_.Tensor: "scale", aten.clamp_.default: "monotone",
                  aten.clamp_min_.default: "monotone", aten.clamp_max_.default: "monotone"}
_KIND_OPS = {"shift": REDUCE_OPS, "fill": REDUCE_OPS, "scale": ("max", "min"),
             "monotone": ("max", "min")}


def _tensor_args(call: OpCall) -> list:
    """Tensor arguments in order: ArgSpecs and plain 0-dim tensors (scalars)."""
    return call.leaves((ArgSpec, torch.Tensor))


def _broadcast_shape(shapes) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s):
            j = ndim - len(s) + i
            if n != 1:
                out[j] = n
    return tuple(out)


def _is_inplace(func) -> bool:
    first = func._schema.arguments[0]
    return first.alias_info is not None and first.alias_info.is_write


def _partial_kept(call: OpCall, tensors: list, axis_index: int) -> str | None:
    """The reduce op the output keeps pending on this mesh axis, or None (inputs reduce first)."""
    partial = [isinstance(t, ArgSpec) and t.placements is not None and isinstance(t.placements[axis_index], Partial)
               for t in tensors]
    if not any(partial):
        return None
    ops = {t.placements[axis_index].reduce_op for t, p in zip(tensors, partial) if p}
    if len(ops) != 1 or next(iter(ops)) not in LINEAR_REDUCE_OPS:
        return None
    func = call.func
    if func in _LINEAR_ALL and all(partial):
        # p + 1 (a Python number arrives as is) would add the number once per summand
        if func._schema.name.split("::")[1].strip("_").replace("foreach_", "") in ("add", "sub") \
                and len(tensors) < 2:
            return None
        cast = call.kwargs.get("dtype") if func is aten._to_copy.default else None
        if not _sum_commutes_with_cast([t.dtype for t in tensors] + ([cast] if cast is not None else [])):
            return None
        return next(iter(ops))
    positions = _LINEAR_ONE.get(func)
    if positions is not None and sum(partial) == 1 and partial.index(True) in positions:
        return next(iter(ops))
    return None


def _sum_commutes_with_cast(dtypes: list) -> bool:
    """Whether summands cast between these dtypes (inputs' and output's) sum to the cast of their
    sum: between floating/complex dtypes (up to rounding), or with no cast. Not to an integer or
    bool: summands 0.6 and 0.6 cast to int64 sum to 0, int64(1.2) is 1; 1.0 and -1.0 cast to
    bool are True, bool(0.0) is False. Nor from one (int32 summands wrap where their int64 casts
    do not)."""
    return len(set(dtypes)) == 1 or all(d.is_floating_point or d.is_complex for d in dtypes)


def _inplace_kept(call: OpCall, tensors: list, axis_index: int) -> str | None:
    """The reduce op an in-place op keeps pending on this axis by acting on the summands
    (``_INPLACE_KINDS``), or None."""
    kind = _INPLACE_KINDS.get(call.func)
    self, others = tensors[0], tensors[1:]
    if kind is None or not isinstance(self, ArgSpec) or self.placements is None:
        return None
    p = self.placements[axis_index]
    if not isinstance(p, Partial) or p.reduce_op not in _KIND_OPS[kind]:
        return None
    if any(isinstance(t, ArgSpec) and (t.placements is None or isinstance(t.placements[axis_index], Partial))
           for t in others):
        return None
    if kind == "scale":  # x.mul_(2.5) arrives as mul_.Tensor with the Python number (part of the plan's key)
        factor = call.args[1] if len(call.args) > 1 else None
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            return None
    if kind == "monotone" and any(isinstance(a, torch.Tensor) for a in call.args[1:]):
        return None
    return p.reduce_op


def _on_one_summand(func, lead: bool):
    """The local function of a "shift"/"fill" in-place op on a pending sum: the op itself on
    the lead rank of the partial axes; elsewhere self unchanged (shift) or 0 where the value
    goes (fill)."""
    kind = _INPLACE_KINDS[func]

    def local(call, self, *args, **kwargs):
        if lead:
            return func(self, *args, **kwargs)
        if kind == "shift":
            return self
        if func in (aten.masked_fill_.Scalar, aten.masked_fill_.Tensor):
            return self.masked_fill_(args[0], 0)
        return self.zero_()

    return local


def whole(spec: ArgSpec):
    """What an output or input keeps of an argument without placement form: its whole spec (an
    uneven layout's padding with it), or its layout where it is pending."""
    return spec.spec if spec.spec is not None and not spec.reduce_op else spec.layout


def _form(spec: ArgSpec):
    """Placements this rule can reason with per axis: None for a layout without placement form
    and for ``_StridedShard`` (a dim cut twice, e.g. a tensor- and data-parallel parameter)."""
    p = spec.placements
    return None if p is None or any(isinstance(q, _StridedShard) for q in p) else p


def _replicated_scalar(spec) -> bool:
    return not isinstance(spec, ArgSpec) or (math.prod(spec.shape) == 1 and spec.reduce_op is None
                                             and spec.placements is not None
                                             and all(isinstance(p, Replicate) for p in spec.placements))


def _rows_broadcast(specs: list, out_shape: tuple) -> Sharding | None:
    """Operands of the output's rank that share leading dims (the rows) and broadcast against
    each other in whole trailing dims, one of them laid out by a layout with no placement form
    that deals only those rows (``specs.reduced_in_place`` over the trailing dims): every operand
    is asked for that map of rows with its own trailing dims (a replicated one is cut where it
    is) and each piece broadcasts its own rows. ``x.unsqueeze(-1) * y.unsqueeze(-2)`` of dealt
    rows: the (R, H, H) outer products keep the rows' map. A replicated operand that spans only
    trailing dims (size 1 or missing in the rows) stays whole and broadcasts over every piece:
    ``t.unsqueeze(-1) == torch.arange(6)`` (``one_hot``) of dealt (8,) targets gives (8, 6) rows
    in the targets' map. None otherwise."""
    ndim = len(out_shape)
    if not specs or any(s.reduce_op for s in specs) or 0 in out_shape:
        return None
    at = next((i for i, s in enumerate(specs) if layout_only(s) and s.ndim == ndim), None)
    if at is None:
        return None
    source = specs[at]
    everywhere = (Replicate(),) * source.mesh.ndim
    for lead in range(ndim - 1, 0, -1):  # the most leading dims first
        in_rows = [s.ndim == ndim and tuple(s.shape[:lead]) == tuple(out_shape[:lead]) for s in specs]

        def spread(s) -> bool:  # replicated, with size 1 (or no dim) in every row dim
            return s.is_replicated() and all(n == 1 for n in s.shape[:max(0, s.ndim - (ndim - lead))])

        if not in_rows[at] or any(not r and not spread(s) for s, r in zip(specs, in_rows)):
            continue
        rows = reduced_in_place(source, list(range(lead, ndim)))
        if rows is None:
            continue
        targets = [with_inner_dims(rows, out_shape[:lead], s.shape[lead:]) if r else everywhere
                   for s, r in zip(specs, in_rows)]
        out = with_inner_dims(rows, out_shape[:lead], out_shape[lead:])
        if out is not None and all(t is not None for t in targets):
            return Sharding(inputs=targets, outputs=out)
    return None


def pointwise_sharding(call: OpCall, anchor: ArgSpec | None = None) -> Sharding:
    """The elementwise rule (also used by other families for ops that act per element).

    ``anchor``: an argument whose placements the output must keep (in-place ops: self).
    """
    mesh = call.mesh
    tensors = _tensor_args(call)
    specs = call.specs
    out_shape = _broadcast_shape([tuple(t.shape) for t in tensors])
    ndim = len(out_shape)
    if anchor is None and _is_inplace(call.func) and specs and (call.args[0] is specs[0] or (
            isinstance(call.args[0], (list, tuple)) and call.args[0] and call.args[0][0] is specs[0])):
        anchor = specs[0]

    # Same shape and same placements (or layout) everywhere, nothing pending: run as is.
    if specs and all(s.shape == out_shape for s in specs) and all(s.reduce_op is None for s in specs):
        first = specs[0]
        if all((_form(s), whole(s)) == (_form(first), whole(first)) if _form(first) is None
               else s.placements == first.placements for s in specs):
            return Sharding(inputs=[None] * len(specs),
                            outputs=first.placements if _form(first) is not None else whole(first))
    # A layout-only tensor with replicated scalars (an optimizer's or clip_grad_norm_'s step on a
    # sharded parameter) or replicated tensors of its shape (sliced to its layout: no data moves):
    # each rank's elements, the layout kept.
    main = next((s for s in specs if s.shape == out_shape and _form(s) is None and not s.reduce_op), None)

    def sliced(s) -> bool:  # a replicated full-shape operand, taken as the main's layout locally
        return s is not main and s.shape == main.shape and s.is_replicated() and not _replicated_scalar(s)

    def per_row(s) -> bool:
        """A layout-only operand of main's leading dims and size 1 in its trailing ones, laid out
        as main's pieces leave those leading dims (a norm's rstd, ``x.pow(2).mean(-1, keepdim=True)``:
        ``specs.reduced_in_place``): each piece broadcasts its own rows locally."""
        if s is main or s.ndim != main.ndim or _form(s) is not None or s.reduce_op or padded(s):
            return False
        trailing = 0
        while trailing < s.ndim and s.shape[s.ndim - 1 - trailing] == 1 != main.shape[s.ndim - 1 - trailing]:
            trailing += 1
        if not trailing or s.shape[:s.ndim - trailing] != main.shape[:s.ndim - trailing]:
            return False
        return reduced_in_place(main, list(range(s.ndim - trailing, s.ndim))) == s.layout

    def per_column(s) -> bool:
        """A replicated operand that broadcasts against main (in each of main's trailing dims it has,
        size 1 or main's size) and has main's size only in dims main's pieces hold whole and local,
        their memory row-major (``specs.reduced_in_place`` of those dims): a norm's weight, RoPE's
        tables ``cos[:, None, None, :]`` beside q of dealt heads. Each piece broadcasts it over its
        own elements."""
        if s is main or not s.is_replicated() or _replicated_scalar(s) or not 0 < s.ndim <= main.ndim:
            return False
        lead = main.ndim - s.ndim
        if any(n not in (1, main.shape[lead + d]) for d, n in enumerate(s.shape)):
            return False
        held = [lead + d for d, n in enumerate(s.shape) if n > 1]
        return bool(held) and reduced_in_place(main, held) is not None

    def per_leading(s) -> bool:
        """A layout-only operand of fewer dims than main, its shape main's trailing dims, laid out
        as main's pieces leave when main's leading dims (whole and local in every piece) are taken
        off (``layout.without_dims``: ``x.expand(2, R, H) * y`` of dealt rows ``y``): each piece
        broadcasts its own rows over those leading dims."""
        if s is main or not 0 < s.ndim < main.ndim or _form(s) is not None or s.reduce_op \
                or padded(s) or s.shape != main.shape[main.ndim - s.ndim:]:
            return False
        return without_dims(main.layout, main.shape, range(main.ndim - s.ndim)) == s.layout

    def pending_scalar(s) -> bool:
        """A pending single value (``x == x.amax()`` in amax's backward): reduced where it is
        (one value per rank) rather than gathering main."""
        return s is not main and math.prod(s.shape) == 1 and s.reduce_op is not None

    if main is not None and (anchor is None or anchor is main) and all(
            s is main or (s.shape == main.shape and whole(s) == whole(main) and not s.reduce_op)
            or _replicated_scalar(s) or sliced(s) or per_row(s) or per_column(s) or per_leading(s)
            or pending_scalar(s) for s in specs):
        everywhere = (Replicate(),) * mesh.ndim
        return Sharding(inputs=[whole(main) if sliced(s) else everywhere if pending_scalar(s) else None for s in specs],
                        outputs=whole(main))

    broadcast = _rows_broadcast(specs, out_shape) if anchor is None else None
    if broadcast is not None:
        return broadcast

    def out_dim(spec: ArgSpec, d: int) -> int | None:
        """Output dim of input dim d, or None when it broadcasts (extent 1 against more)."""
        j = ndim - spec.ndim + d
        return None if spec.shape[d] == 1 and out_shape[j] != 1 else j

    out = []
    one_summand = []  # mesh axes whose pending sum an in-place shift/fill changes on one summand
    order = sorted(specs, key=lambda s: -math.prod(s.shape))
    if anchor is not None:
        order = [anchor] + [s for s in order if s is not anchor]
    for axis_index in range(mesh.ndim):
        if anchor is not None and _form(anchor) is not None:
            p = anchor.placements[axis_index]
            if isinstance(p, Shard):
                out.append(Shard(out_dim(anchor, p.dim)))
            elif isinstance(p, Partial):
                kept = _partial_kept(call, tensors, axis_index)
                if kept is None and anchor is tensors[0]:
                    kept = _inplace_kept(call, tensors, axis_index)
                    if kept == "sum" and _INPLACE_KINDS[call.func] in ("shift", "fill"):
                        one_summand.append(mesh.axis_names[axis_index])
                # not kept: self's pending value is applied in its own buffer first (dispatcher)
                out.append(Partial(kept) if kept else Replicate())
            else:
                out.append(Replicate())
            continue
        if anchor is not None:
            out.append(Replicate())
            continue
        chosen = None
        for s in order:
            p = s.placements[axis_index] if s.placements is not None else None
            if type(p) is Shard and out_dim(s, p.dim) is not None:
                chosen = Shard(out_dim(s, p.dim))
                break
        if chosen is None:
            kept = _partial_kept(call, tensors, axis_index)
            chosen = Partial(kept) if kept else Replicate()
        out.append(chosen)
    if anchor is not None and _form(anchor) is None:
        # an in-place op on a tensor without placement form: everything else follows its layout
        return Sharding(inputs=[None if s is anchor else (whole(anchor) if s.shape == anchor.shape else
                                                          [Replicate()] * mesh.ndim) for s in specs],
                        outputs=whole(anchor))

    inputs = []
    for s in specs:
        want = []
        for axis_index, p in enumerate(out):
            if isinstance(p, Shard):
                d = p.dim - (ndim - s.ndim)
                want.append(Shard(d) if d >= 0 and out_dim(s, d) is not None else Replicate())
            elif isinstance(p, Partial):
                mine = s.placements[axis_index] if s.placements is not None else None
                want.append(mine if isinstance(mine, Partial) else Replicate())
            else:
                want.append(Replicate())
        want = tuple(want)
        inputs.append(None if s.placements == want else want)
    local = None
    if one_summand:
        here = mesh.coordinates()
        local = _on_one_summand(call.func, all(here[a] == 0 for a in one_summand))
    return Sharding(inputs=inputs, outputs=tuple(out), local=local)


_UNARY = ["abs", "neg", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "sin", "cos",
          "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "relu",
          "gelu", "silu", "mish", "erf", "erfc", "erfinv", "reciprocal", "sign", "sgn", "signbit", "floor", "ceil",
          "round", "trunc", "frac", "logical_not", "bitwise_not", "isnan", "isinf", "isposinf", "isneginf",
          "isfinite", "nan_to_num", "clamp", "clamp_min", "clamp_max", "hardtanh", "leaky_relu", "elu", "celu",
          "selu", "softplus", "hardswish", "hardsigmoid", "hardshrink", "softshrink", "threshold", "logit",
          "relu6", "square", "positive", "conj_physical", "angle", "digamma", "lgamma", "i0", "sinc", "deg2rad", "rad2deg",
          "bitwise_left_shift", "bitwise_right_shift", "fill", "clone", "_to_copy", "alias_copy",
          "_conj_physical", "polygamma", "mvlgamma", "special_i0e", "special_i1", "special_i1e", "special_entr",
          "special_erfcx", "special_log_ndtr", "special_ndtri", "special_airy_ai", "special_bessel_j0",
          "special_bessel_j1", "special_bessel_y0", "special_bessel_y1", "special_modified_bessel_i0",
          "special_modified_bessel_i1", "special_modified_bessel_k0", "special_modified_bessel_k1",
          "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1", "special_spherical_bessel_j0"]
_BINARY = ["add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow",
           "maximum", "minimum", "fmax", "fmin", "atan2", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
           "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "copysign", "hypot", "xlogy",
           "nextafter", "lerp", "addcmul", "addcdiv", "masked_fill", "heaviside", "logaddexp", "logaddexp2",
           "float_power", "ldexp", "igamma", "igammac", "polar", "complex", "special_xlog1py", "special_zeta",
           "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u", "special_chebyshev_polynomial_v",
           "special_chebyshev_polynomial_w", "special_shifted_chebyshev_polynomial_t",
           "special_shifted_chebyshev_polynomial_u", "special_shifted_chebyshev_polynomial_v",
           "special_shifted_chebyshev_polynomial_w", "special_hermite_polynomial_h", "special_hermite_polynomial_he",
           "special_laguerre_polynomial_l", "special_legendre_polynomial_p"]
_BACKWARD = ["threshold_backward", "sigmoid_backward", "tanh_backward", "gelu_backward", "silu_backward",
             "leaky_relu_backward", "elu_backward", "hardtanh_backward", "softplus_backward", "mish_backward",
             "hardswish_backward", "hardsigmoid_backward", "logit_backward", "hardshrink_backward",
             "softshrink_backward", "log_sigmoid_backward"]
_FOREACH = ["add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "neg", "abs", "exp", "log",
            "maximum", "minimum", "clamp_min", "clamp_max", "reciprocal", "sign", "pow", "sigmoid", "tanh",
            "zero", "copy", "rsqrt", "sin", "cos", "floor", "ceil", "round", "trunc", "frac", "erf", "expm1",
            "log1p", "log2", "log10"]


def _packets(names, inplace=True):
    out = []
    for name in names:
        for candidate in (name, name + "_") if inplace else (name,):
            packet = getattr(aten, candidate, None)
            if packet is not None:
                out.append(packet)
    return out


_ELEMENTWISE = _packets(_UNARY + _BINARY + _BACKWARD) + [aten.where.self, aten.where.ScalarSelf,
                                                        aten.where.ScalarOther, aten.where.Scalar,
                                                        aten.copy_.default, aten.zero_.default, aten.fill_.Scalar,
                                                        aten.fill_.Tensor, aten.contiguous.default
                                                        if hasattr(aten, "contiguous") else aten.clone.default]
_ELEMENTWISE = list(dict.fromkeys(_ELEMENTWISE))
_ELEMENTWISE += [p for p in _packets([f"_foreach_{n}" for n in _FOREACH]) if p not in _ELEMENTWISE]


@register(*_ELEMENTWISE)
def elementwise(call: OpCall) -> Sharding:
    return pointwise_sharding(call)


@register(aten.frexp.Tensor, aten.log_sigmoid_forward.default)
def elementwise_two_outputs(call: OpCall) -> Sharding:
    """``torch.frexp(x)`` (mantissa, exponent), ``log_sigmoid_forward(x)`` (output, buffer): two
    outputs of ``x``'s shape, each element from the same element of ``x``, laid out alike."""
    one = pointwise_sharding(call)
    if not isinstance(one.outputs, tuple) or any(isinstance(p, Partial) for p in one.outputs):
        return None  # (a layout without placement form, or a pending output: gathered)
    local = _log_sigmoid_forward_local if call.func is aten.log_sigmoid_forward.default else None
    return Sharding(inputs=one.inputs, outputs=(one.outputs, one.outputs), local=local)


def _log_sigmoid_forward_local(call, x, *args, **kwargs):
    # CUDA's kernel returns an empty buffer (its backward does not read it): laid out as x's
    out, buffer = aten.log_sigmoid_forward.default(x, *args, **kwargs)
    return out, (buffer if buffer.shape == out.shape else torch.zeros_like(out))


@register(aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like)
def like_factory(call: OpCall) -> Sharding:
    """A new tensor shaped like its input: same sharding, nothing pending (a fresh value is whole)."""
    (spec,) = call.specs
    if spec.placements is None:
        return Sharding(inputs=[None], outputs=whole(spec))
    return Sharding(inputs=[None], outputs=tuple(Replicate() if isinstance(p, Partial) else p
                                                 for p in spec.placements))


@register(aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided)
def new_factory(call: OpCall) -> Sharding:
    """``x.new_zeros(size)``: a fresh tensor of the given (global) size, laid out as ``x`` where
    the size is ``x``'s and nothing is pending (torch's DTensor follows a sharded ``x`` too), else
    whole on every rank. Autograd copies a non-contiguous gradient by ``new_empty_strided(x.shape)``
    and ``copy_``: laid out as the gradient, the copy moves nothing."""
    x = call.args[0]
    if tuple(call.args[1]) == tuple(x.shape) and not x.reduce_op:
        return Sharding(inputs=[None], outputs=like_factory(call).outputs, local=_new_of_local_size)
    return Sharding(inputs=[None] * len(call.specs), outputs=(Replicate(),) * call.mesh.ndim)


def _new_of_local_size(call, x, size, *args, **kwargs):
    """The factory at this rank's size (``x``'s local shape), row-major strides for ``new_empty_strided``."""
    if call.func is aten.new_empty_strided.default:
        args = (torch.empty(x.shape, device="meta").stride(),) + args[1:]
    return call.func(x, list(x.shape), *args, **kwargs)


@register(aten._local_scalar_dense, aten.equal, aten.is_nonzero)
def to_python(call: OpCall) -> Sharding:
    """``x.item()``, ``torch.equal``: the whole value on every rank, a Python result, read after
    every pending value check (``runtime/checks.py``) is settled, so no value built on bad input
    reaches the host without its error."""
    return Sharding(inputs=[(Replicate(),) * call.mesh.ndim] * len(call.specs), outputs=None, local=_read)


def _read(call: OpCall, *args, **kwargs):
    checks.settle()
    return call.func(*args, **kwargs)


@register(aten._foreach_norm)
def foreach_norm(call: OpCall) -> Sharding:
    """``_foreach_norm([x], ord)`` (clip_grad_norm_): each rank's partial norm, combined over
    the axes that shard ``x`` (``(sum |x|^p)^(1/p)``, or max/min for the infinity norms)."""
    (spec,) = call.specs
    ord_ = float(call.args[1]) if len(call.args) > 1 else float(call.kwargs.get("ord", 2))
    if spec.placements is None or any(isinstance(p, Partial) for p in spec.placements):
        want = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements) \
            if spec.placements is not None else (Replicate(),) * call.mesh.ndim
        spec_placements = want
    else:
        want, spec_placements = None, spec.placements
    if not any(isinstance(p, Shard) for p in spec_placements) or any(
            type(p) not in (Shard, Replicate) for p in spec_placements):
        want = None if want is None and all(isinstance(p, Replicate) for p in spec_placements) else \
            (Replicate(),) * call.mesh.ndim
        return Sharding(inputs=[want], outputs=[(Replicate(),) * call.mesh.ndim])
    axes = [a for a, p in zip(call.mesh.axis_names, spec_placements) if isinstance(p, Shard)]
    mesh = call.mesh

    def local(call_, tensors, *rest, **kwargs):
        (x,) = tensors
        if ord_ == float("inf") or ord_ == float("-inf"):
            # an empty shard (5 rows on 4 ranks) has no amax: it holds the identity of max / min
            magnitude = x.abs()
            if x.numel() == 0:
                value = torch.tensor(0.0 if ord_ > 0 else float("inf"), dtype=magnitude.dtype, device=x.device)
            else:
                value = magnitude.amax() if ord_ > 0 else magnitude.amin()
            op = "max" if ord_ > 0 else "min"
            all_reduce_(value, op, group=mesh.group(axes))
            return [value]
        if ord_ == 0:
            value = (x != 0).sum().to(x.dtype)
            all_reduce_(value, group=mesh.group(axes))
            return [value]
        value = x.abs().pow(ord_).sum()
        all_reduce_(value, group=mesh.group(axes))
        return [value.pow(1.0 / ord_)]

    return Sharding(inputs=[want], outputs=[(Replicate(),) * call.mesh.ndim], local=local)


@register(aten._prelu_kernel.default, aten._prelu_kernel_backward.default)
def prelu_rule(call: OpCall) -> Sharding:
    """``F.prelu(x, w)``: elementwise, with ``w``'s one slope per channel (dim 1 of ``x``) or one
    for all: the channel dim whole where ``w`` has several, ``w`` replicated, nothing pending;
    every other dim keeps its shards. The backward (grad, x, w) gives the input's and the
    per-element slope gradient, both sharded as ``x``."""
    backward = call.func is aten._prelu_kernel_backward.default
    x, w = (call.args[1], call.args[2]) if backward else (call.args[0], call.args[1])
    places = without_partial(placements_of(x))
    if isinstance(w, ArgSpec) and math.prod(w.shape) > 1 and x.ndim > 1:
        places = unshard(places, [1], x.ndim)
    inputs = [(Replicate(),) * call.mesh.ndim if spec is w else places for spec in call.specs]
    return Sharding(inputs=inputs, outputs=(places, places) if backward else places)
