"""The GEMM core's tile loop written in Gluon: the TMA / mbarrier / wgmma pipeline spelled out,
so that it runs ACROSS output tiles.

Triton's pipeliner (gemm.gemm_kernel) pipelines the K loop of one tile: every tile starts with
an empty pipeline (the first STAGES - 1 loads in flight while the tensor cores wait) and ends
with an epilogue that stores from registers while they idle. At K = 1024 a 128 x 256 tile has
only 16 K steps, and that fill and drain are about a tenth of the tile (GEMM-only 0.88 of
cuBLAS on 65536 x 4096 x 1024, docs/gpu_notes.md). Here the loads are counted over the
program's whole sequence of (tile, K step) pairs: while the last K steps of a tile run, the
first loads of the next tile are already in flight, and the tile's result leaves through an
asynchronous TMA store that drains while the next tile's wgmmas run.

    step s of program p:  tile p + (s // k_tiles) * P,  K block s % k_tiles
    load s + STAGES - 1   while wgmma s runs (at most one wgmma in flight: wait(1)); the
                          load's tile is this one or the next (K >= (STAGES - 1) * BK)

A tile's K steps run in two loops, this tile's loads and then the next tile's first STAGES - 1,
so that between a wgmma's wait and its slot's next load the loop selects nothing (the fused
kernels' tile loops do the same, their next task decoded between the two loops while a wgmma
runs; tests/test_kernels_cpu.py checks the instructions between the two).

The GEMM core (gemm.py) launches it for configs marked /gl:

    >>> gemm(a, w.t(), config=GemmCoreConfig.parse("128x256x64/g8/s3/w8/gl/k1"))
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .primitives import grouped_tile


EPILOGUE_SPLIT = 2  # TMA stores per tile: a [BM, BN / 2] staging buffer (measured: 1 is no faster)


def shared_layout(block: list, dtype):
    """The swizzled shared-memory layout of a TMA block (and of its host descriptor)."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


@gluon.constexpr_function
def accumulator_layout(block_m, block_n, num_warps):
    """The wgmma accumulator's register layout: warpgroups (4 warps) stacked along M, each
    running m64nNk16 with N the widest instruction that tiles block_n (256 at 128 x 256 and
    8 warps: two warpgroups of 64 x 256)."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    width = 256
    while width > max(block_n // warps[1], 8) or block_n % width:
        width -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                     instr_shape=[16, width, 16])


@gluon.jit
def tile_of(local, first, programs, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """(tile row, tile column) of the program's `local`-th tile, tile first + local * programs."""
    return grouped_tile(first + local * programs, tiles_m, tiles_n, GROUP_M)


@gluon.jit
def issue_load(step, row, col, k, valid, a_desc, b_desc, bars, a_bufs, b_bufs,
               STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """TMA loads of step `step` (the A block at [row, k], the B block at [k, col]) into ring slot
    step % STAGES, completing on that slot's barrier; nothing when not `valid`."""
    slot = step % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=valid)
    tma.async_copy_global_to_shared(a_desc, [row, k], bar, a_bufs.index(slot), valid)
    if B_TRANSPOSED:
        tma.async_copy_global_to_shared(b_desc, [col, k], bar, b_bufs.index(slot), valid)
    else:
        tma.async_copy_global_to_shared(b_desc, [k, col], bar, b_bufs.index(slot), valid)


@gluon.jit
def allocate_ring(a_desc, b_desc, STAGES: gl.constexpr):
    """The load ring: STAGES slots of A and B blocks in shared memory (the descriptors' blocks
    and swizzles) and a barrier per slot, initialized."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return a_bufs, b_bufs, bars


@gluon.jit
def mma_step(step, acc, use_acc, bars, a_bufs, b_bufs, STAGES: gl.constexpr,
             B_TRANSPOSED: gl.constexpr):
    """One K step: wait for ring slot step % STAGES to be loaded, issue its wgmma, and retire
    the previous step's (wait(1)), whose slot the caller may then load again."""
    slot = step % STAGES
    mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
    b = b_bufs.index(slot)
    if B_TRANSPOSED:
        b = b.permute((1, 0))
    acc = warpgroup_mma(a_bufs.index(slot), b, acc, use_acc=use_acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))


@gluon.jit
def store_tile_halves(tile, desc, staging, row, col):
    """A [BM, BN] tile (already in the output dtype) into `desc` at [row, col] as two TMA stores
    of [BM, BN / 2] through one staging buffer (each waits until the last store has read it)."""
    BM: gl.constexpr = tile.shape[0]
    SUB_N: gl.constexpr = desc.block_type.shape[1]
    halves = gl.reshape(tile, [BM, 2, SUB_N]).permute(0, 2, 1).split()
    tma.store_wait(pendings=0)
    staging.store(halves[0])
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [row, col], staging)
    tma.store_wait(pendings=0)
    staging.store(halves[1])
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [row, col + SUB_N], staging)


@gluon.jit
def gemm_pipelined_kernel(a_desc, b_desc, c_desc, M, N, K, GROUP_M: gl.constexpr,
                          STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                          EPILOGUE_SPLIT: gl.constexpr, num_warps: gl.constexpr):
    """C[M, N] = A @ B (B_TRANSPOSED: b_desc describes the [N, K] matrix B is the transpose of)
    on a persistent grid, tile t on program t mod P. c_desc's block is [BM, BN / EPILOGUE_SPLIT]:
    the tile leaves in EPILOGUE_SPLIT (= 2) TMA stores through one staging buffer that small
    (so STAGES can be 4 at 128 x 256 x 64: 4 x 48 KB + 32 KB of shared memory)."""
    gl.static_assert(EPILOGUE_SPLIT == 2)  # store_tile_halves
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    SUB_N: gl.constexpr = c_desc.block_type.shape[1]
    BN: gl.constexpr = SUB_N * EPILOGUE_SPLIT
    dtype: gl.constexpr = a_desc.dtype
    a_bufs, b_bufs, bars = allocate_ring(a_desc, b_desc, STAGES)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)

    first = gl.program_id(0)
    programs = gl.num_programs(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    my_tiles = gl.cdiv(tiles_m * tiles_n - first, programs)

    # the tile being computed: a load runs at most one tile ahead, since the host launches this
    # kernel only when k_tiles >= STAGES - 1
    tile_m, tile_n = tile_of(0, first, programs, tiles_m, tiles_n, GROUP_M)
    for step in gl.static_range(STAGES - 1):
        issue_load(step, tile_m * BM, tile_n * BN, step * BK, my_tiles > 0, a_desc, b_desc, bars,
                   a_bufs, b_bufs, STAGES, B_TRANSPOSED)
    layout: gl.constexpr = accumulator_layout(BM, BN, num_warps)
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    main_steps = k_tiles - (STAGES - 1)
    step = 0
    for local in range(my_tiles):
        # the wgmma of step - 1 is done: its slot takes the load of step + STAGES - 1, a later
        # K block of this tile, then (the last STAGES - 1 steps) the next tile's first blocks
        for kk in range(main_steps):
            acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
            issue_load(step + STAGES - 1, tile_m * BM, tile_n * BN, (kk + STAGES - 1) * BK, True,
                       a_desc, b_desc, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
            step += 1
        next_m, next_n = tile_of(local + 1, first, programs, tiles_m, tiles_n, GROUP_M)
        for kk in range(main_steps, k_tiles):
            acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
            issue_load(step + STAGES - 1, next_m * BM, next_n * BN, (kk - main_steps) * BK,
                       local + 1 < my_tiles, a_desc, b_desc, bars, a_bufs, b_bufs, STAGES,
                       B_TRANSPOSED)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        store_tile_halves(acc.to(dtype), c_desc, c_smem, tile_m * BM, tile_n * BN)
        tile_m, tile_n = next_m, next_n
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
