"""Random ops on DTensors: the values the unsharded tensor would get from the same generator.

Method: **every rank draws the whole tensor and keeps its piece.** ``x.uniform_()`` on a
``(10, 6)`` DTensor in ``[Shard(0)]`` on 4 ranks: each rank runs ``uniform_`` on a fresh
``(10, 6)`` tensor with the same generator, then copies rows ``[0,3) [3,6) [6,9) [9,10)``
(its own) into its local tensor. So

- ``x.full_tensor()`` equals ``torch.manual_seed(s); torch.empty(10, 6).uniform_()`` exactly,
  for every layout (uneven, nested, block-cyclic: any piece can be cut from the whole). The
  whole is drawn contiguous in the op's shape: on a transposed view (``x.t().uniform_()``) the
  values are those of a fresh contiguous ``(6, 10)`` tensor, where the unsharded op fills the
  view's memory order (the same distribution, other values);
- every rank's generator advances exactly as the unsharded op advances it, so the next
  random call agrees too, and replicated tensors get equal values on every rank;
- it holds on CPU (Mersenne twister, which cannot skip ahead) and on CUDA (Philox, whose
  element-to-counter map depends on the kernel's launch shape, i.e. on the whole tensor).

**Cost**: each rank draws ``numel`` of the *global* tensor (time and a temporary buffer of
that size), not ``numel / ranks``; no communication, except that ops whose random values
depend on tensor arguments (``bernoulli(p)``, ``normal(mean, std)``) gather those arguments.
Dropout draws only its mask this way; the output is ``input * mask * scale`` on the local
pieces (a partial-sum input stays partial: dropout is linear in it).

Precondition (as for any replicated random state): every rank seeds its generator the same
way (``torch.manual_seed(s)`` on all ranks).

Ops: ``uniform_``, ``normal_``, ``bernoulli_`` (float or tensor ``p``), ``random_``,
``exponential_``, ``geometric_``, ``log_normal_``, ``cauchy_``, ``rand_like``, ``randn_like``,
``randint_like``, ``bernoulli``, ``uniform``, ``normal`` (tensor mean/std), ``native_dropout``
and ``native_dropout_backward``. (On CPU ``F.dropout`` arrives as ``empty_like`` +
``bernoulli_`` + ``div_`` + ``mul``; on CUDA as ``native_dropout``.)
"""

from __future__ import annotations

import torch

from ..spec import make_spec, replicated_layout
from .registry import ArgSpec, OpCall, Partial, Replicate, Sharding, register
from .shard_ranges import box_here, inputs_by_name, local_piece, without_partial

aten = torch.ops.aten

__all__ = ["random_fill_rule", "random_like_rule", "random_of_values_rule", "native_dropout_rule",
           "native_dropout_backward_rule"]


# ---------------------------------------------------------------------------
# Cutting this rank's piece out of the whole tensor
# ---------------------------------------------------------------------------


def _cutter(spec: ArgSpec, placements):
    """The function that cuts this rank's local tensor out of a whole tensor shaped like ``spec``:
    by ``placements`` (no Partial) or, when the layout has no placement form (None), by the
    argument's own layout. Made once by the rule; its local step calls it."""
    if placements is not None:
        box = box_here(spec.shape, spec.mesh, placements)
        return lambda full: local_piece(full, box).contiguous()
    from ..runtime import redistribute_local

    whole = make_spec(spec.mesh, replicated_layout(tuple(spec.shape), spec.mesh), tuple(spec.shape))
    return lambda full: redistribute_local(full, whole, spec.spec)


def _first_summand(spec: ArgSpec) -> bool:
    """Whether this rank holds summand 0 of a pending sum (the one that carries the value)."""
    coords = spec.mesh.coordinates()
    return all(coords[axis] == 0 for axis, p in zip(spec.mesh.axis_names, spec.placements)
               if isinstance(p, Partial))


def _target(spec: ArgSpec):
    """Placements (or None: the argument's layout) of a fresh random tensor shaped like ``spec``."""
    return without_partial(spec.placements) if spec.placements is not None else None


# ---------------------------------------------------------------------------
# In-place fills: self keeps its layout; its values come from the whole tensor
# ---------------------------------------------------------------------------

_FILLS = (aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor,
          aten.random_.default, aten.random_.to, getattr(aten.random_, "from"), aten.exponential_.default,
          aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default)


@register(*_FILLS)
def random_fill_rule(call: OpCall) -> Sharding:
    target = call.args[0]
    if target.placements is None and target.reduce_op is not None:
        raise NotImplementedError(f"{call.func} on {target}: a pending {target.reduce_op} in a layout without "
                                  f"placements; redistribute it first")
    everything = (Replicate(),) * call.mesh.ndim
    inputs = inputs_by_name(call, {"self": None}, default=everything)  # p of bernoulli_: read whole
    cut = _cutter(target, _target(target))
    func = call.func

    def local(call, self_local, *args, **kwargs):
        full = torch.empty(target.shape, dtype=self_local.dtype, device=self_local.device)
        func(full, *args, **kwargs)
        piece = cut(full)
        if target.reduce_op == "sum" and not _first_summand(target):
            piece = torch.zeros_like(piece)  # the sum of the summands is the value
        self_local.copy_(piece)
        return self_local

    return Sharding(inputs=inputs, outputs=target.placements if target.placements is not None else target.layout,
                    local=local, note="whole tensor drawn on every rank")


# ---------------------------------------------------------------------------
# Out-of-place: a new tensor shaped (and laid out) like self
# ---------------------------------------------------------------------------

_LIKE = (aten.rand_like.default, aten.rand_like.generator, aten.randn_like.default, aten.randn_like.generator,
         aten.randint_like.default, aten.randint_like.low_dtype, aten.randint_like.generator,
         aten.randint_like.low_generator_dtype, aten.bernoulli.p, aten.uniform.default)


@register(*_LIKE)
def random_like_rule(call: OpCall) -> Sharding:
    """``self`` gives only the shape (and dtype/device): its values are never read."""
    source = call.args[0]
    placements = _target(source) if source.placements is not None else (Replicate(),) * call.mesh.ndim
    inputs = inputs_by_name(call, {"self": None}, default=(Replicate(),) * call.mesh.ndim)
    func = call.func
    cut = _cutter(source, placements)

    def local(call, self_local, *args, **kwargs):
        shape_only = torch.empty(source.shape, dtype=self_local.dtype, device=self_local.device)
        return cut(func(shape_only, *args, **kwargs))

    return Sharding(inputs=inputs, outputs=placements, local=local, note="whole tensor drawn on every rank")


_OF_VALUES = (aten.bernoulli.default, aten.bernoulli.Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
              aten.normal.Tensor_Tensor)


@register(*_OF_VALUES)
def random_of_values_rule(call: OpCall) -> Sharding:
    """Draws that read their tensor arguments (probabilities, means, stds): those are
    gathered, the whole result drawn, and the piece kept in the layout of the argument
    shaped like the result."""
    specs = call.specs
    out_shape = tuple(torch.broadcast_shapes(*(s.shape for s in specs)))
    like = next((s for s in specs if s.shape == out_shape and s.placements is not None), None)
    placements = _target(like) if like is not None else (Replicate(),) * call.mesh.ndim
    everything = (Replicate(),) * call.mesh.ndim
    func = call.func
    box = box_here(out_shape, call.mesh, placements)

    def local(call, *args, **kwargs):
        return local_piece(func(*args, **kwargs), box).contiguous()

    return Sharding(inputs=tuple(everything for _ in specs), outputs=placements, local=local,
                    note="arguments gathered, whole tensor drawn on every rank")


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------


@register(aten.native_dropout.default)
def native_dropout_rule(call: OpCall) -> Sharding:
    source = call.args[0]
    train = call.args[2] if len(call.args) > 2 else call.kwargs.get("train")
    if source.placements is None:  # rare: gather, so the mask can be cut by placements
        placements = (Replicate(),) * call.mesh.ndim
        inputs, out = (placements,), placements
    else:
        inputs, out = (None,), source.placements
        placements = without_partial(source.placements)
    box = box_here(source.shape, call.mesh, placements)

    def local(call, x, p, train=None):
        if train is False:  # inference: no random draw, torch returns the input and an all-true mask
            return aten.native_dropout(x, p, train)
        whole = torch.ones(source.shape, dtype=x.dtype, device=x.device)
        mask = local_piece(aten.native_dropout(whole, p, train)[1], box).contiguous()
        return x * mask * _dropout_scale(p, x), mask

    return Sharding(inputs=inputs, outputs=(out, placements), local=local,
                    note="mask drawn whole on every rank" if train is not False else "")


def _dropout_scale(p: float, x: torch.Tensor) -> float:
    """``1 / (1 - p)`` rounded as torch's kernel rounds it (so outputs match to the bit): in
    double on CPU, in the accumulate type (float, double for double) in the CUDA kernel."""
    if p >= 1:
        return 0.0
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return 1.0 / (1.0 - p)
    keep = torch.tensor(1.0 - p, dtype=torch.float32)
    return float(torch.tensor(1.0, dtype=torch.float32) / keep)


@register(aten.native_dropout_backward.default)
def native_dropout_backward_rule(call: OpCall) -> Sharding:
    grad = call.args[0]
    if grad.placements is None:
        everything = (Replicate(),) * call.mesh.ndim
        return Sharding(inputs=(everything, everything), outputs=everything)
    # linear in the grad: a partial grad stays partial, the mask follows its pieces
    return Sharding(inputs=(None, without_partial(grad.placements)), outputs=grad.placements)
