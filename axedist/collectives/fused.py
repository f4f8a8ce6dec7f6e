"""`gemm_reduce_scatter`: the row-parallel GEMM whose partial sums are reduce-scattered.

    >>> out = gemm_reduce_scatter(a, b, group)   # a [M, K_local], b [K_local, N] on every rank
    >>> out.shape                                # [M / W, N]: rows of this rank, summed over ranks

backend: "p2p" runs the fused persistent kernel (axedist/kernels/gemm_rs.py) with peer loads;
"multimem" the same kernel with multimem.ld_reduce (only where multicast is supported AND
AXEDIST_ENABLE_MULTICAST=1); "torch" is cuBLAS (torch.matmul) then the NCCL reduce-scatter;
"auto" picks per shape from the measured table (FUSED_LOSES) and says why in `plan_gemm_reduce_scatter`.
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
from .backend import (group_name, load_auto_table, multicast_opted_in, multimem_allowed, p2p_possible,
                      through_custom_op)
from .symm import symm_ops_available

# Shapes (M, N, K_local, W) where the fused kernel measured slower than cuBLAS + NCCL in device
# time (bf16, H200): axedist/kernels/gemm_rs_auto.json, which `launch/bench_gemm_rs.py
# --tables-from <gemm_rs_w4.json> <gemm_rs_w2.json>` derives from the recorded benchmark runs
# (benchmarks/results/). "auto" runs cuBLAS + NCCL there and the plan says so.
AUTO_TABLE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "kernels", "gemm_rs_auto.json")


_AUTO = load_auto_table(AUTO_TABLE_PATH)
# (M, N, K_local, W) where cuBLAS + NCCL measured faster, and where torch's symmetric-memory op
# measured the fastest of the three (collectives/symm.py)
FUSED_LOSES: set[tuple[int, int, int, int]] = _AUTO["fused_loses"]
SYMM_WINS: set[tuple[int, int, int, int]] = _AUTO["symm_wins"]
# Below this many rows per rank "auto" does not fuse: at M / W = 32 the fused kernel is slower in
# device time (no split-K), and at 128 it is faster in device time but its host side (tens of
# us per call) makes it slower for a program that issues calls one by one (eager table).
MIN_ROWS_PER_RANK = 256


@dataclasses.dataclass(frozen=True)
class GemmReduceScatterPlan:
    """What gemm_reduce_scatter will run for given operands, and why."""
    backend: str
    m: int
    n: int
    k: int
    world: int
    config: str
    reason: str

    def __str__(self) -> str:
        return (f"gemm_reduce_scatter[{self.m}x{self.k}] @ [{self.k}x{self.n}] over {self.world} "
                f"ranks -> [{self.m // max(self.world, 1)}x{self.n}]: {self.backend}"
                f"{' ' + self.config if self.config else ''} ({self.reason})")


def _validate(a: torch.Tensor, b: torch.Tensor, group, scatter_dim: int) -> int:
    world = dist.get_world_size(group)
    if a.dim() < 2 or b.dim() != 2:
        raise ValueError(f"gemm_reduce_scatter: a must be [..., K] with at least 2 dims and b "
                         f"[K, N]; got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"gemm_reduce_scatter: inner dimensions differ: a {tuple(a.shape)} @ "
                         f"b {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"gemm_reduce_scatter: a is {a.dtype} but b is {b.dtype}")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemm_reduce_scatter: dtype must be bf16 or fp16, got {a.dtype}")
    if a.device != b.device:
        raise ValueError(f"gemm_reduce_scatter: a on {a.device} but b on {b.device}")
    out_dims = a.dim()
    if scatter_dim < 0:
        scatter_dim += out_dims
    if not 0 <= scatter_dim < out_dims:
        raise ValueError(f"gemm_reduce_scatter: scatter_dim {scatter_dim} out of range for an "
                         f"output of {out_dims} dims")
    out_shape = (*a.shape[:-1], b.shape[1])
    if out_shape[scatter_dim] % world != 0:
        raise ValueError(f"gemm_reduce_scatter: output {tuple(out_shape)} of a "
                         f"{tuple(a.shape)} @ b {tuple(b.shape)} has dim {scatter_dim} = "
                         f"{out_shape[scatter_dim]}, not divisible by the group size {world}")
    return scatter_dim


def plan_gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group=None,
                             scatter_dim: int = 0, backend: str = "auto"
                             ) -> GemmReduceScatterPlan:
    """Choose the implementation (no communication happens here)."""
    scatter_dim = _validate(a, b, group, scatter_dim)
    world = dist.get_world_size(group)
    m = a.numel() // a.shape[-1]
    n, k = b.shape[1], b.shape[0]
    if backend not in ("auto", "p2p", "multimem", "torch", "symm"):
        raise ValueError(f"backend must be auto, p2p, multimem, torch or symm, got {backend!r}")

    def plan(chosen, reason, config=""):
        return GemmReduceScatterPlan(chosen, m, n, k, world, config, reason)

    if backend == "torch":
        return plan("torch", "requested: cuBLAS matmul then reduce-scatter")
    possible, why = p2p_possible(a, group)
    if possible and a.dim() > 2 and scatter_dim != 0:
        possible, why = False, f"scatter_dim {scatter_dim} of a {a.dim()}-d input"
    if possible and scatter_dim == a.dim() - 1 and scatter_dim != 0:
        possible, why = False, "scatter on the column dim runs as cuBLAS + reduce-scatter"
    if backend in ("p2p", "multimem", "symm") and not possible:
        raise ValueError(f"gemm_reduce_scatter backend {backend!r} cannot run: {why}")
    if not possible:
        return plan("torch", f"fused kernel unavailable: {why}")
    if backend == "symm":
        available, why = symm_ops_available()
        if not available:
            raise ValueError(f"gemm_reduce_scatter backend 'symm' cannot run: {why}")
        return plan("symm", "requested: torch's symmetric-memory op")
    from ..kernels.gemm_rs import default_config  # imports triton (p2p_possible checked it)

    config = str(default_config(m, n, k, world, a.dtype))
    if backend == "multimem":
        allowed, why = multimem_allowed(a.device.index)
        if not allowed:
            raise ValueError(f"gemm_reduce_scatter backend 'multimem' is not available: {why}")
        return plan("multimem", "requested", config)
    if backend == "p2p":
        return plan("p2p", "requested", config)
    if world == 1:
        return plan("torch", "single rank: a plain matmul")
    if multimem_allowed(a.device.index)[0]:
        return plan("multimem", "multicast supported and opted in", config)
    if (m, n, k, world) in SYMM_WINS and symm_ops_available()[0]:
        return plan("symm", "measured: torch's symmetric-memory op is the fastest for this shape")
    if (m, n, k, world) in FUSED_LOSES:
        return plan("torch", "measured: cuBLAS + NCCL is faster for this shape")
    if m // world < MIN_ROWS_PER_RANK:
        return plan("torch", f"{m // world} rows per rank < {MIN_ROWS_PER_RANK}: measured "
                             f"slower than cuBLAS + NCCL (no split-K in the fused kernel)")
    return plan("p2p", "fused kernel (measured faster or shape not in the table)", config)


@dataclasses.dataclass
class FusedCall:
    """What repeated fused calls of one rank with the same shapes, strides, dtype and group
    share: the plan, the group's size and this rank, the tile config, the rank's workspace
    and the prepared launch (rebuilt when the workspace is replaced).

    workspace_for(nbytes) gives the rank's workspace with at least nbytes per half: the group's
    symmetric workspace (collective) on the real path, a carved one for virtual ranks.
    pinned_config: a tile config to use instead of the tuned / heuristic one.

    >>> call = FusedCall(plan, 4, 1, lambda nbytes: workspace)
    >>> out = call.run(a, b)        # [M / 4, N] on rank 1, one kernel launch
    """
    plan: GemmReduceScatterPlan
    world: int
    rank: int
    workspace_for: object
    pinned_config: object = None
    config: object = None
    config_version: int = -1
    workspace: object = None
    replay: object = None

    def _setup(self, a: torch.Tensor, b: torch.Tensor):
        """(operands, workspace) of a call, refreshing the config and the workspace halves."""
        from ..kernels import gemm_rs

        ops = gemm_rs.prepare_operands(a.reshape(-1, a.shape[-1]), b)
        if ops.m * ops.n >= (1 << 31):
            raise ValueError(f"gemm_reduce_scatter: M * N = {ops.m * ops.n} exceeds int32 "
                             f"indexing")
        if self.pinned_config is not None:
            if self.config is not self.pinned_config:
                self.config, self.replay = self.pinned_config, None
        elif self.config_version != gemm_rs.config_version():  # first call, or a new tuning
            self.config = gemm_rs.default_config(ops.m, ops.n, ops.k, self.world, a.dtype)
            self.config_version = gemm_rs.config_version()
            self.replay = None
        workspace = self.workspace
        if workspace is None or workspace.retired:
            workspace = self.workspace = self.workspace_for(ops.m * ops.n * a.element_size())
            self.replay = None
        return ops, workspace

    def _replays(self, aligned: bool, timeout_s: float | None, workspace) -> bool:
        """Whether the prepared launch serves this call: one was built (for this shape, config
        and workspace: _setup drops it when they change), the pointers are 16-byte aligned as
        it assumed (`aligned`), and the timeout is the default it was built with."""
        return (self.replay is not None and aligned and timeout_s is None
                and self.replay.timeout_ns == workspace.timeout_ns())

    def prepare(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                timeout_s: float | None = None) -> None:
        """Compile and load the kernel that run(a, b, out, timeout_s) launches, without
        launching it (the timeout's width is part of the kernel's specialization)."""
        from ..kernels import gemm_rs

        ops, workspace = self._setup(a, b)
        workspace.set_timeout(timeout_s)
        if self._replays(_aligned(ops, out), timeout_s, workspace):
            return  # loaded, and built for calls like this one
        prepared = gemm_rs.launch(ops, self.config, self.world, self.rank, None, out, workspace,
                                  multimem=self.plan.backend == "multimem", compile_only=True)
        if prepared is not None:  # (a /ce launch: built now, run by the first call)
            self.replay = prepared

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
            timeout_s: float | None = None, check: bool = False) -> torch.Tensor:
        """The fused kernel on this rank: one launch (a prepared Replay from the second call of
        a shape on). The kernel takes its epoch and data half from the rank's call state on the
        device, so the launch may be captured in a CUDA graph and replayed."""
        from ..kernels import gemm_rs

        ops, workspace = self._setup(a, b)
        world = self.world
        lead = a.shape[:-1]
        rows = ops.m // world
        if out is None:
            out = torch.empty((rows, ops.n), dtype=a.dtype, device=a.device)
        elif (out.dtype != a.dtype or out.device != a.device or not out.is_contiguous()
              or out.shape[-1:] != (ops.n, ) or out.numel() != rows * ops.n):
            raise ValueError(f"gemm_reduce_scatter: out must be a contiguous {a.dtype} tensor on "
                             f"{a.device} of [{rows}, {ops.n}] (or the result's shape), got "
                             f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
        out = out.view(rows, ops.n)  # the kernels write [M / W, N] rows (TMA: a 2-D descriptor)
        workspace.begin_call("gemm_reduce_scatter", timeout_s)
        aligned = _aligned(ops, out)
        if self._replays(aligned, timeout_s, workspace):
            self.replay(ops, out)  # the same call as before: only operands and output change
        else:
            self.replay = gemm_rs.launch(
                ops, self.config, world, self.rank, None, out, workspace,
                multimem=self.plan.backend == "multimem",
                prepare=aligned and timeout_s is None)
        if check:
            workspace.check(synchronize=True)
        return out.view(lead[0] // world, *lead[1:], ops.n) if len(lead) > 1 else out


def _aligned(ops, out: torch.Tensor) -> bool:
    """Whether A, B and out start at 16-byte boundaries (what a prepared launch assumes)."""
    return (ops.a.data_ptr() | ops.b.data_ptr() | out.data_ptr()) % 16 == 0


_calls: dict[tuple, FusedCall] = memo("collectives.fused calls")


def _fused_call(a: torch.Tensor, b: torch.Tensor, group, scatter_dim: int,
                backend: str) -> FusedCall:
    key = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
           group, scatter_dim, backend, multicast_opted_in())
    call = _calls.get(key)
    if call is None:
        from .symmetric import get_workspace

        plan = plan_gemm_reduce_scatter(a, b, group, scatter_dim, backend)
        # the first call of a shape on this rank: every rank must run the same product and kernel
        # (K_local may differ; M, N, dtype and the choice may not), else every rank raises
        agree_in_group(group, "gemm_reduce_scatter", f"a {list(a.shape[:-1])} x K @ b [K, {b.shape[1]}] {a.dtype}, "
                       f"scatter_dim {scatter_dim % a.dim()}, runs {plan.backend} {plan.config}, "
                       f"copy engines {copy_engines_usable()}")
        device = a.device
        call = FusedCall(plan, dist.get_world_size(group), dist.get_rank(group),
                         lambda nbytes: get_workspace(group, nbytes, device))
        if len(_calls) > 4096:  # shapes of one model are few; a shape sweep must not grow it
            _calls.clear()
        _calls[key] = call
    return call


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group=None, scatter_dim: int = 0,
                        backend: str = "auto", out: torch.Tensor | None = None,
                        timeout_s: float | None = None, check: bool = False) -> torch.Tensor:
    """reduce_scatter(a @ b, scatter_dim) over `group`, fused into one kernel where it pays.

    a: [M, K_local] (or [..., K_local]) row-major; b: [K_local, N], row-major or the transpose
    of a row-major [N, K_local] (nn.Linear's weight.t()). bf16/fp16, fp32 accumulation.
    Returns [M / W, N] (the slice of dim `scatter_dim` this rank owns); out: where it goes, in
    that shape or its rows flattened ([rows, N]), contiguous, a's dtype (returned in the
    result's shape). check=True synchronizes
    and raises a pending timeout error (otherwise it surfaces at the next call on the group or
    through axedist.collectives.check(group)). The first call of a shape plans and compiles;
    later ones only take an epoch and launch (tens of microseconds of CPU).

    >>> a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    >>> b = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)
    >>> gemm_reduce_scatter(a, b, group).shape     # W = 4: torch.Size([2048, 8192])

    While torch.compile traces, or with operands that require grad, the call goes through the
    custom op ``torch.ops.axedist.gemm_reduce_scatter`` (library.py: fake shapes, gradients).
    Differentiable: the reduce-scatter's adjoint is an all-gather of the output's gradient ``g``,
    so ``grad_a = all_gather(g) @ b^T`` (the fused all-gather + GEMM) and ``grad_b = a^T @
    all_gather(g)``; ``out=``, ``timeout_s=`` and ``check=`` are refused then.
    """
    if through_custom_op("gemm_reduce_scatter", a, b, out, timeout_s, check):
        return torch.ops.axedist.gemm_reduce_scatter(a, b, group_name(group), scatter_dim, backend)
    return run_gemm_reduce_scatter(a, b, group, scatter_dim, backend, out, timeout_s, check)


def run_gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group=None, scatter_dim: int = 0,
                            backend: str = "auto", out: torch.Tensor | None = None,
                            timeout_s: float | None = None, check: bool = False) -> torch.Tensor:
    """``gemm_reduce_scatter`` run now on these tensors (the custom op's implementation)."""
    call = _fused_call(a, b, group, scatter_dim, backend)
    plan = call.plan
    if plan.backend == "symm":  # rows of a flattened: the scatter runs over dim 0 (planned so)
        rows = symm.matmul_reduce_scatter(a.reshape(-1, a.shape[-1]), b, group, 0)
        result = rows.view(a.shape[0] // plan.world, *a.shape[1:-1], b.shape[1])
        return fallback.copy_out("gemm_reduce_scatter", result, out)
    if plan.backend == "torch":
        if plan.world == 1:
            return fallback.matmul_out("gemm_reduce_scatter", a, b, out)
        return fallback.matmul_reduce_scatter("gemm_reduce_scatter", a, b, group, scatter_dim, out, plan.world)
    return call.run(a, b, out, timeout_s, check)


def gemm_only(a: torch.Tensor, b: torch.Tensor, world: int, config=None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel's GEMM alone (same tiles, order and pipeline, no flags, no reduce):
    returns a @ b [M, N]. For the benchmark, to separate GEMM speed from overlap losses."""
    from ..kernels import gemm_rs

    ops = gemm_rs.prepare_operands(a, b)
    config = config or gemm_rs.default_config(ops.m, ops.n, ops.k, world, a.dtype)
    out = torch.empty((ops.m, ops.n), dtype=a.dtype, device=a.device) if out is None else out
    gemm_rs.launch(ops, config, world, 0, out, None, gemm_only=True)
    return out


def gemm_reduce_scatter_variant(a: torch.Tensor, b: torch.Tensor, group, config, mode: int,
                                scope: str = "sys", out: torch.Tensor | None = None,
                                lag_waves: float | None = None) -> torch.Tensor:
    """Benchmark-only: the fused kernel in another MODE (gemm_rs.FUSED / GEMM_AND_SIGNAL) or with
    GPU-scope flag releases (scope="gpu": NOT a correct cross-GPU signal; timing only)."""
    from ..kernels import gemm_rs
    from .symmetric import get_workspace

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ops = gemm_rs.prepare_operands(a, b)
    workspace = get_workspace(group, ops.m * ops.n * a.element_size(), a.device)
    workspace.begin_call("gemm_reduce_scatter_variant")
    if out is None:
        out = torch.empty((ops.m // world, ops.n), dtype=a.dtype, device=a.device)
    gemm_rs.launch(ops, config, world, rank, None, out, workspace, mode=mode, scope=scope,
                   lag_waves=lag_waves)
    return out
