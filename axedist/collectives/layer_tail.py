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
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..caches import memo
from .backend import p2p_possible
from .p2p import TRITON_DTYPE, call_geometry, choose_variant, kernel_signature, static_arguments
from .symmetric import MAX_BARRIER_PROGRAMS, get_workspace

__all__ = ["all_reduce_rms_norm", "all_reduce_add", "unfused_all_reduce_rms_norm", "TailPlan", "kernel_arguments",
           "compile_tail"]

_OP = "all_reduce_rms_norm"
# rows of at most this many elements (Llama-3-405B's 16384); one row is one program's tile
MAX_HIDDEN = 16384


def unfused_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                                group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sequence the fused call replaces: all-reduce (torch.distributed), add, rms_norm (none
    without a weight)."""
    total = x.clone()
    dist.all_reduce(total, group=group)
    h = residual + total
    return h, None if weight is None else F.rms_norm(h, (h.shape[-1],), weight, eps)


def kernel_arguments(hidden: int, dtype: torch.dtype, world: int, push: bool, copy_in: bool,
                     aligned: bool, phases: int = 3, norm: bool = True) -> tuple[dict, dict, list[str]]:
    """(Triton signature of the runtime arguments, constexprs, arguments divisible by 16) of the
    fused kernel for one call shape class (``norm``: with the RMSNorm): what the GPU compiles and
    the CPU tests inspect."""
    element = TRITON_DTYPE[dtype]
    # the one-shot all-reduce's arguments (same workspace, epochs and barrier), then the tail's own
    signature = kernel_signature("all_reduce_one_shot", dtype)
    signature.update(residual_ptr=f"*{element}", weight_ptr=f"*{element}", y_ptr=f"*{element}", n_rows="i32",
                     hidden="i32", eps="fp32")
    constexprs = dict(WORLD=world, BLOCK_H=max(16, 1 << (hidden - 1).bit_length()), PUSH=push, COPY_IN=copy_in,
                      ALIGNED=aligned, PHASES=phases, NORM=norm)
    divisible = ["state_ptr", "abort_ptr", "chunk_stride"]
    if aligned:
        divisible += ["x_ptr", "out_ptr", "residual_ptr", "weight_ptr", "y_ptr", "hidden"]
    return signature, constexprs, divisible


def compile_tail(hidden: int, dtype: torch.dtype, world: int, push: bool, aligned: bool, capability: int = 90,
                 norm: bool = True):
    """The fused kernel compiled for one call shape class and CUDA ``capability`` (Triton caches
    it on disk; a process without a GPU can compile it, as the CPU tests do)."""
    from ..kernels.compile_check import compile_for_target
    from ..kernels.layer_tail import all_reduce_rms_norm_kernel
    signature, constexprs, divisible = kernel_arguments(hidden, dtype, world, push, True, aligned, norm=norm)
    warps = 8 if constexprs["BLOCK_H"] >= 4096 else 4
    return compile_for_target(all_reduce_rms_norm_kernel, signature, constexprs, divisible, capability=capability,
                              num_warps=warps)


class TailPlan:
    """What a fused layer-tail call of one (rows, hidden, dtype, group) needs between calls:
    the workspace, the variant, the grid, the compiled kernel and its static arguments."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, group, device_index: int, variant: str,
                 aligned: bool, workspace=None, norm: bool = True):
        """workspace: the rank's workspace to run on (default: the group's; virtual ranks pass their own);
        norm: with the RMSNorm (else h alone: a model's last tail)."""
        self.rows, self.hidden, self.dtype, self.aligned, self.norm = rows, hidden, dtype, aligned, norm
        world = dist.get_world_size(group) if workspace is None else workspace.world_size
        # the one-shot all-reduce's layout: push slots of the rows rounded up to 16 elements
        self.geometry = call_geometry("all_reduce_one_shot", (rows, hidden), world)
        nbytes = self.geometry["elements"] * dtype.itemsize
        if workspace is None:
            workspace = get_workspace(group, nbytes, torch.device("cuda", device_index))
        elif nbytes > workspace.data_bytes:
            raise ValueError(f"{_OP}: {self.geometry['elements']} elements of {dtype} do not fit the workspace "
                             f"half of {workspace.data_bytes} bytes")
        self.workspace = workspace
        self.world, self.rank = workspace.world_size, workspace.rank
        self.push = choose_variant("all_reduce_one_shot", rows * hidden * dtype.itemsize, variant) == "push"
        self.programs = max(1, min(rows, self.workspace.processors, MAX_BARRIER_PROGRAMS))
        self.device_index = device_index
        self.halves = [self.workspace.tensor.data_ptr() + self.workspace.data_offset(half) for half in (0, 1)]
        self._launch = None

    def __repr__(self) -> str:
        return (f"TailPlan({'push' if self.push else 'pull'}{'' if self.norm else ', no norm'}, "
                f"{TRITON_DTYPE[self.dtype]} ({self.rows}, {self.hidden}) W={self.world}: {self.programs} programs)")

    def launch(self):
        """(CompiledLaunch, static arguments), built on the first call."""
        if self._launch is None:
            from ..kernels.launch import CompiledLaunch
            major, minor = torch.cuda.get_device_capability(self.device_index)
            compiled = compile_tail(self.hidden, self.dtype, self.world, self.push, self.aligned, major * 10 + minor,
                                    norm=self.norm)
            _, constexprs, _ = kernel_arguments(self.hidden, self.dtype, self.world, self.push, True, self.aligned,
                                                norm=self.norm)
            static = static_arguments("all_reduce_one_shot", self.workspace, self.geometry, self.rank, False)
            self._launch = (CompiledLaunch(compiled, tuple(constexprs.values())), static)
        return self._launch

    def run(self, x, residual, weight, out, y, eps: float, timeout_s: float | None) -> None:
        """weight and y: None without the norm (the kernel then reads and writes neither)."""
        address = x.data_ptr()
        if self.halves[0] <= address < self.halves[1] + self.workspace.data_bytes:
            x = x.clone()  # an input inside the workspace would be overwritten by the copy-in
        workspace = self.workspace
        workspace.begin_call(_OP, timeout_s)
        launch, static = self.launch()
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        launch(self.programs, stream, (x.data_ptr(), out.data_ptr(), workspace.state_address(),
                                       int(workspace.timeout_s * 1e9), *static, residual.data_ptr(),
                                       (residual if weight is None else weight).data_ptr(),
                                       (out if y is None else y).data_ptr(), self.rows, self.hidden, float(eps)))


_plans: dict[tuple, TailPlan] = memo("collectives.layer_tail plans")


def _check(x, residual, weight) -> None:
    shape = None if weight is None else tuple(weight.shape)
    if x.dim() != 2 or residual.shape != x.shape or shape not in (None, (x.shape[1],)):
        raise ValueError(f"{_OP}: x and residual must be [rows, hidden] of one shape and weight [hidden]; got x "
                         f"{tuple(x.shape)}, residual {tuple(residual.shape)}, weight {shape}")
    if not x.dtype == residual.dtype == (x.dtype if weight is None else weight.dtype):
        raise ValueError(f"{_OP}: x, residual and weight must share one dtype; got {x.dtype}, {residual.dtype}, "
                         f"{None if weight is None else weight.dtype}")


def _p2p_refusal(x, residual, weight, group) -> str:
    """Why the fused kernel cannot run this call ("" where it can): what every rank sees alike."""
    if not (x.is_cuda and residual.is_cuda and (weight is None or weight.is_cuda)):
        return f"it needs CUDA tensors, got {x.device}"
    if x.dtype not in TRITON_DTYPE:
        return f"it takes bf16, fp16 or fp32, got {x.dtype}"
    if x.shape[1] > MAX_HIDDEN:
        return f"rows of {x.shape[1]} elements exceed the kernel's {MAX_HIDDEN}"
    possible, why = p2p_possible(x, group)
    return "" if possible else why


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, group=None,
                        backend: str = "auto", timeout_s: float | None = None,
                        variant: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h, y)``: ``h = residual + sum of x over the group``, ``y = rms_norm(h) * weight``
    (weight None: ``(h, None)``, no norm; ``all_reduce_add``).

    x, residual: ``[rows, hidden]``; weight: ``[hidden]``. backend ``"p2p"``: the fused kernel
    (CUDA, the group within one NVLink node); ``"torch"``: torch.distributed's all-reduce, then the
    add and ``F.rms_norm``; ``"auto"``: p2p where it can run, torch elsewhere. Every rank passes
    the same shapes, dtype and backend.
    """
    if backend not in ("auto", "p2p", "torch"):
        raise ValueError(f"{_OP}: backend must be auto, p2p or torch, got {backend!r}")
    _check(x, residual, weight)
    if backend == "torch":
        return unfused_all_reduce_rms_norm(x, residual, weight, eps, group)
    reason = _p2p_refusal(x, residual, weight, group)
    if reason and backend == "auto":
        return unfused_all_reduce_rms_norm(x, residual, weight, eps, group)
    if reason:
        raise ValueError(f"{_OP}: backend p2p cannot run: {reason}")
    norm = weight is not None
    x, residual = x.contiguous(), residual.contiguous()
    weight = weight.contiguous() if norm else None
    rows, hidden = x.shape
    out, y = torch.empty_like(x), (torch.empty_like(x) if norm else None)
    aligned = hidden % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, residual, weight, out, y) if t is not None)
    key = (group, rows, hidden, x.dtype, x.get_device(), variant, aligned, norm)
    plan = _plans.get(key)
    if plan is None or plan.workspace.retired:
        plan = _plans[key] = TailPlan(rows, hidden, x.dtype, group, x.get_device(), variant, aligned, norm=norm)
    if rows:
        plan.run(x, residual, weight, out, y, eps, timeout_s)
    return out, y


def all_reduce_add(x: torch.Tensor, residual: torch.Tensor, group=None, backend: str = "auto",
                   timeout_s: float | None = None, variant: str = "auto") -> torch.Tensor:
    """``residual + sum of x over the group`` in one launch (p2p; the unfused pair elsewhere): a
    model's last decode tail, which no RMSNorm follows. As ``all_reduce_rms_norm`` without a weight."""
    return all_reduce_rms_norm(x, residual, None, 0.0, group, backend, timeout_s, variant)[0]
