"""The decode layer tail as one call: ``h = residual + all_reduce(x)``, ``y = rms_norm(h) * weight``.

A row-parallel linear leaves a partial sum on every rank; the layer then adds its residual and
normalizes for the next half. On CUDA with the p2p kernels this is one launch
(kernels/layer_tail.py) over the group's symmetric workspace, graph-capturable like the other
p2p calls; anywhere else (CPU, gloo, NCCL) it is the unfused sequence the kernel replaces, which
is also the reference it is tested against:

    >>> h, y = all_reduce_rms_norm(x, residual, weight, 1e-5, group)   # x, residual: [B, H]
    >>> # h == residual + sum of x over the group; y == F.rms_norm(h, (H,), weight, 1e-5)

Every rank sums the ranks' rows in the same order (rank 0 first), so h and y are bit-identical
on every rank, as a replicated value must be.

Variants of the kernel: ``"push"`` / ``"pull"`` move the rows through the group's workspace and
meet at a flag barrier (a system-scope fence, then a signal to every peer); ``"ll"`` sends each
32 bits with the call's epoch in one 8-byte word over the group's tagged workspace, so a word
is its own flag (no fence, no barrier: one trip over NVLink). ``"auto"`` takes ``"ll"`` where
the rows are 16-byte aligned (measured faster at decode sizes: benchmarks/results/decode_w2.md),
the measured one of push / pull elsewhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..caches import memo
from .backend import p2p_possible
from .p2p import TRITON_DTYPE, call_geometry, choose_variant, kernel_signature, static_arguments
from .symmetric import MAX_BARRIER_PROGRAMS, get_workspace

__all__ = ["all_reduce_rms_norm", "unfused_all_reduce_rms_norm", "TailPlan", "kernel_arguments", "compile_tail",
           "VARIANTS", "tail_variant"]

_OP = "all_reduce_rms_norm"
# rows of at most this many elements (Llama-3-405B's 16384); one row is one program's tile
MAX_HIDDEN = 16384
VARIANTS = ("auto", "push", "pull", "ll")


def unfused_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence the fused call replaces: all-reduce (torch.distributed), add, rms_norm."""
    total = x.clone()
    dist.all_reduce(total, group=group)
    h = residual + total
    return h, F.rms_norm(h, (h.shape[-1],), weight, eps)


def kernel_arguments(hidden: int, dtype: torch.dtype, world: int, variant: str, copy_in: bool,
                     aligned: bool, phases: int = 3) -> tuple[dict, dict, list[str]]:
    """(Triton signature of the runtime arguments, constexprs, arguments divisible by 16) of the
    fused kernel for one call shape class and variant ("push", "pull" or "ll"): what the GPU
    compiles and the CPU tests inspect."""
    element = TRITON_DTYPE[dtype]
    tail = dict(residual_ptr=f"*{element}", weight_ptr=f"*{element}", y_ptr=f"*{element}", n_rows="i32",
                hidden="i32", eps="fp32")
    if variant == "ll":
        # the workspace's data halves, rank, error words and parity stride, then the tail's own
        signature = dict(x_ptr=f"*{element}", out_ptr=f"*{element}", state_ptr="*i32", timeout_ns="i64")
        signature.update({f"D{i}": "i64" for i in range(8)})
        signature.update(rank="i32", abort_ptr="*i32", error_address="i64", half_bytes="i64", **tail)
        per_word = 4 // dtype.itemsize
        constexprs = dict(WORLD=world, BLOCK_W=max(16, 1 << (hidden // per_word - 1).bit_length()),
                          PER_WORD=per_word, PHASES=phases)
        return signature, constexprs, ["state_ptr", "abort_ptr", "x_ptr", "out_ptr", "residual_ptr",
                                       "weight_ptr", "y_ptr", "hidden"]
    # the one-shot all-reduce's arguments (same workspace, epochs and barrier), then the tail's own
    signature = kernel_signature("all_reduce_one_shot", dtype)
    signature.update(tail)
    constexprs = dict(WORLD=world, BLOCK_H=max(16, 1 << (hidden - 1).bit_length()), PUSH=variant == "push",
                      COPY_IN=copy_in, ALIGNED=aligned, PHASES=phases)
    divisible = ["state_ptr", "abort_ptr", "chunk_stride"]
    if aligned:
        divisible += ["x_ptr", "out_ptr", "residual_ptr", "weight_ptr", "y_ptr", "hidden"]
    return signature, constexprs, divisible


def _kernel(variant: str):
    from ..kernels import layer_tail
    return layer_tail.all_reduce_rms_norm_ll_kernel if variant == "ll" else layer_tail.all_reduce_rms_norm_kernel


def compile_tail(hidden: int, dtype: torch.dtype, world: int, variant: str, aligned: bool, capability: int = 90):
    """The fused kernel of `variant` compiled for one call shape class and CUDA ``capability``
    (Triton caches it on disk; a process without a GPU can compile it, as the CPU tests do)."""
    from ..kernels.compile_check import compile_for_target
    signature, constexprs, divisible = kernel_arguments(hidden, dtype, world, variant, True, aligned)
    warps = 8 if hidden > 2048 else 4  # a tile of 4096 columns or more
    return compile_for_target(_kernel(variant), signature, constexprs, divisible, capability=capability,
                              num_warps=warps)


def tail_variant(variant: str, dtype: torch.dtype, aligned: bool, rows: int, hidden: int) -> str:
    """The variant a call runs ("push", "pull" or "ll"), from what every rank sees alike."""
    if variant not in VARIANTS:
        raise ValueError(f"{_OP}: variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "ll" and not aligned:
        raise ValueError(f"{_OP}: variant ll needs rows of a multiple of 16 elements at 16-byte aligned addresses")
    if variant == "auto":
        return "ll" if aligned else choose_variant("all_reduce_one_shot", rows * hidden * dtype.itemsize, "auto")
    return variant


class TailPlan:
    """What a fused layer-tail call of one (rows, hidden, dtype, group, variant) needs between
    calls: the workspace, the grid, the compiled kernel and its static arguments."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, group, device_index: int, variant: str,
                 aligned: bool, workspace=None):
        """variant: "push", "pull" or "ll" (tail_variant's choice); workspace: the rank's workspace
        to run on (default: the group's, tagged for "ll"; virtual ranks pass their own)."""
        self.rows, self.hidden, self.dtype, self.aligned, self.variant = rows, hidden, dtype, aligned, variant
        world = dist.get_world_size(group) if workspace is None else workspace.world_size
        if variant == "ll":  # every rank's slot: its rows as 8-byte words of 32 data bits each
            self.geometry = None
            nbytes = world * rows * (hidden * dtype.itemsize // 4) * 8
        else:  # the one-shot all-reduce's layout: push slots of the rows rounded up to 16 elements
            self.geometry = call_geometry("all_reduce_one_shot", (rows, hidden), world)
            nbytes = self.geometry["elements"] * dtype.itemsize
        if workspace is None:
            workspace = get_workspace(group, nbytes, torch.device("cuda", device_index), tagged=variant == "ll")
        elif nbytes > workspace.data_bytes or workspace.tagged != (variant == "ll"):
            raise ValueError(f"{_OP}: {nbytes} bytes of variant {variant} do not fit a "
                             f"{'tagged ' if workspace.tagged else ''}workspace half of {workspace.data_bytes} bytes")
        self.workspace = workspace
        self.world, self.rank = workspace.world_size, workspace.rank
        self.programs = max(1, min(rows, self.workspace.processors, MAX_BARRIER_PROGRAMS))
        self.device_index = device_index
        self.halves = [self.workspace.tensor.data_ptr() + self.workspace.data_offset(half) for half in (0, 1)]
        self._launch = None

    def __repr__(self) -> str:
        return (f"TailPlan({self.variant}, {TRITON_DTYPE[self.dtype]} "
                f"({self.rows}, {self.hidden}) W={self.world}: {self.programs} programs)")

    def _static_arguments(self) -> tuple:
        workspace = self.workspace
        if self.variant == "ll":
            return (*workspace.data_addresses(0), self.rank, workspace.abort.data_ptr(), workspace.error_address(),
                    workspace.data_bytes)
        return static_arguments("all_reduce_one_shot", workspace, self.geometry, self.rank, False)

    def launch(self):
        """(CompiledLaunch, static arguments), built on the first call."""
        if self._launch is None:
            from ..kernels.launch import CompiledLaunch
            major, minor = torch.cuda.get_device_capability(self.device_index)
            compiled = compile_tail(self.hidden, self.dtype, self.world, self.variant, self.aligned,
                                    major * 10 + minor)
            _, constexprs, _ = kernel_arguments(self.hidden, self.dtype, self.world, self.variant, True, self.aligned)
            self._launch = (CompiledLaunch(compiled, tuple(constexprs.values())), self._static_arguments())
        return self._launch

    def run(self, x, residual, weight, out, y, eps: float, timeout_s: float | None) -> None:
        address = x.data_ptr()
        if self.halves[0] <= address < self.halves[1] + self.workspace.data_bytes:
            x = x.clone()  # an input inside the workspace would be overwritten by the copy-in
        workspace = self.workspace
        workspace.begin_call(_OP, timeout_s)
        launch, static = self.launch()
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        launch(self.programs, stream, (x.data_ptr(), out.data_ptr(), workspace.state_address(),
                                       int(workspace.timeout_s * 1e9), *static, residual.data_ptr(),
                                       weight.data_ptr(), y.data_ptr(), self.rows, self.hidden, float(eps)))


_plans: dict[tuple, TailPlan] = memo("collectives.layer_tail plans")


def _check(x, residual, weight) -> None:
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"{_OP}: x and residual must be [rows, hidden] of one shape and weight [hidden]; got x "
                         f"{tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    if not x.dtype == residual.dtype == weight.dtype:
        raise ValueError(f"{_OP}: x, residual and weight must share one dtype; got {x.dtype}, {residual.dtype}, "
                         f"{weight.dtype}")


def _p2p_refusal(x, residual, weight, group) -> str:
    """Why the fused kernel cannot run this call ("" where it can): what every rank sees alike."""
    if not (x.is_cuda and residual.is_cuda and weight.is_cuda):
        return f"it needs CUDA tensors, got {x.device}"
    if x.dtype not in TRITON_DTYPE:
        return f"it takes bf16, fp16 or fp32, got {x.dtype}"
    if x.shape[1] > MAX_HIDDEN:
        return f"rows of {x.shape[1]} elements exceed the kernel's {MAX_HIDDEN}"
    possible, why = p2p_possible(x, group)
    return "" if possible else why


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group=None,
                        backend: str = "auto", timeout_s: float | None = None,
                        variant: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, y)``: ``h = residual + sum of x over the group``, ``y = rms_norm(h) * weight``.

    x, residual: ``[rows, hidden]``; weight: ``[hidden]``. backend ``"p2p"``: the fused kernel
    (CUDA, the group within one NVLink node); ``"torch"``: torch.distributed's all-reduce, then the
    add and ``F.rms_norm``; ``"auto"``: p2p where it can run, torch elsewhere. variant: the fused
    kernel's (module docstring). Every rank passes the same shapes, dtype, backend and variant.
    """
    if backend not in ("auto", "p2p", "torch"):
        raise ValueError(f"{_OP}: backend must be auto, p2p or torch, got {backend!r}")
    if variant not in VARIANTS:
        raise ValueError(f"{_OP}: variant must be one of {VARIANTS}, got {variant!r}")
    _check(x, residual, weight)
    if backend == "torch":
        return unfused_all_reduce_rms_norm(x, residual, weight, eps, group)
    reason = _p2p_refusal(x, residual, weight, group)
    if reason and backend == "auto":
        return unfused_all_reduce_rms_norm(x, residual, weight, eps, group)
    if reason:
        raise ValueError(f"{_OP}: backend p2p cannot run: {reason}")
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    rows, hidden = x.shape
    out, y = torch.empty_like(x), torch.empty_like(x)
    aligned = hidden % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, residual, weight, out, y))
    key = (group, rows, hidden, x.dtype, x.get_device(), variant, aligned)
    plan = _plans.get(key)
    if plan is None or plan.workspace.retired:
        chosen = tail_variant(variant, x.dtype, aligned, rows, hidden)
        plan = _plans[key] = TailPlan(rows, hidden, x.dtype, group, x.get_device(), chosen, aligned)
    if rows:
        plan.run(x, residual, weight, out, y, eps, timeout_s)
    return out, y
