"""The GEMM core: C = A @ B on one GPU, and the tile code the fused kernel shares.

`gemm_tile` is the K loop of one BM x BN output tile: TMA descriptor loads of A and B (masked
pointer loads where TMA cannot describe the strides) feeding wgmma through `tl.dot`, software
pipelined over STAGES. The fused GEMM + reduce-scatter kernel (gemm_rs.py) runs it for its GEMM
tasks; `gemm_kernel` runs it on a persistent grid that walks the output tiles in a fixed order
(tile t on program t mod P). The fixed order lets Triton pipeline the tile and K loops as one
(FLATTEN) or warp-specialize the loop (WS: a producer warpgroup issues the TMA loads, two
consumer warpgroups run wgmma); WS works on Hopper only in a narrow case (CORE_CANDIDATES).
The fused kernel claims its tasks dynamically (a reduce task waits for other programs' tiles),
so it runs the same tile code without those two options.

SPLIT_K > 1 (few output tiles: small M) cuts K into SPLIT_K slices; work unit u computes slice
u // tiles of tile u % tiles into an fp32 partial, and `splitk_sum_kernel` adds the partials.

    >>> c = gemm(a, b)                      # a [M, K], b [K, N] (or nn.Linear's weight.t())
    >>> gemm(a, b, config=GemmCoreConfig.parse("64x128x64/g8/s6/w4/k1"))
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch
import triton
import triton.language as tl

from ..caches import memo
from .launch import CompiledLaunch, multiprocessors
from .primitives import grouped_tile


@triton.jit
def gemm_tile(a_desc, a_ptr, b_desc, b_ptr, row0, col0, k_first, k_count, M, N, K,
              stride_am, stride_ak, stride_bk, stride_bn, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr,
              B_TRANSPOSED: tl.constexpr):
    """fp32 [BM, BN] = A[row0:, k] @ B[k, col0:] over the K tiles k_first .. k_first + k_count
    (tiles of BK; the last one masked / zero-filled by TMA past K)."""
    accumulator = tl.zeros((BM, BN), dtype=tl.float32)
    if USE_TMA:
        for kk in tl.range(k_first, k_first + k_count, num_stages=STAGES):
            a = a_desc.load([row0, kk * BK])
            if B_TRANSPOSED:
                b = b_desc.load([col0, kk * BK])
                accumulator = tl.dot(a, b.T, accumulator)
            else:
                b = b_desc.load([kk * BK, col0])
                accumulator = tl.dot(a, b, accumulator)
    else:
        rows = row0 + tl.arange(0, BM)
        cols = col0 + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        for kk in tl.range(k_first, k_first + k_count, num_stages=STAGES):
            k_index = kk * BK + ks
            a = tl.load(a_ptr + rows[:, None] * stride_am + k_index[None, :] * stride_ak,
                        mask=(rows[:, None] < M) & (k_index[None, :] < K), other=0.0)
            b = tl.load(b_ptr + k_index[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=(k_index[:, None] < K) & (cols[None, :] < N), other=0.0)
            accumulator = tl.dot(a, b, accumulator)
    return accumulator


@triton.jit
def gemm_kernel(a_desc, a_ptr, b_desc, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                stride_bn, stride_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr,
                B_TRANSPOSED: tl.constexpr, WS: tl.constexpr, SPLIT_K: tl.constexpr,
                FLATTEN: tl.constexpr = False, DEVICE_DESC: tl.constexpr = False):
    """C[M, N] = A @ B on a persistent grid (any number of programs). SPLIT_K > 1: c_ptr is an
    fp32 buffer [SPLIT_K, M, N] of partial products (row stride stride_cm = N). FLATTEN (not
    with WS): Triton pipelines the tile loop and the K loop as one, so the next tile's first
    loads are issued before the last tile's epilogue. DEVICE_DESC: the TMA descriptors are
    built by each program in global scratch memory from the pointers (a_desc, b_desc unused)."""
    if DEVICE_DESC:
        a_load = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BM, BK])
        if B_TRANSPOSED:
            b_load = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                               block_shape=[BN, BK])
        else:
            b_load = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1],
                                               block_shape=[BK, BN])
    else:
        a_load = a_desc
        b_load = b_desc
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    tiles = tiles_m * tiles_n
    k_tiles = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    for unit in tl.range(tl.program_id(0), tiles * SPLIT_K, tl.num_programs(0),
                         warp_specialize=WS, flatten=FLATTEN):
        tile = unit % tiles
        split = unit // tiles
        tile_m, tile_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        k_first = split * per_split
        accumulator = gemm_tile(a_load, a_ptr, b_load, b_ptr, tile_m * BM, tile_n * BN, k_first,
                                tl.minimum(per_split, k_tiles - k_first), M, N, K, stride_am,
                                stride_ak, stride_bk, stride_bn, BM, BN, BK, STAGES, USE_TMA,
                                B_TRANSPOSED)
        rows = tile_m * BM + tl.arange(0, BM)
        cols = tile_n * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        if SPLIT_K == 1:
            tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
                     accumulator.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            partial = c_ptr + split.to(tl.int64) * M * N
            tl.store(partial + rows[:, None] * stride_cm + cols[None, :], accumulator, mask=mask)


@triton.jit
def splitk_sum_kernel(partial_ptr, c_ptr, M, N, stride_cm, SPLIT_K: tl.constexpr,
                      BLOCK: tl.constexpr):
    """C[i] = sum over s of partial[s, i] (fp32), in C's dtype; one BLOCK of elements per
    program."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * M * N + index, mask=mask, other=0.0)
    row = index // N
    tl.store(c_ptr + row * stride_cm + index - row * N, total.to(c_ptr.dtype.element_ty),
             mask=mask)


@dataclasses.dataclass(frozen=True)
class GemmCoreConfig:
    """Tiles and pipeline of the GEMM core. warp_specialize needs TMA, device descriptors,
    64-row tiles and num_warps = 4 (the consumers then hold 2 x 4 warps, the producer 4 more:
    12 warps); see CORE_CANDIDATES for what was measured. pipelined (/gl): the tile loop of
    gemm_gluon.py, whose TMA pipeline runs across tiles (TMA operands and output, split_k 1,
    K of at least stages - 1 blocks; other calls run this kernel with the same tiles)."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    warp_specialize: bool = False
    split_k: int = 1
    flatten: bool = False
    device_descriptors: bool = False
    pipelined: bool = False

    @classmethod
    def parse(cls, text: str) -> "GemmCoreConfig":
        """The config str() printed as `text`.

        >>> GemmCoreConfig.parse("128x256x64/g8/s4/w4/ws/k1")
        GemmCoreConfig(block_m=128, block_n=256, block_k=64, group_m=8, stages=4, warps=4, warp_specialize=True, split_k=1, flatten=False, device_descriptors=False, pipelined=False)
        """
        tile, *parts = text.split("/")
        flags = {part for part in parts if part in ("ws", "fl", "dd", "gl")}
        try:
            block_m, block_n, block_k = (int(v) for v in tile.split("x"))
            numbers = {part[0]: int(part[1:]) for part in parts if part not in flags}
            if set(numbers) != set("gswk") or {"ws", "fl"} <= flags or \
                    ("gl" in flags and len(flags) > 1):
                raise ValueError
        except ValueError:
            raise ValueError(f"not a GemmCoreConfig string: {text!r}") from None
        return cls(block_m, block_n, block_k, numbers["g"], numbers["s"], numbers["w"],
                   "ws" in flags, numbers["k"], "fl" in flags, "dd" in flags, "gl" in flags)

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/g{self.group_m}/s{self.stages}"
                f"/w{self.warps}{'/ws' if self.warp_specialize else ''}"
                f"{'/fl' if self.flatten else ''}{'/dd' if self.device_descriptors else ''}"
                f"{'/gl' if self.pipelined else ''}/k{self.split_k}")


CORE_CANDIDATES = tuple(GemmCoreConfig.parse(text) for text in (
    "128x256x64/g8/s3/w8/gl/k1",     # Gluon: the pipeline runs across tiles (gemm_gluon.py)
    "128x256x64/g8/s4/w8/gl/k1",
    "64x128x64/g8/s6/w4/gl/k1",
    "128x256x64/g8/s3/w8/fl/k1",     # tile and K loops pipelined as one
    "128x256x64/g8/s4/w8/fl/k1",
    "128x256x64/g8/s3/w8/k1",        # the fused kernel's tile
    "128x256x64/g8/s4/w8/k1",
    "64x128x64/g8/s6/w4/k1",         # small M: 128 tiles at M = 128, N = 8192
    "64x128x64/g8/s6/w4/fl/k1",
    "128x128x64/g8/s4/w8/k2",        # small M: split-K (fp32 partials, then a sum kernel)
    "64x128x64/g8/s6/w4/ws/dd/k1",   # warp-specialized, descriptors built on the device
))
# Triton 3.6's Hopper warp specialization, measured on an H200 (benchmarks/results/
# gemm_onegpu_probe.md): with host-encoded descriptors the first launch never finished; with
# device-built descriptors 128-row tiles returned NaN and 64-row tiles ran at half speed.
# CoreLaunch refuses the first two. The Gluon tile loop measured 0.97-1.04 of cuBLAS on twelve
# shapes where the Triton loop measured 0.93-1.01 (benchmarks/results/gemm_gluon_probe.md).
LARGE_TILE = CORE_CANDIDATES[0]
SMALL_TILE = CORE_CANDIDATES[7]

_TUNED_PATH = os.path.join(os.path.dirname(__file__), "gemm_tuned.json")


def _load_tuned(path: str = _TUNED_PATH) -> dict[str, GemmCoreConfig]:
    """{"MxNxK": config string}: the fastest candidate per shape in the recorded benchmark
    (benchmarks/bench_gemm.py --tables-from)."""
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        return {key: GemmCoreConfig.parse(text) for key, text in json.load(handle)["best"].items()}


TUNED: dict[str, GemmCoreConfig] = _load_tuned()


def core_config(m: int, n: int, k: int, device_index: int = 0) -> GemmCoreConfig:
    """The measured best config of this shape, else a heuristic: 128 x 256 tiles, smaller
    tiles or split-K when they leave most SMs idle.

    >>> str(core_config(128, 8192, 7168, 0))      # 32 tiles of 128 x 256 on 132 SMs
    '64x128x64/g8/s6/w4/k1'
    """
    tuned = TUNED.get(f"{m}x{n}x{k}")
    if tuned is not None:
        return tuned
    processors = multiprocessors(device_index) if torch.cuda.is_available() else 132
    if triton.cdiv(m, 128) * triton.cdiv(n, 256) * 2 >= processors:
        return LARGE_TILE
    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
    if tiles * 2 >= processors:
        return SMALL_TILE
    split = max(1, min(8, processors // max(tiles, 1), triton.cdiv(k, 64) // 4))
    return dataclasses.replace(SMALL_TILE, split_k=split)


def tma_compatible(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe t: 16-byte aligned base and row stride, unit
    column stride."""
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and (t.stride(0) * t.element_size()) % 16 == 0)


class DescriptorBase:
    """Stands in for a tensor as a descriptor's base: the address and dtype are all the
    encoder reads, and, unlike the tensor, it does not keep the memory alive."""
    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype):
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


def encoded_at(kernel: CompiledLaunch, position: int, cache: dict, address: int,
               layout: tuple) -> list:
    """What the C launcher takes for the descriptor argument at `position` when its operand
    (layout: dtype, shape, strides, block; only the address varies) sits at `address`; encoded
    once per address in `cache` (weights and reused buffers encode once; at most 64 kept)."""
    encoded = cache.get(address)
    if encoded is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if len(cache) >= 64:
            cache.clear()
        dtype, shape, strides, block = layout
        encoded = cache[address] = kernel.descriptor_arguments(
            position, TensorDescriptor(DescriptorBase(address, dtype), shape, strides, block))
    return encoded


class CoreLaunch:
    """One specialization of the GEMM core, ready to launch: compiled kernel, grid and every
    argument that does not change between calls. A call fills in the encoded descriptors of A
    and B (cached by address), the three pointers, and launches; split-K adds the sum.

    >>> launch = core_launch(a, b, c, config)       # compiles on first use of the shapes
    >>> launch(a, b, c)                             # a few microseconds of CPU
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, b_transposed: bool, c: torch.Tensor,
                 config: GemmCoreConfig):
        from triton.tools.tensor_descriptor import TensorDescriptor

        m, k = a.shape
        n = b.shape[0] if b_transposed else b.shape[1]
        self.m, self.n, self.k, self.config = m, n, k, config
        self.use_tma = tma_compatible(a) and tma_compatible(b)
        self.device_index = a.device.index
        split = config.split_k
        self.block_a = [config.block_m, config.block_k]
        self.block_b = ([config.block_n, config.block_k] if b_transposed
                        else [config.block_k, config.block_n])
        if b_transposed:  # b holds [N, K]: element (k, n) at n * stride(0) + k
            strides = (a.stride(0), a.stride(1), b.stride(1), b.stride(0))
        else:
            strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1))
        self.partial = (torch.empty((split, m, n), dtype=torch.float32, device=a.device)
                        if split > 1 else None)
        target = self.partial if split > 1 else c
        stride_cm = n if split > 1 else c.stride(0)
        if config.warp_specialize and not config.device_descriptors:
            raise ValueError(f"{config}: warp specialization with host-encoded descriptors hung "
                             f"on Hopper (Triton 3.6); use device descriptors (/dd)")
        if config.warp_specialize and config.block_m > 64:
            raise ValueError(f"{config}: warp-specialized tiles of more than 64 rows returned "
                             f"NaN on Hopper (Triton 3.6)")
        device_desc = config.device_descriptors and self.use_tma
        constexprs = dict(BM=config.block_m, BN=config.block_n, BK=config.block_k,
                          GROUP_M=config.group_m, STAGES=config.stages, USE_TMA=self.use_tma,
                          B_TRANSPOSED=b_transposed and self.use_tma,
                          WS=config.warp_specialize and self.use_tma, SPLIT_K=split,
                          FLATTEN=config.flatten and not config.warp_specialize,
                          DEVICE_DESC=device_desc)
        host_desc = self.use_tma and not device_desc
        a_desc = TensorDescriptor.from_tensor(a, self.block_a) if host_desc else None
        b_desc = TensorDescriptor.from_tensor(b, self.block_b) if host_desc else None
        if not self.use_tma and b_transposed:
            raise ValueError("the pointer path takes B as row-major [K, N]")
        self.use_tma = host_desc  # whether calls refill encoded descriptors
        args = (a_desc, a, b_desc, b, target, m, n, k, *strides, stride_cm)
        kernel = gemm_kernel.warmup(*args, **constexprs, num_warps=config.warps,
                                    num_stages=config.stages, grid=(1,))
        self.kernel = CompiledLaunch(kernel, tuple(constexprs.values()))
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n) * split
        self.grid = max(1, min(tiles, multiprocessors(self.device_index)))
        scratch = kernel.metadata.global_scratch_size
        # device-built descriptors live in global scratch memory, one slice per program
        self.scratch = (torch.empty(self.grid * scratch, dtype=torch.uint8, device=a.device)
                        if scratch else None)
        self.scratch_address = self.scratch.data_ptr() if scratch else None
        # the C launcher's argument list; slots of A, B and C are refilled per call
        self.template: list = []
        self.slots: dict[str, object] = {}
        for name, value in zip(("a_desc", "a", "b_desc", "b", "c"), args[:5]):
            if name.endswith("_desc"):
                position = gemm_kernel.arg_names.index(name)
                if value is None:
                    self.template.append(None)
                    continue
                encoded = self.kernel.descriptor_arguments(position, value)
                self.slots[name] = (len(self.template), len(encoded), position)
                self.template.extend(encoded)
            else:
                self.slots[name] = len(self.template)
                self.template.append(value.data_ptr())
        self.template.extend(int(v) for v in args[5:])
        self._encoded: dict[str, dict[int, list]] = {"a": {}, "b": {}}
        # (dtype, shape, strides, block) of each operand's descriptor; only the address varies
        self.a_layout = (a.dtype, list(a.shape), list(a.stride()), self.block_a)
        self.b_layout = (b.dtype, list(b.shape), list(b.stride()), self.block_b)
        self.copy_a = self.copy_b = False  # set by gemm when it hands this launch copies
        self.sum = None
        if split > 1:
            block = 1024
            self.sum_grid = triton.cdiv(m * n, block)
            sum_args = (self.partial, c, m, n, c.stride(0))
            compiled = splitk_sum_kernel.warmup(*sum_args, SPLIT_K=split, BLOCK=block,
                                                num_warps=4, grid=(1,))
            self.sum = CompiledLaunch(compiled, (split, block))
            self.sum_static = (self.partial.data_ptr(), m, n, c.stride(0))

    def _encode(self, name: str, address: int, dtype: torch.dtype, shape: list,
                strides: list, block: list) -> list:
        return encoded_at(self.kernel, self.slots[name + "_desc"][2], self._encoded[name],
                          address, (dtype, shape, strides, block))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        """Launch on a, b (as given to gemm: [K, N], or the transposed view of [N, K]) and c,
        which must have this specialization's shapes, strides and alignment."""
        args = list(self.template)
        a_address, b_address = a.data_ptr(), b.data_ptr()
        if self.use_tma:
            start, length, _ = self.slots["a_desc"]
            args[start:start + length] = self._encode("a", a_address, *self.a_layout)
            start, length, _ = self.slots["b_desc"]
            args[start:start + length] = self._encode("b", b_address, *self.b_layout)
        args[self.slots["a"]] = a_address
        args[self.slots["b"]] = b_address
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        if self.sum is None:
            args[self.slots["c"]] = c.data_ptr()
            self.kernel.launch_expanded(self.grid, stream, args, self.scratch_address)
        else:
            self.kernel.launch_expanded(self.grid, stream, args, self.scratch_address)
            self.sum.launch_expanded(self.sum_grid, stream,
                                     [self.sum_static[0], c.data_ptr(), *self.sum_static[1:]])


class PipelinedLaunch:
    """A /gl config's launch: the Gluon tile loop (gemm_gluon.gemm_pipelined_kernel) compiled for
    one specialization, with the A, B and C descriptors encoded once per address (C's block is
    [BM, BN / EPILOGUE_SPLIT]: the epilogue's TMA stores). Same call as CoreLaunch.

    >>> launch = PipelinedLaunch(a, w, True, c, GemmCoreConfig.parse("128x256x64/g8/s3/w8/gl/k1"))
    >>> launch(a, w, c)                             # c = a @ w.t()
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, b_transposed: bool, c: torch.Tensor,
                 config: GemmCoreConfig):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from .gemm_gluon import EPILOGUE_SPLIT, gemm_pipelined_kernel, shared_layout

        m, k = a.shape
        n = b.shape[0] if b_transposed else b.shape[1]
        self.m, self.n, self.k, self.config = m, n, k, config
        self.device_index = a.device.index
        blocks = ([config.block_m, config.block_k],
                  [config.block_n, config.block_k] if b_transposed
                  else [config.block_k, config.block_n],
                  [config.block_m, config.block_n // EPILOGUE_SPLIT])
        descriptors = [TensorDescriptor.from_tensor(t, block, shared_layout(block, a.dtype))
                       for t, block in zip((a, b, c), blocks)]
        constexprs = dict(GROUP_M=config.group_m, STAGES=config.stages, B_TRANSPOSED=b_transposed,
                          EPILOGUE_SPLIT=EPILOGUE_SPLIT, num_warps=config.warps)
        compiled = gemm_pipelined_kernel.warmup(*descriptors, m, n, k, **constexprs, grid=(1,))
        self.kernel = CompiledLaunch(compiled, tuple(constexprs.values()))
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
        self.grid = max(1, min(tiles, multiprocessors(self.device_index)))
        self.layouts = [(t.dtype, list(t.shape), list(t.stride()), block)
                        for t, block in zip((a, b, c), blocks)]
        self.positions = [gemm_pipelined_kernel.arg_names.index(name)
                          for name in ("a_desc", "b_desc", "c_desc")]
        self._encoded: list[dict[int, list]] = [{}, {}, {}]
        self.tail = [m, n, k]
        self.copy_a = self.copy_b = False  # set by gemm when it hands this launch copies

    def _encode(self, operand: int, address: int) -> list:
        """Encoded descriptor of operand 0 / 1 / 2 (A / B / C) at `address`."""
        return encoded_at(self.kernel, self.positions[operand], self._encoded[operand], address,
                          self.layouts[operand])

    def __call__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        """Launch on a, b and c of this specialization's shapes, strides and alignment."""
        args = [*self._encode(0, a.data_ptr()), *self._encode(1, b.data_ptr()),
                *self._encode(2, c.data_ptr()), *self.tail]
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        self.kernel.launch_expanded(self.grid, stream, args)


def pipelined_fits(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   config: GemmCoreConfig) -> bool:
    """Whether the Gluon tile loop takes these operands: TMA-describable A, B and C, one K slice,
    and at least stages - 1 K blocks (a load runs at most one tile ahead)."""
    return (config.split_k == 1 and tma_compatible(a) and tma_compatible(b)
            and tma_compatible(out) and triton.cdiv(a.shape[1], config.block_k) >= config.stages - 1)


_launches: dict[tuple, CoreLaunch | PipelinedLaunch] = memo("kernels.gemm launches")


def cached_launches() -> int:
    """How many specializations the launcher cache holds (a repeated call adds none)."""
    return len(_launches)


def _orient(b: torch.Tensor, k: int) -> tuple[torch.Tensor, bool]:
    """B as row-major [K, N], or as the row-major [N, K] it is the transpose of (nn.Linear's
    weight.t()); other strides are copied."""
    if b.stride(0) == 1 and b.stride(1) == k and b.shape[1] > 1:
        return b.t(), True
    if b.stride(1) == 1 and b.stride(0) == b.shape[1]:
        return b, False
    return b.contiguous(), False


def _new_launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None,
                config: GemmCoreConfig | None) -> CoreLaunch | PipelinedLaunch:
    """Validate the operands of a first call and build its launch (copying operands whose
    strides neither TMA nor the pointer path can take; the launch then copies every call)."""
    copy_a = a.stride(-1) != 1 or a.stride(0) != a.shape[1]
    a = a.contiguous() if copy_a else a
    m, k = a.shape
    n = b.shape[1]
    oriented, b_transposed = _orient(b, k)
    copy_b = oriented.data_ptr() != b.data_ptr() and not b_transposed
    if b_transposed and not (tma_compatible(a) and tma_compatible(oriented)):
        oriented, b_transposed, copy_b = b.contiguous(), False, True
    out = torch.empty((m, n), dtype=a.dtype, device=a.device) if out is None else out
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype \
            or out.dtype != a.dtype:
        raise ValueError(f"gemm: a, b and out must be bf16 or fp16 of one dtype, got "
                         f"{a.dtype}, {b.dtype}, {out.dtype}")
    if b.shape[0] != k or out.shape != (m, n):
        raise ValueError(f"gemm: shapes do not match: a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"out {tuple(out.shape)}")
    if not (a.is_cuda and b.device == a.device and out.device == a.device):
        raise ValueError(f"gemm: tensors must be on one CUDA device: a on {a.device}, b on "
                         f"{b.device}, out on {out.device}")
    if out.stride(1) != 1:
        raise ValueError("gemm: out must have unit column stride")
    chosen = config or core_config(m, n, k, a.device.index)
    if chosen.pipelined and pipelined_fits(a, oriented, out, chosen):
        launch = PipelinedLaunch(a, oriented, b_transposed, out, chosen)
    else:
        launch = CoreLaunch(a, oriented, b_transposed, out,
                            dataclasses.replace(chosen, pipelined=False))
    launch.copy_a, launch.copy_b = copy_a, copy_b
    return launch


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
         config: GemmCoreConfig | None = None) -> torch.Tensor:
    """a @ b for bf16 / fp16 a [M, K] and b [K, N] (fp32 accumulation), on the GEMM core.
    The first call of a specialization (shapes, strides, dtypes, 16-byte alignment, config)
    validates and compiles; later ones look it up and launch.

    >>> a = torch.randn(2048, 7168, device="cuda", dtype=torch.bfloat16)
    >>> w = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16)   # nn.Linear weight
    >>> gemm(a, w.t()).shape
    torch.Size([2048, 8192])
    """
    a_address, b_address = a.data_ptr(), b.data_ptr()
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device,
           (a_address | b_address) & 15, config,
           None if out is None else (out.shape, out.stride(), out.dtype, out.data_ptr() & 15))
    launch = _launches.get(key)
    if launch is None:
        if len(_launches) >= 256:
            _launches.clear()
        launch = _launches[key] = _new_launch(a, b, out, config)
    if launch.copy_a:
        a = a.contiguous()
    if launch.copy_b:
        b = b.contiguous()
    if out is None:
        out = torch.empty((launch.m, launch.n), dtype=a.dtype, device=a.device)
    launch(a, b, out)
    return out
