"""Tensor-parallel layers declared with layouts (or placements), and ``parallelize``.

A *style* says how one module's parameters are laid out on a 1-D tensor-parallel mesh and
what layouts its inputs and outputs have; ``parallelize(module, mesh, plan)`` applies the
styles of a plan (module-name patterns -> styles) and lays every other parameter and buffer
out replicated (with axedist's styles), so axedist DTensors flow through the whole model and
its backward::

    >>> mesh = ax.init_mesh()                                    # 4 ranks, axis 'gpuid'
    >>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    >>> parallelize(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    >>> mlp[0].weight.placements, mlp[0].weight.to_local().shape   # 64 output features / 4 ranks
    ((Shard(dim=0),), torch.Size([16, 16]))
    >>> y = mlp(torch.randn(8, 16))         # plain input: read as Replicate; y: DTensor, Replicate
    >>> describe(mlp)                       # each layer's layouts and the collectives that ran

Where a style takes a layout (``input_layouts``, ``output_layouts``, ``desired_input_layouts``,
``weight_layout``) it accepts a torch placement (``Shard(0)``), a tuple of placements (one per
mesh axis), an axedist :class:`~axedist.Layout` (e.g. a block-cyclic one no placement can
express), or a function ``shape -> layout`` when the layout depends on the tensor's shape.
torch's own ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput`` and ``PrepareModuleInputOutput`` objects are
accepted in a plan and translated (their layouts and ``use_local_output``; a subclass that
replaces their methods, and any other torch style, is refused: ``from_torch_style``); a plan of
torch's styles alone keeps torch's semantics (what it does not name stays as it is), and
``parallelize_module`` takes torch's keywords and torch meshes (docs/migration.md). Unlike
torch, axedist's styles default to ``use_local_output=False``: outputs stay DTensors, so the
model's code (e.g. its ``view`` to global head counts) needs no change.

Row-parallel output into sequence-sharded activations is a reduce-scatter: the row-parallel
linear multiplies ``[rows, K]`` (``K`` sharded) by its weight, giving a partial sum, and
redistributes it to rows sharded, which on CUDA runs the fused GEMM + reduce-scatter kernel.
With sequence-first activations ``[S, B, H]``, sharding the GEMM's rows is sharding ``S``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..dtensor import DTensor, distribute
from ..layout import Layout, LayoutError, one_dim_iters
from ..planning import plan_redistribute
from ..mesh import DeviceMesh, MeshError, as_mesh
from ..runtime import count_collectives, execution_bytes
from ..runtime.tails import defer_tails, pending_tail
from ..tracing import compiling
from .grads import reduce_pending_grads

__all__ = [
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "VocabParallelEmbedding",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize", "parallelize_module",
    "as_mesh", "describe", "replicate", "vocab_parallel_cross_entropy", "to_inference", "distribute_module",
]

# What a style accepts wherever it takes a layout.
Where = Placement | Sequence[Placement] | Layout | Callable[[tuple[int, ...]], Any]


# ---------------------------------------------------------------------------
# Layouts as a style states them -> what DTensor takes
# ---------------------------------------------------------------------------


def _resolve(where, shape: Sequence[int], mesh: DeviceMesh):
    """Placements (tuple, one per mesh axis, dims made non-negative) or a Layout for ``shape``."""
    if callable(where) and not isinstance(where, (Layout, Placement)):
        where = where(tuple(shape))
    if isinstance(where, Layout):
        return where
    placements = (where,) if isinstance(where, Placement) else tuple(where)
    if len(placements) != mesh.ndim or not all(isinstance(p, Placement) for p in placements):
        raise LayoutError(f"expected a placement, {mesh.ndim} placements or an axedist Layout for a tensor of "
                          f"shape {tuple(shape)} on mesh {mesh}, got {where!r}")
    out = []
    for p in placements:
        if isinstance(p, Shard):
            if not -len(shape) <= p.dim < len(shape):
                raise LayoutError(f"{p} names a dim that a tensor of shape {tuple(shape)} does not have")
            p = Shard(_constant_dim(p.dim, len(shape)))
        out.append(p)
    return tuple(out)


def _constant_dim(dim, ndim: int) -> int:
    """``dim % ndim`` as a plain int, also where torch.compile reads ``dim`` as a symbol (a hook's
    code compiled again for a module whose placement differs: Dynamo then makes the int dynamic,
    and a placement takes constants only). ``_constant_dim(-1, 3) == 2``."""
    return [d for d in range(ndim) if d == dim % ndim][0]


def _text(where) -> str:
    if where is None:
        return "-"
    if isinstance(where, (bool, int, str, dict, Placement)):
        return repr(where)
    if isinstance(where, Layout):
        return str(where)
    if callable(where):
        return getattr(where, "__name__", repr(where))
    return str(tuple(where))


def replicate(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A tensor every rank already holds, as a replicated DTensor (no data moves).

    >>> replicate(torch.tensor([3, 1, 2]), mesh).placements      # 4 ranks
    (Replicate(),)
    """
    return DTensor.from_local(tensor.to(mesh.device), mesh, [Replicate()] * mesh.ndim)


def _where_now(x: DTensor) -> str:
    try:
        placements = x.placements
    except LayoutError:
        return str(x.axe_layout)
    return str(tuple(placements))


class _Log:
    """What a parallelized module did, recorded the first time each transition runs."""

    def __init__(self, name: str, style: "ParallelStyle"):
        self.name, self.style = name, style
        self.lines: dict[str, str] = {}
        self.watching: contextlib.ExitStack | None = None  # open during the first forward
        self.counted = None  # what it counted (a CollectiveCount)
        self.noting = None  # (what, note, x): a line that ``note(x)`` completes after the forward

    def seen(self, what: str) -> bool:
        return what in self.lines

    def add(self, what: str, text: str) -> None:
        self.lines.setdefault(what, text)


def _log_of(module: nn.Module) -> _Log | None:
    return module.__dict__.get("_axedist_log")


def _forward_log(module: nn.Module) -> _Log | None:
    """The log a forward adds to; none while torch.compile traces (eager runs record the moves)."""
    return None if compiling() else _log_of(module)


def _transition(x: DTensor, dst, what: str) -> str:
    """``output [256, 64] (Partial(sum),) -> (Shard(dim=0),): reduce_scatter, 49152 B sent by this rank``:
    the plan that layout inference makes for this move (planning only; nothing moves here)."""
    head = f"{what} {list(x.shape)} {_where_now(x)} -> {_text(dst)}"
    try:
        spec = _spec_of(x, dst)
        if spec == x._spec:
            return f"{head}: nothing to move"
        route = plan_redistribute(x._spec, spec, x.element_size())
        kinds = ", ".join(k for k in route.kinds if k != "local") or "local copy"
        return f"{head}: {kinds}, {execution_bytes(route, x.mesh)} B sent by this rank"
    except Exception as e:  # the description must never break a forward
        return f"{head}: (no plan: {e})"


def _watch(module: nn.Module):
    """Count the collectives of the module's first eager forward, all of them: its hooks' moves
    and the ops' own (e.g. a weight whose layout its product cannot take, moved on every call),
    for ``describe``'s ``forward ran:`` line. Registers the counting pre-hook now, before the
    style's hooks (so it runs first; not through ``prepend=True``, whose reordered hook dict
    torch 2.11's Dynamo indexes wrongly when it builds a compiled module's guards), and returns
    the function that registers the closing hook, to be called after the style's. A forward
    that torch.compile traces is not counted and leaves the hooks in place."""
    def pre(mod, args):
        if compiling():
            return
        log = _forward_log(mod)
        if log is None:
            return
        if log.watching is not None:  # the last forward raised before its end: count this one instead
            log.watching.close()
        log.watching = contextlib.ExitStack()
        log.counted = log.watching.enter_context(count_collectives())

    def post(mod, args, out):
        if compiling():
            return
        log = _log_of(mod)
        if log is None or log.watching is None:
            return
        log.watching.close()
        log.watching = None
        try:
            text = _ran_text(mod, log.counted)
        except Exception as e:  # the description must never break a forward
            text = f"(not counted: {e})"
        log.add("ran", f"forward ran: {text}")
        for handle in handles:  # once: later forwards (and torch.compile) see no hook of ours
            handle.remove()

    handles = [module.register_forward_pre_hook(pre)]
    return lambda: handles.append(module.register_forward_hook(post))


def _ran_text(module: nn.Module, counted) -> str:
    """``all_gather over gpuid: 1 call, 288 B sent; ...``, and which parameters moved (a route
    whose source is the parameter's storage, the parameter or a view such as a Linear weight's
    transpose): a parameter whose layout the ops cannot take is moved again on every forward."""
    text = "; ".join(str(counted).splitlines())
    sources = {address for address in counted.storages if address}  # (0: an empty local tensor)
    # outside inference mode, where a view of a parameter made before it is allowed (torch
    # refuses one inside: "Cannot set version_counter")
    with torch.inference_mode(False), torch.no_grad():
        moved = [pname for pname, p in module.named_parameters(recurse=False)
                 if isinstance(p, DTensor) and p.to_local().untyped_storage().data_ptr() in sources]
    if moved:
        many = len(moved) > 1
        text += (f" (moves parameter{'s' if many else ''} {', '.join(moved)} on every forward: "
                 f"{'their layouts are not ones' if many else 'its layout is not one'} the ops take)")
    return text


def _move(x, dst, mesh: DeviceMesh, module: nn.Module, what: str, *, given=None, note=None, stays=None):
    """``x`` laid out as ``dst``; a plain tensor is first read as ``given`` (its local piece);
    ``note(x)``: a line the layer's log adds to the move's plan after the forward (the fused
    choice the forward made, read from its record). ``stays`` (one dict per hook, kept by it):
    the specs this move left as they were, by id; a DTensor in one of them is ``x`` at once (its
    first move checked that every rank agrees; a decode step's TP layers take that way)."""
    if not isinstance(x, torch.Tensor):
        return x
    log = _forward_log(module)
    if stays is not None and not compiling() and type(x) is DTensor and stays.get(id(x._spec)) is x._spec and \
            (log is None or log.seen(what)):
        return x
    if not isinstance(x, DTensor):
        src = _resolve(given if given is not None else dst, x.shape, mesh)
        if isinstance(src, Layout):
            raise LayoutError(f"{what} of {log.name if log else module}: a plain tensor cannot be read as the layout "
                              f"{src} (its global shape is unknown); pass a DTensor or give placements")
        x = DTensor.from_local(x.to(mesh.device), mesh, src)
    if dst is None:
        return x
    target = _resolve(dst, x.shape, mesh)
    if log is not None and not log.seen(what):
        log.add(what, _transition(x, target, what))
        if note is not None:
            note(x)  # (drops an older record of the choice)
            log.noting = (what, note, x)
    moved = x.redistribute(target)
    if stays is not None and not compiling() and moved is x:
        if len(stays) > 64:  # (a layer called with ever new shapes)
            stays.clear()
        stays[id(x._spec)] = x._spec
    return moved


def _complete_note(module: nn.Module) -> None:
    """Add to the line of the move that ``_move`` left noting the text its note gives now."""
    log = _log_of(module)
    if log is not None and log.noting is not None:
        what, noted, x = log.noting
        log.noting = None
        log.lines[what] += noted(x)


def _local(x, use_local_output: bool):
    return x.to_local() if use_local_output and isinstance(x, DTensor) else x


# ---------------------------------------------------------------------------
# Styles
# ---------------------------------------------------------------------------


class ParallelStyle:
    """How one module is parallelized; ``parallelize`` calls ``apply`` once per matching module.

    A style of one's own overrides ``apply(module, mesh, name, shared, src_rank)``: ``module``
    the matching module, ``mesh`` the 1-D axedist mesh, ``name`` the module's name in the model
    (for messages), ``shared`` parallelize's record of the parameters laid out so far (tied
    weights; left alone by a style that lays out no parameter), ``src_rank`` the global rank whose
    values parameters take (None: every rank's own). It lays out parameters and registers the
    module's hooks; parameters it leaves plain become replicated DTensors (docs/tensor_parallel.md,
    "A style of your own")::

        class NoParallel(ParallelStyle):   # replicated parameters, inputs read as Replicate, local outputs
            def apply(self, module, mesh, name, shared, src_rank):
                module.register_forward_pre_hook(lambda mod, args: (replicate(args[0], mesh),) + args[1:])
                module.register_forward_hook(lambda mod, args, out: out.redistribute([Replicate()]).to_local())
    """

    def apply(self, module: nn.Module, mesh: DeviceMesh, name: str, shared: dict, src_rank: int | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not override ParallelStyle.apply(module, mesh, name, "
                                  f"shared, src_rank), which parallelize calls (torch's _apply(module, device_mesh) "
                                  f"is not called: it would build torch DTensors)")

    def _params(self, module: nn.Module, mesh: DeviceMesh, layouts: dict, shared: dict, src_rank) -> None:
        for pname, where in layouts.items():
            param = getattr(module, pname, None)
            if param is None:
                continue
            module.register_parameter(pname, _distribute_param(param, mesh, where, shared, src_rank,
                                                               f"{type(module).__name__}.{pname}"))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_text(v)}" for k, v in vars(self).items()
                           if v is not None and v != {} and not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _distribute_param(param: nn.Parameter, mesh: DeviceMesh, where, shared: dict, src_rank, what: str) -> nn.Parameter:
    """The parameter as a DTensor Parameter; a parameter shared by two modules (tied weights)
    becomes one DTensor Parameter, and both modules must ask for the same layout."""
    target = _resolve(where, param.shape, mesh)
    if id(param) in shared:
        old_target, new = shared[id(param)]
        if new._spec != _spec_of(new, target):
            raise LayoutError(f"{what}: a tied parameter is laid out as {_text(old_target)} by one module and "
                              f"{_text(target)} by another")
        return new
    if isinstance(param, DTensor):
        dt = param.detach().redistribute(target)
    else:
        local = param.detach() if param.is_meta else param.detach().to(mesh.device)
        dt = distribute(local, mesh, target, src_rank=src_rank)
    new = nn.Parameter(dt, requires_grad=param.requires_grad)
    shared[id(param)] = (target, new)
    shared[id(new)] = (target, new)
    return new


def _spec_of(x: DTensor, target):
    from ..spec import target_spec
    return target_spec(x._spec, target, None, None)


def _check_type(style, module, kinds):
    if not isinstance(module, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"{type(style).__name__} applies to {names} modules, got {type(module).__name__}")


class _LinearLike(ParallelStyle):
    def __init__(self, *, input_layouts: Where | None = None, output_layouts: Where | None = None,
                 use_local_output: bool = False, weight_layout: Where | None = None,
                 desired_input_layouts: Where | None = None):
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts
        self.desired_input_layouts = desired_input_layouts
        self.use_local_output = use_local_output
        self.weight_layout = weight_layout

    def _hooks(self, module: nn.Module, mesh: DeviceMesh, given, desired, output, *, note=None, output_note=None):
        """The pre-hook reads the input as ``given`` and moves it to ``desired``, the post-hook
        moves the output to ``output``; ``note`` / ``output_note`` complete the log's line of the
        input's / output's move with the fused choice the forward / the move made (``_move``)."""
        stays_in, stays_out = {}, {}  # (_move)

        def pre(mod, args):
            return (_move(args[0], desired, mesh, mod, "input", given=given, note=note, stays=stays_in),) + \
                tuple(args[1:])

        def post(mod, args, out):
            _complete_note(mod)
            out = _move(out, output, mesh, mod, "output", note=output_note, stays=stays_out)
            _complete_note(mod)
            return _local(out, self.use_local_output)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


class ColwiseParallel(_LinearLike):
    """Split a Linear's output features (weight ``Shard(0)``) or an Embedding's embedding dim.

    Input: read as ``input_layouts`` (default Replicate), brought to Replicate; output:
    ``output_layouts`` (default ``Shard(-1)``: no communication). A ``[8, 16] -> [8, 64]``
    Linear on 4 ranks holds a ``[16, 16]`` weight slice and gives a ``[8, 16]`` local output.
    With sequence-parallel input (``input_layouts=Shard(0)`` of sequence-first activations) the
    move to Replicate is an all-gather of the GEMM's rows, which on CUDA the fused all-gather +
    GEMM runs (the gather stays pending until the GEMM takes it). In backward the input's
    gradient ``grad[S*B, N_local] @ W_local``, seen as ``[S, B, H]``, is reduce-scattered back
    to ``Shard(0)``: on CUDA the fused GEMM + reduce-scatter. One consumer of the gathered input
    (the output head) fuses its product; several (wq/wk/wv, w1/w3 on one gathered input) have
    their gradients summed unrun and fuse once, on the operands concatenated along K
    (docs/gpu_notes.md, "Backward of the column-parallel half").
    """

    def apply(self, module, mesh, name, shared, src_rank=0):
        _check_type(self, module, (nn.Linear, nn.Embedding))
        if isinstance(module, nn.Linear):
            self._params(module, mesh, {"weight": self.weight_layout or Shard(0)}, shared, src_rank)
            bias = Shard(0) if self.weight_layout is None else _rows_of(module.weight)
            self._params(module, mesh, {"bias": bias}, shared, src_rank)
        else:
            self._params(module, mesh, {"weight": self.weight_layout or Shard(1)}, shared, src_rank)
        note = ((lambda x: _fused_note(x, "all-gather") if _rows_sharded(x) else "")
                if isinstance(module, nn.Linear) else None)
        self._hooks(module, mesh, self.input_layouts or Replicate(), self.desired_input_layouts or Replicate(),
                    self.output_layouts or Shard(-1), note=note)


def _rows_of(weight: DTensor):
    """How a column-parallel bias is laid out: as its weight's rows (the output features), so
    the product and the bias add where they are. ``Shard(0)`` when the rows have no layout of
    their own (the weight's input features split over devices, padding)."""
    spec = weight._spec
    rows = None if spec.padded != spec.shape else one_dim_iters(spec.layout, spec.shape, 0)
    return Shard(0) if rows is None else Layout(rows, spec.layout.replica, spec.layout.offset)


class RowwiseParallel(_LinearLike):
    """Split a Linear's input features (weight ``Shard(1)``) or an Embedding's vocabulary.

    Linear: input read as ``input_layouts`` (default ``Shard(-1)``); the local GEMM gives a
    partial sum of the ``[rows, out]`` result, which goes to ``output_layouts`` (default
    Replicate: an all-reduce; ``Shard(0)`` of sequence-first activations: a reduce-scatter of
    the GEMM's rows, fused with the GEMM on CUDA). The bias (Replicate) is added after the sum.
    Embedding (vocab-parallel): the weight is ``Shard(0)``, each rank looks up the ids in its
    vocabulary slice (a partial sum), which goes to ``output_layouts`` (default Replicate).
    """

    def apply(self, module, mesh, name, shared, src_rank=0):
        _check_type(self, module, (nn.Linear, nn.Embedding))
        output = self.output_layouts or Replicate()
        if isinstance(module, nn.Embedding):
            self._params(module, mesh, {"weight": self.weight_layout or Shard(0)}, shared, src_rank)
            self._hooks(module, mesh, self.input_layouts or Replicate(), self.desired_input_layouts or Replicate(),
                        output)
            return
        self._params(module, mesh, {"weight": self.weight_layout or Shard(1), "bias": Replicate()}, shared, src_rank)
        # the module's own forward: F.linear gives the partial sums (the bias joins the sum once), left
        # pending, so the output's move is the fused GEMM + reduce-scatter / all-reduce on CUDA
        self._hooks(module, mesh, self.input_layouts or Shard(-1), self.desired_input_layouts or Shard(-1), output,
                    output_note=lambda y: _fused_note(y, _row_collective(y, output, mesh)))


def _row_collective(y, output, mesh: DeviceMesh) -> str | None:
    """The collective that moves a row-parallel Linear's partial output ``y`` to ``output``: a
    reduce-scatter of its rows (``Shard(0)``), an all-reduce (Replicate), else none of the two."""
    if not isinstance(y, DTensor) or y.reduce_op is None:
        return None
    target = _resolve(output, tuple(y.shape), mesh)
    if isinstance(target, Layout):
        return None
    if tuple(target) == (Shard(0),):
        return "reduce-scatter"
    return "all-reduce" if all(isinstance(p, Replicate) for p in target) else None


def _rows_sharded(x) -> bool:
    """Whether ``x`` (a DTensor on a 1-D mesh) is sharded on its first dim: its move to
    Replicate is an all-gather of rows."""
    try:
        return isinstance(x, DTensor) and x.placements == (Shard(0),)
    except LayoutError:
        return False


def _fused_note(x, collective: str | None) -> str:
    """On CUDA, the fused GEMM + collective choice just made for this layer (read from its record,
    kept when the choice was made: runtime/deferred.py): the row-parallel GEMM + reduce-scatter /
    all-reduce, or for a column-parallel layer ("all-gather") the all-gather of its rows + GEMM.
    Without a record the work was not deferred (``defer_gemm`` / ``defer_gathers``: "auto"
    defers CUDA bf16/fp16 only), so no fused kernel was asked. Asking takes the record
    (``PendingWork.take_choice``): a note asked before a move drops an older one."""
    if collective is None or not isinstance(x, DTensor) or x.mesh.device_type != "cuda":
        return ""
    text = DTensor.dispatcher.pending.take_choice(collective)
    if text is None:
        text = f"fused GEMM + {collective} not used: not deferred (dtype {x.dtype}, or a policy that does not defer)"
    return f"\n      {text}"


class VocabParallelEmbedding(RowwiseParallel):
    """An Embedding whose vocabulary is split over the ranks (weight ``Shard(0)``).

    ids are Replicate; each rank returns the rows of the ids in its slice and zeros elsewhere,
    a partial sum that goes to ``output_layouts`` (Replicate: all-reduce; ``Shard(0)`` of
    sequence-first activations: reduce-scatter). Vocabulary 10 on 4 ranks: slices of 3,3,3,1 rows.
    """

    def apply(self, module, mesh, name, shared, src_rank=0):
        _check_type(self, module, (nn.Embedding,))
        super().apply(module, mesh, name, shared, src_rank)


class SequenceParallel(ParallelStyle):
    """A norm (or any module with replicated parameters) run on sequence-sharded activations.

    Parameters Replicate; input read as / brought to ``Shard(sequence_dim)``; output left as
    the ops make it (``Shard(sequence_dim)`` for norms over the last dim). The parameters'
    gradients come out as partial sums (each rank saw part of the sequence).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module, mesh, name, shared, src_rank=0):
        self._params(module, mesh, {p: Replicate() for p, _ in module.named_parameters(recurse=False)}, shared,
                     src_rank)
        layout = Shard(self.sequence_dim)

        def pre(mod, args):
            return (_move(args[0], layout, mesh, mod, "input"),) + tuple(args[1:])

        def post(mod, args, out):
            return _local(out, self.use_local_output)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def _per_argument(layouts) -> tuple | None:
    if layouts is None:
        return None
    return (layouts,) if isinstance(layouts, (Placement, Layout)) else tuple(layouts)


class PrepareModuleInput(ParallelStyle):
    """Lay a module's inputs out before it runs: positional input ``i`` is read as
    ``input_layouts[i]`` (a plain tensor) and brought to ``desired_input_layouts[i]``; an
    ``input_layouts[i]`` of ``None`` leaves that input alone, whatever its desired layout (as
    torch's). Same for keyword inputs with the ``*_kwarg_*`` dicts.

    ``PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None))``
    all-gathers a sequence-sharded first input and leaves the second as it is.
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False):
        self.input_layouts = _per_argument(input_layouts)
        self.desired_input_layouts = _per_argument(desired_input_layouts)
        if self.input_layouts is not None and (self.desired_input_layouts is None
                                               or len(self.input_layouts) != len(self.desired_input_layouts)):
            raise ValueError(f"PrepareModuleInput: input_layouts {self.input_layouts} and desired_input_layouts "
                             f"{self.desired_input_layouts} must have one entry per input each")
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(f"PrepareModuleInput: input_kwarg_layouts names {sorted(self.input_kwarg_layouts)} and "
                             f"desired_input_kwarg_layouts names {sorted(self.desired_input_kwarg_layouts)} differ")
        self.use_local_output = use_local_output

    def apply(self, module, mesh, name, shared, src_rank=0):
        def prepare(mod, value, given, desired, what):
            if given is None:  # (torch's leaves it alone too, even with a desired layout)
                return value
            out = _move(value, desired, mesh, mod, what, given=given)
            return _local(out, self.use_local_output)

        def pre(mod, args, kwargs):
            args = list(args)
            if self.input_layouts is not None:
                if len(args) < len(self.input_layouts):
                    raise ValueError(f"{name}: PrepareModuleInput has layouts for {len(self.input_layouts)} inputs, "
                                     f"the module got {len(args)}")
                for i, (given, desired) in enumerate(zip(self.input_layouts, self.desired_input_layouts)):
                    args[i] = prepare(mod, args[i], given, desired, f"input {i}")
            for key, given in self.input_kwarg_layouts.items():
                if key in kwargs:
                    kwargs[key] = prepare(mod, kwargs[key], given, self.desired_input_kwarg_layouts[key], f"input {key}")
            return tuple(args), kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)


class PrepareModuleOutput(ParallelStyle):
    """Lay a module's outputs out after it runs: output ``i`` is read as ``output_layouts[i]``
    (a plain tensor) and brought to ``desired_output_layouts[i]``; an ``output_layouts[i]`` of
    ``None`` leaves that output alone. One output is returned bare, as torch's does, also where
    the module returned ``(y,)``."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _per_argument(output_layouts)
        self.desired_output_layouts = _per_argument(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError("PrepareModuleOutput: output_layouts and desired_output_layouts differ in length")
        self.use_local_output = use_local_output

    def apply(self, module, mesh, name, shared, src_rank=0):
        def post(mod, args, out):
            outs = out if isinstance(out, tuple) else (out,)
            if len(outs) != len(self.output_layouts):
                raise ValueError(f"{name}: PrepareModuleOutput has layouts for {len(self.output_layouts)} outputs, "
                                 f"the module returned {len(outs)}")
            moved = tuple(o if g is None else _local(_move(o, d, mesh, mod, f"output {i}", given=g),
                                                     self.use_local_output)
                          for i, (o, g, d) in enumerate(zip(outs, self.output_layouts, self.desired_output_layouts)))
            return moved[0] if len(moved) == 1 else moved

        module.register_forward_hook(post)


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` then ``PrepareModuleOutput`` on one module, as torch's style of the
    same name: the inputs' keywords as ``PrepareModuleInput``'s (``use_local_input`` is its
    ``use_local_output``), the outputs' as ``PrepareModuleOutput``'s.

    ``PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
    use_local_input=True, output_layouts=Partial(), desired_output_layouts=Shard(0))``: a
    sequence-sharded input all-gathered and handed in as a local tensor, the module's partial
    sums reduce-scattered back to sequence-sharded (torchtitan's MoE).
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_input: bool = False, output_layouts,
                 desired_output_layouts, use_local_output: bool = True):
        self.inputs = PrepareModuleInput(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                                         input_kwarg_layouts=input_kwarg_layouts,
                                         desired_input_kwarg_layouts=desired_input_kwarg_layouts,
                                         use_local_output=use_local_input)
        self.outputs = PrepareModuleOutput(output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
                                           use_local_output=use_local_output)

    def apply(self, module, mesh, name, shared, src_rank=0):
        self.inputs.apply(module, mesh, name, shared, src_rank)
        self.outputs.apply(module, mesh, name, shared, src_rank)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inputs!r}, {self.outputs!r})"


# ---------------------------------------------------------------------------
# torch's styles -> ours
# ---------------------------------------------------------------------------


def _first(layouts):
    return None if layouts is None else layouts[0]


def _torch_translations() -> dict:
    """torch's style classes -> the axedist style made from one's layouts (and nothing else)."""
    from torch.distributed.tensor import parallel as tp

    return {
        tp.ColwiseParallel: lambda style: ColwiseParallel(
            input_layouts=_first(style.input_layouts), output_layouts=_first(style.output_layouts),
            use_local_output=style.use_local_output),
        tp.RowwiseParallel: lambda style: RowwiseParallel(
            input_layouts=_first(style.input_layouts), output_layouts=_first(style.output_layouts),
            use_local_output=style.use_local_output),
        tp.SequenceParallel: lambda style: SequenceParallel(
            sequence_dim=style.sequence_sharding[0].dim, use_local_output=style.use_local_output),
        tp.PrepareModuleInput: _torch_input,
        tp.PrepareModuleOutput: _torch_output,
        tp.PrepareModuleInputOutput: _torch_input_output,
    }


def _torch_input(style) -> "PrepareModuleInput":
    return PrepareModuleInput(input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
                              input_kwarg_layouts=style.input_kwarg_layouts,
                              desired_input_kwarg_layouts=style.desired_input_kwarg_layouts,
                              use_local_output=style.use_local_output)


def _torch_output(style) -> "PrepareModuleOutput":
    return PrepareModuleOutput(output_layouts=style.output_layouts, desired_output_layouts=style.desired_output_layouts,
                               use_local_output=style.use_local_output)


def _torch_input_output(style) -> "PrepareModuleInputOutput":
    inputs = from_torch_style(style.prepare_module_input)  # (a half replaced by a subclass is refused too)
    outputs = from_torch_style(style.prepare_module_output)
    return PrepareModuleInputOutput(input_layouts=inputs.input_layouts,
                                    desired_input_layouts=inputs.desired_input_layouts,
                                    input_kwarg_layouts=inputs.input_kwarg_layouts,
                                    desired_input_kwarg_layouts=inputs.desired_input_kwarg_layouts,
                                    use_local_input=inputs.use_local_output, output_layouts=outputs.output_layouts,
                                    desired_output_layouts=outputs.desired_output_layouts,
                                    use_local_output=outputs.use_local_output)


# Names a style's class may redefine without changing what it does: its translation reads the
# layouts from the instance, so a subclass with other defaults (its own __init__) is translated.
_NOT_BEHAVIOUR = frozenset({"__init__", "__repr__", "__str__"})


def _overridden(style, torch_class) -> list[str]:
    """The methods of ``torch_class`` (and its torch bases) that ``style`` replaces, in its class
    or on the instance: what it does there the translation would drop. For torchtitan's
    ``Float8ColwiseParallel(ColwiseParallel)``: ``['_apply', '_prepare_input_fn', '_prepare_output_fn']``."""
    methods = {name for cls in torch_class.__mro__ if cls is not object
               for name, value in vars(cls).items()
               if name not in _NOT_BEHAVIOUR and (callable(value) or isinstance(value, (property, classmethod)))}
    return sorted(name for name in methods
                  if inspect.getattr_static(type(style), name) is not inspect.getattr_static(torch_class, name)
                  or name in vars(style))


def from_torch_style(style) -> ParallelStyle:
    """The axedist style equal to one of torch's ``torch.distributed.tensor.parallel`` styles
    (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``,
    ``PrepareModuleOutput``, ``PrepareModuleInputOutput``), made from its layouts. A subclass
    that replaces one of the class's methods (its own input or output functions, partitioning,
    ``_apply``) would lose them there: it is refused, as is any other torch style (its ``_apply``
    builds torch DTensors), with how to port it.

        >>> from_torch_style(torch_tp.RowwiseParallel(output_layouts=Shard(0)))
        RowwiseParallel(output_layouts=Shard(dim=0), use_local_output=True)
    """
    if isinstance(style, ParallelStyle):
        return style
    from torch.distributed.tensor import parallel as tp

    port = ("port it to an axedist.nn.ParallelStyle subclass whose apply(module, mesh, name, shared, src_rank) "
            "lays out the parameters and registers the same input/output functions on axedist DTensors "
            "(docs/tensor_parallel.md, \"A style of your own\"), or lay the module out with "
            "axedist.nn.distribute_module(module, mesh, partition_fn, input_fn, output_fn)")
    for torch_class, translate in _torch_translations().items():
        if not isinstance(style, torch_class):
            continue
        replaced = _overridden(style, torch_class)
        if replaced:
            raise TypeError(f"{type(style).__qualname__} subclasses torch's {torch_class.__name__} and replaces "
                            f"{', '.join(replaced)}: axedist translates torch's styles from their layouts and would "
                            f"not run that code; {port}")
        return translate(style)
    if isinstance(style, tp.ParallelStyle):
        raise TypeError(f"{type(style).__qualname__} is a torch ParallelStyle of its own (its _apply builds torch "
                        f"DTensors), which axedist does not run; {port}")
    raise TypeError(f"a plan's values must be axedist styles or torch's ColwiseParallel / RowwiseParallel / "
                    f"SequenceParallel / PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput, "
                    f"got {style!r}")


# ---------------------------------------------------------------------------
# parallelize
# ---------------------------------------------------------------------------


def _matches(pattern: str, name: str) -> bool:
    """fnmatch per dotted part (as torch's parallelize_module): ``layers.*.wq`` matches
    ``layers.3.wq`` but not ``layers.3.attention.wq``."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms))


def _check_apply(style: ParallelStyle) -> None:
    """A style's ``apply`` takes what ``parallelize`` passes (a style written to another signature
    is named here, not by Python's count of its arguments)."""
    try:
        inspect.signature(style.apply).bind(None, None, "", {}, None)
    except TypeError:
        raise TypeError(f"{type(style).__qualname__}.apply{inspect.signature(style.apply)} does not take what "
                        f"parallelize passes: apply(module, mesh, name, shared, src_rank) (ParallelStyle's "
                        f"docstring)") from None


def parallelize(module: nn.Module, mesh, plan, *, src_rank: int | None | str = "first",
                unmatched: str = "raise") -> nn.Module:
    """Apply ``plan`` (module-name pattern -> style, or one style for ``module`` itself) to
    ``module`` on a 1-D mesh, in place.

    ``mesh``: an axedist mesh, or a torch ``DeviceMesh`` (1-D, or a named sub-mesh such as
    ``world_mesh["tp"]``). Matching modules get their style (parameters laid out, input/output
    hooks). With axedist's styles every other parameter and every buffer becomes a replicated
    DTensor, so DTensors flow through the whole model; a plan of torch's styles only leaves
    them as they are, as torch's ``parallelize_module`` does (its local outputs meet plain
    buffers). Parameter values come from global rank ``src_rank`` (default ``"first"``: the
    mesh's first rank, as torch's ``distribute_tensor``; ``None``: every rank already holds
    the same values, nothing is sent). A pattern that matches no module is an error
    (``unmatched="warn"``: a warning, as torch's ``parallelize_module`` gives). Returns ``module``.

        >>> parallelize(model, mesh, {"layers.*.attention.wq": ColwiseParallel(), "output": ColwiseParallel()})
    """
    mesh = as_mesh(mesh)
    if mesh.ndim != 1:
        raise ValueError(f"parallelize lays modules out on a 1-D tensor-parallel mesh; mesh {mesh} has axes "
                         f"{mesh.axis_names}: pass mesh['<tp axis>']")
    if src_rank == "first":
        src_rank = mesh.ranks[0]
    if not isinstance(plan, dict):
        plan = {"": plan}
    # torch's styles alone: torch's semantics (what the plan does not name stays untouched)
    replicate_rest = any(isinstance(style, ParallelStyle) for style in plan.values())
    styles = {pattern: from_torch_style(style) for pattern, style in plan.items()}
    for style in styles.values():
        _check_apply(style)
    used = {pattern: 0 for pattern in styles}
    shared: dict = {}
    closers = []  # each watched module's closing hook, registered after its styles' hooks
    for name, sub in list(module.named_modules()):
        for pattern, style in styles.items():
            if not _matches(pattern, name):
                continue
            used[pattern] += 1
            if _log_of(sub) is None:
                sub.__dict__["_axedist_log"] = _Log(name, style)
                closers.append(_watch(sub))
            else:
                _log_of(sub).style = f"{_log_of(sub).style} + {style}"
            style.apply(sub, mesh, name, shared, src_rank)
    for close in closers:
        close()
    unused = [p for p, n in used.items() if n == 0]
    if unused:
        names = [n for n, _ in module.named_modules() if n][:12]
        if unmatched != "warn":
            raise ValueError(f"plan patterns {unused} match no module (names look like {names})")
        warnings.warn(f"parallelize_module: plan patterns {unused} match no module (names look like {names}); "
                      f"left out, as torch's parallelize_module does", stacklevel=3)
    if replicate_rest:
        for sub in module.modules():
            _replicate_own(sub, mesh, shared, src_rank, send_buffers=False)
    module.__dict__["_axedist_mesh"] = mesh
    if "_axedist_outputs_hook" not in module.__dict__:
        module.__dict__["_axedist_outputs_hook"] = module.register_forward_hook(_outputs_computed)
    return reduce_pending_grads(module)


def _outputs_computed(module, args, output) -> None:
    """The parallelized model's outputs carry no deferred decode all-reduce (ops/fusion.py): at
    decode the last block's ``h + ffn(h)`` waits for an RMSNorm that never comes inside the model;
    it runs here, before the forward returns, so that a CUDA graph captured around the model
    records it (a deferred tail run after the capture would not be replayed). Nothing is deferred
    while compiling (the compiler schedules the collectives), so a traced forward skips this."""
    if compiling() or defer_tails() == "never":  # (nothing can be left to run)
        return
    for leaf in torch.utils._pytree.tree_leaves(output):
        if type(leaf) is DTensor and pending_tail(leaf._pending) is not None:
            leaf.to_local()


def _replicate_own(sub: nn.Module, mesh: DeviceMesh, shared: dict, src_rank, *, send_buffers: bool) -> None:
    """``sub``'s own parameters and buffers that are not DTensors yet, replicated: parameters
    (and buffers if ``send_buffers``) with global rank ``src_rank``'s values, other buffers
    with each rank's own (they are taken to be equal already)."""
    for pname, param in list(sub.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            sub.register_parameter(pname, _distribute_param(param, mesh, Replicate(), shared, src_rank,
                                                            f"{type(sub).__name__}.{pname}"))
    for bname, buffer in list(sub.named_buffers(recurse=False)):
        if buffer is not None and not isinstance(buffer, DTensor):
            persistent = bname not in sub._non_persistent_buffers_set
            value = (distribute(buffer.to(mesh.device), mesh, [Replicate()] * mesh.ndim, src_rank=src_rank)
                     if send_buffers else replicate(buffer, mesh))
            sub.register_buffer(bname, value, persistent=persistent)


def distribute_module(module: nn.Module, device_mesh=None, partition_fn=None, input_fn=None,
                      output_fn=None) -> nn.Module:
    """torch's ``distribute_module`` on axedist DTensors: ``partition_fn(name, submodule,
    device_mesh)`` runs on every submodule (it registers DTensor parameters, e.g. with
    ``axedist.distribute_tensor``); then every parameter and buffer that is not a DTensor yet is
    replicated with the mesh's first rank's values (as torch's). ``input_fn(module, inputs,
    device_mesh)`` runs before each forward (its return, if any, replaces the inputs) and
    ``output_fn(module, outputs, device_mesh)`` after (its return, if any, replaces the outputs).
    The mesh may be torch's or axedist's; the functions get it as it was given.

        >>> distribute_module(model, mesh, shard_linears, input_fn=lambda m, inputs, mesh:
        ...     tuple(distribute_tensor(x, mesh, [Replicate()]) for x in inputs))
    """
    if device_mesh is None:
        raise TypeError("distribute_module needs device_mesh= (a torch or axedist mesh); axedist keeps no "
                        "current mesh")
    mesh = as_mesh(device_mesh)
    shared: dict = {}
    for name, sub in list(module.named_modules()):
        if partition_fn is not None:
            partition_fn(name, sub, device_mesh)
        _replicate_own(sub, mesh, shared, mesh.ranks[0], send_buffers=True)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module


def parallelize_module(module: nn.Module, device_mesh=None, parallelize_plan=None, *,
                       src_data_rank: int | None = 0) -> nn.Module:
    """torch's ``parallelize_module``, spelled as torch spells it (keywords ``module``,
    ``device_mesh``, ``parallelize_plan``, ``src_data_rank``), on axedist DTensors:
    :func:`parallelize` with the mesh's rank ``src_data_rank`` as the source of the values.

        >>> parallelize_module(module=block, device_mesh=world_mesh["tp"],
        ...                    parallelize_plan={"attention.wq": ColwiseParallel()})
    """
    if device_mesh is None:
        raise ValueError("parallelize_module needs device_mesh= (a torch or axedist mesh); axedist keeps no "
                         "current mesh")
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given; the module is left as it is", stacklevel=2)
        return module
    mesh = as_mesh(device_mesh)
    if src_data_rank is not None and (isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)
                                      or not 0 <= src_data_rank < len(mesh.ranks)):
        raise MeshError(f"parallelize_module: src_data_rank={src_data_rank!r} is not a rank of mesh {mesh} (the index "
                        f"of the rank in the mesh that sends the values, 0 to {len(mesh.ranks) - 1}; None: every "
                        f"rank keeps its own)")
    src_rank = None if src_data_rank is None else mesh.ranks[src_data_rank]
    # torch's warns of a plan key that matches no module (torchtitan's Llama-3 plan names q_norm / k_norm,
    # which only some of its models have)
    return parallelize(module, mesh, parallelize_plan, src_rank=src_rank, unmatched="warn")


def describe(module: nn.Module) -> str:
    """Each parallelized layer's style, parameter layouts and (after a forward) the moves of its
    inputs and outputs, and every collective its first eager forward ran (the ops' own too: a
    parameter moved on every forward is named)::

        layers.0.attention.wo  RowwiseParallel(output_layouts=Shard(dim=0), ...)
          weight  f32[64, 64]  (Shard(dim=1),)  S[(64,4,16):(16,1@gpuid,1)]
          input [128, 2, 64] (Shard(dim=2),) -> (Shard(dim=2),): nothing to move
          output [128, 2, 64] (Partial(sum),) -> (Shard(dim=0),): reduce_scatter, 49152 B sent by this rank
          forward ran: reduce_scatter over gpuid: 1 call, 49,152 B sent
    """
    lines = []
    for name, sub in module.named_modules():
        log = _log_of(sub)
        if log is None:
            continue
        lines.append(f"{name or '<root>'}  {log.style}")
        for pname, p in sub.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                dtype = str(p.dtype).replace("torch.", "")
                lines.append(f"  {pname}  {dtype}{list(p.shape)}  {_where_now(p)}  {p.axe_layout}")
        for text in log.lines.values():
            lines.append(f"  {text}")
    return "\n".join(lines)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    """Cross-entropy of logits ``[..., V]`` sharded on the classes, without gathering them.

    Each rank holds a vocabulary slice; the log-sum-exp and the target's logit are reduced
    across ranks by the loss's sharding rule (a few scalars per row move, never ``V``).
    Plain ``targets`` are taken as replicated. ``kwargs`` go to ``F.cross_entropy``.

    >>> vocab_parallel_cross_entropy(logits, targets)   # logits f32[32, 1000] (Shard(1),), targets [32]
    """
    if isinstance(logits, DTensor) and not isinstance(targets, DTensor):
        targets = replicate(targets, logits.mesh)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), **kwargs)


def to_inference(module: nn.Module) -> nn.Module:
    """Make every parameter and buffer an inference tensor (no grad), in place, for decoding
    under ``torch.inference_mode()``.

    A view of a DTensor made outside inference mode fails inside it ("Cannot set
    version_counter for inference tensor": the wrapper made inside is an inference tensor;
    torch's DTensor has the same limit), and ``F.linear`` views its weight. Copies made inside
    inference mode view freely. Returns ``module``; train it no more afterwards.

        >>> to_inference(model)
        >>> with torch.inference_mode():
        ...     logits = model(tokens)
    """
    with torch.inference_mode():
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None:
                    sub._parameters[name] = nn.Parameter(param.clone(), requires_grad=False)  # clone: not a view
            for name, buffer in list(sub._buffers.items()):
                if buffer is not None:
                    sub._buffers[name] = buffer.clone()
    return module
