"""The other fused halves of a tensor-parallel block: `all_gather_gemm` (column-parallel linear
with sequence-parallel input) and `gemm_all_reduce` (row-parallel linear at decode sizes).

    >>> y = all_gather_gemm(x, w.t(), group)     # x [S/W, B, H] on each rank -> y [S, B, N/W]
    >>> z = gemm_all_reduce(h, w2.t(), group)    # h [4, K/W] on each rank -> z [4, N] summed

backend: "p2p" runs the fused persistent kernel (kernels/ag_gemm.py, kernels/gemm_ar.py) over
the group's symmetric workspace; "multimem" the same kernels with multimem.st /
multimem.ld_reduce (only where multicast is supported AND AXEDIST_ENABLE_MULTICAST=1);
"torch" is the collective through torch.distributed and cuBLAS; "auto" decides from the
measured tables (kernels/ag_gemm_auto.json, kernels/gemm_ar_auto.json, which the benchmarks'
--tables-from write) and says why in the plan. Every fused launch takes its epoch and data half
from the rank's call state on the device, so calls can be captured in CUDA graphs.
This module imports Triton only when a kernel is launched.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from ..caches import memo
from ..kernels.launch import copy_engines_usable
from ..peers import agree_in_group
from . import fallback
from . import symm
from .backend import (TUNED, group_name, load_auto_table, multicast_opted_in, multimem_allowed, p2p_possible,
                      through_custom_op)
from .symm import symm_ops_available

_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
AG_AUTO_TABLE_PATH = os.path.join(_KERNELS, "ag_gemm_auto.json")
AR_AUTO_TABLE_PATH = os.path.join(_KERNELS, "gemm_ar_auto.json")
BACKENDS = ("auto", "p2p", "multimem", "torch", "symm")  # symm: all_gather_gemm only (collectives/symm.py)
# the decode kernel's row range: beyond it the GEMM is no longer small and two kernels win
MAX_DECODE_ROWS = 256


AG_AUTO = load_auto_table(AG_AUTO_TABLE_PATH)
AR_AUTO = load_auto_table(AR_AUTO_TABLE_PATH)


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """What a fused TP call will run for given operands, and why (`op`: all_gather_gemm or
    gemm_all_reduce; m: rows of the whole product; algorithm: one_shot / two_shot for
    gemm_all_reduce)."""
    op: str
    backend: str
    m: int
    n: int
    k: int
    world: int
    config: str
    reason: str
    algorithm: str = ""

    def __str__(self) -> str:
        rows = (f"[{self.m // max(self.world, 1)}x{self.k}] gathered to [{self.m}x{self.k}]"
                if self.op == "all_gather_gemm" else f"[{self.m}x{self.k}]")
        how = " ".join(part for part in (self.backend, self.algorithm, self.config) if part)
        return (f"{self.op}{rows} @ [{self.k}x{self.n}] over {self.world} ranks -> "
                f"[{self.m}x{self.n}]: {how} ({self.reason})")


def _validate(op: str, a: torch.Tensor, b: torch.Tensor, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if a.dim() < 2 or b.dim() != 2:
        raise ValueError(f"{op}: a must be [..., K] with at least 2 dims and b [K, N]; got "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a {tuple(a.shape)} @ b "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: a is {a.dtype} but b is {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: a on {a.device} but b on {b.device}")


def _choose(op: str, a: torch.Tensor, group, backend: str, fusable: tuple[bool, str],
            loses: bool, config, plan, symm_wins: bool = False) -> FusedPlan:
    """The backend decision shared by both ops: requested ones checked, then "auto" (torch's
    symmetric-memory op where ``symm_wins``: all_gather_gemm's table named the shape)."""
    if backend == "torch":
        return plan("torch", "requested: the collective through torch.distributed and cuBLAS")
    possible, why = p2p_possible(a, group)
    if possible and a.dtype not in (torch.bfloat16, torch.float16):
        possible, why = False, f"dtype {a.dtype} (the fused kernels take bf16/fp16)"
    if possible:
        possible, why = fusable
    if backend in ("p2p", "multimem", "symm") and not possible:
        raise ValueError(f"{op} backend {backend!r} cannot run: {why}")
    if not possible:
        return plan("torch", f"fused kernel unavailable: {why}")
    if backend == "symm":
        available, why = symm_ops_available() if op == "all_gather_gemm" else (False, "torch has no such op for it")
        if not available:
            raise ValueError(f"{op} backend 'symm' cannot run: {why}")
        return plan("symm", "requested: torch's symmetric-memory op")
    if backend == "multimem":
        allowed, why = multimem_allowed(a.device.index)
        if not allowed:
            raise ValueError(f"{op} backend 'multimem' is not available: {why}")
        return plan("multimem", "requested", str(config()))
    if backend == "p2p":
        return plan("p2p", "requested", str(config()))
    if dist.get_world_size(group) == 1:
        return plan("torch", "single rank: a plain matmul")
    if multimem_allowed(a.device.index)[0]:
        return plan("multimem", "multicast supported and opted in", str(config()))
    if symm_wins and symm_ops_available()[0]:
        return plan("symm", "measured: torch's symmetric-memory op is the fastest for this shape")
    if loses:
        return plan("torch", "measured: the unfused pair is faster for this shape")
    return plan("p2p", "fused kernel (measured faster or shape not in the table)", str(config()))


# -- all_gather_gemm ------------------------------------------------------------------------

def plan_all_gather_gemm(a: torch.Tensor, b: torch.Tensor, group=None, gather_dim: int = 0,
                         backend: str = "auto") -> FusedPlan:
    """Choose the implementation of all_gather_gemm (no communication happens here).

    >>> str(plan_all_gather_gemm(x, w.t(), group))   # x [2048, 8192], w [7168, 8192], W = 4
    'all_gather_gemm[2048x8192] gathered to [8192x8192] @ [8192x7168] over 4 ranks -> [8192x7168]: p2p 128x256x64/g8/s3/w8/c16x512 (...)'
    """
    _validate("all_gather_gemm", a, b, backend)
    world = dist.get_world_size(group)
    if not -a.dim() <= gather_dim < a.dim() - 1:
        raise ValueError(f"all_gather_gemm: gather_dim {gather_dim} must be a row dim of a "
                         f"{tuple(a.shape)} (not its last, contracted one)")
    m_local = a.numel() // a.shape[-1]
    n, k = b.shape[1], b.shape[0]

    def plan(chosen, reason, config=""):
        return FusedPlan("all_gather_gemm", chosen, world * m_local, n, k, world, config, reason)

    fusable = (True, "ok")
    if gather_dim % a.dim() != 0:
        fusable = (False, f"gather_dim {gather_dim} of a {a.dim()}-d input interleaves the "
                          f"ranks' rows")
    elif m_local == 0:
        fusable = (False, "no rows")

    def config():
        from ..kernels.ag_gemm import default_config
        return default_config(m_local, n, k, world)

    loses = (world * m_local, n, k, world) in AG_AUTO["fused_loses"]
    wins = (world * m_local, n, k, world) in AG_AUTO["symm_wins"]
    if (backend == "auto" and fusable[0] and world > 1
            and m_local < AG_AUTO["min_rows_per_rank"]):
        fusable = (False, f"{m_local} rows per rank < {AG_AUTO['min_rows_per_rank']} (the "
                          f"fused GEMM + reduce-scatter's measured break-even; this kernel's "
                          f"own table has no such rows yet)")
    return _choose("all_gather_gemm", a, group, backend, fusable, loses, config, plan, wins)


@dataclasses.dataclass
class AllGatherGemmCall:
    """What repeated all_gather_gemm calls of one rank with the same shapes share: the plan,
    the group's size and this rank, the tile config, the rank's workspace (workspace_for(nbytes):
    the group's symmetric workspace on the real path, a carved one for virtual ranks) and the
    compiled launches (per operand layout and timeout).

    >>> call = AllGatherGemmCall(plan, 4, 1, lambda nbytes: workspace)
    >>> out = call.run(a, b)        # [4 * M_LOCAL, N] on rank 1, one kernel launch
    """
    plan: FusedPlan
    world: int
    rank: int
    workspace_for: object
    pinned_config: object = None
    workspace: object = None
    launches: dict = dataclasses.field(default_factory=dict)

    def _setup(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None,
               timeout_s: float | None, gathered: torch.Tensor | None = None):
        from ..kernels import ag_gemm, gemm_rs

        ops = gemm_rs.prepare_operands(a.reshape(-1, a.shape[-1]), b)
        if self.world * ops.m * max(ops.n, ops.k) >= (1 << 31):
            raise ValueError("all_gather_gemm: the gathered product exceeds int32 indexing")
        workspace = self.workspace
        needed = ag_gemm.workspace_bytes_needed(self.world, ops.m, ops.k, a.element_size())
        if workspace is None or workspace.retired or workspace.data_bytes < needed:
            workspace = self.workspace = self.workspace_for(needed)
            self.launches = {}
        workspace.set_timeout(timeout_s)
        if out is None:
            out = torch.empty((self.world * ops.m, ops.n), dtype=a.dtype, device=a.device)
        elif out.shape != (self.world * ops.m, ops.n) or out.dtype != a.dtype \
                or out.stride(1) != 1:
            raise ValueError(f"all_gather_gemm: out must be a {a.dtype} tensor of shape "
                             f"{(self.world * ops.m, ops.n)} with unit column stride")
        if gathered is not None and (gathered.shape != (self.world * ops.m, ops.k)
                                     or gathered.dtype != a.dtype or not gathered.is_contiguous()
                                     or gathered.data_ptr() % 16):
            raise ValueError(f"all_gather_gemm: gathered must be a contiguous, 16-byte aligned "
                             f"{a.dtype} tensor of shape {(self.world * ops.m, ops.k)}")
        key = (ag_gemm.launch_layout(ops, out), workspace.timeout_ns(), gathered is not None)
        launch = self.launches.get(key)
        if launch is None:
            config = self.pinned_config or ag_gemm.default_config(ops.m, ops.n, ops.k,
                                                                  self.world)
            if len(self.launches) >= 16:
                self.launches.clear()
            launch = self.launches[key] = ag_gemm.AllGatherGemmLaunch(
                ops, out, config, workspace, multimem=self.plan.backend == "multimem",
                copy_out=gathered is not None)
        return ops, out, workspace, launch

    def prepare(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                timeout_s: float | None = None, gathered: torch.Tensor | None = None) -> None:
        """Compile and load the kernel that run(a, b, out, timeout_s, gathered=...) launches,
        without launching it (virtual ranks: no module may load while another rank spins)."""
        self._setup(a, b, out, timeout_s, gathered)

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
            timeout_s: float | None = None, check: bool = False,
            gathered: torch.Tensor | None = None) -> torch.Tensor:
        """The product; gathered (optional): receives the gathered A as well."""
        ops, out, workspace, launch = self._setup(a, b, out, timeout_s, gathered)
        workspace.begin_call("all_gather_gemm", timeout_s)
        launch(ops, out, gathered)
        if check:
            workspace.check(synchronize=True)
        lead = a.shape[:-1]
        return out.view(self.world * lead[0], *lead[1:], ops.n) if len(lead) > 1 else out


_calls: dict[tuple, object] = memo("collectives.fused_tp calls")


def _cached_call(kind, a, b, group, extra, backend, make, shared: str):
    """The call of these operands (made on first use). The first use of a shape on this rank
    also checks that every rank runs the same: ``shared`` (the shapes the ranks must share) and
    the kernel chosen, else every rank raises ``RankDisagreementError``."""
    key = (kind, a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
           group, extra, backend, multicast_opted_in())
    call = _calls.get(key)
    if call is None:
        call = make()
        agree_in_group(group, kind, f"{shared} {a.dtype}, {extra}, runs {call.plan.backend} "
                                    f"{call.plan.config}, copy engines {copy_engines_usable()}")
        if len(_calls) > 4096:  # shapes of one model are few; a shape sweep must not grow it
            _calls.clear()
        _calls[key] = call
    return call


def _group_workspace(group, device):
    from .symmetric import get_workspace
    return lambda nbytes: get_workspace(group, nbytes, device)


def all_gather_gemm(a: torch.Tensor, b: torch.Tensor, group=None, gather_dim: int = 0,
                    backend: str = "auto", out: torch.Tensor | None = None,
                    timeout_s: float | None = None, check: bool = False,
                    gathered: torch.Tensor | None = None) -> torch.Tensor:
    """all_gather(a, gather_dim) @ b over `group`, fused into one kernel where it pays.

    a: this rank's rows [M_LOCAL, K] (or [..., K], gathered along dim 0); b: [K, N_local],
    row-major or the transpose of a row-major [N_local, K] (nn.Linear's weight.t()).
    bf16/fp16, fp32 accumulation. Returns [W * M_LOCAL, N_local] (rank p's rows at
    p * M_LOCAL). check=True synchronizes and raises a pending timeout error. gathered: a
    contiguous [W * M_LOCAL, K] tensor (for gather_dim 0: [W * a.shape[0], *a.shape[1:]])
    that receives the gathered a as well (what the backward of a linear layer needs). out:
    where the product goes, in its shape or its rows flattened ([rows, N_local]), a's dtype,
    unit column stride; the call returns it in the product's shape (every backend alike).

    >>> a = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)   # S/W rows, W = 4
    >>> w = torch.randn(7168, 8192, device="cuda", dtype=torch.bfloat16)   # column shard
    >>> all_gather_gemm(a, w.t(), group).shape
    torch.Size([8192, 7168])

    While torch.compile traces, or with operands that require grad, the call goes through the
    custom op ``torch.ops.axedist.all_gather_gemm`` (library.py), which returns the gathered
    rows too (copied into ``gathered`` when given). Differentiable: ``grad_b = all_gather(a)^T @
    g`` and ``grad_a`` is this rank's slice of ``reduce_scatter(g @ b^T)`` (the fused GEMM +
    reduce-scatter); ``out=``, ``timeout_s=`` and ``check=`` are refused then.
    """
    if through_custom_op("all_gather_gemm", a, b, out, timeout_s, check):
        result, rows = torch.ops.axedist.all_gather_gemm(a, b, group_name(group), gather_dim, backend)
        if gathered is not None:
            gathered.copy_(rows.reshape(gathered.shape))
        return result
    return run_all_gather_gemm(a, b, group, gather_dim, backend, out, timeout_s, check, gathered)


def run_all_gather_gemm(a: torch.Tensor, b: torch.Tensor, group=None, gather_dim: int = 0,
                        backend: str = "auto", out: torch.Tensor | None = None,
                        timeout_s: float | None = None, check: bool = False,
                        gathered: torch.Tensor | None = None) -> torch.Tensor:
    """``all_gather_gemm`` run now on these tensors (the custom op's implementation)."""
    def make():
        plan = plan_all_gather_gemm(a, b, group, gather_dim, backend)
        return AllGatherGemmCall(plan, dist.get_world_size(group), dist.get_rank(group),
                                 _group_workspace(group, a.device))
    call = _cached_call("all_gather_gemm", a, b, group, gather_dim, backend, make, f"a {list(a.shape)}")
    if call.plan.backend == "symm":  # gather_dim 0 (planned so): a's rows flattened, gathered in rank order
        product, rows = symm.all_gather_matmul(a.reshape(-1, a.shape[-1]), b, group, 0)
        if gathered is not None:
            gathered.copy_(rows.reshape(gathered.shape))
        result = product.view(call.world * a.shape[0], *a.shape[1:-1], b.shape[1])
        return fallback.copy_out("all_gather_gemm", result, out)
    if call.plan.backend == "torch":
        whole = a if call.world == 1 else fallback.all_gather(
            a.movedim(gather_dim, 0), group).movedim(0, gather_dim)
        if gathered is not None:
            gathered.copy_(whole.reshape(gathered.shape))
        return fallback.matmul_out("all_gather_gemm", whole, b, out)  # (out checked after the gather)
    flat = None if gathered is None else gathered.view(-1, a.shape[-1])
    out = fallback.product_rows("all_gather_gemm", out,
                                (call.world * a.shape[0], *a.shape[1:-1], b.shape[1]), a.dtype,
                                a.device)
    return call.run(a, b, out, timeout_s, check, flat)


# -- gemm_all_reduce ------------------------------------------------------------------------

def decode_algorithm(m: int, n: int, element_size: int, algorithm: str = "auto") -> str:
    """one_shot up to the measured one-shot all-reduce size of the collectives' table, else
    two_shot (least traffic).

    >>> decode_algorithm(4, 8192, 2), decode_algorithm(256, 8192, 2)
    ('one_shot', 'two_shot')
    """
    if algorithm not in ("auto", "one_shot", "two_shot"):
        raise ValueError(f"algorithm must be auto, one_shot or two_shot, got {algorithm!r}")
    if algorithm != "auto":
        return algorithm
    limit = TUNED["one_shot_all_reduce_max_bytes"]
    return "one_shot" if m * n * element_size <= limit else "two_shot"


def plan_gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group=None, backend: str = "auto",
                         algorithm: str = "auto") -> FusedPlan:
    """Choose the implementation of gemm_all_reduce (no communication happens here).

    >>> str(plan_gemm_all_reduce(h, w.t(), group))   # h [4, 2048], w [8192, 2048], W = 4
    'gemm_all_reduce[4x2048] @ [2048x8192] over 4 ranks -> [4x8192]: p2p one_shot 64x64x128/s4/w4 (...)'
    """
    _validate("gemm_all_reduce", a, b, backend)
    world = dist.get_world_size(group)
    m = a.numel() // a.shape[-1]
    n, k = b.shape[1], b.shape[0]
    chosen_algorithm = decode_algorithm(m, n, a.element_size(), algorithm)

    def plan(chosen, reason, config=""):
        return FusedPlan("gemm_all_reduce", chosen, m, n, k, world, config, reason,
                         chosen_algorithm if chosen != "torch" else "")

    fusable = (True, "ok")
    if m == 0:
        fusable = (False, "no rows")
    elif m > MAX_DECODE_ROWS:
        fusable = (False, f"{m} rows > {MAX_DECODE_ROWS}: not a decode size")

    def config():
        from ..kernels.gemm_ar import default_config
        return default_config(m, n, k)

    loses = (m, n, k, world) in AR_AUTO["fused_loses"]
    return _choose("gemm_all_reduce", a, group, backend, fusable, loses, config, plan)


@dataclasses.dataclass
class GemmAllReduceCall:
    """What repeated gemm_all_reduce calls of one rank with the same shapes share (as
    AllGatherGemmCall); push: the p2p kernel pushes tiles (default) or the ranks pull them."""
    plan: FusedPlan
    world: int
    rank: int
    workspace_for: object
    push: bool = True
    pinned_config: object = None
    workspace: object = None
    launches: dict = dataclasses.field(default_factory=dict)

    def _setup(self, a, b, out, timeout_s):
        from ..kernels import gemm_ar, gemm_rs

        ops = gemm_rs.prepare_operands(a.reshape(-1, a.shape[-1]), b)
        workspace = self.workspace
        needed = gemm_ar.workspace_bytes_needed(self.world, ops.m, ops.n, a.element_size())
        if workspace is None or workspace.retired or workspace.data_bytes < needed:
            workspace = self.workspace = self.workspace_for(needed)
            self.launches = {}
        workspace.set_timeout(timeout_s)
        if out is None:
            out = torch.empty((ops.m, ops.n), dtype=a.dtype, device=a.device)
        elif out.shape != (ops.m, ops.n) or out.dtype != a.dtype or not out.is_contiguous():
            raise ValueError(f"gemm_all_reduce: out must be a contiguous {a.dtype} tensor of "
                             f"shape {(ops.m, ops.n)}")
        key = (gemm_ar.launch_layout(ops, out), workspace.timeout_ns())
        launch = self.launches.get(key)
        if launch is None:
            config = self.pinned_config or gemm_ar.default_config(ops.m, ops.n, ops.k,
                                                                  workspace.processors)
            multimem = self.plan.backend == "multimem"
            if len(self.launches) >= 16:
                self.launches.clear()
            launch = self.launches[key] = gemm_ar.GemmAllReduceLaunch(
                ops, out, config, workspace, two_shot=self.plan.algorithm == "two_shot",
                push=self.push and not multimem, multimem=multimem)
        return ops, out, workspace, launch

    def prepare(self, a, b, out=None, timeout_s=None) -> None:
        """Compile and load the kernel that run(a, b, out, timeout_s) launches."""
        self._setup(a, b, out, timeout_s)

    def run(self, a, b, out=None, timeout_s=None, check=False) -> torch.Tensor:
        ops, out, workspace, launch = self._setup(a, b, out, timeout_s)
        workspace.begin_call("gemm_all_reduce", timeout_s)
        launch(ops, out)
        if check:
            workspace.check(synchronize=True)
        return out.view(*a.shape[:-1], ops.n)


def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group=None, backend: str = "auto",
                    algorithm: str = "auto", out: torch.Tensor | None = None,
                    timeout_s: float | None = None, check: bool = False) -> torch.Tensor:
    """all_reduce(a @ b) over `group` in one kernel for decode sizes (M = 1..256 rows).

    a: [M, K_local] (or [..., K_local]); b: [K_local, N], row-major or nn.Linear's weight.t().
    Returns [..., N], the sum over ranks, bit-identical on every rank. algorithm: "one_shot"
    (every rank sums every tile: least latency), "two_shot" (each rank sums its share, then
    hands it out) or "auto". out: where the product goes, in its shape or its rows flattened
    ([rows, N]), contiguous, a's dtype; the call returns it in the product's shape.

    >>> h = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)    # K / W = 2048
    >>> w = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16) # row shard
    >>> gemm_all_reduce(h, w.t(), group).shape
    torch.Size([4, 8192])

    While torch.compile traces, or with operands that require grad, the call goes through the
    custom op ``torch.ops.axedist.gemm_all_reduce`` (library.py). Differentiable: the result is
    one tensor every rank holds (a replicated DTensor's value), so its gradient is the same on
    every rank and is each rank's product's: ``grad_a = g @ b^T``, ``grad_b = a^T @ g``, no
    communication (Megatron's row-parallel convention).
    """
    if through_custom_op("gemm_all_reduce", a, b, out, timeout_s, check):
        return torch.ops.axedist.gemm_all_reduce(a, b, group_name(group), backend, algorithm)
    return run_gemm_all_reduce(a, b, group, backend, algorithm, out, timeout_s, check)


def run_gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group=None, backend: str = "auto",
                        algorithm: str = "auto", out: torch.Tensor | None = None,
                        timeout_s: float | None = None, check: bool = False) -> torch.Tensor:
    """``gemm_all_reduce`` run now on these tensors (the custom op's implementation)."""
    def make():
        plan = plan_gemm_all_reduce(a, b, group, backend, algorithm)
        return GemmAllReduceCall(plan, dist.get_world_size(group), dist.get_rank(group),
                                 _group_workspace(group, a.device))
    call = _cached_call("gemm_all_reduce", a, b, group, algorithm, backend, make,
                        f"a {list(a.shape[:-1])} x K @ b [K, {b.shape[1]}]")
    if call.plan.backend == "torch":
        if call.world == 1:
            return fallback.matmul_out("gemm_all_reduce", a, b, out)
        product = torch.matmul(a, b)
        return fallback.copy_out("gemm_all_reduce", fallback.all_reduce(product, group, out=product), out)
    out = fallback.product_rows("gemm_all_reduce", out, (*a.shape[:-1], b.shape[1]), a.dtype,
                                a.device)
    return call.run(a, b, out, timeout_s, check)
