"""torch.compile support that every layer shares: whether a compile is tracing, and metadata
work (specs, plans, index tensors) done on real tensors while it traces.

Under ``torch.compile`` the DTensor's sharding rules and plans run at trace time, while Dynamo
and AOTAutograd hold fake (shape-only) and functional tensors on their dispatch-mode stack.
Planning builds small real tensors (element tables, the gather/scatter indices of a plan's
steps) and reads them back as ints, which a fake tensor cannot do; :func:`outside_tracing`
runs such a function with the modes set aside, so what it builds is real, and becomes a
constant of the traced graph where a traced op uses it::

    >>> @outside_tracing
    ... def slots(n):                      # a plan's index tensor: real even inside a trace
    ...     return torch.arange(n)
    >>> compiling()                        # True inside torch.compile's trace, else False
    False
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["ALL_DIMS", "compiling", "eager_only", "may_defer", "outside_tracing", "static_sizes", "traced_constant", "keep_on_copy",
           "unusable_here"]

_modes_active = torch._C._len_torch_dispatch_stack
_FUNCTIONAL = torch._C._TorchDispatchModeKey.FUNCTIONAL
_FAKE = torch._C._TorchDispatchModeKey.FAKE


class _AllDims:
    """Contains every dim index: ``3 in ALL_DIMS`` is True (what Dynamo asks of a tensor's
    ``_dynamo_static_indices``; ``torch._dynamo.mark_static`` adds to it, a no-op here)."""

    def __contains__(self, dim) -> bool:
        return True

    def add(self, dim) -> None:
        pass

    def issubset(self, other) -> bool:
        return isinstance(other, _AllDims)

    def __repr__(self) -> str:
        return "ALL_DIMS"


ALL_DIMS = _AllDims()


def static_sizes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (and the tensor it views) marked static in every dim for Dynamo, as
    ``torch._dynamo.mark_static`` would: a DTensor's local tensor, which Dynamo fakes on its own
    and would otherwise make symbolic when a compiled frame sees a second size (specs and plans
    are for concrete shapes; a DTensor's own dims are static already)."""
    for one in (t, t._base):
        if one is not None and getattr(one, "_dynamo_static_indices", None) is not ALL_DIMS:
            one._dynamo_static_indices = ALL_DIMS
    return t


def compiling() -> bool:
    """Whether torch.compile (or export) is tracing now: Dynamo, or AOTAutograd running the
    subclass's ``__torch_dispatch__`` on fake tensors. A fake-tensor mode on the dispatch stack
    counts too: Dynamo runs a graph node (``allow_in_graph``) on fake tensors to learn its
    outputs, where torch 2.11's ``is_compiling()`` is still False (two-GPU run: a planned
    all-gather took the eager carrier there and read a fake tensor's data pointer)."""
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(_FAKE) is not None


def may_defer() -> bool:
    """Whether work may be left pending for a later op to take (a deferred GEMM or gather that
    a fused kernel consumes): in eager, and while AOTAutograd traces the whole graph
    (functionalization on); not while Dynamo runs the ops one at a time on fake tensors and
    inspects each result on its own."""
    return not compiling() or torch._C._get_dispatch_mode(_FUNCTIONAL) is not None


def unusable_here(t: torch.Tensor) -> bool:
    """Whether no op can run on ``t`` now: a functional tensor read after its mode has left the
    stack (AOTAutograd reads a traced graph's outputs that way when it converts them back)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, FunctionalTensor) and torch._C._get_dispatch_mode(_FUNCTIONAL) is None


def eager_only(fn):
    """``fn`` marked so that Dynamo neither compiles its frame nor the frames it calls, and does
    not inline it (a call from traced code is a graph break around the call): ``fn`` always runs
    as plain Python. For the dispatcher's handlers and ``wrap``: after a graph break in a compiled
    function the eager code between its graphs runs with Dynamo's frame hook on, which would
    compile each frame of the dispatch on its own and resume one half-way through ``wrap``, on a
    DTensor without its spec yet. Dynamo's own ``skip`` with a recursive skip, set on the code
    object: no cost per call (``torch._dynamo.disable`` adds a wrapper of ~0.5 us)."""
    frames = torch._C._dynamo.eval_frame
    skip = frames._FrameAction.SKIP
    frames.set_code_exec_strategy(fn.__code__, frames._FrameExecStrategy(skip, skip))
    fn._torchdynamo_disable = True
    return fn


def outside_tracing(fn):
    """``fn`` run with every dispatch mode (fake, functional, proxy) set aside while one is
    active: tensors it makes are real. One C call of overhead otherwise."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _modes_active():
            return fn(*args, **kwargs)
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return run


def traced_constant(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """A real tensor built outside the trace (a plan's index tensor), as a constant of the
    traced program when a trace is running (fake tensors refuse real operands); ``t`` itself
    otherwise. ``torch.tensor(data)`` is how traced code makes constants. ``like``: the tensor
    the constant meets; where it is fake while no mode is on the stack (Dynamo runs a node on
    fake tensors and a subclass's ``__torch_dispatch__`` sees them with its mode set aside), the
    constant is made in its fake mode."""
    mode = getattr(like, "fake_mode", None)
    if not _modes_active() and mode is None:
        return t
    with _disable_current_modes():
        data = t.tolist()  # read as the real tensor it is (a fake mode would refuse it)
    if _modes_active():
        return torch.tensor(data, dtype=t.dtype, device=t.device)
    with mode:
        return torch.tensor(data, dtype=t.dtype, device=t.device)


def keep_on_copy(self, memo=None):
    """``__deepcopy__`` / ``__copy__`` of immutable records (meshes, layouts, specs): the same
    object. Dynamo deep-copies a subclass's flatten metadata for its guard, and a mesh holds
    process groups, which cannot be copied."""
    return self
