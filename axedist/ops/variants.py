"""Calls the dispatcher's per-op route does not cover alone: ``out=``, ``_foreach_*``, fused
optimizer steps, plain constants among DTensors, and ops with no rule (the gather fallback).

Each function takes the dispatcher (``d``: its tensor class ``d.cls``, ``d.dispatch`` for the
functional op, its caches and counts). ``torch.add(x, y, out=o)`` runs ``add.Tensor`` through the
dispatcher, then copies the result into ``o`` in ``o``'s layout; ``torch.aminmax(x, dim=1)`` (no rule)
gathers ``x``, runs on the whole tensor, and lays the result out replicated, warning once.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.distributed.tensor import Partial, Replicate

from ..runtime import checks, redistribute_local
from ..spec import make_spec, replicated_layout
from .call_plan import (FOREACH_INFO, FOREACH_WRITE, DispatchError, OpInfo, PlainTensorError, functional_of,
                        replace_dtensors, scan, writes_first, written)
from .registry import collect_leaves
from .reshape_inplace import rebind
from .specs import placements_or_none, spec_of

__all__ = ["FUSED_OPTIMIZERS", "NOT_HANDLED", "dispatch_out", "dispatch_foreach", "dispatch_fused_optimizer",
           "adopt_constants", "gather_fallback", "implicit_replication", "loss_parallel", "LOSS_OPS", "MODES"]

aten = torch.ops.aten

NOT_HANDLED = object()  # dispatch_fused_optimizer's answer when the gather fallback must run

# Fused optimizer steps (``torch.optim.AdamW(fused=True)``, ``SGD(fused=True)``): one call over
# lists of parameters, gradients and states.
FUSED_OPTIMIZERS = tuple(getattr(getattr(aten, name), overload) for name in ("_fused_adam_", "_fused_adamw_",
                                                                            "_fused_sgd_")
                         if hasattr(aten, name) for overload in getattr(aten, name).overloads())


def dispatch_out(d, func, args, kwargs, info: OpInfo):
    """``op(..., out=o)``: the functional op, then the result copied into ``o`` in ``o``'s layout."""
    functional = functional_of(func)
    if functional is None:
        dts, mesh, _ = scan(d.cls, func, args, kwargs)
        return gather_fallback(d, func, args, kwargs, dts, mesh, info)
    outs = [kwargs[name] for name in info.out_names]
    rest = {k: v for k, v in kwargs.items() if k not in info.out_names}
    result = d.dispatch(functional, args, rest)
    results = [result] if len(outs) == 1 else list(result)
    for o, r in zip(outs, results):
        if not isinstance(o, d.cls):
            raise DispatchError(f"{func}: out= is a plain tensor but the result is a DTensor; pass a DTensor")
        if tuple(o.shape) != tuple(r.shape):
            raise DispatchError(f"{func}: out= has shape {tuple(o.shape)}, the result {tuple(r.shape)} "
                                f"(axedist does not resize DTensors)")
        if not isinstance(r, d.cls):
            raise DispatchError(f"{func}: the result is not a DTensor")
        value = r._local if r._spec == o._spec else redistribute_local(r._local, r._spec, o._spec)
        o._local.copy_(value)
    return outs[0] if len(outs) == 1 else tuple(outs)


def dispatch_foreach(d, func, args, kwargs):
    """``_foreach_op(list, ...)``: the same op once per list element (lists of one),
    so each element follows its own sharding rule."""
    schema = func._schema.arguments
    is_list = [isinstance(v, (list, tuple)) and isinstance(a.type, torch.ListType) for v, a in zip(args, schema)]
    lengths = {len(v) for v, lst in zip(args, is_list) if lst}
    lengths |= {len(v) for v in kwargs.values() if isinstance(v, (list, tuple))}
    if len(lengths) != 1:
        raise DispatchError(f"{func}: list arguments of different lengths {sorted(lengths)}")
    (n,) = lengths
    results = []
    for i in range(n):
        # element i of every list argument, as a list of one (the op still takes lists)
        one_args = tuple([v[i]] if lst else v for v, lst in zip(args, is_list))
        one_kwargs = {k: ([v[i]] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}
        if any(isinstance(x, d.cls) for v in one_args for x in (v if isinstance(v, list) else [v])):
            results.append(_dispatch_single_foreach(d, func, one_args, one_kwargs))
        else:
            results.append(func(*one_args, **one_kwargs))
    returns = func._schema.returns
    if returns and isinstance(returns[0].type, torch.ListType):
        return [r[0] for r in results]
    return None


def _dispatch_single_foreach(d, func, args, kwargs):
    dts, mesh, key = scan(d.cls, func, args, kwargs)
    plan = d.plan(func, args, kwargs, dts, mesh, key, FOREACH_INFO)
    if plan is None:
        return gather_fallback(d, func, args, kwargs, dts, mesh, FOREACH_WRITE if writes_first(func) else FOREACH_INFO)
    if writes_first(func):
        for dt, t in zip(dts, plan.targets):
            if dt is args[0][0] and t is not None:
                raise DispatchError(f"{func} is in-place on {dt._spec}, but its rule needs it moved; an in-place op "
                                    f"cannot change its tensor's layout")
    return d.run(func, args, kwargs, dts, plan, FOREACH_INFO)


def dispatch_fused_optimizer(d, func, args, kwargs):
    """A fused optimizer step on DTensor parameters, or ``NOT_HANDLED`` (then the fallback runs).

    Element ``i`` of every list lives where parameter ``i`` does (its states were made by
    ``zeros_like(param)``); the gradient, which the step only reads (no ``grad_scale``), is
    moved there (a pending sum reduced or reduce-scattered), and the op runs once on all the
    local tensors: AdamW on a ``[Shard(0)]`` weight with a ``[Partial()]`` gradient updates
    each rank's rows with its rows of the summed gradient.
    """
    cls = d.cls
    if kwargs.get("grad_scale") is not None or kwargs.get("found_inf") is not None:
        return NOT_HANDLED  # the step would write the unscaled gradients back
    params = args[0]
    if not all(isinstance(p, cls) and not p._spec.reduce_op for p in params):
        return NOT_HANDLED
    mesh = params[0]._spec.mesh if params else None
    local_args = [[p._local for p in params]]
    for k, values in enumerate(args[1:], start=1):
        if not isinstance(values, (list, tuple)):
            local_args.append(values)
            continue
        locals_ = []
        for i, t in enumerate(values):
            if not isinstance(t, cls):
                locals_.append(t)  # plain 0-dim step counters
            elif t._spec.mesh != mesh:
                return NOT_HANDLED
            elif t._spec == params[i]._spec:
                locals_.append(t._local)
            elif k == 1:
                locals_.append(redistribute_local(t._local, t._spec, params[i]._spec))
            else:
                return NOT_HANDLED  # a state in another layout than its parameter: written, so not moved
        local_args.append(locals_)
    local_kwargs = {k: (v._local if isinstance(v, cls) and v._spec.mesh == mesh and
                        all(isinstance(p, Replicate) for p in (placements_or_none(v._spec) or [None])) else v)
                    for k, v in kwargs.items()}
    if any(isinstance(v, cls) for v in local_kwargs.values()):
        return NOT_HANDLED
    func(*local_args, **local_kwargs)
    return None


# Loss ops whose plain target / weight ``loss_parallel()`` takes as replicated.
LOSS_OPS = frozenset({aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, aten.nll_loss_backward.default,
                      aten.nll_loss2d_backward.default})

# Ops whose integer / bool tensor arguments say where (indices, masks): ``x[[0, 2]]``, ``x[mask]``,
# ``x.gather(1, idx)`` with a plain index next to a DTensor take the index as replicated once every
# rank is seen to hold the same one (torch's DTensor refuses them all).
INDEX_OPS = frozenset({
    aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
    aten.index_select.default, aten.index_add.default, aten.index_add_.default, aten.index_copy.default,
    aten.index_copy_.default, aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar, aten.gather.default,
    aten.scatter.src, aten.scatter.value, aten.scatter_.src, aten.scatter_.value, aten.scatter_add.default,
    aten.scatter_add_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two, aten.take.default,
    aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_select.default, aten.masked_scatter.default,
    aten.masked_scatter_.default, aten.embedding.default})
# Ops that look each element up in a whole second tensor (``torch.isin(ids, special_ids)``,
# ``torch.bucketize(x, edges)``): a plain table of any dtype is taken as replicated, once every
# rank is seen to hold the same one.
LOOKUP_OPS = frozenset({aten.isin.Tensor_Tensor, aten.bucketize.Tensor, aten.searchsorted.Tensor})


class _Modes:
    """How many ``implicit_replication()`` / ``loss_parallel()`` blocks are open (process-wide,
    as torch's flags are: backward may run on autograd's own threads)."""

    implicit_replication = 0
    loss_parallel = 0


MODES = _Modes()


@contextlib.contextmanager
def implicit_replication():
    """Inside, a plain tensor among DTensor arguments is taken as replicated, as under torch's
    ``torch.distributed.tensor.experimental.implicit_replication()`` (whose flag axedist also
    honours). Unlike torch, axedist checks that every rank passed the same tensor (one small
    all-reduce per such call) and raises if not, and refuses a plain tensor that requires grad
    (its gradient would be a DTensor): distribute those.

        >>> with implicit_replication():
        ...     y = x_dtensor + torch.ones(8, 6)      # the plain ones: Replicate
    """
    MODES.implicit_replication += 1
    try:
        yield
    finally:
        MODES.implicit_replication -= 1


@contextlib.contextmanager
def loss_parallel():
    """Inside (forward and backward), a plain target or class weight of the cross-entropy ops
    is taken as replicated, as under torch's ``torch.distributed.tensor.parallel.loss_parallel()``
    (which axedist also honours). The loss over class-sharded logits needs no switch in
    axedist (``ops/loss.py``); this is what lets plain integer labels in. Each rank must pass
    the same labels (checked, one small all-reduce per loss op).

        >>> with loss_parallel():
        ...     loss = F.cross_entropy(logits, labels)   # logits (Shard(1),), labels a plain [B] tensor
        ...     loss.backward()
    """
    MODES.loss_parallel += 1
    try:
        yield
    finally:
        MODES.loss_parallel -= 1


def _torch_implicit_replication() -> bool:
    flag = getattr(torch._C, "_get_dtensor_allow_implicit_replication", None)
    return bool(flag()) if flag is not None else False


def _torch_loss_parallel() -> bool:
    # torch's loss_parallel() installs handlers for the loss ops in its DTensor's dispatcher
    try:
        from torch.distributed.tensor import DTensor as TorchDTensor

        return aten.nll_loss_forward.default in TorchDTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError):
        return False


def adopt_constants(cls, func, args, kwargs, error: PlainTensorError):
    """``args``/``kwargs`` with plain tensors among DTensors replaced by replicated ``cls``
    DTensors where that is what the program means; else ``error`` is raised (on every rank).

    Always adopted: a plain tensor that holds one value, the same on every rank of the mesh
    (autograd formulas make such constants next to DTensors: prod's backward concatenates
    ``torch.ones(1, 3)`` with slices of the input); the integer / bool indices and masks of the
    indexing ops (``INDEX_OPS``: ``x[[0, 2]]``, ``x[:, idx]``, ``x.gather(1, idx)``) and the tables
    of the lookup ops (``LOOKUP_OPS``: ``torch.isin(ids, special)``) equal on every rank. Under
    ``implicit_replication()`` and in a backward pass (autograd's formulas build index tensors)
    any plain tensor equal on every rank; under ``loss_parallel()`` the target and weight of the
    loss ops.
    Whether the ranks agree takes one small all-reduce over the mesh, which every rank joins
    (the arguments' structure is the same on every rank), so none waits.
    """
    found: list = []
    for value in list(args) + list(kwargs.values()):
        collect_leaves(value, (torch.Tensor,), found)
    mesh = next((t._spec.mesh for t in found if isinstance(t, cls)), None)
    plain = [t for t in found if not isinstance(t, cls) and t.dim() > 0]
    if mesh is None or not plain:
        raise error
    replicate_any = (MODES.implicit_replication > 0 or _torch_implicit_replication() or _in_backward()
                     or (func in LOSS_OPS and (MODES.loss_parallel > 0 or _torch_loss_parallel()))
                     or (func in INDEX_OPS and all(not (t.is_floating_point() or t.is_complex()) for t in plain))
                     or func in LOOKUP_OPS)
    if replicate_any:
        grads = [tuple(t.shape) for t in plain if t.requires_grad]
        if grads and torch.is_grad_enabled():  # (under no_grad no gradient flows: a parameter copied in is a value)
            raise DispatchError(f"{error} (under implicit replication: a plain tensor that requires grad, shape "
                                f"{grads[0]}, cannot be taken as replicated, its gradient would be a DTensor; "
                                f"distribute it)") from None
        differs = f"{error} (taken as replicated, it must be the same on every rank of {mesh}: it differs)"
        agreed = _agreed(mesh, [_fingerprint(t) for t in plain], f"{func}: a plain tensor argument taken as "
                                                                 f"replicated differs between the ranks (distribute it)")
        if agreed is not None and not all(agreed):
            raise DispatchError(differs) from None
    else:
        not_constant = (f"{error} (a plain tensor is taken as replicated only when it holds one value, the same "
                        f"on every rank, like the ones an autograd formula makes, or inside "
                        f"implicit_replication() / loss_parallel() for the loss's labels)")
        if not _agree_constant(mesh, plain, f"{func}: a plain tensor argument among DTensors holds more than one "
                                             f"value or differs between the ranks (distribute it)"):
            raise DispatchError(not_constant) from None
    adopted = {id(t): cls(t.to(mesh.device).contiguous(), spec_of(tuple(t.shape), mesh, (Replicate(),) * mesh.ndim))
               for t in plain}
    # (a DTensor's id is not among the adopted: it stays as it is)
    return replace_dtensors(torch.Tensor, args, kwargs, lambda t: adopted.get(id(t), t))


def _in_backward() -> bool:
    """Is autograd running a backward pass? Its formulas make plain tensors of their own (as_strided's
    backward index_adds an index it builds from the sizes), the same on every rank: taken as
    replicated once checked, as under ``implicit_replication()``."""
    return torch._C._current_graph_task_id() != -1


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Words (int64, on ``t``'s device) two ranks agree on when they hold the same tensor: its shape,
    and two checksums of the values (their sum, and a sum weighted by position), each float by its
    exact bits. Made with no host read, so a CUDA graph can capture it."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat.resolve_conj().resolve_neg()).reshape(-1)
    flat = flat.to(torch.float64).nan_to_num(nan=1.5e300, posinf=1.7e300, neginf=-1.7e300)
    weights = (torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) * 0.618033988749895) % 1.0 + 0.5
    shape = sum((i + 1) * size for i, size in enumerate(t.shape))  # a fixed count of words on every rank
    sums = torch.stack([flat.sum(), (flat * weights).sum()])
    return torch.cat([_words_of(flat, [t.dim(), t.numel(), shape]), _exact_words(sums)])


def _words_of(like: torch.Tensor, values: list[int]) -> torch.Tensor:
    """Host integers as int64 words on ``like``'s device, made by fills (a copy from the host is
    refused while a CUDA graph is captured)."""
    return torch.stack([torch.full((), v, dtype=torch.int64, device=like.device) for v in values])


def _exact_words(values: torch.Tensor) -> torch.Tensor:
    """Real values as int64 words that equal values share, on their device: integers as themselves
    (uint64 above int64's range wraps), floats by their float64 bits (-0.0 read as 0.0, every NaN
    as one NaN)."""
    if not values.is_floating_point():
        return values.to(torch.int64)
    wide = values.to(torch.float64)
    wide = torch.where(wide == 0, torch.zeros_like(wide), wide)
    wide = torch.where(wide.isnan(), torch.full_like(wide, math.nan), wide)
    return wide.view(torch.int64)


def _agreed(mesh, facts: list[torch.Tensor], message: str) -> list[bool] | None:
    """Per 1-D int64 tensor of words: is it the same on every rank of the mesh? One all-reduce (MAX)
    of every word and its complement: the ranks agree on a word iff max(word) == ~max(~word), i.e.
    its max is its min. Lists of different lengths on different ranks cannot happen: same
    arguments, same shapes.

    While a CUDA graph is captured nothing can be read on the host: the answer is asserted on the
    device instead (``checks.assert_on_device``, ``message``, a short text: CUDA cuts it at 254
    characters; every replay checks again) and None returned."""
    flat = torch.cat([f.to(mesh.device) for f in facts])
    both = torch.cat([flat, torch.bitwise_not(flat)])
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=mesh.group(mesh.axis_names))
    n = flat.numel()
    same = both[:n] == torch.bitwise_not(both[n:])
    if checks.capturing(same):
        checks.assert_on_device(same.all(), message)
        return None
    same = same.tolist()
    out, i = [], 0
    for f in facts:
        out.append(all(same[i:i + f.numel()]))
        i += f.numel()
    return out


def _agree_constant(mesh, plain: list, message: str) -> bool:
    """Does every tensor of ``plain`` hold one value, the same on every rank of the mesh? (Under
    CUDA-graph capture: asserted on the device, ``message``, and True returned.)

    Values are compared exactly, as int64 words: an integer as itself (2**53 and 2**53 + 1
    differ, as they would not through float64), a float by its float64 bits."""
    facts = []
    for t in plain:
        flat = t.detach().reshape(-1)
        if not t.numel() or t.requires_grad or t.is_complex():
            facts.append(_words_of(flat, [1, 0]))
            continue
        first = flat[0]
        constant = (flat == first).all()
        word = _exact_words(first)
        facts.append(torch.stack([(~constant).to(torch.int64), torch.where(constant, word, torch.zeros_like(word))]))
    # agreed everywhere and constant here means constant on every rank
    constant_here = torch.stack([f[0] for f in facts]).to(mesh.device).eq(0)
    agreed = _agreed(mesh, facts, message)
    if agreed is None:  # captured: the agreement is asserted on the device
        checks.assert_on_device(constant_here.all(), message)
        return True
    return all(agreed) and all(constant_here.tolist())


# ops that read their input's storage (offsets and strides into it), not its elements
_READS_STORAGE = frozenset(getattr(aten, name).default for name in ("as_strided", "as_strided_copy",
                                                                    "as_strided_scatter") if hasattr(aten, name))


def _owns_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def gather_fallback(d, func, args, kwargs, dts, mesh, info: OpInfo):
    """Gather every DTensor, run the op on the whole tensors, lay the result out replicated."""
    cls = d.cls
    d.note_fallback(func)
    full = {}
    copied = set()  # the DTensors whose whole tensor here is a copy (gathered, or cloned for as_strided)
    for dt in dts:
        if id(dt) not in full:
            replicated = make_spec(mesh, replicated_layout(dt.shape, mesh), dt.shape)
            whole = redistribute_local(dt._local, dt._spec, replicated)
            if dt._spec != replicated:
                copied.add(id(dt))
            if func in _READS_STORAGE and not _owns_storage(whole):
                # a DTensor is its values, its own storage: as_strided reads that, not a gather buffer's
                whole = whole.clone(memory_format=torch.contiguous_format)
                copied.add(id(dt))
            full[id(dt)] = (dt, replicated, whole)
    # a view op's output aliases its first argument: a view of a copy where that was copied
    view_of_copy = func.is_view and bool(args) and (id(args[0]) in copied or getattr(args[0], "_copied_view", False))
    local_args, local_kwargs = replace_dtensors(cls, args, kwargs, lambda dt: full[id(dt)][2])
    result = func(*local_args, **local_kwargs)
    # written arguments: lay the whole result back out in their own layout
    first = args[0] if info.inplace else []
    targets = (list(first) if isinstance(first, (list, tuple)) else [first]) + written(args, kwargs, info)
    for target in targets:
        if isinstance(target, cls):
            dt, replicated, value = full[id(target)]
            if tuple(value.shape) != tuple(dt.shape):
                # an in-place op that changed its tensor's shape: the DTensor takes the new shape
                rebind(dt, cls(value, make_spec(mesh, replicated_layout(value.shape, mesh), value.shape)))
                continue
            dt._local.copy_(_laid_out(func, value, replicated, dt._spec))
    if not func._schema.returns:  # torch wants None from an op that returns nothing (_fused_adamw_)
        return None
    if info.inplace:
        return args[0]
    return _replicated_result(result, cls, mesh, func, view_of_copy)


def _replicated_result(value, cls, mesh, func, view_of_copy: bool):
    """The fallback's result with each tensor in it a replicated ``cls`` DTensor on ``mesh``. A
    module function, not a closure that calls itself: such a closure is a reference cycle, and
    what it held stayed alive until the garbage collector ran."""
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        raise DispatchError(f"{func} returns a {value.layout} tensor; axedist DTensors hold dense (strided) "
                            f"tensors only: convert the result of to_local() or full_tensor() instead")
    if isinstance(value, torch.Tensor):
        spec = make_spec(mesh, replicated_layout(value.shape, mesh), value.shape)
        out = cls(value, spec, stride=tuple(value.stride()) if value.is_contiguous() else None)
        if view_of_copy:  # (DTensor._copied_view)
            out._copied_view = True
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_replicated_result(v, cls, mesh, func, view_of_copy) for v in value)
    return value


def _laid_out(func, value, replicated, spec) -> torch.Tensor:
    """This rank's local tensor of the whole ``value`` (given ``replicated``) in ``spec``.

    A pending ``spec`` (a written argument that was a partial sum) gets a valid set of
    summands of ``value``: for a sum, ``value`` on the rank at coordinate 0 of the partial
    axes and 0 on the others; for avg/max/min, ``value`` on every rank.
    """
    if not spec.reduce_op:
        return redistribute_local(value, replicated, spec)
    placements = placements_or_none(spec)
    if placements is None:
        raise DispatchError(f"{func} (run through the gather fallback) writes an argument pending a "
                            f"{spec.reduce_op} in a layout with no placement form ({spec}); redistribute it first")
    whole = spec_of(spec.shape, spec.mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in placements))
    local = redistribute_local(value, replicated, whole)
    if spec.reduce_op == "sum":
        here = spec.mesh.coordinates()
        if any(here[a] != 0 for a, p in zip(spec.mesh.axis_names, placements) if isinstance(p, Partial)):
            local = torch.zeros_like(local)
    return local.unsqueeze(0)
