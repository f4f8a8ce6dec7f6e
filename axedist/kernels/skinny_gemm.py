"""Products of a few rows: ``c = a @ b`` for ``a`` [M, K] with M <= 64 (a decode step's tokens)
and a weight ``b`` [K, N], in one launch that streams the weight once.

At decode a linear layer reads its whole weight to produce a handful of rows: the work is memory
bound, and the weight's bytes are the time. cuBLAS runs such products as split-K tiles (64 or 128
output columns by 8 rows) plus a second ``splitKreduce`` kernel that sums the K slices: two
launches a product, 24 of a 4-layer TP = 2 decode step's 121 kernels (docs/gpu_notes.md). Here
every program owns ``BLOCK_N`` output columns over the whole K (no split, so no second kernel),
and the grid has enough programs (N / BLOCK_N, hundreds at the decode shapes) to keep every SM's
memory pipeline full:

  DOT = False (M == 1)  the weight tile [BLOCK_N, BLOCK_K] times the row, accumulated elementwise
                        in fp32 and summed over K once at the end;
  DOT = True  (M > 1)   tl.dot of the rows' tile [BLOCK_M, BLOCK_K] (BLOCK_M >= 16, masked) and
                        the weight tile, fp32 accumulation.

The sum over K runs in a fixed order (a program's K steps in turn), so a product is the same on
every call. Which products run here and with which tiles: ``skinny_config``.
"""
from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from ..caches import cached, memo

__all__ = ["MAX_ROWS", "SkinnyConfig", "heuristic_config", "skinny_config", "skinny_mm", "smallest_chosen", "table_key"]

# the most rows a product may have to run here (the decode batch sizes)
MAX_ROWS = 64


@triton.jit
def skinny_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                       stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
                       K_INNER: tl.constexpr):
    """c[:M, n block] = a[:M, :K] @ b[:K, n block] for program n; fp32 accumulation.
    EVEN: K a multiple of BLOCK_K and N of BLOCK_N (the loads need no mask but the rows').
    K_INNER: a's and b's K strides are 1 (stride_ak, stride_bk unread), so that the loads of
    consecutive K elements vectorize (a linear's input and weight.t())."""
    if K_INNER:
        stride_ak = 1
        stride_bk = 1
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if DOT:
        offs_m = tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs, mask=in_m[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                in_k = k0 + offs_k < K
                a = tl.load(a_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
            if a_ptr.dtype.element_ty == tl.float32:
                acc = tl.dot(a, b, acc, input_precision="ieee")  # torch.mm's fp32, not TF32
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])
    else:
        a_ptrs = a_ptr + offs_k * stride_ak
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                in_k = k0 + offs_k < K
                a = tl.load(a_ptrs, mask=in_k, other=0.0)
                b = tl.load(b_ptrs, mask=in_n[:, None] & in_k[None, :], other=0.0)
            acc += b.to(tl.float32) * a.to(tl.float32)[None, :]
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        tl.store(c_ptr + offs_n * stride_cn, tl.sum(acc, axis=1).to(c_ptr.dtype.element_ty), mask=in_n)


class SkinnyConfig(tuple):
    """(block_n, block_k, num_warps, num_stages) of one product shape."""

    __slots__ = ()

    def __new__(cls, block_n: int, block_k: int, num_warps: int, num_stages: int):
        return super().__new__(cls, (block_n, block_k, num_warps, num_stages))

    def __repr__(self) -> str:
        return "n{}k{}w{}s{}".format(*self)


def _block_m(rows: int) -> int:
    return 1 if rows == 1 else max(16, triton.next_power_of_2(rows))


def heuristic_config(rows: int, n: int, k: int) -> SkinnyConfig:
    """Tiles for a [rows, k] @ [k, n] product: output columns per program so that the grid has
    at least about two programs per SM of an H100 / H200 (132) where the columns allow."""
    block_n = 16 if rows > 1 else 8
    while block_n > (16 if rows > 1 else 2) and n // block_n < 264:
        block_n //= 2
    block_k = 512 if rows == 1 else 128
    return SkinnyConfig(block_n, block_k, 4, 3)


def table_key(rows: int, n: int, k: int) -> str:
    """The tuned table's key of a product: rows in buckets (1; 2-16, measured at 8; 17-64, at 64)."""
    bucket = 1 if rows == 1 else 16 if rows <= 16 else 64
    return f"M{bucket}_N{n}_K{k}"


@cached(maxsize=None)
def _tuned() -> dict:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "skinny_tuned.json")) as f:
        return json.load(f)


@cached(maxsize=None)
def smallest_chosen(rows: int) -> tuple[int, int]:
    """(N, K) below which the table never chose this kernel for products of ``rows`` rows (the
    least N and the least K of the chosen entries of their bucket; (inf, inf) when it chose none):
    a product with fewer columns or a shallower contraction, its own shard included, never runs
    here."""
    bucket = table_key(rows, 0, 0).split("_")[0]
    chosen = [key for key, entry in _tuned().items() if entry != "cublas" and key.split("_")[0] == bucket]
    if not chosen:
        return (float("inf"), float("inf"))
    sizes = [tuple(int(part[1:]) for part in key.split("_")[1:]) for key in chosen]
    return (min(n for n, _ in sizes), min(k for _, k in sizes))


@cached(maxsize=None)
def skinny_config(rows: int, n: int, k: int) -> SkinnyConfig | None:
    """The shipped choice for a product with K innermost in both operands (skinny_tuned.json,
    written by benchmarks/bench_skinny_gemm.py from device timings of ``x @ weight.t()``): its
    tiles where this kernel beat cuBLAS at that shape, None where cuBLAS was faster or the shape
    was not measured."""
    entry = _tuned().get(table_key(rows, n, k))
    return None if entry is None or entry == "cublas" else SkinnyConfig(*entry)


def skinny_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
              config: SkinnyConfig | None = None) -> torch.Tensor:
    """``a @ b`` for CUDA ``a`` [M, K] (1 <= M <= MAX_ROWS) and ``b`` [K, N] of one floating
    dtype (any strides; a linear's ``weight.t()`` reads its rows contiguously), into ``out``
    [M, N] when given. ``config``: the tiles (default: the shipped ones, else the heuristic's)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"skinny_mm multiplies [M, K] by [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    rows, k = a.shape
    n = b.shape[1]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny_mm takes 1 to {MAX_ROWS} rows, got {rows}")
    if a.dtype != b.dtype or not a.dtype.is_floating_point:
        raise ValueError(f"skinny_mm needs one floating dtype, got {a.dtype} and {b.dtype}")
    if out is None:
        out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != (rows, n) or out.dtype != a.dtype:
        raise ValueError(f"out must be [{rows}, {n}] of {a.dtype}, got {tuple(out.shape)} of {out.dtype}")
    if k == 0:
        return out.zero_()
    config = config or skinny_config(rows, n, k) or heuristic_config(rows, n, k)
    block_n, block_k, num_warps, num_stages = config
    constexprs = dict(BLOCK_M=_block_m(rows), BLOCK_N=block_n, BLOCK_K=block_k, DOT=rows > 1,
                      EVEN=k % block_k == 0 and n % block_n == 0, K_INNER=a.stride(1) == 1 and b.stride(0) == 1)
    programs = triton.cdiv(n, block_n)
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1))
    if not a.is_cuda:  # the Triton interpreter (CPU tests)
        skinny_gemm_kernel[(programs,)](a, b, out, rows, n, k, *strides, **constexprs, num_warps=num_warps,
                                        num_stages=num_stages)
        return out
    if not a.device == b.device == out.device:
        raise ValueError(f"skinny_mm needs a, b and out on one device, got {a.device}, {b.device}, {out.device}")
    if a.device.index != torch.cuda.current_device():  # a launch runs in the current device's context
        with torch.cuda.device(a.device):
            return skinny_mm(a, b, out, config)
    launch = _launcher(a, b, out, strides, config, constexprs)
    launch(programs, torch._C._cuda_getCurrentRawStream(a.device.index),
           (a.data_ptr(), b.data_ptr(), out.data_ptr(), rows, n, k, *strides))
    return out


# specialization -> CompiledLaunch (kernels/launch.py: the call goes straight to Triton's C
# launcher, without its per-call binding: about 20 us of CPU a call on the H200 hosts, as cuBLAS's,
# against 28-57 through `kernel[grid]`)
_LAUNCHES = memo("skinny GEMM launchers")


def _launcher(a, b, out, strides: tuple, config: SkinnyConfig, constexprs: dict):
    """The compiled kernel of this call's specialization (everything Triton specializes on:
    exact sizes and strides, 16-byte alignment of each pointer, dtype, tiles, device), compiled
    through Triton's JIT once without launching."""
    rows, k = a.shape
    key = (a.dtype, rows, b.shape[1], k, strides, a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0,
           out.data_ptr() % 16 == 0, config, a.device.index)
    launch = _LAUNCHES.get(key)
    if launch is None:
        from .launch import CompiledLaunch
        kernel = skinny_gemm_kernel.warmup(a, b, out, rows, b.shape[1], k, *strides, **constexprs,
                                           num_warps=config[2], num_stages=config[3], grid=(1,))
        launch = _LAUNCHES[key] = CompiledLaunch(kernel, tuple(constexprs.values()))
    return launch
