"""Fused GEMM + all-reduce for decode (M = 1..256 rows) in ONE Triton kernel.

out = sum_p A_p @ B_p   on every rank, for A_p [M, K_local] and B_p [K_local, N] (or nn.Linear's
weight.t()): the row-parallel linear without sequence parallelism, where a few rows make the
all-reduce's latency, not its bandwidth, the cost.

Each program computes output tiles (BM x BN) of this rank's partial, then
  one-shot  PUSH: stores its tile into slot `rank` of every rank's workspace and releases flag
            (rank, tile) there (posted writes: one NVLink trip); every rank then waits on its own
            flags and sums the W slots of each tile, in rank order.
            pull (PUSH = False; p2p or MULTIMEM): stores the tile into its own slot, releases its
            own flag; every rank waits on every rank's flag and sums the tiles it loads from
            them (in rank order), or asks the switch for the sum (multimem.ld_reduce).
  two-shot  tile t is reduced by rank t % W only (PUSH: the others push their tile to its slot),
            which stores the result and hands it to every rank (PUSH: into their result area,
            pull: they load it from the owner's), each with a flag.
Every rank's output is bit-identical (same sums in the same order, or the owner's result).

Each phase loops over its tiles before the next starts, and every wait is on a tile that a
program computes or reduces without waiting first: no deadlock for any grid, given that all
programs are resident (the grid never exceeds the SMs the rank may fill).

Workspace half (elements of the call's dtype): slots [W][M][N] at s * M * N, the reduced result
area [M][N] at W * M * N. Flags: (source, tile) at source * tiles + tile; "reduced" at
W * tiles + tile. PHASES (interpreter tests only): 1 the tiles, 2 the reduce, 4 the two-shot
gather; 7 all of them with their flags and waits.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .gemm import gemm_tile, tma_compatible
from .gemm_rs import descriptor, launch_template
from .launch import CompiledLaunch
from .primitives import (call_epoch, fence_acq_rel_sys, finish_call, load_reduce, peer_pointers,
                         pick, shift8, st_release_sys, wait_flag)


@triton.jit
def _release_all(F0, F1, F2, F3, F4, F5, F6, F7, flag, epoch, rank, WORLD: tl.constexpr):
    """Flag `flag` = epoch in every rank's flag array, after every thread's stores so far."""
    fence_acq_rel_sys(flag)
    tl.debug_barrier()
    for step in tl.static_range(WORLD):
        peer = (rank + step) % WORLD
        st_release_sys(pick(peer, F0, F1, F2, F3, F4, F5, F6, F7) + flag * 4, epoch)


@triton.jit
def _release_one(F0, F1, F2, F3, F4, F5, F6, F7, owner, flag, epoch):
    fence_acq_rel_sys(flag)
    tl.debug_barrier()
    st_release_sys(pick(owner, F0, F1, F2, F3, F4, F5, F6, F7) + flag * 4, epoch)


@triton.jit
def _tile_offsets(tile, tiles_m, M, N, BM: tl.constexpr, BN: tl.constexpr):
    # tile t covers rows (t % tiles_m) * BM .. and columns (t // tiles_m) * BN ..
    rows = (tile % tiles_m) * BM + tl.arange(0, BM)
    cols = (tile // tiles_m) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    return rows[:, None] * N + cols[None, :], mask


@triton.jit(do_not_specialize=["rank", "timeout_ns", "half_bytes"])
def gemm_all_reduce_kernel(
        a_desc, a_ptr, b_desc, b_ptr, out_ptr,
        D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
        F0, F1, F2, F3, F4, F5, F6, F7,
        state_ptr, abort_ptr, error_address, timeout_ns,
        M, N, K, stride_am, stride_bk, stride_bn, rank, half_bytes,
        WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        STAGES: tl.constexpr, USE_TMA: tl.constexpr, B_TRANSPOSED: tl.constexpr,
        TWO_SHOT: tl.constexpr, PUSH: tl.constexpr, MULTIMEM: tl.constexpr,
        ALIGNED: tl.constexpr, PHASES: tl.constexpr):
    """out [M, N] (row-major) = sum over ranks of A @ B (see the module docstring). D*: every
    rank's data half 0 (the kernel moves to its epoch's half); F*: flag arrays."""
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    SIGNAL: tl.constexpr = PHASES == 7
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    multicast_base += parity * half_bytes  # (used by MULTIMEM only)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BM)
    tiles = tiles_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    slot_elements = M * N
    result = WORLD * slot_elements     # the reduced result area (two-shot)
    own_data = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
    own_flags = pick(rank, F0, F1, F2, F3, F4, F5, F6, F7)
    if PHASES & 1:
        for tile in range(pid, tiles, programs):
            accumulator = gemm_tile(a_desc, a_ptr, b_desc, b_ptr, (tile % tiles_m) * BM,
                                    (tile // tiles_m) * BN, 0, k_tiles, M, N, K, stride_am, 1,
                                    stride_bk, stride_bn, BM, BN, BK, STAGES, USE_TMA,
                                    B_TRANSPOSED)
            offsets, mask = _tile_offsets(tile, tiles_m, M, N, BM, BN)
            values = accumulator.to(ELEMENT)
            if PUSH:
                flag = rank * tiles + tile
                if TWO_SHOT:
                    owner = tile % WORLD
                    slot = pick(owner, D0, D1, D2, D3, D4, D5, D6, D7)
                    tl.store(peer_pointers(slot, rank * slot_elements + offsets, ELEMENT, ALIGNED),
                             values, mask=mask)
                    if SIGNAL:
                        _release_one(F0, F1, F2, F3, F4, F5, F6, F7, owner, flag, epoch)
                else:
                    for step in tl.static_range(WORLD):
                        peer = (rank + step) % WORLD
                        slot = pick(peer, D0, D1, D2, D3, D4, D5, D6, D7)
                        tl.store(peer_pointers(slot, rank * slot_elements + offsets, ELEMENT,
                                               ALIGNED), values, mask=mask)
                    if SIGNAL:
                        _release_all(F0, F1, F2, F3, F4, F5, F6, F7, flag, epoch, rank, WORLD)
            else:
                tl.store(peer_pointers(own_data, offsets, ELEMENT, ALIGNED), values, mask=mask)
                if SIGNAL:
                    _release_one(F0, F1, F2, F3, F4, F5, F6, F7, rank, tile, epoch)
    if PHASES & 2:
        if TWO_SHOT:
            first, stride = rank + pid * WORLD, programs * WORLD   # the tiles this rank owns
        else:
            first, stride = pid, programs
        for tile in range(first, tiles, stride):
            offsets, mask = _tile_offsets(tile, tiles_m, M, N, BM, BN)
            total = tl.zeros((BM, BN), dtype=tl.float32)
            if PUSH:
                for source in tl.static_range(WORLD):
                    if SIGNAL:
                        wait_flag(own_flags + (source * tiles + tile) * 4, epoch, abort_ptr,
                                  error_address, rank * 0 + source, source * tiles + tile,
                                  timeout_ns)
                    total += tl.load(peer_pointers(own_data, source * slot_elements + offsets,
                                                   ELEMENT, ALIGNED),
                                     mask=mask, other=0.0).to(tl.float32)
            else:
                for source in tl.static_range(WORLD):
                    if SIGNAL:
                        wait_flag(pick(source, F0, F1, F2, F3, F4, F5, F6, F7) + tile * 4, epoch,
                                  abort_ptr, error_address, rank * 0 + source, tile, timeout_ns)
                if MULTIMEM:
                    total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base, offsets,
                                        mask, rank, ELEMENT, WORLD, True, ALIGNED)
                else:
                    for source in tl.static_range(WORLD):   # rank order: the same sum everywhere
                        peer_data = pick(source, D0, D1, D2, D3, D4, D5, D6, D7)
                        total += tl.load(peer_pointers(peer_data, offsets, ELEMENT, ALIGNED),
                                         mask=mask, other=0.0).to(tl.float32)
            reduced = total.to(ELEMENT)
            tl.store(out_ptr + offsets, reduced, mask=mask)
            if TWO_SHOT:
                flag = WORLD * tiles + tile
                if PUSH:
                    for step in tl.static_range(1, WORLD):
                        peer = (rank + step) % WORLD
                        area = pick(peer, D0, D1, D2, D3, D4, D5, D6, D7)
                        tl.store(peer_pointers(area, result + offsets, ELEMENT, ALIGNED),
                                 reduced, mask=mask)
                    if SIGNAL:
                        _release_all(F0, F1, F2, F3, F4, F5, F6, F7, flag, epoch, rank, WORLD)
                else:
                    tl.store(peer_pointers(own_data, result + offsets, ELEMENT, ALIGNED), reduced,
                             mask=mask)
                    if SIGNAL:
                        _release_one(F0, F1, F2, F3, F4, F5, F6, F7, rank, flag, epoch)
    if TWO_SHOT and (PHASES & 4):
        for tile in range(pid, tiles, programs):
            owner = tile % WORLD
            if owner != rank:
                offsets, mask = _tile_offsets(tile, tiles_m, M, N, BM, BN)
                flag = WORLD * tiles + tile
                if PUSH:
                    if SIGNAL:
                        wait_flag(own_flags + flag * 4, epoch, abort_ptr, error_address, owner,
                                  flag, timeout_ns)
                    source = own_data
                else:
                    if SIGNAL:
                        wait_flag(pick(owner, F0, F1, F2, F3, F4, F5, F6, F7) + flag * 4, epoch,
                                  abort_ptr, error_address, owner, flag, timeout_ns)
                    source = pick(owner, D0, D1, D2, D3, D4, D5, D6, D7)
                values = tl.load(peer_pointers(source, result + offsets, ELEMENT, ALIGNED),
                                 mask=mask)
                tl.store(out_ptr + offsets, values, mask=mask)
    finish_call(state_ptr, epoch)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the fused GEMM + all-reduce: few rows, narrow columns so that many programs
    stream B (the cost at decode sizes), deep pipelines."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    stages: int = 4
    warps: int = 4

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/s{self.stages}/w{self.warps}")


def default_config(m: int, n: int, k: int, processors: int = 132) -> DecodeConfig:
    """64-row tiles up to M = 64, 128 above (M <= 256: at most two row tiles), 64 columns.
    (Measured on one H100, W = 1, [1 x 4096] @ [4096 x 4096]: 64-column tiles 27.6 us,
    32-column tiles 41.4 us, cuBLAS 13-14 us; the narrow TMA boxes cost more than the SMs
    they fill. Closing the gap needs split-K; `processors` is for that choice.)

    >>> str(default_config(200, 8192, 1792)), str(default_config(1, 4096, 4096))
    ('128x64x128/s3/w4', '64x64x128/s4/w4')
    """
    return DecodeConfig() if m <= 64 else DecodeConfig(128, 64, 128, 3, 4)


def workspace_bytes_needed(world: int, m: int, n: int, element_size: int) -> int:
    """Bytes per data half: W slots of the [M, N] partial and the reduced result area."""
    return (world + 1) * m * n * element_size


class GemmAllReduceLaunch:
    """The fused kernel of one rank for one shape, config, algorithm and workspace, compiled
    and ready: a call fills in A, B and the output and launches (the epoch and data half are
    the rank's call state on the device: the launch can be captured in a CUDA graph).

    >>> launch = GemmAllReduceLaunch(ops, out, config, workspace, two_shot=False, push=True)
    >>> launch(ops, out)          # out [M, N]: the sum over ranks, on every rank
    """

    _A_DESC, _A, _B_DESC, _B, _OUT = 0, 1, 2, 3, 4

    def __init__(self, ops, out: torch.Tensor, config: DecodeConfig, workspace,
                 two_shot: bool, push: bool, multimem: bool = False):
        world, rank = workspace.world_size, workspace.rank
        element = ops.a.element_size()
        self.device_index = ops.a.device.index
        needed = workspace_bytes_needed(world, ops.m, ops.n, element)
        if needed > workspace.data_bytes:
            raise ValueError(f"gemm_all_reduce: {needed} bytes per half needed, the workspace "
                             f"has {workspace.data_bytes}")
        tiles = triton.cdiv(ops.m, config.block_m) * triton.cdiv(ops.n, config.block_n)
        if (world + 1) * tiles > (1 << 16):
            raise ValueError(f"gemm_all_reduce: {(world + 1) * tiles} flags exceed the "
                             f"workspace's 65536; use wider tiles")
        if multimem and (push or not workspace.multicast_base):
            raise ValueError("gemm_all_reduce: multimem pulls from a multicast mapping")
        if out.stride(1) != 1 or out.stride(0) != ops.n:
            raise ValueError("gemm_all_reduce: out must be a row-major [M, N] tensor")
        self.use_tma = tma_compatible(ops.a) and tma_compatible(ops.b)
        self.block_a = [config.block_m, config.block_k]
        self.block_b = ([config.block_n, config.block_k] if ops.b_transposed
                        else [config.block_k, config.block_n])
        if ops.b_transposed and not self.use_tma:
            raise ValueError("gemm_all_reduce: the pointer path takes B as row-major [K, N]")
        a_desc = descriptor(ops.a, self.block_a, False) if self.use_tma else None
        b_desc = descriptor(ops.b, self.block_b, False) if self.use_tma else None
        stride_bk, stride_bn = ((ops.b.stride(1), ops.b.stride(0)) if ops.b_transposed
                                else (ops.b.stride(0), ops.b.stride(1)))
        self.timeout_ns = workspace.timeout_ns()
        aligned = (ops.n * element) % 16 == 0 and config.block_n % 8 == 0
        if multimem and not aligned:
            raise ValueError("gemm_all_reduce: multimem needs rows of a multiple of 16 bytes")
        constexprs = dict(WORLD=world, BM=config.block_m, BN=config.block_n, BK=config.block_k,
                          STAGES=config.stages, USE_TMA=self.use_tma,
                          B_TRANSPOSED=ops.b_transposed, TWO_SHOT=two_shot, PUSH=push,
                          MULTIMEM=multimem, ALIGNED=aligned, PHASES=7)
        args = (a_desc, ops.a, b_desc, ops.b, out, *workspace.data_addresses(0),
                workspace.multicast_address(0) if multimem else 0, *workspace.flag_addresses(),
                workspace.state, workspace.abort, workspace.error_address(), self.timeout_ns,
                ops.m, ops.n, ops.k, ops.a.stride(0), stride_bk, stride_bn, rank,
                workspace.data_bytes)
        kernel = gemm_all_reduce_kernel.warmup(*args, **constexprs, num_warps=config.warps,
                                               num_stages=config.stages, grid=(1,))
        self.kernel = CompiledLaunch(kernel, tuple(constexprs.values()))
        # one program per SM the rank may fill at most: every program resident
        self.grid = max(1, min(workspace.processors, tiles))
        self.template = launch_template(args, (self._A_DESC, self._B_DESC) if self.use_tma else ())
        self.layout = launch_layout(ops, out)

    def __call__(self, ops, out: torch.Tensor) -> None:
        args = list(self.template)
        if self.use_tma:
            args[self._A_DESC] = descriptor(ops.a, self.block_a, True)
            args[self._B_DESC] = descriptor(ops.b, self.block_b, True)
        args[self._A], args[self._B] = ops.a.data_ptr(), ops.b.data_ptr()
        args[self._OUT] = out.data_ptr()
        self.kernel(self.grid, torch._C._cuda_getCurrentRawStream(self.device_index), args)


def launch_layout(ops, out: torch.Tensor) -> tuple:
    """What a prepared launch assumed of its operands and output: shapes, strides, orientation,
    dtype and 16-byte alignment of every pointer (it is reused only for calls that match)."""
    return (tuple(ops.a.shape), tuple(ops.a.stride()), tuple(ops.b.shape), tuple(ops.b.stride()),
            ops.b_transposed, ops.a.dtype, tuple(out.shape),
            tuple(t.data_ptr() % 16 == 0 for t in (ops.a, ops.b, out)))
