"""Deferred GEMMs and gathers: work kept unrun until its data is used, so that the next step
can fuse it with a collective.

An mm/addmm whose output is a pending sum: redistributing it to rows sharded on the summed mesh
axis (or to Replicate) runs the fused GEMM + reduce-scatter (or GEMM + all-reduce) kernel on the
operands instead of the GEMM followed by the collective. Two ranks, ``x [8, 6] (Shard(1),) @
w [6, 4] (Shard(0),)``: the dispatcher defers each rank's ``[8, 3] @ [3, 4]`` product
(:func:`defer`); ``.redistribute([Shard(0)])`` asks :func:`fused_collective`, which on CUDA bf16
gives each rank its ``[4, 4]`` rows from one kernel; any other use of the data runs
:meth:`DeferredGemm.wait` (the GEMM, once). A view of a pending product stays pending
(:class:`DeferredView`: the ``[S * B, H]`` input gradient of a column-parallel linear seen as
``[S, B, H]``), and so does the sum of two pending products of one shape (:class:`DeferredSum`:
the input gradients of wq, wk and wv, which share their input); the fused kernel then runs once
on their operands concatenated along K (``g_q W_q + g_k W_k = [g_q g_k] @ [W_q; W_k]``).

A row all-gather (``[Shard(0)] -> [Replicate()]`` of a 2-d tensor on CUDA): kept unrun
(:func:`defer_gather`) until an mm takes it as its left operand with column-sharded weights,
which then runs the fused all-gather + GEMM (:func:`fused_gather_product`) and receives the
gathered rows on the way; any other use runs :meth:`DeferredGather.wait` (the all-gather).

Under torch.compile the same decisions run at trace time: a deferred product or gather that a
fused kernel takes puts that kernel's custom op (``torch.ops.axedist.gemm_reduce_scatter``,
``all_gather_gemm``, ``gemm_all_reduce``) in the graph; one used otherwise traces the plain
GEMM or the gather's functional collective.

Deferred work is computed before anything writes what it reads (:func:`flush`, given the
tensors an op is about to change), or on first use of its data. What is outstanding, what the
deferred work did and the gather policy are one object, :data:`PENDING` (:class:`PendingWork`).

Nothing here builds a DTensor: callers wrap what these functions return.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..layout import LayoutError
from ..planning.fused import FusedStep, all_reduce_axis, row_gather_axis, row_scatter_axis
from ..spec import DTensorSpec, placements_of
from ..tracing import compiling, may_defer, outside_tracing
from .pins import fused_backend

__all__ = ["DeferredGemm", "DeferredSum", "DeferredGather", "DeferredView", "DeferredTranspose", "DeferredProduct",
           "PendingWork", "PENDING", "version_of", "defer", "defer_gather", "defer_gathers", "defer_sum",
           "defer_product_of_gather", "placeholder", "flush", "pending_product", "pending_gather", "gather_rows",
           "gather_rows_transposed", "transposed", "fused_gemm_stats", "fused_choice", "fused_collective", "fused_gather_product", "reads_any",
           "POLICIES"]

_FLUSH_AT = 64  # outstanding work kept at most; beyond, it is computed
CHANGED_OPERAND = ("a deferred matrix product's operand was changed in place (outside axedist ops, e.g. through "
                   "to_local()) before the product was used; use the product first, or clone the operand's local "
                   "tensor before changing it")
POLICIES = ("auto", "always", "never")  # of every kind of deferral: gathers, GEMMs (the dispatcher), tails


class PendingWork:
    """This process's deferred work not yet consumed, what deferred work did, and the gather policy.

    One object for the whole process (``PENDING``), shared by every thread, unlike the fast
    path's per-thread ``READY`` (ops/state.py), which is one call's output handed from the fast
    path to the ``__torch_dispatch__`` of that same call on the same thread. Deferred work outlives
    the call and the thread that made it: the backward thread (CUDA autograd) defers the input
    gradient ``g @ W``, and the main thread's optimizer then writes ``W`` in place; the write
    must find that product here to compute it first (:meth:`flush`), or its version check raises.
    The threads take turns (the main thread waits inside ``backward()``), so plain list updates
    suffice.

    ``outstanding``: weak references to work not yet run (an op about to write a tensor computes
    what reads it first, so an in-place change never reaches work still waiting for it).
    ``counts``: products deferred, pairs of pending products summed unrun, fused (a fused GEMM +
    collective ran), collectives of a deferred product that ran unfused (GEMM, then the planned
    collective), products computed on first use of their data; "reason": why the last such
    collective was not fused. Gathers deferred, fused into an all-gather + GEMM, and run on their
    own; "gather_reason": why the last was not fused. ``gather_policy``: see :func:`defer_gathers`.
    Decode tails (all-reduces of a row-parallel output, runtime/tails.py) deferred, fused into
    all-reduce + residual add + RMSNorm, and run on their own; ``tail_policy``: see ``tails.defer_tails``.
    ``choices``: per collective ("reduce-scatter", "all-reduce", "all-gather"), the text of the
    last fused choice made for it, kept when the choice is made (:meth:`take_choice`).
    """

    __slots__ = ("outstanding", "counts", "gather_policy", "tail_policy", "choices")

    def __init__(self):
        self.outstanding: list = []
        self.counts = {"deferred": 0, "summed": 0, "fused": 0, "unfused": 0, "materialized": 0, "reason": "",
                       "gathers_deferred": 0, "gathers_fused": 0, "gathers_materialized": 0, "gather_reason": "",
                       "tails_deferred": 0, "tails_fused": 0, "tails_materialized": 0}
        self.gather_policy = "auto"
        self.tail_policy = "auto"  # see tails.defer_tails
        self.choices: dict = {}

    def track(self, pending) -> None:
        """Count ``pending`` as outstanding; past _FLUSH_AT live entries, compute them all."""
        outstanding = self.outstanding
        if len(outstanding) > _FLUSH_AT:
            outstanding[:] = [ref for ref in outstanding if ref() is not None and ref().value is None]
            if len(outstanding) > _FLUSH_AT:
                self.flush()
        outstanding.append(weakref.ref(pending))

    def flush(self, written=None, releasing: bool = False) -> None:
        """Compute outstanding deferred work: all of it, or (``written``: the tensors an op is
        about to change in place) what reads one of them. In a torch.compile trace (fake tensors
        have no storage to compare) a write computes everything outstanding.

        ``releasing``: ``written``'s storage is about to be freed, not changed (FSDP resharding a
        gathered parameter). A product (or a sum inside a sum) whose enclosing sum already ran
        (``DeferredGemm.summed``) then is not run alone: autograd added it into that sum, and only
        a reference left over (torch's multi-grad hook holds a unit's input gradients while FSDP's
        post-backward runs) keeps it outstanding. Run here it would be a second GEMM whose result
        nobody reads (a dp2 x tp2 Llama step on H200s: 18 of 105 GEMMs); used alone later, it
        raises the clear error of :meth:`DeferredGemm.check_unchanged` unless the storage was
        refilled."""
        refs = list(self.outstanding)
        self.outstanding.clear()
        tracing = compiling()
        storages = None if written is None or tracing else {_storage(t) for t in written} - {0}
        for ref in refs:
            pending = ref()
            if pending is None or pending.value is not None:
                continue
            if pending.traced and not tracing:
                continue  # left over from a finished torch.compile trace: its tensors were fake
            if storages is not None and not pending.reads(storages):
                self.outstanding.append(ref)
            elif not (releasing and type(pending) in (DeferredGemm, DeferredSum)
                      and all(term.summed for term in pending.terms())):
                pending.wait()

    def consumed(self, pending) -> None:
        """A fused kernel used the product (or sum, or gather): no flush for it any more (later
        uses of the pending value itself still compute it, checking its operands did not change)."""
        done = pending.nodes() if type(pending) is DeferredSum else (pending,)
        self.outstanding[:] = [ref for ref in self.outstanding if not any(ref() is node for node in done)]

    def policy(self, name: str, value: str | None, caller: str) -> str:
        """Set the policy attribute ``name`` to ``value`` (one of auto / always / never; None keeps
        it) for ``caller`` (``defer_gathers``, ``tails.defer_tails``); returns the policy in force."""
        if value is not None:
            if value not in POLICIES:
                raise ValueError(f"{caller} policy must be auto, always or never, got {value!r}")
            setattr(self, name, value)
        return getattr(self, name)

    def record_choice(self, collective: str, plan, reason: str) -> None:
        """Keep the fused choice just made for ``collective``: the fused kernels' plan (its text
        says which kernel and why), or, without one, why the fused kernel was not used."""
        self.choices[collective] = str(plan) if plan is not None else f"fused GEMM + {collective} not used: {reason}"

    def take_choice(self, collective: str) -> str | None:
        """The fused choice recorded for ``collective`` since the last take (None: none made):
        ``"fused GEMM + reduce-scatter not used: dtype torch.float32 (the fused kernel takes bf16/fp16)"``."""
        return self.choices.pop(collective, None)

    def __repr__(self) -> str:
        live = sum(1 for ref in self.outstanding if ref() is not None and ref().value is None)
        return f"PendingWork({live} outstanding, gathers {self.gather_policy})"


PENDING = PendingWork()


def fused_gemm_stats() -> dict:
    """How deferred products ran in this process: ``{"deferred", "summed", "fused", "unfused",
    "materialized", "reason", ...}`` (reason: why the last row reduce-scatter was not fused;
    the ``gather`` keys count deferred row all-gathers)."""
    return dict(PENDING.counts)


def version_of(t: torch.Tensor) -> int:
    """``t``'s in-place version counter, -1 for an inference tensor (made under
    torch.inference_mode: it keeps none, so an in-place change of it cannot be detected)."""
    return -1 if t.is_inference() else t._version


class DeferredGemm:
    """The local product ``alpha * (a @ b) + beta * bias`` of an mm/addmm, not yet run.

    ``compute()`` runs it as the op would have (with the leading summand dim); ``wait()`` does
    so once and checks that no operand changed in place since the product was deferred.
    """

    __slots__ = ("compute", "a", "b", "bias", "alpha", "beta", "shape", "versions", "value", "traced", "even",
                 "summed", "__weakref__")

    def __init__(self, compute, a, b, bias, alpha, beta, shape, even: bool = True):
        self.compute, self.a, self.b, self.bias = compute, a, b, bias
        self.alpha, self.beta, self.shape, self.value = alpha, beta, tuple(shape), None
        self.even = even  # the operands' local shapes are the same on every rank (fused_choice)
        self.versions = self.current_versions()
        self.traced = compiling()  # deferred while torch.compile traces: its operands are fake
        self.summed = False  # a sum that holds it ran (its product went into the sum's buffer)

    def current_versions(self) -> tuple:
        return tuple(version_of(t) for t in (self.a, self.b, self.bias) if t is not None)

    def check_unchanged(self) -> None:
        """Raises the clear error when an operand was changed in place since the product was
        deferred, or its storage freed (FSDP resharded a gathered parameter it reads)."""
        if any(t is not None and t.numel() and t.untyped_storage().nbytes() == 0
               for t in (self.a, self.b, self.bias)):
            raise LayoutError("a deferred matrix product's operand was freed (FSDP resharded the gathered "
                              "parameter it reads) before the product was used on its own; use the product "
                              "before the module's backward ends")
        if self.current_versions() != self.versions:
            raise LayoutError(CHANGED_OPERAND)

    def wait(self) -> torch.Tensor:
        if self.value is None:
            self.check_unchanged()
            value = self.compute()
            if tuple(value.shape) != self.shape:
                raise LayoutError(f"deferred product: local result {tuple(value.shape)}, expected {self.shape}")
            self.value = value
            self.compute = self.a = self.b = self.bias = None
            PENDING.counts["materialized"] += 1
        return self.value

    def terms(self) -> tuple:
        """The products this pending value sums: itself."""
        return (self,)

    def plain(self) -> bool:
        """Unrun, ``a @ b`` alone (alpha 1, no bias): a term a sum can concatenate."""
        return self.value is None and self.alpha == 1 and (self.bias is None or self.beta == 0)

    def reads(self, storages: set) -> bool:
        return reads_any((self.a, self.b, self.bias), storages)

    def view(self, shape: tuple) -> "DeferredView":
        return DeferredView(self, tuple(shape))

    def __repr__(self) -> str:
        if self.value is not None:
            return f"DeferredGemm({list(self.shape)}: computed)"
        return f"DeferredGemm({list(self.a.shape)} @ {list(self.b.shape)} -> {list(self.shape)}: unrun)"


class DeferredSum:
    """``left + right`` of two pending products (or sums) of one local shape, not yet run: a
    gradient that autograd adds up from several uses of one tensor (``x`` into wq, wk and wv).

    ``wait()`` computes the sum in one buffer: the first product, then each next one added in
    place by its own GEMM (``addmm_``: no product's temporary, no add kernel), or, when a part
    already ran, adds the two values as the add would have. A fused reduce-scatter instead runs
    once on the terms' operands concatenated along K (``sum_i a_i @ b_i = [a_1 .. a_n] @
    [b_1; ..; b_n]``), where that concatenation is no larger than the product (``fused_choice``).
    Two ranks, the input gradient of wq [8 -> 16] and wk [8 -> 4] on 12 rows: each rank's terms
    are ``[12, 8] @ [8, 8]`` and ``[12, 2] @ [2, 8]``; fused, one ``[12, 10] @ [10, 8]`` GEMM +
    reduce-scatter gives each rank its ``[6, 8]`` rows.
    """

    __slots__ = ("left", "right", "shape", "value", "traced", "__weakref__")

    def __init__(self, left, right):
        self.left, self.right, self.shape, self.value = left, right, left.shape, None
        self.traced = left.traced or right.traced

    def wait(self) -> torch.Tensor:
        if self.value is None:
            if self.plain():   # every term an unrun a @ b
                self.value = _accumulated(self.terms())
            else:
                self.value = self.left.wait() + self.right.wait()
            self.left = self.right = None
        return self.value

    def terms(self) -> tuple:
        """The products it sums (itself, once computed: a term that already ran)."""
        return (self,) if self.value is not None else self.left.terms() + self.right.terms()

    def plain(self) -> bool:
        return self.value is None and self.left.plain() and self.right.plain()

    def reads(self, storages: set) -> bool:
        # a part already computed is read as its value (an in-place op on it must not reach the sum)
        return any(reads_any((part.value,), storages) if part.value is not None else part.reads(storages)
                   for part in (self.left, self.right))

    def nodes(self) -> tuple:
        """This sum and every sum and product under it (not yet computed)."""
        if self.value is not None:
            return (self,)
        return (self,) + tuple(n for part in (self.left, self.right)
                               for n in (part.nodes() if type(part) is DeferredSum else (part,)))

    def view(self, shape: tuple) -> "DeferredView":
        return DeferredView(self, tuple(shape))

    def __repr__(self) -> str:
        state = "computed" if self.value is not None else f"{len(self.terms())} products, unrun"
        return f"DeferredSum({list(self.shape)}: {state})"


def _accumulated(terms: tuple) -> torch.Tensor:
    """``sum_i a_i @ b_i`` of unrun plain products (their 2-d local operands) with the leading
    summand dim, as their ``compute()`` gives it: one new buffer, the first product, then each
    next one's GEMM adds into it (beta 1). The terms stay unrun: one may still be used alone."""
    for term in terms:
        term.check_unchanged()
    first = terms[0]
    total = torch.mm(first.a, first.b)
    for term in terms[1:]:
        total.addmm_(term.a, term.b)
    for term in terms:
        term.summed = True
    PENDING.counts["materialized"] += len(terms)
    return total.unsqueeze(0)


def reads_any(tensors, storages: set) -> bool:
    """Whether one of ``tensors`` lives in one of ``storages`` (data pointers)."""
    return any(t is not None and _storage(t) in storages for t in tensors)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def defer(compute, a, b, bias, alpha, beta, local_shape, even: bool = True) -> DeferredGemm:
    """A product kept unrun (counted as outstanding until used); the caller wraps it. ``even``:
    its operands' local shapes are the same on every rank (else it never runs fused)."""
    pending = DeferredGemm(compute, a, b, bias, alpha, beta, local_shape, even)
    PENDING.counts["deferred"] += 1
    PENDING.track(pending)
    return pending


_PLACEHOLDERS: dict = {}


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty stand-in for a deferred product's local tensor (never written): one per dtype and device."""
    key = (dtype, device)
    found = _PLACEHOLDERS.get(key)
    if found is None:
        found = _PLACEHOLDERS[key] = _empty(dtype, device)
    return found


@outside_tracing  # real, also when first asked for inside a torch.compile trace (it is kept)
def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def defer_sum(left, right):
    """The pending ``left + right`` of two pending products, sums or views of them (what an add
    of two such DTensors of one spec gives), or None when it cannot stay pending (a product
    already ran, has a bias or alpha, or the two differ in local shape; then the add runs)."""
    roots = [_product_root(p) for p in (left, right)]
    if any(r is None or not r.plain() for r in roots) or roots[0].shape != roots[1].shape \
            or left.shape != right.shape:
        return None
    total = DeferredSum(*roots)
    PENDING.counts["summed"] += 1
    PENDING.track(total)
    return total if tuple(left.shape) == total.shape else total.view(left.shape)


def _product_root(pending):
    """The product or sum a pending value is (or is a view of); None for anything else."""
    root = pending.root if type(pending) is DeferredView else pending
    return root if type(root) in (DeferredGemm, DeferredSum) else None


def pending_product(pending):
    """The unrun product or sum (:class:`DeferredGemm`, :class:`DeferredSum`) that a DTensor's
    pending value is or views, else None (a gather, an async move, work already run)."""
    root = _product_root(pending) if pending is not None else None
    return root if root is not None and root.value is None else None


def pending_gather(pending) -> "DeferredGather | None":
    """The unrun row all-gather that a DTensor's pending value is or views, else None."""
    root = pending.root if type(pending) is DeferredView else pending
    return root if type(root) is DeferredGather and root.value is None else None


def flush(written=None, releasing: bool = False) -> None:
    """Compute outstanding deferred work: all of it, or what reads one of ``written`` (the
    tensors an op is about to change in place, or whose storage is about to be freed:
    ``releasing``): :meth:`PendingWork.flush` of ``PENDING``."""
    PENDING.flush(written, releasing)


def fused_choice(spec: DTensorSpec, pending, dst: DTensorSpec) -> FusedStep | None:
    """None when ``spec -> dst`` is neither a row reduce-scatter nor an all-reduce of a pending
    product, sum or view of one (or it already ran); otherwise whether the fused kernel runs,
    and why not when it does not."""
    root = pending_product(pending)
    if root is None:
        return None
    axis, collective = row_scatter_axis(spec, dst), "reduce-scatter"
    if axis is None:
        axis, collective = all_reduce_axis(spec, dst), "all-reduce"
    if axis is None:
        return None
    terms = root.terms()

    def step(fused, reason, plan=None):
        return FusedStep(axis, fused, reason, plan, collective, len(terms))

    if any(t.value is not None for t in terms):
        return step(False, "a summed product already ran (it was used on its own)")
    a, b = _operands(terms, concatenated=False)
    if len(terms) > 1 and a.shape[-1] > b.shape[-1]:
        # (a Llama MLP's input gradient: [M, 2 x FFN / TP] against [M, dim])
        return step(False, f"{len(terms)} summed products whose operands concatenated along K ({a.shape[-1]}) "
                           f"would outgrow their product ({b.shape[-1]} columns): their GEMMs accumulate in one "
                           "buffer, then the collective runs once")
    if not a.is_cuda:
        return step(False, f"operands on {a.device.type} (the fused kernel is CUDA-only)")
    if a.dtype not in (torch.bfloat16, torch.float16):
        return step(False, f"dtype {a.dtype} (the fused kernel takes bf16/fp16)")
    if not all(t.even for t in terms):
        # each rank's kernel choice follows its local shapes: ranks would choose apart
        return step(False, "uneven operands (their local shapes differ by rank)")
    mesh = spec.mesh
    group = mesh.group(axis)
    if dist.get_rank(group) != mesh.coordinates()[axis]:
        return step(False, f"process-group order differs from mesh axis {axis}'s order")
    from ..collectives import plan_gemm_all_reduce, plan_gemm_reduce_scatter

    planner = plan_gemm_reduce_scatter if collective == "reduce-scatter" else plan_gemm_all_reduce
    try:
        gemm = planner(a, b, group, backend=fused_backend())
    except ValueError as e:
        return step(False, str(e))
    return step(gemm.backend != "torch", gemm.reason, gemm)


def _operands(terms: tuple, concatenated: bool) -> tuple:
    """``(a, b)`` whose product is the sum of ``terms``' products: a term's own operands, or
    the terms' operands concatenated along K (``concatenated``; else shape-only stand-ins of
    them, for planning: no copy)."""
    if len(terms) == 1:
        return terms[0].a, terms[0].b
    first, k = terms[0], sum(t.a.shape[-1] for t in terms)
    if concatenated:
        return torch.cat([t.a for t in terms], dim=-1), torch.cat([t.b for t in terms], dim=0)
    one = torch.empty((), dtype=first.a.dtype, device=first.a.device)
    return one.expand(*first.a.shape[:-1], k), one.expand(k, first.b.shape[-1])


def fused_collective(spec: DTensorSpec, pending, dst: DTensorSpec) -> torch.Tensor | None:
    """This rank's local tensor of ``spec -> dst`` by ``gemm_reduce_scatter`` (rows) or
    ``gemm_all_reduce``, or None (then the caller takes the unfused path: the GEMM, then the
    planned collective). ``pending``: a product, a sum of products, or a view of either (the
    result is viewed as ``dst``'s local shape)."""
    choice = fused_choice(spec, pending, dst)
    if choice is None:
        return None
    PENDING.record_choice(choice.collective, choice.gemm, choice.reason)
    if not choice.fused:
        PENDING.counts["unfused"] += 1
        PENDING.counts["reason"] = choice.reason
        return None
    from ..collectives import gemm_all_reduce, gemm_reduce_scatter

    root = pending_product(pending)
    terms = root.terms()
    if any(t.current_versions() != t.versions for t in terms):
        root.wait()  # raises the clear error
    mesh = spec.mesh
    group = mesh.group(choice.axis)
    a, b = _operands(terms, concatenated=True)
    if choice.collective == "reduce-scatter":
        out = gemm_reduce_scatter(a, b, group, backend=fused_backend())
    else:
        out = gemm_all_reduce(a, b, group, backend=fused_backend())
    term = terms[0]
    if len(terms) == 1 and term.alpha != 1:
        out.mul_(term.alpha)
    bias = term.bias if len(terms) == 1 else None
    if bias is not None and term.beta != 0:
        if choice.collective == "reduce-scatter" and bias.dim() == 2 and bias.shape[0] != 1:
            rows = out.shape[0]  # a whole [M, n] bias: this rank's rows
            bias = bias.narrow(0, mesh.coordinates()[choice.axis] * rows, rows)
        out.add_(bias, alpha=term.beta)
    shape = pending.shape[1:]  # the pending value's local shape, without its summand dim
    if choice.collective == "reduce-scatter":
        shape = (shape[0] // dist.get_world_size(group),) + tuple(shape[1:])
    PENDING.counts["fused"] += 1
    PENDING.counts["reason"] = ""
    PENDING.consumed(root)
    return out if tuple(out.shape) == shape else out.view(shape)


class DeferredGather:
    """A row all-gather ``src -> dst`` of this rank's ``local`` rows, not yet run (the pending
    value of the gathered DTensor). ``wait()`` runs it once, after checking that ``local`` did
    not change in place meanwhile; a fused all-gather + GEMM sets ``value`` instead."""

    __slots__ = ("local", "src", "dst", "axis", "version", "value", "traced", "__weakref__")

    def __init__(self, local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, axis: str):
        self.local, self.src, self.dst, self.axis, self.value = local, src, dst, axis, None
        self.version = version_of(local)
        self.traced = compiling()

    def changed(self) -> bool:
        return version_of(self.local) != self.version

    def wait(self) -> torch.Tensor:
        if self.value is None:
            if self.changed():
                raise LayoutError("a deferred all-gather's rows were changed in place (outside axedist ops) "
                                  "before the gathered tensor was used; use it first, or clone the rows")
            from .executor import redistribute_local
            self.value = redistribute_local(self.local, self.src, self.dst)
            self.local = None
            PENDING.counts["gathers_materialized"] += 1
        return self.value

    def reads(self, storages: set) -> bool:
        return reads_any((self.local,), storages)

    def __repr__(self) -> str:
        state = "computed" if self.value is not None else "unrun"
        return f"DeferredGather({self.src} -> {self.dst} over {self.axis}: {state})"

    def view(self, shape: tuple) -> "DeferredView":
        return DeferredView(self, tuple(shape))


class DeferredView:
    """A view of deferred work's value: a gather's ``[S, B, H]`` seen as ``[S * B, H]`` (what
    linear hands mm), or a product's ``[S * B, H]`` seen as ``[S, B, H]`` (the input gradient
    that linear's backward hands back). It shares its ``root``: whichever use runs the root
    (fused or not) serves every view. ``shape``: the view's local shape."""

    __slots__ = ("root", "shape")

    def __init__(self, root, shape: tuple):
        self.root, self.shape = root, shape

    @property
    def value(self):
        return None if self.root.value is None else self.root.value.view(self.shape)

    @property
    def traced(self) -> bool:
        return self.root.traced

    def wait(self) -> torch.Tensor:
        return self.root.wait().view(self.shape)

    def view(self, shape: tuple) -> "DeferredView":
        return DeferredView(self.root, tuple(shape))

    def __repr__(self) -> str:
        return f"DeferredView({type(self.root).__name__} as {list(self.shape)})"


class DeferredTranspose:
    """The transpose of pending work, not yet run: a deferred gather's rows matrix ``[M, H]``
    seen as ``[H, M]`` (torch's ``mm`` backward asks for ``grad.t()`` of a linear's gathered
    output gradient before it multiplies that gradient by the weights), or of a
    :class:`DeferredProduct` made from one. Nothing runs until the value is used; the transpose
    of a transpose is the work itself (:func:`transposed`)."""

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    @property
    def value(self):
        inner = self.inner.value
        return None if inner is None else inner.t()

    @property
    def traced(self) -> bool:
        return self.inner.traced

    def wait(self) -> torch.Tensor:
        return self.inner.wait().t()

    def __repr__(self) -> str:
        return f"DeferredTranspose({self.inner!r})"


def transposed(pending):
    """``pending`` transposed, unrun: a :class:`DeferredTranspose`, or the work inside one."""
    return pending.inner if type(pending) is DeferredTranspose else DeferredTranspose(pending)


def gather_rows(pending) -> bool:
    """Whether ``pending`` is an unrun deferred gather, or a view of one, whose value is a 2-d rows matrix."""
    gather = pending_gather(pending)
    return gather is not None and len(pending.shape if type(pending) is DeferredView else gather.local.shape) == 2


def gather_rows_transposed(pending) -> bool:
    """Whether ``pending`` is the transpose of an unrun deferred gather's 2-d rows matrix."""
    return type(pending) is DeferredTranspose and gather_rows(pending.inner)


class DeferredProduct:
    """``a @ b`` where ``a`` is pending (the transposed rows of a deferred gather: the weight
    gradient ``grad.t() @ input`` that torch's ``mm`` backward computes before the input gradient
    ``grad @ W``), not yet run: the input gradient's ``mm`` can then run the gather fused with
    its GEMM, and this product reads the gathered rows it leaves (or runs the gather on its own,
    when nothing fused it). Computed on first use; ``b`` must not change in place before that."""

    __slots__ = ("a", "b", "shape", "version", "value", "traced", "__weakref__")

    def __init__(self, a, b: torch.Tensor, shape: tuple):
        self.a, self.b, self.shape, self.value = a, b, tuple(shape), None
        self.version = version_of(b)
        self.traced = compiling()

    def wait(self) -> torch.Tensor:
        if self.value is None:
            if version_of(self.b) != self.version:
                raise LayoutError(CHANGED_OPERAND)
            value = torch.mm(self.a.wait(), self.b)
            if tuple(value.shape) != self.shape:
                raise LayoutError(f"deferred product: local result {tuple(value.shape)}, expected {self.shape}")
            self.value, self.a, self.b = value, None, None
        return self.value

    def reads(self, storages: set) -> bool:
        gather = pending_gather(self.a.inner) if self.a is not None else None
        return reads_any((self.b, gather.local if gather is not None else None), storages)

    def __repr__(self) -> str:
        state = "computed" if self.value is not None else f"{self.a!r} @ {list(self.b.shape)}: unrun"
        return f"DeferredProduct({list(self.shape)}: {state})"


def defer_product_of_gather(a, b: torch.Tensor, shape: tuple) -> DeferredProduct:
    """``a @ b`` kept unrun (``a``: see :func:`gather_rows_transposed`), counted as outstanding."""
    pending = DeferredProduct(a, b, shape)
    PENDING.track(pending)
    return pending


def defer_gathers(policy: str | None = None) -> str:
    """When row all-gathers are deferred: ``"auto"`` only where the fused kernel can consume
    them (CUDA, bf16/fp16), ``"always"`` (tests of the deferral on CPU), ``"never"``. Returns
    the policy in force (after setting it, when given)."""
    return PENDING.policy("gather_policy", policy, "defer_gathers")


def defer_gather(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> DeferredGather | None:
    """A deferred row all-gather when ``src -> dst`` is one of a 2-d CUDA bf16/fp16 tensor (what
    a fused all-gather + GEMM can consume), else None (the caller moves the data now)."""
    policy = PENDING.gather_policy
    if policy == "never" or not may_defer() or policy == "auto" and (
            not local.is_cuda or local.dtype not in (torch.bfloat16, torch.float16)):
        return None
    axis = row_gather_axis(src, dst)
    if axis is None:
        return None
    pending = DeferredGather(local, src, dst, axis)
    PENDING.counts["gathers_deferred"] += 1
    PENDING.track(pending)
    return pending


def fused_gather_product(pending, b: torch.Tensor, b_spec: DTensorSpec,
                         out_shape: tuple) -> torch.Tensor | None:
    """The local product of a deferred gather's 2-d value (``pending``: the DeferredGather or a
    DeferredView of it as rows ``[M, K]``) and ``b`` (this rank's ``[K, N_local]``, ``b_spec`` its
    spec) by one fused all-gather + GEMM, which also fills the gather's value; None when the
    kernel does not run (``b`` not column-sharded on the gathered axis, other local shapes, the
    kernel plan's choice: then the caller gathers and multiplies)."""
    root = pending.root if type(pending) is DeferredView else pending
    if root.value is not None or root.changed():
        return None
    mesh, axis = root.src.mesh, root.axis
    local = root.local.reshape(-1, root.local.shape[-1])
    world = dist.get_world_size(mesh.group(axis))
    # the gather's local value: this rank's dim 0 times the group (no other axis splits dim 0)
    gathered_shape = (root.local.shape[0] * world, *root.local.shape[1:])
    rows = local.shape[0] * world
    if type(pending) is DeferredView and tuple(pending.shape) != (rows, local.shape[1]):
        return _unfused_gather(f"a view {pending.shape} of the gathered rows is not their matrix")
    try:
        placements = placements_of(b_spec)
    except LayoutError:
        return None
    columns = placements[mesh.axis_names.index(axis)]
    if (b_spec.reduce_op is not None or len(b_spec.shape) != 2 or b_spec.padded != b_spec.shape
            or not (isinstance(columns, Shard) and columns.dim % 2 == 1)
            or any(isinstance(p, Shard) and p.dim % 2 == 0 for p in placements)):
        # (uneven columns: each rank's N differs, so would its choice of kernel)
        return _unfused_gather(f"weights {b_spec} are not evenly column-sharded on {axis} with whole rows")
    group = mesh.group(axis)
    if tuple(out_shape) != (rows, b.shape[1]) or dist.get_rank(group) != mesh.coordinates()[axis]:
        return _unfused_gather("local shapes or process-group order differ from the kernel's")
    from ..collectives import all_gather_gemm, plan_all_gather_gemm

    backend = fused_backend()
    try:
        plan = plan_all_gather_gemm(local, b, group, backend=backend)
    except ValueError as e:
        return _unfused_gather(str(e))
    PENDING.record_choice("all-gather", plan, plan.reason)
    if plan.backend == "torch":
        PENDING.counts["gather_reason"] = plan.reason
        return None
    gathered = torch.empty(gathered_shape, dtype=local.dtype, device=local.device)
    out = all_gather_gemm(local, b, group, backend=backend, gathered=gathered.view(rows, local.shape[1]))
    root.value, root.local = gathered, None
    PENDING.counts["gathers_fused"] += 1
    PENDING.counts["gather_reason"] = ""
    PENDING.consumed(root)
    return out


def _unfused_gather(reason: str) -> None:
    """None, after keeping why a deferred gather does not run fused (its count and its choice)."""
    PENDING.counts["gather_reason"] = reason
    PENDING.record_choice("all-gather", None, reason)
