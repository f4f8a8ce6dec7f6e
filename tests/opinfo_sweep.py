"""torch's OpInfo database through axedist DTensors: each op's sample inputs with every tensor
argument laid out Replicate, Shard(0), Shard(-1) and mixes, forward values and gradients against
the plain op.

One op on every rank of a mesh (``sweep_op``, run by ``run_on_ranks``) ends in one outcome:

* ``pass``: every sample's outputs (shape, dtype, values) and input gradients match the plain op;
* ``clear error``: a sample raised axedist's own error (``DispatchError`` / ``LayoutError``:
  it names the op and what is unsupported), and none went wrong;
* ``other error``: a sample raised anything else (an internal ``ZeroDivisionError``, torch's
  kernel refusing the local tensors a rule made, ...): a bug to fix or to turn into a clear error;
* ``silent wrong``: some output or gradient differs from the plain op's (value, shape, dtype):
  the one outcome that must never happen.

Samples on which the plain op itself raises are skipped; a sample whose plain backward raises
(``linalg.eig``: a loss that depends on the eigenvectors' phase is ill-defined) is compared forward only. A random op (one that draws from torch's
generator: its RNG state moves) and the ``empty`` family (uninitialized values) are compared by
shape and dtype only. ``fallback`` counts the aten
calls that went through the gather fallback (``DTensor.dispatcher.cache_info()["fallbacks"]``),
and ``fallback_ops`` names them. ``tests/test_ops_opinfo.py`` runs ``FAST_OPS`` in the CPU suite;
``benchmarks/sweep_opinfo.py`` runs the whole database and writes the table.

    >>> run_on_ranks(sweep_op, 2, args=("2", "cat"))[0]
    {'op': 'cat', 'outcome': 'pass', 'samples': 12, 'runs': 36, 'fallback': 0, ...}
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

import axedist as ax
from axedist.dtensor import distribute, DTensor
from axedist.layout import LayoutError
from axedist.mesh import DeviceMesh
from axedist.ops import DispatchError
from axedist.placements import Replicate, Shard

__all__ = ["FAST_OPS", "op_entries", "op_key", "same_samples", "sweep_op", "sweep_ops", "summarize", "OUTCOMES",
           "UNINITIALIZED"]

OUTCOMES = ("pass", "clear error", "other error", "silent wrong")
# ops whose values are uninitialized memory: compared by shape and dtype only
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})
MESHES = {"2": ((2,), ("gpuid",)), "2x2": ((2, 2), ("x", "y"))}
CLEAR_ERRORS = (DispatchError, LayoutError)

# Representative ops for the CPU suite: pointwise, reductions, norms, matmuls, views, joins,
# indexing, the in-place shape changers torch's kernels call, attention, losses, masked ops.
FAST_OPS = (
    "add", "mul", "div.no_rounding_mode", "pow", "exp", "tanh", "sigmoid", "nn.functional.gelu",
    "nn.functional.silu", "where", "masked_fill", "clamp", "sum", "mean", "amax", "var", "softmax",
    "log_softmax", "nn.functional.layer_norm", "nn.functional.rms_norm", "mm", "bmm", "addmm", "matmul",
    "nn.functional.linear", "einsum", "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze",
    "flatten", "expand", "cat", "stack", "index_select", "gather", "topk", "max.reduction_with_dim",
    "tril", "triu", "cumsum", "nn.functional.embedding", "nn.functional.cross_entropy",
    "nn.functional.dropout", "quantile", "stft", "resize_", "masked.sum", "masked.softmax",
    "nn.functional.scaled_dot_product_attention", "linalg.vector_norm", "nn.functional.group_norm",
    "tensor_split", "short",
)


def op_key(op) -> str:
    """``name`` or ``name.variant``: ``max.reduction_with_dim``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_entries() -> dict:
    """``{key: OpInfo}`` of torch's op database, the ops with a float32 or float64 CPU kernel."""
    from torch.testing._internal.common_methods_invocations import op_db

    out = {}
    for op in op_db:
        dtypes = op.supported_dtypes("cpu")
        if torch.float32 in dtypes or torch.float64 in dtypes:
            out[op_key(op)] = op
    return out


# -- the same samples on every rank ---------------------------------------------------------------

# Non-tensor arguments shown by value in a sample's description; anything else by its type name
# (a function's or an object's repr carries its address, which differs per rank).
_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size)


def _describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}:{value.stride()}:{value.dtype}:{value.requires_grad}"
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return f"{type(value).__name__}({', '.join(_describe_value(v) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return repr(value)
    return repr(value) if isinstance(value, _PLAIN) else type(value).__name__


def _describe(sample) -> str:
    """A sample's structure, the same text on every rank for the same sample: its tensors'
    shapes, strides and dtypes, its other arguments' values (not the tensors' values)."""
    return _describe_value([sample.input, sample.args, sample.kwargs])


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a.eq(b) | (a.ne(a) & b.ne(b))).all())


def same_samples(samples: list, limit: int) -> list:
    """Up to ``limit`` of ``samples`` (this rank's list from ``op.sample_inputs``), spread over
    the list as rank 0 listed it: the same samples in the same order on every rank, their
    tensors holding rank 0's values.

    torch's sample functions may iterate a set (``sample_inputs_meshgrid``: ``{'xy', 'ij'}``),
    whose order follows the string hash seed, which differs per process: rank 0 may list
    ``(3,) () indexing='ij'`` where rank 1 lists ``indexing='xy'``, with the random values drawn
    in each rank's order. Every rank then runs another op and the ranks disagree or hang. Raises
    ``RuntimeError`` (on every rank) when the ranks' samples are not the same set, or hold other
    values that cannot be overwritten."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _spread(samples, limit)
    descriptions = [_describe(s) for s in samples]
    listed = [None] * dist.get_world_size()
    dist.all_gather_object(listed, descriptions)
    first = listed[0]
    if any(sorted(other) != sorted(first) for other in listed):
        raise RuntimeError("the ranks' sample_inputs differ beyond their order")
    by_description: dict = {}
    for description, sample in zip(descriptions, samples):
        by_description.setdefault(description, []).append(sample)
    chosen = _spread([by_description[d].pop(0) for d in first], limit)
    found: list = []
    _tensors([[s.input, s.args, s.kwargs] for s in chosen], found)
    values = [t.detach() for t in found] if dist.get_rank() == 0 else None
    sent = [values]
    dist.broadcast_object_list(sent, src=0)
    failed = torch.zeros((), dtype=torch.int32)
    with torch.no_grad():
        for mine, theirs in zip(found, sent[0]):
            if not _same_values(mine, theirs):
                try:
                    mine.copy_(theirs)
                except RuntimeError:  # an expanded tensor (elements sharing memory) takes no copy
                    failed.fill_(1)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # so that every rank raises, or none
    if failed.item():
        raise RuntimeError("the ranks' sample_inputs hold other values and cannot take rank 0's")
    return chosen


# -- placements of a sample's tensors -----------------------------------------------------------

def _plans(mesh: DeviceMesh) -> list:
    """Per plan, the placements of tensor ``i`` of ``n`` (a 0-dim tensor is always replicated)."""
    R, S0, S1 = Replicate(), Shard(0), Shard(-1)
    if mesh.ndim == 1:
        return [lambda i, n: (R,), lambda i, n: (S0,), lambda i, n: (S1,),
                lambda i, n: (S0,) if i == 0 else (R,), lambda i, n: (R,) if i == 0 else (S1,),
                lambda i, n: (S0,) if i % 2 == 0 else (S1,)]
    return [lambda i, n: (R, R), lambda i, n: (S0, S1), lambda i, n: (S1, S0), lambda i, n: (S0, S0),
            lambda i, n: (S0, R) if i == 0 else (R, S1), lambda i, n: (R, S0) if i % 2 == 0 else (S1, R)]


def _tensors(value, found: list) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, found)


def _swap(value, table: dict):
    if isinstance(value, torch.Tensor):
        return table.get(id(value), value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_swap(v, table) for v in value)
    if isinstance(value, dict):
        return {k: _swap(v, table) for k, v in value.items()}
    return value


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


class _Side:
    """Whose DTensors a sample runs on: axedist's (``torch_side=False``) or torch's DTensor, the
    same placements on a mesh of the same shape (torch's side is the reference the issue's
    goal names: axedist passes every op torch's DTensor passes)."""

    def __init__(self, mesh: DeviceMesh, torch_side: bool):
        self.mesh, self.torch_side = mesh, torch_side
        self.clear_errors = () if torch_side else CLEAR_ERRORS
        if torch_side:
            from torch.distributed.tensor import DTensor as TorchDTensor, distribute_tensor
            self.dtensor_type, self.torch_mesh, self.distribute = TorchDTensor, mesh.to_torch(), distribute_tensor
        else:
            self.dtensor_type = DTensor

    def place(self, t: torch.Tensor, placements):
        if t.dim() == 0:
            placements = (Replicate(),) * self.mesh.ndim
        if self.torch_side:
            placements = [Shard(p.dim % t.dim()) if isinstance(p, Shard) else p for p in placements]
            dt = self.distribute(t.detach(), self.torch_mesh, placements)
        else:
            dt = distribute(t.detach(), self.mesh, list(placements), src_rank=None)
        return dt.requires_grad_(t.requires_grad)

    def replicated(self, t: torch.Tensor):
        """``t`` (the same on every rank) replicated, without communication."""
        if self.torch_side:
            return self.dtensor_type.from_local(t, self.torch_mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return self.place(t, (Replicate(),) * self.mesh.ndim)

    def agree(self, ok: bool) -> bool:
        """Did every rank get here with ``ok``? axedist raises its errors on every rank alike; torch's
        DTensor may raise on one rank only, whose peers would then wait in the next collective."""
        if not self.torch_side:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


# -- comparing -----------------------------------------------------------------------------------

def _tolerance(dtype) -> dict:
    if dtype in (torch.float64, torch.complex128):
        return dict(rtol=1e-7, atol=1e-7)
    return dict(rtol=1e-4, atol=1e-4)


def _whole(value):
    if type(value) is not torch.Tensor and hasattr(value, "full_tensor"):  # axedist's or torch's DTensor
        return value.full_tensor()
    return value


def _compare(got, want, what: str, values: bool) -> str | None:
    """None when ``got`` (from DTensors) is ``want`` (plain), else what differs."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{what}: {type(got).__name__} where the plain op gives a tensor"
        if tuple(got.shape) != tuple(want.shape):
            return f"{what}: shape {tuple(got.shape)}, plain {tuple(want.shape)}"
        if got.dtype != want.dtype:
            return f"{what}: dtype {got.dtype}, plain {want.dtype}"
        if not values:
            return None
        whole = _whole(got).detach()
        try:
            torch.testing.assert_close(whole, want.detach(), equal_nan=True, check_stride=False,
                                       **_tolerance(want.dtype))
        except AssertionError as error:
            return f"{what}: values differ: {str(error).splitlines()[-3:]}"
        return None
    if isinstance(got, torch.Tensor) and not isinstance(want, torch.Tensor):
        got = _whole(got)
        if got.dim() == 0 and isinstance(want, (int, float, bool, complex)):
            got = got.item()
    if values and got != want and not (isinstance(want, float) and want != want and got != got):
        return f"{what}: {got!r}, plain {want!r}"
    return None


def _owning(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a leaf copy of its values with a storage of its own when ``t`` is a view."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(t.requires_grad)


def _swap_sample(sample, table: dict):
    """The sample with its tensors replaced per ``table`` (``id -> tensor``)."""
    return type(sample)(_swap(sample.input, table), args=_swap(sample.args, table), kwargs=_swap(sample.kwargs, table))


def _is_random(op, sample) -> bool:
    """Does the plain op draw from torch's generator (its state moves)?"""
    state = torch.get_rng_state()
    try:
        op(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        return False
    return not torch.equal(state, torch.get_rng_state())


# -- one sample, one op ---------------------------------------------------------------------------

def _run_sample(op, sample, side: _Side, placements_of, dtype) -> tuple[str, str]:
    """``(kind, detail)``: kind ``pass``, ``skip`` (the plain op raised), ``wrong``, ``clear`` or ``other``."""
    found: list = []
    _tensors([sample.input, sample.args, sample.kwargs], found)
    found = list({id(t): t for t in found}.values())
    if any(t.layout is not torch.strided for t in found):
        return "skip", "a sparse input"
    # A DTensor holds its values, not a storage: a plain input that is a view into a larger
    # storage (as_strided's partial views) is compared as the tensor of its values it stands for
    owned = {id(t): _owning(t) for t in found}
    sample = _swap_sample(sample, owned)
    found = [owned[id(t)] for t in found]
    random = op.name in UNINITIALIZED or _is_random(op, sample)
    torch.manual_seed(0)
    try:
        want = op(sample.input, *sample.args, **sample.kwargs)
    except Exception as error:
        return "skip", f"plain op raised {type(error).__name__}"
    placements = [placements_of(i, len(found)) for i in range(len(found))]
    table = {}
    try:
        for t, p in zip(found, placements):
            table[id(t)] = side.place(t, p)
    except side.clear_errors as error:
        return "clear", f"distribute: {type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - torch's side: its distribute refusing a placement
        return "other", f"distribute: {type(error).__name__}: {_first_line(error)}"
    where = " ".join(f"{tuple(t.shape)}{list(p) if t.dim() else ''}" for t, p in zip(found, placements))
    args = _swap(sample.args, table)
    kwargs = _swap(sample.kwargs, table)
    torch.manual_seed(0)
    try:
        got = op(_swap(sample.input, table), *args, **kwargs)
    except side.clear_errors as error:
        got, failed = None, ("clear", f"{where}: {type(error).__name__}: {_first_line(error)}")
    except Exception as error:  # noqa: BLE001 - every other failure is reported, not raised
        got, failed = None, ("other", f"{where}: {type(error).__name__}: {_first_line(error)}")
    else:
        failed = None
    if not side.agree(failed is None):
        return failed or ("other", f"{where}: the op raised on another rank")
    try:
        wants, gots = _flat(want), _flat(got)
        if len(wants) != len(gots):
            return "wrong", f"{where}: {len(gots)} outputs, plain {len(wants)}"
        for k, (g, w) in enumerate(zip(gots, wants)):
            problem = _compare(g, w, f"{where}: output {k}", values=not random)
            if problem:
                return "wrong", problem
        if random or not op.supports_autograd:
            return "pass", ""
        return _compare_gradients(found, table, wants, gots, where, side)
    except side.clear_errors as error:
        return "clear", f"{where}: {type(error).__name__}: {_first_line(error)}"
    except Exception as error:  # noqa: BLE001 - every other failure is reported, not raised
        return "other", f"{where}: {type(error).__name__}: {_first_line(error)}"


def _first_line(error) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


def _compare_gradients(found, table, wants, gots, where, side: _Side) -> tuple[str, str]:
    leaves = [t for t in found if t.requires_grad]
    pairs = [(w, g) for w, g in zip(wants, gots)
             if isinstance(w, torch.Tensor) and w.requires_grad and (w.is_floating_point() or w.is_complex())]
    if not leaves or not pairs:
        return "pass", ""
    g = torch.Generator().manual_seed(7)
    ups = [torch.randn(w.shape, dtype=w.dtype, generator=g) for w, _ in pairs]
    try:
        want_grads = torch.autograd.grad([w for w, _ in pairs], leaves, ups, allow_unused=True)
    except RuntimeError:
        want_grads = None  # the plain backward raises (linalg.eig's phase-dependent loss): compared forward only
    if not side.agree(want_grads is not None):
        return "pass", ""
    up_dts = [side.replicated(u) for u in ups]
    outs = [gt for _, gt in pairs]
    if not all(isinstance(o, side.dtensor_type) and o.requires_grad for o in outs):
        return "wrong", f"{where}: an output does not require grad"
    error = None
    try:
        got_grads = torch.autograd.grad(outs, [table[id(t)] for t in leaves], up_dts, allow_unused=True)
    except Exception as raised:  # noqa: BLE001 - raised again below (the caller reports it)
        error = raised
    if not side.agree(error is None):
        if error is not None:
            raise error
        return "other", f"{where}: the backward raised on another rank"
    for i, (gw, gg) in enumerate(zip(want_grads, got_grads)):
        if gw is None or gg is None:
            if (gw is None) != (gg is None) and not (gw is not None and not gw.any()):
                return "wrong", f"{where}: gradient {i} is {'None' if gg is None else 'a tensor'}, plain " \
                                f"{'None' if gw is None else 'a tensor'}"
            continue
        problem = _compare(gg, gw, f"{where}: gradient of input {i}", values=True)
        if problem:
            return "wrong", problem
    return "pass", ""


def _spread(samples: list, limit: int) -> list:
    """``limit`` samples spread over the list (the first ones are often the smallest)."""
    if len(samples) <= limit:
        return samples
    step = len(samples) / limit
    return [samples[int(i * step)] for i in range(limit)]


def _over_budget(start: float, budget_s: float) -> bool:
    """Has any rank spent ``budget_s`` since ``start``? The same answer on every rank (each rank's
    own clock would let one rank start a sample the others skip)."""
    over = torch.tensor([time.monotonic() - start > budget_s], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
    return bool(over.item())


def sweep_op(rank, world, mesh_name: str, key: str, dtypes=("float64", "float32"), max_samples=(8, 3),
             plans_per_sample: int = 3, budget_s: float = 60.0, torch_side: bool = False) -> dict:
    """One op of the database on this rank's mesh: its outcome and counts (the same on every rank).

    Per dtype, up to ``max_samples`` samples (spread over the op's list); each sample under
    ``plans_per_sample`` placement plans: all replicated, then the others in turn (so the op's
    samples together meet every plan). Stops starting new samples after ``budget_s`` seconds.
    ``torch_side``: each run again on torch's DTensor (``torch_outcome``: pass, or fail with its
    first problem in ``torch_detail``)."""
    warnings.simplefilter("ignore")
    op = op_entries()[key]
    mesh = DeviceMesh("cpu", *MESHES[mesh_name])
    plans = _plans(mesh)
    ours, theirs = _Side(mesh, False), (_Side(mesh, True) if torch_side else None)
    torch_kinds: dict = {}
    torch_detail = ""
    fallbacks = DTensor.dispatcher.cache_info()["fallbacks"]
    DTensor.dispatcher.forget_fallbacks()
    start = time.monotonic()
    kinds: dict = {}
    details: dict = {}
    samples = runs = turn = 0
    for dtype_name, limit in zip(dtypes, max_samples):
        dtype = getattr(torch, dtype_name)
        if not limit or dtype not in op.supported_dtypes("cpu"):
            continue
        torch.manual_seed(1234)
        try:
            listed = list(op.sample_inputs("cpu", dtype, requires_grad=op.supports_autograd))
        except Exception as error:  # noqa: BLE001
            details.setdefault("skip", f"sample_inputs raised {type(error).__name__}")
            listed = []
        try:  # collective: every rank calls it, also where sample_inputs raised
            listed = same_samples(listed, limit)
        except RuntimeError as error:
            details.setdefault("skip", f"{dtype_name} {error}")
            continue
        for sample in listed:
            if _over_budget(start, budget_s):
                break
            samples += 1
            chosen = [plans[0]] + [plans[1 + (turn + j) % (len(plans) - 1)] for j in range(plans_per_sample - 1)]
            turn += plans_per_sample - 1
            for plan in chosen:
                kind, detail = _run_sample(op, sample, ours, plan, dtype)
                runs += kind != "skip"
                kinds[kind] = kinds.get(kind, 0) + 1
                if kind != "pass":
                    details.setdefault(kind, f"{dtype_name} {detail}")
                if theirs is not None and kind != "skip":
                    fallen = DTensor.dispatcher.cache_info()["fallbacks"]  # (torch's side adds none of ours)
                    their_kind, their_detail = _run_sample(op, sample, theirs, plan, dtype)
                    assert DTensor.dispatcher.cache_info()["fallbacks"] == fallen
                    torch_kinds[their_kind] = torch_kinds.get(their_kind, 0) + 1
                    if their_kind != "pass" and not torch_detail:
                        torch_detail = f"{dtype_name} {their_kind}: {their_detail}"
    fell_back = DTensor.dispatcher.cache_info()["fallbacks"] - fallbacks
    outcome = ("silent wrong" if kinds.get("wrong") else "other error" if kinds.get("other")
               else "clear error" if kinds.get("clear") else "pass" if kinds.get("pass") else "skipped")
    torch_outcome = None if theirs is None else (
        "pass" if torch_kinds and set(torch_kinds) <= {"pass", "skip"} and torch_kinds.get("pass") else
        "fail" if torch_kinds else "skipped")
    return {"op": key, "outcome": outcome, "samples": samples, "runs": runs, "kinds": kinds,
            "torch_outcome": torch_outcome, "torch_detail": torch_detail,
            "fallback": fell_back, "fallback_ops": sorted(str(f) for f in DTensor.dispatcher.fallback_ops()),
            "details": details, "seconds": round(time.monotonic() - start, 2)}


def sweep_ops(rank, world, mesh_name: str, keys, dtypes=("float64", "float32"), max_samples=(8, 3),
              torch_side: bool = False) -> list:
    """``sweep_op`` of each key in turn, on the same ranks (the CPU suite's subset in one call)."""
    return [sweep_op(rank, world, mesh_name, key, dtypes, max_samples, torch_side=torch_side) for key in keys]


def summarize(results: list) -> dict:
    """Counts per outcome, and of passing ops that went through the gather fallback."""
    counts = {name: 0 for name in OUTCOMES + ("skipped", "hang or crash")}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    counts["pass through the fallback"] = sum(1 for r in results if r["outcome"] == "pass" and r["fallback"])
    counts["ops"] = len(results)
    if any(r.get("torch_outcome") for r in results):
        counts["torch's DTensor passes"] = sum(1 for r in results if r.get("torch_outcome") == "pass")
        counts["torch passes, axedist does not"] = sum(1 for r in results if r.get("torch_outcome") == "pass"
                                                       and r["outcome"] != "pass")
        counts["axedist passes, torch does not"] = sum(1 for r in results if r["outcome"] == "pass"
                                                       and r.get("torch_outcome") == "fail")
    return counts
