"""One op call on DTensors read as data: its DTensors and key (unwrap), and its rule's answer
turned into a :class:`CallPlan` (propagate) that the dispatcher caches and runs.

``a + b`` with ``a`` in ``[Shard(0)]`` and ``b`` in ``[Replicate()]``, shape ``(8, 6)``, 4 ranks:
:func:`scan` gives ``[a, b]``, their mesh and a hashable key; :func:`plan_call` asks the rule for
``aten.add.Tensor`` (``ops/pointwise.py``) and records ``b``'s target ``[Shard(0)]``, the output
``[Shard(0)]`` with local shape ``(2, 6)`` (the op run once on meta tensors of the global
shapes gives the global output shape), and the routes the dispatcher may take on later calls.
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import Partial, Replicate

from ..caches import cached
from ..layout import Layout
from ..spec import DTensorSpec
from ..runtime import redistribute_local
from ..tracing import compiling, outside_tracing
from .registry import ArgSpec, OpCall, Sharding, rule_for
from .specs import expected_local_shape, placements_or_none, spec_of

__all__ = ["DispatchError", "PlainTensorError", "OpInfo", "op_info", "functional_of", "decomposable", "decompose",
           "writes_first", "FOREACH_INFO", "FOREACH_WRITE", "written", "SCALAR_TYPES", "scan", "replace_dtensors",
           "local_of", "OutSpec", "Slot", "FastForm", "LocalRoute", "CallPlan", "plan_call", "DEFERRABLE"]

aten = torch.ops.aten


class DispatchError(RuntimeError):
    """An op on DTensors that cannot run as called (mixed meshes, plain tensors, a rule's mistake)."""


class PlainTensorError(DispatchError):
    """A plain tensor with dims among DTensor arguments (maybe a constant the dispatcher can adopt)."""


# ---------------------------------------------------------------------------
# Per-op facts read from the schema (cached)
# ---------------------------------------------------------------------------


class OpInfo:
    """What an op writes: ``add_.Tensor`` is ``inplace``; ``add.out`` has ``out_names == ("out",)``."""

    __slots__ = ("inplace", "out_names", "written", "foreach")

    def __init__(self, inplace: bool, out_names: tuple[str, ...], written: tuple[int, ...], foreach: bool):
        self.inplace = inplace        # writes its first (positional) argument and returns it
        self.out_names = out_names    # kwarg-only written arguments (the out= variant)
        self.written = written        # positional indices of other written arguments
        self.foreach = foreach


@cached(maxsize=None)
def op_info(func) -> OpInfo:
    schema = func._schema
    written_at = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    out_names = tuple(schema.arguments[i].name for i in written_at if schema.arguments[i].kwarg_only)
    positional = tuple(i for i in written_at if not schema.arguments[i].kwarg_only)
    inplace = positional[:1] == (0,) and not out_names
    return OpInfo(inplace, out_names, positional[1:] if inplace else positional,
                  schema.name.startswith("aten::_foreach_"))


FOREACH_INFO = OpInfo(False, (), (), True)
FOREACH_WRITE = OpInfo(False, (), (0,), True)


@cached(maxsize=None)
def functional_of(func):
    """The overload of ``func``'s packet with the same non-out arguments and no writes
    (``add.out`` -> ``add.Tensor``), or None."""
    schema = func._schema
    wanted = [(a.name, str(a.type)) for a in schema.arguments if not (a.alias_info and a.alias_info.is_write)]
    packet = func._overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        args = candidate._schema.arguments
        if any(a.alias_info is not None and a.alias_info.is_write for a in args):
            continue
        if [(a.name, str(a.type)) for a in args] == wanted:
            return candidate
    return None


@cached(maxsize=None)
def decomposable(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


def decompose(func, args, kwargs):
    """A composite op (``decomposable``) run as its decomposition. In eager, torch's C++ kernel, each
    op it calls coming back through the dispatcher; not the Python one torch registers beside it for
    tracing (torch._decomp's ``matmul`` costs about 0.2 ms of host time a call: a linear at decode,
    under inference_mode, where composite ops reach a subclass undecomposed). While compiling,
    torch's own choice (``OpOverload.decompose``), which the tracers expect."""
    if compiling():
        return func.decompose(*args, **kwargs)
    return func._op_dk(_COMPOSITE, *args, **kwargs)


@cached(maxsize=None)
def writes_first(func) -> bool:
    a = func._schema.arguments[0]
    return a.alias_info is not None and a.alias_info.is_write


def written(args, kwargs, info: OpInfo) -> list:
    """The written positional arguments other than an in-place op's self (lists flattened)."""
    out = []
    for i in info.written:
        if i < len(args):
            out.extend(args[i] if isinstance(args[i], (list, tuple)) else [args[i]])
    return out


# ---------------------------------------------------------------------------
# Unwrap: the DTensors of a call
# ---------------------------------------------------------------------------


# The plain argument types a cache key holds by value (with their type): ``x * 2.0`` keys on
# (float, 2.0). Other arguments make a call uncacheable on the fast routes.
SCALAR_TYPES = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.memory_format,
                          torch.layout, complex})


def scan(cls, func, args, kwargs):
    """The ``cls`` DTensors (in ``OpCall.specs`` order), their mesh, and a hashable key of the
    call (None if some argument is unhashable). Raises for plain non-scalar tensors and mixed meshes."""
    walk = _Scan(cls, func)
    names = [a.name for a in func._schema.arguments]
    key: list = [func]
    for i, value in enumerate(args):
        key.append(walk.item(value, f"argument {names[i] if i < len(names) else i!r}"))
    for name in kwargs:
        key.append((name, walk.item(kwargs[name], f"argument {name!r}")))
    return walk.found, walk.mesh, (tuple(key) if walk.hashable else None)


class _Scan:
    """What ``scan`` gathers as it walks an op's arguments. A walker object, not a recursive
    closure: a closure that calls itself is a reference cycle, and the DTensors it had gathered
    (the op's inputs: activations) stayed alive in it until the garbage collector ran."""

    __slots__ = ("cls", "func", "found", "mesh", "hashable")

    def __init__(self, cls, func):
        self.cls, self.func = cls, func
        self.found: list = []
        self.mesh = None
        self.hashable = True

    def item(self, value, where):
        if isinstance(value, self.cls):
            spec = value._spec
            if self.mesh is None:
                self.mesh = spec.mesh
            elif spec.mesh is not self.mesh and spec.mesh != self.mesh:
                raise DispatchError(f"{self.func}: {where} is on mesh {spec.mesh}, another argument on {self.mesh}; "
                                    f"an op needs all its DTensors on one mesh")
            self.found.append(value)
            # (the piece's device too: a plan tags its output for it, _result_device)
            return (spec, value.dtype, value.stride(), value.device)
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                return ("scalar", value.dtype, value.device.type)
            raise PlainTensorError(f"{self.func}: {where} is a plain torch.Tensor of shape {tuple(value.shape)} "
                                   f"mixed with axedist DTensors; distribute it first (ax.distribute or "
                                   f"DTensor.from_local)")
        if isinstance(value, (list, tuple)):
            return (type(value).__name__,) + tuple(self.item(v, f"{where}[{i}]") for i, v in enumerate(value))
        try:
            hash(value)
        except TypeError:
            self.hashable = False
            return None
        return value


def _replace(cls, value, convert):
    if isinstance(value, cls):
        return convert(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, (cls, list, tuple)) for v in value):
        return type(value)(_replace(cls, v, convert) for v in value)
    return value


def replace_dtensors(cls, args, kwargs, convert):
    """``args``, ``kwargs`` with every ``cls`` DTensor (also inside lists) replaced by ``convert(dtensor)``."""
    return (tuple(_replace(cls, a, convert) for a in args), {k: _replace(cls, v, convert) for k, v in kwargs.items()})


def local_of(dt, target):
    """``dt``'s local tensor moved to ``target`` (None: kept), without a pending sum's summand dim."""
    local = dt._local
    if target is None:
        return local[0] if dt._spec.reduce_op else local
    local = redistribute_local(local, dt._spec, target)
    return local[0] if target.reduce_op else local


# ---------------------------------------------------------------------------
# The plan of one call and its routes
# ---------------------------------------------------------------------------


class OutSpec:
    """One output: its spec (None for a non-tensor output), this rank's local shape, its global
    stride (None: contiguous), and whether the local result gains the summand dim (a pending sum)."""

    __slots__ = ("spec", "local_shape", "stride", "unsqueeze")

    def __init__(self, spec, local_shape, stride):
        self.spec, self.local_shape, self.stride = spec, torch.Size(local_shape), stride
        self.unsqueeze = spec is not None and bool(spec.reduce_op)


_NO_OUTPUT = OutSpec(None, (), ())


class Slot:
    """A DTensor argument at ``position``: moved to ``target`` (None: kept), and whether its
    local tensor loses the summand dim of extent 1 (``strip``: a kept pending sum)."""

    __slots__ = ("position", "target", "strip")

    def __init__(self, position: int, target, strip: bool):
        self.position, self.target, self.strip = position, target, strip


class FastForm:
    """A call whose DTensors are all top-level positional arguments and whose other arguments
    (keyword ones too) are scalars: its argument ``slots``, the output (``out``; None: in-place,
    the result is ``self``; ``outs``: one OutSpec per output of a tuple or list result, as
    ``_fused_rms_norm`` or ``split`` give) and the rule's ``local`` function (None: the op itself)."""

    __slots__ = ("slots", "out", "outs", "local", "dtype", "tag")

    def __init__(self, slots: tuple[Slot, ...], out: OutSpec | None, local, outs: tuple | None = None):
        self.slots, self.out, self.outs, self.local = slots, out, outs, local
        self.dtype = self.tag = None  # a single output's dtype and its tag (plan_call)


def copies_view(func, args, dts, targets, sharding) -> bool:
    """Is the output of this view op (``func.is_view``) a view of a copy (``DTensor._copied_view``):
    does it move the tensor its output aliases (its first argument), or compute the view's values
    anew (``sharding.copies``)?"""
    return func.is_view and (sharding.copies or (bool(dts) and dts[0] is args[0] and targets[0] is not None))


class LocalRoute:
    """The plainest cached case, "the op on the local tensors, wrapped", for an aten call (a
    ``CallPlan``'s ``plain``) and for a torch call (the fast path's entry, ops/fastpath.py): the
    DTensors at ``positions`` stay where they are, the local result (``local_shape``, after
    ``unsqueeze(0)`` for a pending sum, of ``dtype``) goes in ``spec`` with global ``stride`` and
    ``tag``. ``op``: the aten op's C++ callable (a plan's route), or the aten op a grad-mode
    fast-path entry hands its output to (None without grad). A deferrable GEMM (``defer``) takes
    the route only where the dispatcher would not defer it (``OpDispatcher.defers``).
    Fast-path entries also know ``pointwise`` (every aten op of the call is pointwise, so the
    route holds for any float values) and the result's ``device`` (a plan's route, planned on
    meta tensors, reads it off the result) and what runs in place of the torch function on the
    local tensors (``run``: None for the function itself, else a kernel choice's twin, such as
    the decode product's linear, ops/matmul.py); ``fresh``: an op that may alias whose recorded
    call made a new tensor (a hit checks that its own is new too)."""

    __slots__ = ("op", "positions", "spec", "local_shape", "stride", "unsqueeze", "dtype", "tag", "defer",
                 "pointwise", "device", "cuda", "view", "run", "fresh")

    def __init__(self, op, positions: tuple, out: OutSpec, dtype, tag, defer: bool, pointwise: bool = False,
                 device=None, view: bool = False, run=None, fresh: bool = False):
        self.op, self.positions, self.spec, self.local_shape = op, positions, out.spec, out.local_shape
        self.stride, self.unsqueeze, self.dtype, self.tag, self.defer = out.stride, out.unsqueeze, dtype, tag, defer
        self.pointwise, self.device = pointwise, device
        self.cuda = device is not None and device.type == "cuda"  # (asked per hit: device.type costs 0.2 us)
        self.view = view  # a view op: its output is a copied view where its input is (DTensor._copied_view)
        self.run, self.fresh = run, fresh

    def __repr__(self) -> str:
        via = f"{self.op}, " if self.op is not None else ""
        return f"LocalRoute({via}-> {self.spec}, {str(self.dtype).replace('torch.', '')}, stride {self.stride})"


class CallPlan:
    """What the dispatcher does for calls with this key: move each DTensor to its ``targets``
    entry (None: keep it), run the op (or ``sharding.local``), wrap per ``outputs``."""

    __slots__ = ("call", "sharding", "targets", "outputs", "structure", "defer", "fast", "reduce_self", "plain", "even",
                 "view")

    def __init__(self, call: OpCall, sharding: Sharding, targets: list, outputs: list, structure: str,
                 defer: bool, fast: FastForm | None, reduce_self, plain: LocalRoute | None, even: bool = False,
                 view: int = 0):
        self.call, self.sharding, self.targets, self.outputs = call, sharding, targets, outputs
        self.structure = structure      # "single", "tuple", "list", "none"
        self.defer = defer              # mm/addmm giving a pending sum: the local GEMM may wait
        self.fast = fast
        self.reduce_self = reduce_self  # in-place op on a pending value it cannot keep: self's spec reduced
        self.plain = plain
        self.even = even                # a deferred GEMM's operands alike on every rank (_evenly_split)
        self.view = view                # 0: not a view op; 1: a view op; 2: one that moves self (copies_view)

    def __repr__(self) -> str:
        return f"CallPlan({self.call.func}: {self.sharding})"


# mm/addmm whose output is a pending sum over one mesh axis may run later (runtime/deferred.py):
# redistributing the result to row shards on that axis then runs the fused GEMM + reduce-scatter.
DEFERRABLE = (aten.mm.default, aten.addmm.default)


@outside_tracing  # rules and meta shapes on real metadata, also while torch.compile traces
def plan_call(cls, func, args, kwargs, dts, specs, mesh, info: OpInfo, tag_for) -> CallPlan | None:
    """The plan of ``func(*args, **kwargs)`` (``dts`` its DTensors, ``specs`` their ArgSpecs),
    or None when no rule answers; ``tag_for(spec, dtype, stride, device)`` tags the plainest route's output."""
    rule = rule_for(func)
    if rule is None:
        return None
    iterator = iter(specs)
    spec_args, spec_kwargs = replace_dtensors(cls, args, kwargs, lambda d: next(iterator))
    call = OpCall(func, spec_args, spec_kwargs, mesh)
    sharding = rule(call)
    if sharding is None:  # a rule may decline (e.g. a layout it cannot reason about): gather
        return None
    if len(sharding.inputs) != len(dts):
        raise DispatchError(f"{func}: rule {rule.__name__} gave {len(sharding.inputs)} input placements for "
                            f"{len(dts)} DTensor arguments ({specs})")
    targets = _input_targets(func, rule, dts, specs, sharding, mesh)
    reduce_self = _reduce_self(func, rule, args, kwargs, dts, specs, sharding, targets, info)
    if reduce_self is not None:
        targets = [None if d is args[0] else t for d, t in zip(dts, targets)]
    flat, structure = _meta_result(cls, func, args, kwargs, sharding)
    entries = _normalize_outputs(sharding.outputs, len(flat), func) if structure != "none" else [None]
    outputs = [_out_spec(func, rule, value, entry, mesh) for value, entry in zip(flat, entries)]
    if info.inplace:
        self_spec = dts[0]._spec if dts and dts[0] is args[0] else None
        if reduce_self is not None:
            self_spec = reduce_self
        if outputs[0].spec != self_spec:
            raise DispatchError(f"{func} is in-place on {specs[0]}, but rule {rule.__name__} gives its result as "
                                f"{entries[0]}; an in-place op cannot change its tensor's layout")
    defer = (func in DEFERRABLE and structure == "single" and outputs[0].spec.reduce_op == "sum"
             and sum(isinstance(p, Partial) for p in (placements_or_none(outputs[0].spec) or ())) == 1)
    even = defer and _evenly_split([t if t is not None else s.spec for s, t in zip(specs, targets)] + [outputs[0].spec])
    # a local result marked conjugate / negative is materialized when wrapped (DTensor's
    # constructor), which the fast routes skip: such an op (on meta tensors too) stays off them
    bits = any(isinstance(v, torch.Tensor) and (v.is_conj() or v.is_neg()) for v in flat) and sharding.local is None
    fast = None if reduce_self is not None or bits else _fast_form(cls, args, kwargs, dts, info, targets, structure,
                                                                   outputs, sharding)
    if fast is not None and fast.out is not None:  # the output's tag: the next op's key needs no stride() call
        fast.dtype = flat[0].dtype
        device = _result_device(dts, kwargs)
        if device is not None:  # (else untagged: the output's tag is derived from it when first keyed)
            fast.tag = tag_for(fast.out.spec, fast.dtype, fast.out.stride, device)
    plain = None
    if fast is not None and fast.out is not None and sharding.local is None and \
            all(slot.target is None and not slot.strip for slot in fast.slots):
        plain = LocalRoute(func._op, tuple(slot.position for slot in fast.slots), fast.out, fast.dtype, fast.tag,
                           defer, view=func.is_view)
    view = 2 if copies_view(func, args, dts, targets, sharding) else int(func.is_view)
    return CallPlan(call, sharding, targets, outputs, structure, defer, fast, reduce_self, plain, even, view)


def _evenly_split(specs) -> bool:
    """No spec pads a dim: every rank's local shapes are the same. A deferred GEMM may become a
    fused kernel, chosen by its local shapes (the measured tables, the first-use check of a
    shape): with uneven operands (a contraction dim of 9 over 4 ranks: 3, 2, 2, 2) ranks would
    choose apart, and one rank's kernel or check would wait for peers that never come."""
    return all(spec.padded == spec.shape for spec in specs)


def _input_targets(func, rule, dts, specs, sharding, mesh) -> list:
    """Per DTensor: the spec the rule wants it in, or None to keep it as it is."""
    targets = []
    for d, spec, wanted in zip(dts, specs, sharding.inputs):
        own = d._spec
        if wanted is None:
            target = own
        elif isinstance(wanted, DTensorSpec):
            target = wanted
        else:
            summands = None if isinstance(wanted, Layout) else own.summands
            if summands is not None and spec.placements is not None and \
                    sum(isinstance(p, Partial) for p in wanted) != sum(isinstance(p, Partial) for p in spec.placements):
                summands = None  # [Partial, Partial] -> [Partial, Replicate]: the target has fewer summands
            target = spec_of(own.shape, mesh, wanted if isinstance(wanted, Layout) else tuple(wanted), summands)
            if target == own:
                target = own
        if target.reduce_op and expected_local_shape(target, spec.placements if target is own else
                                                     (None if isinstance(wanted, (Layout, DTensorSpec)) else tuple(wanted)))[0] != 1:
            raise DispatchError(f"{func}: rule {rule.__name__} keeps {spec}, a pending {target.reduce_op} with more "
                                f"than one summand per device; ask for placements instead")
        # None, not the spec: a cached plan serves later DTensors whose equal specs are other objects
        targets.append(None if target is own else target)
    return targets


def _reduce_self(func, rule, args, kwargs, dts, specs, sharding, targets, info: OpInfo):
    """An in-place op's self spec with its pending reduction applied, when that is the only
    move the rule asks of a written argument (``exp_`` of a pending sum); None when nothing
    written moves; raises for any other move of a written argument."""
    reduce_self = None
    for i, d in enumerate(dts):
        is_self = info.inplace and d is args[0]
        if targets[i] is None or not (is_self or any(d is w for w in written(args, kwargs, info))):
            continue
        if is_self and _only_reduces(d._spec, targets[i]):
            reduce_self = targets[i]  # the sum is applied in self's own buffer first (run time)
            continue
        raise DispatchError(f"{func} is in-place on {specs[i]}, but rule {rule.__name__} needs it as "
                            f"{sharding.inputs[i]}; an in-place op cannot change its tensor's layout "
                            f"(redistribute first, or use the out-of-place op)")
    return reduce_self


def _only_reduces(own, target) -> bool:
    """Is ``target`` ``own`` with its pending reduction applied and nothing else moved
    (``[Partial(), Shard(0)]`` -> ``[Replicate(), Shard(0)]``)?"""
    if not own.reduce_op or target.reduce_op:
        return False
    mine, theirs = placements_or_none(own), placements_or_none(target)
    if mine is None or theirs is None:
        return False
    return all((isinstance(p, Partial) and isinstance(q, Replicate)) or p == q for p, q in zip(mine, theirs))


def _meta(cls, value):
    if isinstance(value, cls):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):  # a 0-dim scalar
        return torch.empty((), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(cls, v) for v in value)
    return value


def _meta_result(cls, func, args, kwargs, sharding):
    """The op's outputs on meta tensors of the global shapes, flattened, and their structure:
    checks the call like torch would (shape mismatches raise torch's error before any data
    moves) and gives the global output shapes."""
    if not any("Tensor" in str(r.type) for r in func._schema.returns):
        return [None], "none"
    meta_args = tuple(_meta(cls, a) for a in args)
    meta_kwargs = {k: _meta(cls, v) for k, v in kwargs.items()}
    if "device" in meta_kwargs and meta_kwargs["device"] is not None:
        meta_kwargs["device"] = "meta"
    try:
        out = func(*meta_args, **meta_kwargs)
    except NotImplementedError:
        if sharding is None or sharding.out_shape is None:
            raise DispatchError(f"{func} has no meta kernel, so its global output shape is unknown; its sharding "
                                f"rule must give out_shape") from None
        shapes = sharding.out_shape
        if isinstance(shapes, (tuple, list)) and shapes and isinstance(shapes[0], (tuple, list, torch.Size)):
            out = tuple(torch.empty(s, device="meta") for s in shapes)
        else:
            out = torch.empty(shapes, device="meta")
    if isinstance(out, torch.Tensor):
        return [out], "single"
    if isinstance(out, (tuple, list)):
        return list(out), "list" if isinstance(out, list) else "tuple"
    return [out], "none"


def _normalize_outputs(outputs, count: int, func):
    """A rule's ``outputs`` as one entry per output."""
    def one(entry):
        return entry is None or isinstance(entry, (Layout, ArgSpec, DTensorSpec)) or (
            isinstance(entry, (list, tuple)) and all(not isinstance(p, (list, tuple, Layout)) and p is not None
                                                     for p in entry))

    if count == 1 and one(outputs) and not (isinstance(outputs, tuple) and len(outputs) == 1
                                            and isinstance(outputs[0], (list, tuple, Layout, ArgSpec))):
        return [outputs]
    if isinstance(outputs, (list, tuple)) and len(outputs) == count:
        return list(outputs)
    raise DispatchError(f"{func}: the sharding rule gave outputs {outputs!r} for {count} outputs")


def _out_spec(func, rule, value, entry, mesh) -> OutSpec:
    """The OutSpec of one meta output under the rule's entry for it."""
    if not isinstance(value, torch.Tensor):
        return _NO_OUTPUT
    if entry is None:
        if value.numel() == 0:  # an unused empty output, e.g. flash attention's debug mask: stays plain
            return _NO_OUTPUT
        raise DispatchError(f"{func}: rule {rule.__name__} gave no placements for a tensor output")
    shape = tuple(value.shape)
    if isinstance(entry, ArgSpec):  # exactly that argument's spec (alias, detach)
        spec, placements = entry.spec, entry.placements
    elif isinstance(entry, DTensorSpec):
        spec, placements = entry, None
    elif isinstance(entry, Layout):
        spec, placements = spec_of(shape, mesh, entry), None
    else:
        placements = tuple(entry)
        spec = spec_of(shape, mesh, placements)
    stride = None if value.is_contiguous() else tuple(value.stride())
    return OutSpec(spec, expected_local_shape(spec, placements), stride)


def _result_device(dts, kwargs) -> torch.device | None:
    """The device of an op's local result where its DTensor arguments' pieces tell it: theirs,
    when they share one and no ``device=`` argument names another (the plan's cache key holds
    their devices, so every call of the plan has them); else None."""
    devices = {d._value.device for d in dts}
    return devices.pop() if len(devices) == 1 and kwargs.get("device") is None else None


def _fast_form(cls, args, kwargs, dts, info: OpInfo, targets, structure: str, outputs, sharding) -> FastForm | None:
    """The FastForm of a call, or None: each DTensor a top-level positional argument (a DTensor
    among the kwargs or in a list has none), tensor outputs (or an in-place op)."""
    if info.foreach or info.out_names or info.written:
        return None
    positions = [i for i, a in enumerate(args) if isinstance(a, cls)]
    if len(positions) != len(dts) or any(type(args[i]) is not cls for i in positions):
        return None
    slots = tuple(Slot(i, t, t is None and bool(args[i]._spec.reduce_op)) for i, t in zip(positions, targets))
    if info.inplace:
        return FastForm(slots, None, sharding.local)
    if structure == "single":
        return FastForm(slots, outputs[0], sharding.local)
    if structure == "none":
        return None
    return FastForm(slots, None, sharding.local, tuple(outputs))
