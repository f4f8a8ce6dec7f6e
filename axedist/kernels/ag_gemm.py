"""Fused all-gather + GEMM in ONE persistent Triton kernel (the column-parallel half of TP).

out = all_gather(A_r) @ B   on every rank r, for A_r [M_LOCAL, K] (this rank's rows) and the
rank's B [K, N] (or nn.Linear's weight.t()); out is [W * M_LOCAL, N], rank p's rows at
p * M_LOCAL.

Every rank claims task ids from its counter in one order (programs of a persistent grid, one per
SM, always co-resident; schedule.ag_decode_task is the order's host twin, which the CPU tests
compare with the kernel's decode and simulate for deadlock). The order is W segments; segment s
holds the GEMM tiles over the rows of source (r - s) % W (s = 0: this rank's own), with the push
tasks of step s + 1 spread evenly among them:

    push tasks   (step s, row block t, piece c): rank r stores column range c of rows t*BM .. of
                 its A into the gathered buffer of rank (r + s) % W (slot r: remote stores over
                 NVLink, posted writes), then releases flag (r, t, c) in that rank's flag array.
                 PIECES ranges per block let that many programs move one block at once. In each
                 segment every rank sends to one peer and receives from one. With MULTIMEM one
                 multimem.st per 16 bytes writes every rank's copy at once (one step, segment 0).
    local tiles  segment 0: GEMM tiles over this rank's own rows, read from A itself (a_desc /
                 a_ptr); they wait for nothing, and the first step's stores run under their math.
    peer tiles   segment s >= 1: GEMM tiles over the rows of source (r - s) % W, which that
                 source pushed in its step s (its segment s - 1): each acquires the PIECES flags
                 (source, t, c) in this rank's own flag array (local polling), then TMA-loads its
                 A tile from the gathered buffer in local memory. The pushes of step s + 1 run
                 under them, so at W > 2 the stores of all steps hide behind GEMM tiles.

Deadlock freedom: pushes and local tiles never wait, and a program finishes a task before it
claims the next. Segment 0 therefore completes on every rank; by induction, once every rank's
segments 0 .. s - 1 have completed, every flag a segment-s peer tile waits for has been released
(its push is in segment s - 1 of its source), so segment s completes too.

Gathered buffer: rows of K elements in the rank's data region, the half of the call's epoch
starting at row `parity * half_rows` (the host makes half_rows * K * size at least a half's
bytes), source s at row s * M_LOCAL within it. One TMA descriptor spans both halves.
PHASES (interpreter tests only): 1 the push tasks, 2 the GEMM tasks, 3 both with their flags.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from . import schedule
from .gemm import gemm_tile, tma_compatible
from .gemm_gluon import (EPILOGUE_SPLIT, accumulator_layout, allocate_ring, mma_step,
                         shared_layout, store_tile_halves)
from .gemm_rs import descriptor, launch_template
from .launch import (CompiledLaunch, StreamGraph, copy_bytes_async, copy_engine_runtime,
                     copy_engines_usable, copy_rows_async, graphs_per_parity)
from .primitives import (grouped_tile, call_epoch, claim_task, fence_acq_rel_sys, fence_proxy_async, finish_call,
                         engine_chunk_epoch, engine_flag_index, ld_acquire_sys, multimem_st_16bytes, peer_pointers,
                         pick, st_release_sys, wait_engine_chunk, wait_flag)


@triton.jit
def _words(values, ELEMENT: tl.constexpr):
    """16-bit values [R, C] as four int32 words per 16 bytes: ([R, C // 8] x 4) for multimem.st."""
    R: tl.constexpr = values.shape[0]
    C: tl.constexpr = values.shape[1]
    halves = tl.reshape(values.to(tl.int16, bitcast=True), [R, C // 2, 2])
    low, high = tl.split(halves)
    words = (low.to(tl.int32) & 0xFFFF) | (high.to(tl.int32) << 16)
    pairs = tl.reshape(words, [R, C // 8, 2, 2])
    even, odd = tl.split(pairs)            # words 0, 2 and 1, 3 of each group
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _copy_rows(source, source_stride, target, rows_here, col_first, col_last, K,
               multicast_target, ELEMENT: tl.constexpr, COPY_ROWS: tl.constexpr,
               COPY_COLS: tl.constexpr, ALIGNED: tl.constexpr, MULTIMEM: tl.constexpr):
    """Columns col_first .. col_last of rows 0 .. rows_here of `source` (a pointer to its row
    0, row stride source_stride) into `target` (byte address of row 0 of rows of K elements,
    in any rank's memory), COPY_ROWS x COPY_COLS elements at a time; MULTIMEM: into every
    rank's copy through `multicast_target` instead."""
    for sub in range(0, rows_here, COPY_ROWS):
        rows = sub + tl.arange(0, COPY_ROWS)
        for k0 in range(col_first, col_last, COPY_COLS):
            cols = k0 + tl.arange(0, COPY_COLS)
            mask = (rows[:, None] < rows_here) & (cols[None, :] < col_last)
            values = tl.load(source + rows[:, None] * source_stride + cols[None, :], mask=mask)
            offsets = rows[:, None] * K + cols[None, :]
            if MULTIMEM:
                # one 16-byte multimem.st per group; the host sets MULTIMEM only for K % 8 == 0
                G: tl.constexpr = COPY_COLS // 8
                group_offsets = tl.reshape(offsets, [COPY_ROWS, G, 8])
                first = tl.min(group_offsets, axis=2).to(tl.int64)
                group_mask = tl.max(tl.reshape(mask.to(tl.int32), [COPY_ROWS, G, 8]), axis=2) > 0
                w0, w1, w2, w3 = _words(values, ELEMENT)
                addresses = multicast_target + first * (ELEMENT.primitive_bitwidth // 8)
                multimem_st_16bytes(addresses, w0, w1, w2, w3, group_mask.to(tl.int32))
            else:
                tl.store(peer_pointers(target, offsets, ELEMENT, ALIGNED), values, mask=mask)


@triton.jit
def _interleaved(task, pushes, locals_):
    """(is a push, index among its kind) of task `task` < pushes + locals_, the two kinds spread
    evenly over the range in claim order: the device twin of schedule.interleaved."""
    total = pushes + locals_
    before = (task.to(tl.int64) * pushes) // total          # pushes among tasks 0 .. task - 1
    through = ((task.to(tl.int64) + 1) * pushes) // total   # ... among tasks 0 .. task
    is_push = through > before
    return is_push, tl.where(is_push, before, task - before).to(tl.int32)


PUSH = tl.constexpr(schedule.PUSH)
TILE = tl.constexpr(schedule.TILE)
COPY = tl.constexpr(schedule.COPY)


@triton.jit
def _task_count(tiles_m, tiles_n, WORLD: tl.constexpr, STEPS: tl.constexpr, PIECES: tl.constexpr,
                COPY_OUT: tl.constexpr, ENGINE: tl.constexpr):
    # the device twin of schedule.ag_task_count
    return ((0 if ENGINE else STEPS * tiles_m * PIECES) + WORLD * tiles_m * tiles_n
            + (WORLD * tiles_m * PIECES if COPY_OUT else 0))


@triton.jit
def _decode_task(task, rank, tiles_m, tiles_n, WORLD: tl.constexpr, STEPS: tl.constexpr,
                 MULTIMEM: tl.constexpr, PIECES: tl.constexpr, GROUP_M: tl.constexpr,
                 ENGINE: tl.constexpr):
    """(kind, who, x, y) of task `task` (STEPS: schedule.ag_steps): the device twin of
    schedule.ag_decode_task."""
    per_source = tiles_m * tiles_n
    step_pushes = tiles_m * (0 if ENGINE else PIECES)  # the push tasks of one step
    segment_tasks = per_source + step_pushes
    with_pushes = STEPS * segment_tasks   # segments 0 .. STEPS - 1: one step's pushes among the tiles
    gemm_end = with_pushes + (WORLD - STEPS) * per_source
    in_pushes = task < with_pushes
    segment = tl.where(in_pushes, task // segment_tasks, STEPS + (task - with_pushes) // per_source)
    within = tl.where(in_pushes, task % segment_tasks, (task - with_pushes) % per_source)
    is_push, index = _interleaved(within, tl.where(in_pushes, step_pushes, 0), per_source)
    tile_m, tile_n = grouped_tile(tl.where(is_push, 0, index), tiles_m, tiles_n, GROUP_M)  # a push's index may pass the tiles
    is_tile = (task < gemm_end) & ~is_push
    copy = tl.maximum(task - gemm_end, 0)
    kind = tl.where(is_push, PUSH, tl.where(is_tile, TILE, COPY))
    peer = -1 if MULTIMEM else (rank + 1 + segment) % WORLD
    who = tl.where(is_push, peer, tl.where(is_tile, (rank - segment % WORLD + WORLD) % WORLD,
                                           (rank - copy // (PIECES * tiles_m) % WORLD + WORLD) % WORLD))
    x = tl.where(is_push, index // PIECES, tl.where(is_tile, tile_m, copy // PIECES % tiles_m))
    y = tl.where(is_push, index % PIECES, tl.where(is_tile, tile_n, copy % PIECES))
    return kind, who, x, y


@triton.jit
def _call_geometry(state_ptr, rank, half_rows, M_LOCAL, N, K, D0, D1, D2, D3, D4, D5, D6, D7,
                   F0, F1, F2, F3, F4, F5, F6, F7, ELEMENT: tl.constexpr, WORLD: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr,
                   PIECES: tl.constexpr, COPY_COLS: tl.constexpr, COPY_OUT: tl.constexpr,
                   ENGINE: tl.constexpr):
    """What both kernels derive from a call's arguments: the epoch, the first row of the
    call's half of the gathered buffers, row bytes, tiles, the task count, a piece's columns,
    K blocks, this rank's flags and its gathered buffer."""
    epoch = call_epoch(state_ptr)
    slot_row0 = (epoch % 2) * half_rows
    row_bytes = K.to(tl.int64) * (ELEMENT.primitive_bitwidth // 8)
    tiles_m = tl.cdiv(M_LOCAL, BM)
    tiles_n = tl.cdiv(N, BN)
    tasks = _task_count(tiles_m, tiles_n, WORLD, STEPS, PIECES, COPY_OUT, ENGINE)
    piece_cols = tl.cdiv(tl.cdiv(K, PIECES), COPY_COLS) * COPY_COLS
    k_tiles = tl.cdiv(K, BK)
    own_flags = pick(rank, F0, F1, F2, F3, F4, F5, F6, F7)
    gathered = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7).to(tl.pointer_type(ELEMENT))
    return (epoch, slot_row0, row_bytes, tiles_m, tiles_n, tasks, piece_cols, k_tiles, own_flags,
            gathered)


@triton.jit
def schedule_probe_kernel(out_ptr, count_ptr, tiles_m, tiles_n, rank, WORLD: tl.constexpr,
                          MULTIMEM: tl.constexpr, PIECES: tl.constexpr, GROUP_M: tl.constexpr,
                          COPY_OUT: tl.constexpr, ENGINE: tl.constexpr = False):
    """Program `task` writes (kind, who, x, y) of that task id, decoded as the fused kernel
    decodes it, and program 0 the task count; the CPU tests run it under TRITON_INTERPRET=1
    against schedule.py."""
    STEPS: tl.constexpr = 1 if MULTIMEM and WORLD > 1 else WORLD - 1
    task = tl.program_id(0)
    if task == 0:
        tl.store(count_ptr, _task_count(tiles_m, tiles_n, WORLD, STEPS, PIECES, COPY_OUT, ENGINE))
    kind, who, x, y = _decode_task(task, rank, tiles_m, tiles_n, WORLD, STEPS, MULTIMEM, PIECES, GROUP_M,
                                   ENGINE)
    tl.store(out_ptr + task * 4 + 0, kind)
    tl.store(out_ptr + task * 4 + 1, who)
    tl.store(out_ptr + task * 4 + 2, x)
    tl.store(out_ptr + task * 4 + 3, y)


@triton.jit
def _wait_engine_rows(own_flags, engine_flag0, epoch, source, block, chunk_blocks, abort_ptr,
                      error_address, timeout_ns, ENGINE_CHUNKS: tl.constexpr):
    """Wait until the chunk of `source`'s rows holding row block `block` (chunks of
    chunk_blocks row blocks) has arrived by copy engine (primitives.wait_engine_chunk)."""
    wait_engine_chunk(own_flags, engine_flag0, epoch, source, block // chunk_blocks, abort_ptr,
                      error_address, timeout_ns, ENGINE_CHUNKS)


ENGINE_CHUNKS = tl.constexpr(schedule.ENGINE_CHUNKS)


@triton.jit(do_not_specialize=["rank", "timeout_ns", "half_rows", "gathered_address"])
def all_gather_gemm_kernel(
        a_ptr, a_desc, g_desc, b_desc, b_ptr, out_ptr, gathered_address,
        D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
        F0, F1, F2, F3, F4, F5, F6, F7,
        state_ptr, abort_ptr, error_address, timeout_ns,
        M_LOCAL, N, K, stride_am, stride_bk, stride_bn, stride_om, engine_flag0, chunk_blocks,
        rank, half_rows,
        WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr,
        B_TRANSPOSED: tl.constexpr, MULTIMEM: tl.constexpr, ALIGNED: tl.constexpr,
        COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr, PIECES: tl.constexpr,
        COPY_OUT: tl.constexpr, PHASES: tl.constexpr, ENGINE: tl.constexpr):
    """out[p * M_LOCAL + i, :] = A_p[i, :] @ B for every rank p (see the module docstring).
    a_ptr / a_desc: this rank's A [M_LOCAL, K] (row stride stride_am, unit column stride;
    a_desc its TMA descriptor, TMA only); g_desc: this rank's gathered buffer, both halves
    [2 * half_rows, K] (TMA only); D*: every rank's data half 0; F*: flag arrays. Local tiles
    read A, peer tiles the gathered buffer. COPY_OUT: after the GEMM tiles, copy-out tasks
    (source, block, piece) also write the gathered A [W * M_LOCAL, K] (row-major) at
    gathered_address, for later users of it. ENGINE: no push tasks; the peers' copy engines
    bring their rows in chunks of chunk_blocks row blocks, each announced by a flag in the
    region starting at flag index engine_flag0 (AllGatherGemmLaunch issues the copies)."""
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    SIGNAL: tl.constexpr = PHASES == 3
    STEPS: tl.constexpr = 1 if MULTIMEM and WORLD > 1 else WORLD - 1  # schedule.ag_steps
    (epoch, slot_row0, row_bytes, tiles_m, tiles_n, tasks, piece_cols, k_tiles, own_flags,
     gathered) = _call_geometry(state_ptr, rank, half_rows, M_LOCAL, N, K, D0, D1, D2, D3, D4,
                                D5, D6, D7, F0, F1, F2, F3, F4, F5, F6, F7, ELEMENT, WORLD, BM,
                                BN, BK, STEPS, PIECES, COPY_COLS, COPY_OUT, ENGINE)
    task = claim_task(state_ptr)
    while task < tasks:
        kind, who, x, y = _decode_task(task, rank, tiles_m, tiles_n, WORLD, STEPS, MULTIMEM, PIECES, GROUP_M,
                                       ENGINE)
        if kind == PUSH:
            if (PHASES & 1) and STEPS > 0 and not ENGINE:  # W = 1, ENGINE: no push code compiled
                block = x
                piece = y
                col_first = piece * piece_cols
                col_last = tl.minimum(col_first + piece_cols, K)
                row0 = block * BM
                rows_here = tl.minimum(BM, M_LOCAL - row0)
                push_row = (slot_row0 + rank * M_LOCAL + row0).to(tl.int64)
                flag = ((rank * tiles_m + block) * PIECES + piece) * 4
                if MULTIMEM:
                    _copy_rows(a_ptr + row0 * stride_am, stride_am, 0, rows_here, col_first,
                               col_last, K, multicast_base + push_row * row_bytes, ELEMENT,
                               COPY_ROWS, COPY_COLS, ALIGNED, True)
                    if SIGNAL:
                        fence_acq_rel_sys(block)
                        tl.debug_barrier()
                        for step in tl.static_range(WORLD):
                            peer = (rank + step) % WORLD
                            st_release_sys(pick(peer, F0, F1, F2, F3, F4, F5, F6, F7) + flag,
                                           epoch)
                else:
                    peer = who
                    target = pick(peer, D0, D1, D2, D3, D4, D5, D6, D7) + push_row * row_bytes
                    _copy_rows(a_ptr + row0 * stride_am, stride_am, target, rows_here, col_first,
                               col_last, K, 0, ELEMENT, COPY_ROWS, COPY_COLS, ALIGNED, False)
                    if SIGNAL:
                        # every thread's (remote) stores ordered before thread 0's release
                        fence_acq_rel_sys(block)
                        tl.debug_barrier()
                        st_release_sys(pick(peer, F0, F1, F2, F3, F4, F5, F6, F7) + flag, epoch)
        elif kind == COPY:
            if PHASES & 2:
                source = who
                block = x
                piece = y
                row0 = block * BM
                col_first = piece * piece_cols
                if source == rank:  # this rank's rows: from A itself
                    rows_from, rows_stride = a_ptr + row0 * stride_am, stride_am
                else:
                    if SIGNAL:
                        if ENGINE:
                            _wait_engine_rows(own_flags, engine_flag0, epoch, source, block,
                                              chunk_blocks, abort_ptr, error_address, timeout_ns,
                                              ENGINE_CHUNKS)
                        else:
                            flag = (source * tiles_m + block) * PIECES + piece
                            wait_flag(own_flags + flag * 4, epoch, abort_ptr, error_address,
                                      source, flag, timeout_ns)
                    rows_from = gathered + (slot_row0 + source * M_LOCAL + row0).to(tl.int64) * K
                    rows_stride = K
                _copy_rows(rows_from, rows_stride,
                           gathered_address + (source * M_LOCAL + row0).to(tl.int64) * row_bytes,
                           tl.minimum(BM, M_LOCAL - row0), col_first,
                           tl.minimum(col_first + piece_cols, K), K, 0, ELEMENT, COPY_ROWS,
                           COPY_COLS, ALIGNED, False)
        elif PHASES & 2:
            source = who  # this rank's own rows in segment 0
            tile_m = x
            tile_n = y
            local_row0 = tile_m * BM
            col0 = tile_n * BN
            if source == rank:
                # rows past M_LOCAL are masked (pointer path) or zero-filled by TMA
                rows_desc, rows_ptr, row0, rows_end, rows_stride = a_desc, a_ptr, local_row0, M_LOCAL, stride_am
            else:
                if SIGNAL:
                    if ENGINE:
                        _wait_engine_rows(own_flags, engine_flag0, epoch, source, tile_m,
                                          chunk_blocks, abort_ptr, error_address, timeout_ns,
                                          ENGINE_CHUNKS)
                    else:
                        for piece in tl.static_range(PIECES):
                            flag = (source * tiles_m + tile_m) * PIECES + piece
                            wait_flag(own_flags + flag * 4, epoch, abort_ptr, error_address,
                                      source, flag, timeout_ns)
                    fence_proxy_async(tile_m)  # the rows arrived by generic stores; TMA reads them
                # rows past this source's slot are masked (pointer path) or garbage the store drops
                row0 = slot_row0 + source * M_LOCAL + local_row0
                rows_desc, rows_ptr, rows_end, rows_stride = g_desc, gathered, row0 - local_row0 + M_LOCAL, K
            # one call site: one tile loop, one set of pipeline buffers in shared memory
            accumulator = gemm_tile(rows_desc, rows_ptr, b_desc, b_ptr, row0, col0, 0, k_tiles, rows_end, N,
                                    K, rows_stride, 1, stride_bk, stride_bn, BM, BN, BK, STAGES, USE_TMA,
                                    B_TRANSPOSED)
            rows = local_row0 + tl.arange(0, BM)
            cols = col0 + tl.arange(0, BN)
            mask = (rows[:, None] < M_LOCAL) & (cols[None, :] < N)
            out_rows = source * M_LOCAL + rows
            tl.store(out_ptr + out_rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                     accumulator.to(ELEMENT), mask=mask)
        task = claim_task(state_ptr)
    finish_call(state_ptr, epoch)


@gluon.jit
def _copy_rows_gluon(source, source_stride, target, rows_here, col_first, col_last, K,
                     ELEMENT: gl.constexpr, COPY_ROWS: gl.constexpr, COPY_COLS: gl.constexpr,
                     ALIGNED: gl.constexpr):
    """_copy_rows (unicast) in Gluon: columns col_first .. col_last of rows 0 .. rows_here of
    `source` (pointer to row 0, row stride source_stride) into `target` (byte address of row 0
    of rows of K elements), COPY_ROWS x COPY_COLS elements at a time, 16 bytes per thread."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows_in = gl.arange(0, COPY_ROWS, layout=gl.SliceLayout(1, layout))
    cols_in = gl.arange(0, COPY_COLS, layout=gl.SliceLayout(0, layout))
    base = target.to(gl.pointer_type(ELEMENT))
    for sub in range(0, rows_here, COPY_ROWS):
        rows = sub + rows_in
        for k0 in range(col_first, col_last, COPY_COLS):
            cols = k0 + cols_in
            mask = (rows[:, None] < rows_here) & (cols[None, :] < col_last)
            values = gl.load(source + rows[:, None].to(gl.int64) * source_stride + cols[None, :],
                             mask=mask)
            pointers = base + (rows[:, None].to(gl.int64) * K + cols[None, :])
            if ALIGNED:
                pointers = gl.multiple_of(pointers, [16, 16])
            gl.store(pointers, values, mask=mask)


@gluon.jit
def _tile_rows(task, rank, tiles_m, tiles_n, M_LOCAL, slot_row0, WORLD: gl.constexpr,
               STEPS: gl.constexpr, PIECES: gl.constexpr, GROUP_M: gl.constexpr,
               BM: gl.constexpr, BN: gl.constexpr, ENGINE: gl.constexpr):
    """Of tile task `task`: (source rank, tile row, its first A row: in A for this rank's rows,
    in the gathered buffer for a peer's, first column)."""
    kind, source, tile_m, tile_n = _decode_task(task, rank, tiles_m, tiles_n, WORLD, STEPS, False,
                                                PIECES, GROUP_M, ENGINE)
    local_row0 = tile_m * BM
    row0 = gl.where(source == rank, local_row0, slot_row0 + source * M_LOCAL + local_row0)
    return source, tile_m, row0, tile_n * BN


@gluon.jit
def _next_tile_task(task, step, tasks, rank, tiles_m, tiles_n, WORLD: gl.constexpr,
                    STEPS: gl.constexpr, PIECES: gl.constexpr, GROUP_M: gl.constexpr,
                    ENGINE: gl.constexpr):
    """The first tile task among task, task + step, ... (>= tasks: none left)."""
    kind, who, x, y = _decode_task(task, rank, tiles_m, tiles_n, WORLD, STEPS, False, PIECES,
                                   GROUP_M, ENGINE)
    while (task < tasks) & (kind != TILE):
        task += step
        kind, who, x, y = _decode_task(task, rank, tiles_m, tiles_n, WORLD, STEPS, False, PIECES,
                                       GROUP_M, ENGINE)
    return task


@gluon.jit
def _rows_arrived(own_flags, source, tile_m, tiles_m, epoch, rank, engine_flag0, chunk_blocks,
                  PIECES: gl.constexpr, ENGINE: gl.constexpr):
    """Whether every piece of the source's row block tile_m has arrived (this rank's own rows
    always have): one acquire load per piece and thread, no waiting (ENGINE: of the flag of the
    copy-engine chunk holding the block, primitives.engine_flag_index). The answer steers code
    with CTA barriers in it, so it must be the same in every thread: a flag can flip between
    two threads' loads, hence "every thread saw it" (a CTA-wide min), not each thread's own
    load (that race hung the W = 8 virtual-rank test)."""
    arrived = source == rank
    if source != rank:
        threads: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        zero = gl.arange(0, 32 * gl.num_warps(), layout=threads) * 0
        seen = zero + 1
        if ENGINE:
            flag = engine_flag_index(engine_flag0, epoch, source, tile_m // chunk_blocks,
                                     ENGINE_CHUNKS)
            seen = seen & (ld_acquire_sys(own_flags + flag * 4 + zero)
                           >= engine_chunk_epoch(epoch)).to(gl.int32)
        else:
            for piece in gl.static_range(PIECES):
                flag = (source * tiles_m + tile_m) * PIECES + piece
                seen = seen & (ld_acquire_sys(own_flags + flag * 4 + zero) >= epoch).to(gl.int32)
        arrived = gl.min(seen, axis=0) > 0
    return arrived


@gluon.jit
def _wait_rows(own_flags, source, tile_m, tiles_m, epoch, rank, abort_ptr, error_address,
               timeout_ns, engine_flag0, chunk_blocks, PIECES: gl.constexpr,
               ENGINE: gl.constexpr):
    """Wait until every piece of the source's row block tile_m has arrived (ENGINE: its
    copy-engine chunk; nothing to wait for on this rank's own rows), then order those stores
    before TMA reads them."""
    if source != rank:
        if ENGINE:
            _wait_engine_rows(own_flags, engine_flag0, epoch, source, tile_m, chunk_blocks,
                              abort_ptr, error_address, timeout_ns, ENGINE_CHUNKS)
        else:
            for piece in gl.static_range(PIECES):
                flag = (source * tiles_m + tile_m) * PIECES + piece
                wait_flag(own_flags + flag * 4, epoch, abort_ptr, error_address, source, flag,
                          timeout_ns)
        fence_proxy_async(tile_m)


@gluon.jit
def _store_tile(acc, o_desc, c_smem, out_ptr, stride_om, source, tile_m, col0, M_LOCAL, N,
                BM: gl.constexpr, BN: gl.constexpr, OUT_TMA: gl.constexpr):
    """A finished tile of source `source` into out: two TMA stores (OUT_TMA), else masked
    stores."""
    ELEMENT: gl.constexpr = out_ptr.dtype.element_ty
    if OUT_TMA:
        store_tile_halves(acc.to(ELEMENT), o_desc, c_smem, source * M_LOCAL + tile_m * BM, col0)
    else:
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        result = gl.convert_layout(acc.to(ELEMENT), out_layout)
        rows = tile_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
        cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        mask = (rows[:, None] < M_LOCAL) & (cols[None, :] < N)
        out_rows = (source * M_LOCAL + rows).to(gl.int64)
        gl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], result, mask=mask)


@gluon.jit
def _issue_tile_load(step, local, row, col, k, valid, a_desc, g_desc, b_desc, bars, a_bufs,
                     b_bufs, STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """TMA loads of one K step: A from this rank's A (local) or the gathered buffer, B."""
    slot = step % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=valid)
    # a branch, not two predicated copies: every copy costs a CTA barrier, issued or not
    if local:
        tma.async_copy_global_to_shared(a_desc, [row, k], bar, a_bufs.index(slot), valid)
    else:
        tma.async_copy_global_to_shared(g_desc, [row, k], bar, a_bufs.index(slot), valid)
    if B_TRANSPOSED:
        tma.async_copy_global_to_shared(b_desc, [col, k], bar, b_bufs.index(slot), valid)
    else:
        tma.async_copy_global_to_shared(b_desc, [k, col], bar, b_bufs.index(slot), valid)


@gluon.jit(do_not_specialize=["rank", "timeout_ns", "half_rows", "gathered_address"])
def pipelined_all_gather_gemm_kernel(
        a_ptr, a_desc, g_desc, b_desc, b_ptr, out_ptr, gathered_address,
        D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
        F0, F1, F2, F3, F4, F5, F6, F7,
        state_ptr, abort_ptr, error_address, timeout_ns,
        M_LOCAL, N, K, stride_am, stride_bk, stride_bn, stride_om, engine_flag0, chunk_blocks,
        rank, half_rows, tail_tiles, partials, partial_flags, o_desc,
        WORLD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, USE_TMA: gl.constexpr,
        B_TRANSPOSED: gl.constexpr, MULTIMEM: gl.constexpr, ALIGNED: gl.constexpr,
        COPY_ROWS: gl.constexpr, COPY_COLS: gl.constexpr, PIECES: gl.constexpr,
        COPY_OUT: gl.constexpr, PHASES: gl.constexpr, OUT_TMA: gl.constexpr,
        ENGINE: gl.constexpr):
    """all_gather_gemm_kernel (unicast pushes, TMA) with the Gluon tile loop of gemm_gluon.py:
    same arguments, same task order, tasks assigned statically (program p runs p, p + P, ...),
    so that a program loads its next tile during the current one.

    A tile's loads wait for nothing but its own rows: a peer tile acquires its PIECES flags
    before its first load. Ahead of time, the next tile's loads are issued only if its rows
    have already arrived (one acquire per piece, no spin); otherwise that tile waits for them
    when it starts and loads then. So a program never waits for a later task's rows, and
    deadlock freedom holds as for the claimed order: the lowest unfinished task of all ranks is
    its program's current one, and what it waits for (pushes of its source's previous segment)
    comes earlier in the order. OUT_TMA (M_LOCAL a whole number of row tiles, out 16-byte
    aligned rows): a tile leaves through two TMA stores via o_desc (block [BM, BN / 2]); else
    through masked stores (o_desc unused).

    The last tail_tiles tasks (tiles of the last source; 0: none) run as a stream-K tail after
    every program's other tasks (schedule.stream_k_segments): their K steps spread over all
    programs, a tile's owner adding the fp32 partials (`partials`, a BM x BN slot per program)
    of the programs after it once their flags (`partial_flags`, the address of an int32 per
    program) show this call's epoch.

    ENGINE ("/gl/ce"): no push tasks; the peers' copy engines bring their rows in chunks of
    chunk_blocks row blocks, each announced by a flag from flag index engine_flag0 on (as in
    all_gather_gemm_kernel): a peer tile waits for, or looks ahead at, its chunk's flag."""
    gl.static_assert(USE_TMA and (not MULTIMEM) and PHASES == 3)
    ELEMENT: gl.constexpr = out_ptr.dtype.element_ty
    dtype: gl.constexpr = a_desc.dtype
    STEPS: gl.constexpr = WORLD - 1  # schedule.ag_steps (unicast)
    a_bufs, b_bufs, bars = allocate_ring(a_desc, b_desc, STAGES)
    c_smem = None
    if OUT_TMA:
        c_smem = gl.allocate_shared_memory(dtype, o_desc.block_type.shape, o_desc.layout)
    (epoch, slot_row0, row_bytes, tiles_m, tiles_n, tasks, piece_cols, k_tiles, own_flags,
     gathered) = _call_geometry(state_ptr, rank, half_rows, M_LOCAL, N, K, D0, D1, D2, D3, D4,
                                D5, D6, D7, F0, F1, F2, F3, F4, F5, F6, F7, ELEMENT, WORLD, BM,
                                BN, BK, STEPS, PIECES, COPY_COLS, COPY_OUT, ENGINE)
    first = gl.program_id(0)
    programs = gl.num_programs(0)
    layout: gl.constexpr = accumulator_layout(BM, BN, gl.num_warps())
    tail_first = tasks - tail_tiles  # the stream-K tail's first task
    tasks = tail_first               # what the static assignment runs

    tile_task = _next_tile_task(first, programs, tasks, rank, tiles_m, tiles_n, WORLD, STEPS,
                                PIECES, GROUP_M, ENGINE)
    source, tile_m, row0, col0 = _tile_rows(tile_task, rank, tiles_m, tiles_n, M_LOCAL,
                                            slot_row0, WORLD, STEPS, PIECES, GROUP_M, BM, BN,
                                            ENGINE)
    loaded = first * 0  # whether the current tile's first STAGES - 1 steps are loaded
    step = 0
    task = first
    while task < tasks:
        if task == tile_task:  # (known to be a tile: nothing decoded before its first wgmma)
            local = source == rank
            if loaded == 0:  # its rows were not there when the last tile ran: wait, then load
                _wait_rows(own_flags, source, tile_m, tiles_m, epoch, rank, abort_ptr,
                           error_address, timeout_ns, engine_flag0, chunk_blocks, PIECES, ENGINE)
                for ahead in gl.static_range(STAGES - 1):
                    _issue_tile_load(step + ahead, local, row0, col0, ahead * BK,
                                     ahead < k_tiles, a_desc, g_desc, b_desc, bars, a_bufs,
                                     b_bufs, STAGES, B_TRANSPOSED)
            # two loops, so that a K step runs the core's few instructions between a wgmma's
            # wait and the next load: the steps loading later K blocks of this tile (the row,
            # column and operand fixed for the loop), then the last STAGES - 1 steps loading the
            # next tile's first blocks, that tile decoded and its rows looked at once, while
            # the wgmma before them runs
            main_steps = k_tiles - (STAGES - 1)  # >= 0: the host launches this kernel only then
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
            for kk in range(main_steps):
                acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                _issue_tile_load(step + STAGES - 1, local, row0, col0, (kk + STAGES - 1) * BK,
                                 True, a_desc, g_desc, b_desc, bars, a_bufs, b_bufs, STAGES,
                                 B_TRANSPOSED)
                step += 1
            next_task = _next_tile_task(task + programs, programs, tasks, rank, tiles_m, tiles_n,
                                        WORLD, STEPS, PIECES, GROUP_M, ENGINE)
            next_source, next_tile_m, next_row, next_col = _tile_rows(
                next_task, rank, tiles_m, tiles_n, M_LOCAL, slot_row0, WORLD, STEPS, PIECES,
                GROUP_M, BM, BN, ENGINE)
            next_ready = ((next_task < tasks) & _rows_arrived(
                own_flags, next_source, next_tile_m, tiles_m, epoch, rank, engine_flag0,
                chunk_blocks, PIECES, ENGINE)).to(gl.int32)
            fence_proxy_async(next_tile_m)
            next_local = next_source == rank
            for kk in range(main_steps, k_tiles):
                acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                _issue_tile_load(step + STAGES - 1, next_local, next_row, next_col,
                                 (kk - main_steps) * BK, next_ready != 0, a_desc, g_desc, b_desc,
                                 bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _store_tile(acc, o_desc, c_smem, out_ptr, stride_om, source, tile_m, col0, M_LOCAL, N,
                        BM, BN, OUT_TMA)
            tile_task, source, tile_m, row0, col0 = (next_task, next_source, next_tile_m, next_row,
                                                     next_col)
            loaded = next_ready
        else:  # a push or copy task
            kind, who, x, y = _decode_task(task, rank, tiles_m, tiles_n, WORLD, STEPS, False,
                                           PIECES, GROUP_M, ENGINE)
            if kind == PUSH:
                if not ENGINE:  # (ENGINE: no push tasks, no push code compiled)
                    block = x
                    piece = y
                    col_first = piece * piece_cols
                    push_row = (slot_row0 + rank * M_LOCAL + block * BM).to(gl.int64)
                    target = pick(who, D0, D1, D2, D3, D4, D5, D6, D7) + push_row * row_bytes
                    _copy_rows_gluon(a_ptr + block * BM * stride_am, stride_am, target,
                                     gl.minimum(BM, M_LOCAL - block * BM), col_first,
                                     gl.minimum(col_first + piece_cols, K), K, ELEMENT, COPY_ROWS,
                                     COPY_COLS, ALIGNED)
                    # every thread's (remote) stores ordered before thread 0's release
                    fence_acq_rel_sys(block)
                    gl.thread_barrier()
                    st_release_sys(pick(who, F0, F1, F2, F3, F4, F5, F6, F7)
                                   + ((rank * tiles_m + block) * PIECES + piece) * 4, epoch)
            elif kind == COPY:
                block = x
                piece = y
                col_first = piece * piece_cols
                if who == rank:  # this rank's rows: from A itself
                    rows_from = a_ptr + block * BM * stride_am
                    rows_stride = stride_am
                else:
                    if ENGINE:
                        _wait_engine_rows(own_flags, engine_flag0, epoch, who, block, chunk_blocks,
                                          abort_ptr, error_address, timeout_ns, ENGINE_CHUNKS)
                    else:
                        flag = (who * tiles_m + block) * PIECES + piece
                        wait_flag(own_flags + flag * 4, epoch, abort_ptr, error_address, who, flag,
                                  timeout_ns)
                    rows_from = gathered + (slot_row0 + who * M_LOCAL + block * BM).to(gl.int64) * K
                    rows_stride = K
                _copy_rows_gluon(rows_from, rows_stride,
                                 gathered_address + (who * M_LOCAL + block * BM).to(gl.int64) * row_bytes,
                                 gl.minimum(BM, M_LOCAL - block * BM), col_first,
                                 gl.minimum(col_first + piece_cols, K), K, ELEMENT, COPY_ROWS,
                                 COPY_COLS, ALIGNED)
        task += programs
    if tail_tiles > 0:  # the stream-K tail: at most two segments per program
        units = tail_tiles * k_tiles
        unit = (first * units) // programs
        share_end = ((first + 1) * units) // programs
        rows_in = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols_in = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        in_slot = rows_in[:, None] * BN + cols_in[None, :]  # a partial, in the accumulator's layout
        for _segment in range(2):
            if unit < share_end:
                tail = unit // k_tiles
                k_first = unit - tail * k_tiles
                k_end = gl.minimum(share_end - tail * k_tiles, k_tiles)
                source, tile_m, row0, col0 = _tile_rows(tail_first + tail, rank, tiles_m, tiles_n,
                                                        M_LOCAL, slot_row0, WORLD, STEPS, PIECES,
                                                        GROUP_M, BM, BN, ENGINE)
                _wait_rows(own_flags, source, tile_m, tiles_m, epoch, rank, abort_ptr,
                           error_address, timeout_ns, engine_flag0, chunk_blocks, PIECES, ENGINE)
                count = k_end - k_first
                for fill in gl.static_range(STAGES - 1):
                    _issue_tile_load(step + fill, source == rank, row0, col0,
                                     (k_first + fill) * BK, fill < count, a_desc, g_desc,
                                     b_desc, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
                for kk in range(count):
                    acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                    ahead = kk + STAGES - 1
                    _issue_tile_load(step + STAGES - 1, source == rank, row0, col0,
                                     (k_first + ahead) * BK, ahead < count, a_desc, g_desc,
                                     b_desc, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                    step += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                if k_first == 0:  # the owner: add the later programs' partials, store the tile
                    helpers_end = gl.minimum(programs, gl.cdiv((tail + 1) * k_tiles * programs,
                                                               units))
                    for helper in range(first + 1, helpers_end):
                        wait_flag(partial_flags + helper * 4, epoch, abort_ptr, error_address, rank,
                                  helper, timeout_ns)
                        acc += gl.load(partials + helper * (BM * BN) + in_slot, cache_modifier=".cg")
                    _store_tile(acc, o_desc, c_smem, out_ptr, stride_om, source, tile_m, col0,
                                M_LOCAL, N, BM, BN, OUT_TMA)
                else:  # a first segment: the partial into this program's slot, then its flag
                    gl.store(partials + first * (BM * BN) + in_slot, acc, cache_modifier=".cg")
                    fence_acq_rel_sys(tail)
                    gl.thread_barrier()
                    st_release_sys(partial_flags + first * 4, epoch)
                unit = tail * k_tiles + k_end
    if OUT_TMA:
        tma.store_wait(pendings=0)  # (the stores read shared memory until here)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    finish_call(state_ptr, epoch)


# An address argument's value until a call fills it in: Triton types an int argument by its
# value (i32 below 2**31), so a placeholder 0 would compile a kernel that cannot take a real
# 64-bit address (the launcher raised OverflowError on the first call with one).
UNSET_ADDRESS = 1 << 40


@dataclasses.dataclass(frozen=True)
class AllGatherGemmConfig:
    """Tiles and pipeline of the fused all-gather + GEMM kernel (the GEMM core's tile), the
    COPY_ROWS x COPY_COLS elements a push task moves per step, and the column ranges (pieces)
    a row block's push is cut into (one task and one flag each)."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    copy_rows: int = 32
    copy_cols: int = 512
    pieces: int = 4
    # the Gluon kernel (pipelined_all_gather_gemm_kernel): its TMA pipeline runs across the
    # program's tiles; where it cannot run (multimem, operands TMA cannot describe, fewer than
    # stages - 1 K blocks) the launch runs the Triton kernel with the same tiles
    pipelined: bool = False
    # (pipelined only, "/sk") the last round's tiles as a stream-K tail where it leaves SMs idle
    # (schedule.stream_k_tiles). Opt-in: on one H200 it saved nothing at 2048 x 7168 x 8192,
    # 2% at 8192 x 13312 x 16384 and cost 3% at 8192 x 6400 x 5120 (docs/gpu_notes.md)
    stream_k: bool = False
    # ("/ce", unicast; "/gl/ce" on the Gluon kernel) the rows move by copy engine, not by the
    # kernel's push tasks: every SM computes tiles, the copies run beside them. Each source's
    # rows go in `pieces` chunks of whole row blocks, each followed by its flag. Inside a CUDA graph
    # capture the launch pushes instead (a captured copy's destination half would be fixed);
    # so does a machine without cuda-python (the copies go through its runtime bindings)
    engine: bool = False

    def __post_init__(self):
        if self.engine and self.stream_k:
            raise ValueError("AllGatherGemmConfig: the stream-K tail (/sk) does not run with the "
                             "rows by copy engine (/ce)")

    @classmethod
    def parse(cls, text: str) -> "AllGatherGemmConfig":
        """The config str() printed as `text`.

        >>> AllGatherGemmConfig.parse("128x256x64/g8/s3/w8/c32x512/p4")
        AllGatherGemmConfig(block_m=128, block_n=256, block_k=64, group_m=8, stages=3, warps=8, copy_rows=32, copy_cols=512, pieces=4, pipelined=False, stream_k=False, engine=False)
        """
        try:
            tile, g, s, w, c, p, *flags = text.split("/")
            if (g[0], s[0], w[0], c[0], p[0]) != ("g", "s", "w", "c", "p") or \
                    flags not in ([], ["gl"], ["gl", "sk"], ["ce"], ["gl", "ce"]):
                raise ValueError
            block_m, block_n, block_k = (int(v) for v in tile.split("x"))
            copy_rows, copy_cols = (int(v) for v in c[1:].split("x"))
            pieces = int(p[1:])
            if "ce" in flags and not 1 <= pieces <= schedule.ENGINE_CHUNKS:
                raise ValueError
            return cls(block_m, block_n, block_k, int(g[1:]), int(s[1:]), int(w[1:]), copy_rows,
                       copy_cols, pieces, "gl" in flags, "sk" in flags, "ce" in flags)
        except ValueError:
            raise ValueError(f"not an AllGatherGemmConfig string: {text!r}") from None

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/g{self.group_m}/s{self.stages}"
                f"/w{self.warps}/c{self.copy_rows}x{self.copy_cols}/p{self.pieces}"
                f"{'/gl' if self.pipelined else ''}"
                f"{'/sk' if self.pipelined and self.stream_k else ''}"
                f"{'/ce' if self.engine else ''}")


CANDIDATES = tuple(AllGatherGemmConfig.parse(text) for text in (
    "128x256x64/g8/s3/w8/c32x512/p4",
    "128x256x64/g8/s4/w8/c32x512/p4",
    "128x128x64/g8/s4/w8/c32x512/p4",
    "64x256x64/g8/s4/w4/c16x512/p4",
))


def default_config(m_local: int, n: int, k: int, world: int, engines: bool | None = None) -> AllGatherGemmConfig:
    """128 x 256 tiles (the GEMM core's measured default) unless they leave most SMs idle; at
    W = 2, where cuda-python can issue the copies, the rows move by copy engine and the tiles
    run on the Gluon loop (/gl/ce: on 2x H200 at b3d56ba as fast as or faster than the Triton
    /ce kernel on all 12 design, model and Llama-3-8B shapes, up to 1.05x, and faster than
    torch's fused op on 11; benchmarks/results/ag_gemm_w2*.md). At W = 4 likewise where the
    128 x 256 tiles fill the GPU (4x H200 at 902a153: /gl/ce faster than the pushes in device
    time on all 11 such design, model and Llama-3-8B shapes, 1.01-1.20x, and level with or
    faster than torch's op on 10 of them; with 128 x 128 tiles, at 2048x2048x8192, the pushes
    were faster: 0.165 vs 0.190 ms; benchmarks/results/ag_gemm_w4*.md). Where the operands
    cannot take TMA the launch falls back to the Triton loop (/ce). Other world sizes keep the
    pushes until a run there measures the copy engines. ``engines``: whether the copy engines
    can move rows (None: this process's ``copy_engines_usable()``).

    >>> str(default_config(512, 2048, 8192, 4))    # 4 x 16 tiles per source, 256 in all
    '128x128x64/g8/s4/w8/c32x512/p4'
    >>> str(default_config(4096, 2048, 8192, 2))   # with cuda-python
    '128x256x64/g8/s3/w8/c32x512/p4/gl/ce'
    >>> str(default_config(2048, 2048, 8192, 4))   # with cuda-python: 16 x 8 tiles per source
    '128x256x64/g8/s3/w8/c32x512/p4/gl/ce'
    """
    tiles = CANDIDATES[0] if triton.cdiv(m_local, 128) * triton.cdiv(n, 256) * world >= 264 \
        else CANDIDATES[2]
    if engines is None:
        engines = copy_engines_usable()
    engine = engines and (world == 2 or (world == 4 and tiles is CANDIDATES[0]))
    return dataclasses.replace(tiles, engine=engine, pipelined=engine)


def gathered_rows(data_bytes: int, k: int, element_size: int) -> int:
    """Rows of K elements from the start of data half 0 to the first whole row of half 1: where
    the gathered buffer of an odd-epoch call starts.

    >>> gathered_rows(1 << 22, 5120, 2)     # 4 MB halves, 10240-byte rows
    410
    """
    row_bytes = k * element_size
    return -(-data_bytes // row_bytes)


def workspace_bytes_needed(world: int, m_local: int, k: int, element_size: int) -> int:
    """Bytes per data half that hold W sources' rows after the row-aligned start of half 1."""
    return (world * m_local + 1) * k * element_size


class AllGatherGemmLaunch:
    """The fused kernel of one rank for one shape, config and workspace, compiled and ready:
    a call fills in A, B and the output and launches (one kernel; the epoch, the data half and
    the task counter are the rank's call state on the device, so the launch can be captured in
    a CUDA graph and replayed).

    >>> launch = AllGatherGemmLaunch(ops, out, config, workspace, multimem=False)
    >>> launch(ops, out)          # out [W * M_LOCAL, N] on every rank
    """

    _A, _A_DESC, _B_DESC, _B, _OUT, _GATHERED = 0, 1, 3, 4, 5, 6
    _O_DESC = -1  # the Gluon kernel's last runtime argument

    def __init__(self, ops, out: torch.Tensor, config: AllGatherGemmConfig,
                 workspace, multimem: bool = False, copy_out: bool = False):
        from triton.tools.tensor_descriptor import TensorDescriptor

        world, rank = workspace.world_size, workspace.rank
        element = ops.a.element_size()
        self.config, self.world, self.device_index = config, world, ops.a.device.index
        row_bytes = ops.k * element
        self.half_rows = gathered_rows(workspace.data_bytes, ops.k, element)
        needed = workspace_bytes_needed(world, ops.m, ops.k, element)
        if needed > workspace.data_bytes:
            raise ValueError(f"all_gather_gemm: {needed} bytes per half needed, the workspace "
                             f"has {workspace.data_bytes}")
        if world * triton.cdiv(ops.m, config.block_m) * config.pieces > workspace.tile_flags:
            raise ValueError("all_gather_gemm: more row blocks than the workspace has flags")
        gathered = workspace.local_data(0, ops.a.dtype, 2 * workspace.data_bytes // element,
                                        both_halves=True)
        total_rows = 2 * workspace.data_bytes // row_bytes
        self.use_tma = (tma_compatible(ops.a) and tma_compatible(ops.b) and row_bytes % 16 == 0
                        and gathered.data_ptr() % 16 == 0)
        self.block_a = [config.block_m, config.block_k]
        self.block_b = ([config.block_n, config.block_k] if ops.b_transposed
                        else [config.block_k, config.block_n])
        if ops.b_transposed and not self.use_tma:
            raise ValueError("all_gather_gemm: the pointer path takes B as row-major [K, N]")
        multimem = multimem and world > 1
        self.pipelined = (config.pipelined and self.use_tma and not multimem
                          and triton.cdiv(ops.k, config.block_k) >= config.stages - 1)
        if self.pipelined:  # the Gluon JIT types a descriptor by its shared layout too
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as Described

            def describe(t, shape, strides, block):
                return Described(t, shape, strides, block, shared_layout(block, t.dtype))
        else:
            def describe(t, shape, strides, block):
                return TensorDescriptor(t, shape, strides, block)
        g_desc = (describe(gathered, [total_rows, ops.k], [ops.k, 1], self.block_a)
                  if self.use_tma else None)
        a_desc = (describe(ops.a, list(ops.a.shape), list(ops.a.stride()), self.block_a)
                  if self.use_tma else None)
        b_desc = (describe(ops.b, list(ops.b.shape), list(ops.b.stride()), self.block_b)
                  if self.use_tma else None)
        stride_bk, stride_bn = ((ops.b.stride(1), ops.b.stride(0)) if ops.b_transposed
                                else (ops.b.stride(0), ops.b.stride(1)))
        if multimem and (ops.k % 8 or not workspace.multicast_base):
            raise ValueError("all_gather_gemm: multimem needs K % 8 == 0 and a multicast mapping")
        self.timeout_ns = workspace.timeout_ns()
        tiles_m, tiles_n = triton.cdiv(ops.m, config.block_m), triton.cdiv(ops.n, config.block_n)
        # the copies go through cuda-python (launch.copy_engines_usable); without it, pushes
        self.engine = config.engine and world > 1 and not multimem and copy_engines_usable()
        self.pushing = None
        if self.engine:
            self._prepare_engine(ops, out, config, workspace, tiles_m, copy_out)
        constexprs = dict(WORLD=world, BM=config.block_m, BN=config.block_n, BK=config.block_k,
                          GROUP_M=config.group_m, STAGES=config.stages, USE_TMA=self.use_tma,
                          B_TRANSPOSED=ops.b_transposed, MULTIMEM=multimem,
                          ALIGNED=row_bytes % 16 == 0, COPY_ROWS=config.copy_rows,
                          COPY_COLS=config.copy_cols, PIECES=config.pieces,
                          COPY_OUT=copy_out, PHASES=3)
        engine_args = (workspace.engine_flag0, self.chunk_blocks if self.engine else 1)
        constexprs["ENGINE"] = self.engine
        args = (ops.a, a_desc, g_desc, b_desc, ops.b, out, UNSET_ADDRESS,
                *workspace.data_addresses(0),
                workspace.multicast_address(0) if multimem else 0,
                *workspace.flag_addresses(), workspace.state, workspace.abort,
                workspace.error_address(), self.timeout_ns,
                ops.m, ops.n, ops.k, ops.a.stride(0), stride_bk, stride_bn, out.stride(0),
                *engine_args, rank, self.half_rows)
        function = pipelined_all_gather_gemm_kernel if self.pipelined else all_gather_gemm_kernel
        tasks = schedule.ag_task_count(world, tiles_m, tiles_n, config.pieces, multimem, copy_out,
                                       self.engine)
        # one program per SM the rank may fill: all resident (a peer tile waits on pushes
        # that other programs run)
        self.grid = max(1, min(workspace.processors, tasks))
        self.tail_tiles = 0
        self.block_out = [config.block_m, config.block_n // EPILOGUE_SPLIT]
        self.out_tma = (self.pipelined and ops.m % config.block_m == 0 and tma_compatible(out))
        if self.pipelined:
            # the stream-K tail (its partial slots and flags in the rank's scratch), the output
            # descriptor (refilled per call) and whether it is used
            if config.stream_k and not copy_out:
                self.tail_tiles = schedule.stream_k_tiles(
                    tasks, self.grid, tiles_m * tiles_n, triton.cdiv(ops.k, config.block_k),
                    config.stages)
            slots = self.grid * config.block_m * config.block_n * 4 if self.tail_tiles else 0
            flag_bytes = triton.cdiv(self.grid * 4, 16) * 16
            scratch = workspace.scratch(flag_bytes + slots)
            args = args + (self.tail_tiles, scratch[flag_bytes:][:slots].view(torch.float32),
                           scratch.data_ptr(),
                           describe(out, list(out.shape), list(out.stride()), self.block_out)
                           if self.out_tma else None)
            constexprs["OUT_TMA"] = self.out_tma
        kernel = function.warmup(*args, **constexprs, num_warps=config.warps,
                                 num_stages=config.stages, grid=(1,))
        self.kernel = CompiledLaunch(kernel, tuple(constexprs.values()))
        refilled = (self._A_DESC, self._B_DESC) if self.use_tma else ()
        self.template = launch_template(args, refilled + ((len(args) - 1,) if self.out_tma else ()))
        # what the compiled kernel assumed of the per-call operands: shapes, strides, alignment
        self.layout = launch_layout(ops, out)

    def _prepare_engine(self, ops, out, config, workspace, tiles_m, copy_out) -> None:
        """The copy-engine transfers of a call (engine_transfers), the events ordering them
        around the kernel, and the push launch a CUDA graph capture runs."""
        if config.pieces > schedule.ENGINE_CHUNKS:
            raise ValueError(f"all_gather_gemm: at most {schedule.ENGINE_CHUNKS} copy-engine "
                             f"chunks, the config asks {config.pieces}")
        self.row_bytes = ops.k * ops.a.element_size()
        if ops.a.stride(0) != ops.k:  # (prepare_operands' A always is: the copies assume it)
            raise ValueError("all_gather_gemm /ce: A's rows must be contiguous (prepare_operands)")
        # each flag gets the rank's last finished epoch (state word 0)
        self.chunk_blocks, self.copies = engine_transfers(
            workspace, ops.m, self.row_bytes, config.block_m, config.pieces, self.half_rows)
        self.workspace, self.epoch_word = workspace, workspace.state.data_ptr()
        self.ready, self.sent = torch.cuda.Event(), torch.cuda.Event()
        # per epoch parity, the call's copies as a CUDA graph whose row copies take each call's
        # A (made now, before any virtual rank's kernel spins; A's rows are contiguous:
        # prepare_operands makes them so, and a launch serves only calls of its layout);
        # graph_error: why they are issued one by one instead
        self.graphs, self.graph_error = graphs_per_parity(
            lambda parity: self._capture_sends(ops.a, parity))
        self.pushing = AllGatherGemmLaunch(ops, out, dataclasses.replace(config, engine=False),
                                           workspace, copy_out=copy_out)

    def _issue_sends(self, a_address: int, parity: int, stream: int, flat: bool = False) -> None:
        """The copies of a call of this epoch parity on `stream`: each chunk of rows (A, row-major,
        at `a_address`) into every peer's gathered buffer, then this rank's last finished epoch
        (state word 0) into the peer's flag of the chunk. flat: each chunk as a 1-D copy, whose
        source a graph can change per call (else a 2-D one, as measured issued)."""
        runtime, row_bytes = copy_engine_runtime(), self.row_bytes
        for begin, rows, target, flag in self.copies[parity]:
            source = a_address + begin * row_bytes
            if flat:
                copy_bytes_async(runtime, target, source, rows * row_bytes, stream)
            else:
                copy_rows_async(runtime, target, row_bytes, source, row_bytes, row_bytes, rows,
                                stream)
            copy_rows_async(runtime, flag, 4, self.epoch_word, 4, 4, 1, stream)

    def _capture_sends(self, a: torch.Tensor, parity: int) -> tuple:
        """(graph, [(its row copy's node, first row, rows, target)]) of this parity's copies,
        captured with `a`'s rows as the source (each call sets its own)."""
        side = self.workspace.copy_streams()[0]
        graph = StreamGraph([side], lambda: self._issue_sends(a.data_ptr(), parity,
                                                              side.cuda_stream, True))
        nodes = graph.copy_nodes()
        if any(target not in nodes for _, _, target, _ in self.copies[parity]):
            raise RuntimeError("a row copy of the captured graph was not found by its target")
        return graph, [(nodes[target], begin, rows, target)
                       for begin, rows, target, _ in self.copies[parity]]

    def _send_rows(self, a: torch.Tensor) -> None:
        """This call's rows to every peer by copy engine, on the workspace's first side stream
        (the copies wait on nothing, so one stream issues them back to back), after what the
        current stream queued (the previous call's kernel: the peers' halves of this parity are
        free once it finished); the current stream waits for them after the kernel. With the
        graphs, each row copy is pointed at this call's A and the graph launched."""
        current = torch.cuda.current_stream(a.device)
        side = self.workspace.copy_streams()[0]
        self.ready.record(current)
        side.wait_event(self.ready)
        parity, row_bytes = self.workspace.call_epoch() % 2, self.row_bytes
        if self.graphs:
            graph, nodes = self.graphs[parity]
            for node, begin, rows, target in nodes:
                graph.set_copy(node, target, a.data_ptr() + begin * row_bytes, rows * row_bytes)
            graph.launch(side.cuda_stream)
        else:
            self._issue_sends(a.data_ptr(), parity, side.cuda_stream)
        self.sent.record(side)

    def __call__(self, ops, out: torch.Tensor, gathered: torch.Tensor | None = None) -> None:
        """gathered: where the gathered A [W * M_LOCAL, K] goes too (a launch built with
        copy_out; row-major, 16-byte aligned)."""
        if self.engine:
            if torch.cuda.is_current_stream_capturing():
                self.pushing(ops, out, gathered)
                return
            self._send_rows(ops.a)
        args = list(self.template)
        if self.use_tma:
            args[self._A_DESC] = descriptor(ops.a, self.block_a, True)
            args[self._B_DESC] = descriptor(ops.b, self.block_b, True)
        args[self._A], args[self._B] = ops.a.data_ptr(), ops.b.data_ptr()
        args[self._OUT] = out.data_ptr()
        if self.out_tma:
            args[self._O_DESC] = descriptor(out, self.block_out, True)
        if gathered is not None:
            args[self._GATHERED] = gathered.data_ptr()
        self.kernel(self.grid, torch._C._cuda_getCurrentRawStream(self.device_index), args)
        if self.engine:
            torch.cuda.current_stream(ops.a.device).wait_event(self.sent)


def engine_transfers(workspace, m: int, row_bytes: int, block_m: int, pieces: int,
                     half_rows: int) -> tuple[int, list]:
    """(row blocks per chunk, copies) of a copy-engine ("/ce") call of this rank: for each epoch
    parity, in push-step order over the peers (rank + 1 first: it computes this rank's rows in
    its segment 1) and chunk order, (first row, rows, the address of the chunk's place in that
    peer's gathered buffer, the address of the peer's flag word of the chunk
    (schedule.engine_flag)); rows are row_bytes apart in the gathered buffer.

    >>> blocks, copies = engine_transfers(workspace, 1000, 8192, 128, 4, rows)
    >>> blocks, [c[:2] for c in copies[0]]        # W = 2: 8 row blocks in 4 chunks to rank 1
    (2, [(0, 256), (256, 256), (512, 256), (768, 232)])
    """
    world, rank = workspace.world_size, workspace.rank
    chunk_blocks, chunks = schedule.engine_chunks(triton.cdiv(m, block_m), pieces)
    bounds = [(c * chunk_blocks * block_m, min((c + 1) * chunk_blocks * block_m, m))
              for c in range(chunks)]
    data, flags = workspace.data_addresses(0), workspace.flag_addresses()
    copies = [[], []]
    for parity in (0, 1):
        first = parity * half_rows + rank * m  # this rank's slot in the call's half (one buffer
        for step in range(1, world):           # of rows spans both halves from half 0)
            peer = (rank + step) % world
            gathered = data[peer] + first * row_bytes
            for chunk, (begin, end) in enumerate(bounds):
                flag = workspace.engine_flag0 + schedule.engine_flag(parity, rank, chunk)
                copies[parity].append((begin, end - begin, gathered + begin * row_bytes,
                                       flags[peer] + 4 * flag))
    return chunk_blocks, copies


def launch_layout(ops, out: torch.Tensor) -> tuple:
    """What a prepared launch assumed of its operands and output (it is reused only for calls
    that match): shapes, strides, orientation, dtype and 16-byte alignment of every pointer."""
    return (tuple(ops.a.shape), tuple(ops.a.stride()), tuple(ops.b.shape), tuple(ops.b.stride()),
            ops.b_transposed, ops.a.dtype, tuple(out.shape), tuple(out.stride()),
            tuple(t.data_ptr() % 16 == 0 for t in (ops.a, ops.b, out)))
