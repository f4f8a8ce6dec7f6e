"""Fused GEMM + reduce-scatter in ONE persistent Triton kernel (p2p or multimem reduce).

out_r = sum_p (A_p @ B_p)[r * M/W : (r + 1) * M/W]   on rank r, for A_p [M, K] and B_p [K, N].

One launch per call with a grid of one program per SM (always co-resident). Programs claim task
ids from an atomic counter in the global order of `schedule.py`: GEMM tiles write their bf16/fp16
partial into this rank's symmetric workspace and release a per-tile flag (epoch, system scope);
reduce tiles of this rank's chunk acquire that tile's flag on every rank, `load_reduce` the tile
from all ranks in fp32 and store the output. Back-to-back calls need no memset and no host sync
(epochs + alternating workspace halves, see collectives/symmetric.py). Waits time out and raise.
The epoch, the half and the task counter are the rank's call state in device memory, advanced
and reset by the kernel itself (primitives.finish_call): a launch replays from a CUDA graph.

The GEMM tiles are the GEMM core's (gemm.gemm_tile: TMA descriptors and wgmma through tl.dot,
software-pipelined over K; masked pointer loads where TMA cannot describe the strides).
GEMM_ONLY runs the same kernel with the reduce tasks and flags removed (for the benchmark).
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma_wait)

from . import schedule
from ..caches import memo
from .gemm import DescriptorBase, gemm_tile, tma_compatible
from .gemm_gluon import (EPILOGUE_SPLIT, accumulator_layout, allocate_ring, issue_load,
                         mma_step, shared_layout, store_tile_halves)
from .launch import (CompiledLaunch, StreamGraph, copy_engine_runtime, copy_engines_usable,
                     copy_rows_async, graphs_per_parity, multiprocessors, stream_memory_driver,
                     take_flag_async, wait_value_async)
from .primitives import (grouped_tile, STATE_WORDS, bulk_stores_complete, call_epoch, claim_task,
                         clock_cycles, fence_acq_rel_sys, fence_proxy_async, finish_call,
                         globaltimer, load_reduce,
                         peer_pointers, pick, shift8, sm_id, st_release_gpu,
                         st_release_sys, wait_engine_chunk, wait_flag)


@triton.jit
def _decode_task(task, rounds, lag, WORLD: tl.constexpr):
    # the device twin of schedule.decode_task
    head = lag * WORLD
    body = (rounds - lag) * (WORLD + 1)
    in_body = task - head
    step = in_body // (WORLD + 1)
    body_slot = in_body % (WORLD + 1)
    is_head = task < head
    is_body = (task >= head) & (in_body < body)
    is_gemm = is_head | (is_body & (body_slot < WORLD))
    round_ = tl.where(is_head, task // WORLD,
                      tl.where(is_body, tl.where(body_slot < WORLD, lag + step, step),
                               rounds - lag + (in_body - body)))
    slot = tl.where(is_head, task % WORLD, tl.where(is_body & (body_slot < WORLD), body_slot, 0))
    return is_gemm, round_, slot


@triton.jit
def schedule_probe_kernel(out_ptr, rounds, lag, tiles_m, tiles_n, rank,
                          WORLD: tl.constexpr, GROUP_M: tl.constexpr):
    """Program `task` writes (is_gemm, chunk, tile row, tile col) of that task id, decoded as the
    fused kernel decodes it; the CPU tests run it under TRITON_INTERPRET=1 against schedule.py."""
    task = tl.program_id(0)
    if task >= 0:
        is_gemm, round_, slot = _decode_task(task, rounds, lag, WORLD)
        tile_m, tile_n = grouped_tile(round_, tiles_m, tiles_n, GROUP_M)
        chunk = tl.where(is_gemm, (rank + 1 + slot) % WORLD, rank)
        tl.store(out_ptr + task * 4 + 0, is_gemm.to(tl.int32))
        tl.store(out_ptr + task * 4 + 1, chunk)
        tl.store(out_ptr + task * 4 + 2, tile_m)
        tl.store(out_ptr + task * 4 + 3, tile_n)


@triton.jit
def _tma_store_to(owner, P0, P1, P2, P3, P4, P5, P6, P7, row, col, tile,
                  WORLD: tl.constexpr):
    """TMA store of `tile` at [row, col] of rank `owner`'s push buffer (descriptor P<owner>).
    The store is asynchronous: the copy engine of the SM drains it over NVLink while the
    program goes on; bulk_stores_complete waits for it before the tile's flag is released."""
    if owner == 0:
        P0.store([row, col], tile)
    elif owner == 1:
        P1.store([row, col], tile)
    elif (WORLD > 2) and (owner == 2):
        P2.store([row, col], tile)
    elif (WORLD > 3) and (owner == 3):
        P3.store([row, col], tile)
    elif (WORLD > 4) and (owner == 4):
        P4.store([row, col], tile)
    elif (WORLD > 5) and (owner == 5):
        P5.store([row, col], tile)
    elif (WORLD > 6) and (owner == 6):
        P6.store([row, col], tile)
    elif WORLD > 7:
        P7.store([row, col], tile)


@triton.jit
def _release(F0, F1, F2, F3, F4, F5, F6, F7, owner, flag, epoch, SCOPE: tl.constexpr,
             BULK: tl.constexpr = False):
    """Publish `flag` (= epoch) in the flag array of rank `owner`, after the tile's stores
    (BULK: the program's TMA stores too)."""
    if BULK:
        bulk_stores_complete(flag)
    tl.debug_barrier()  # every thread's stores of the tile precede thread 0's release
    own_flags = pick(owner, F0, F1, F2, F3, F4, F5, F6, F7)
    if SCOPE == "gpu":
        st_release_gpu(own_flags + flag * 4, epoch)
    else:
        st_release_sys(own_flags + flag * 4, epoch)


# MODE: 0 = fused GEMM + reduce-scatter; 1 = GEMM only (no flags, no reduce tasks);
# 2 = GEMM + flag releases without reduce tasks; 3 = the fused schedule with the GEMM main
# loop skipped (zero tiles): stores, flags and reduce alone. 2 and 3 are for the benchmark.
FUSED, GEMM_ONLY, GEMM_AND_SIGNAL, NO_MATH = 0, 1, 2, 3


@triton.jit(do_not_specialize=["rank", "timeout_ns", "lag", "half_bytes", "push_rows"])
def gemm_reduce_scatter_kernel(
        a_desc, a_ptr, b_desc, b_ptr, part_ptr, out_ptr,
        P0, P1, P2, P3, P4, P5, P6, P7,
        D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
        F0, F1, F2, F3, F4, F5, F6, F7,
        state_ptr, abort_ptr, error_address, timeout_ns,
        M, N, K, M_CHUNK, stride_am, stride_ak, stride_bk, stride_bn,
        rank, lag, half_bytes, push_rows,
        WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr,
        B_TRANSPOSED: tl.constexpr, MODE: tl.constexpr, MULTIMEM: tl.constexpr,
        ALIGNED: tl.constexpr, REDUCE_ROWS: tl.constexpr, DEFER: tl.constexpr,
        SCOPE: tl.constexpr, PUSH: tl.constexpr, TMA_PUSH: tl.constexpr):
    """PUSH (p2p only): a GEMM tile is stored straight into its owner's workspace (slot of this
    rank: [W sources, M/W rows, N]) and its flag released in the owner's flag array; reduce
    tasks then wait on local flags and sum local slots. Remote stores are posted writes, so
    producers never stall on NVLink latency, unlike the pull reduce's remote loads.
    DEFER: release a GEMM tile's flag only after the NEXT tile's main loop (its stores, local or
    remote, have drained by then, so the system-scope fence is cheap), and always before a
    reduce task or the end, so no program holds an unreleased flag while it waits (deadlock
    freedom holds). `pending` is the held flag, `pending_owner` the rank whose array holds it.
    TMA_PUSH (with PUSH; the host sets it only when M_CHUNK % BM == 0, so a tile never crosses
    into the next source's slot): the remote tile store is a TMA store through descriptor
    P<owner> of the owner's push buffers (both halves: [2 * push_rows, N], half 1 starting at
    row push_rows), asynchronous, so the program starts its next tile while NVLink drains the
    last one (with DEFER, usually already drained when the flag is released).
    D* are the ranks' data half 0 (the kernel moves to its epoch's half); part_ptr is the
    product's destination in GEMM_ONLY mode only."""
    ELEMENT: tl.constexpr = part_ptr.dtype.element_ty
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    multicast_base += parity * half_bytes  # (used by MULTIMEM only)
    push_row0 = parity.to(tl.int32) * push_rows
    tiles_m = tl.cdiv(M_CHUNK, BM)
    tiles_n = tl.cdiv(N, BN)
    rounds = tiles_m * tiles_n
    if (MODE == 0) or (MODE == 3):
        tasks = rounds * (WORLD + 1)
    else:
        tasks = rounds * WORLD
    task = claim_task(state_ptr)
    pending = task * 0 - 1
    pending_owner = task * 0
    while task < tasks:
        if (MODE == 0) or (MODE == 3):
            is_gemm, round_, slot = _decode_task(task, rounds, lag, WORLD)
        else:
            is_gemm = task >= 0
            round_ = task // WORLD
            slot = task % WORLD
        tile_m, tile_n = grouped_tile(round_, tiles_m, tiles_n, GROUP_M)
        col0 = tile_n * BN
        cols = col0 + tl.arange(0, BN)
        if is_gemm:
            chunk = (rank + 1 + slot) % WORLD
            row0 = chunk * M_CHUNK + tile_m * BM
            if MODE == 3:
                accumulator = tl.zeros((BM, BN), dtype=tl.float32)
            else:
                accumulator = gemm_tile(a_desc, a_ptr, b_desc, b_ptr, row0, col0, 0,
                                        tl.cdiv(K, BK), M, N, K, stride_am, stride_ak,
                                        stride_bk, stride_bn, BM, BN, BK, STAGES, USE_TMA,
                                        B_TRANSPOSED)
            if DEFER:
                if pending >= 0:
                    _release(F0, F1, F2, F3, F4, F5, F6, F7, pending_owner, pending, epoch, SCOPE,
                             TMA_PUSH)
            rows = row0 + tl.arange(0, BM)
            # rows past the chunk belong to the next chunk's tiles: never write them
            mask = (rows[:, None] < (chunk + 1) * M_CHUNK) & (cols[None, :] < N)
            if PUSH and MODE != 1:
                if TMA_PUSH:
                    _tma_store_to(chunk, P0, P1, P2, P3, P4, P5, P6, P7,
                                  push_row0 + rank * M_CHUNK + tile_m * BM, col0,
                                  accumulator.to(ELEMENT), WORLD)
                else:
                    slot_rows = rank * M_CHUNK + rows - chunk * M_CHUNK
                    destination = peer_pointers(pick(chunk, D0, D1, D2, D3, D4, D5, D6, D7),
                                                slot_rows[:, None] * N + cols[None, :], ELEMENT,
                                                ALIGNED)
                    tl.store(destination, accumulator.to(ELEMENT), mask=mask)
                if DEFER:
                    pending = rank * rounds + round_
                    pending_owner = chunk
                else:
                    _release(F0, F1, F2, F3, F4, F5, F6, F7, chunk, rank * rounds + round_,
                             epoch, SCOPE, TMA_PUSH)
            elif MODE == 1:
                tl.store(part_ptr + rows[:, None] * N + cols[None, :], accumulator.to(ELEMENT),
                         mask=mask)
            else:
                partial = peer_pointers(pick(rank, D0, D1, D2, D3, D4, D5, D6, D7),
                                        rows[:, None] * N + cols[None, :], ELEMENT, ALIGNED)
                tl.store(partial, accumulator.to(ELEMENT), mask=mask)
                if DEFER:
                    pending = chunk * rounds + round_
                    pending_owner = rank
                else:
                    _release(F0, F1, F2, F3, F4, F5, F6, F7, rank, chunk * rounds + round_,
                             epoch, SCOPE)
        else:
            if DEFER:
                if pending >= 0:
                    _release(F0, F1, F2, F3, F4, F5, F6, F7, pending_owner, pending, epoch, SCOPE,
                             TMA_PUSH)
                pending = pending * 0 - 1
            if PUSH:
                own_flags = pick(rank, F0, F1, F2, F3, F4, F5, F6, F7)
                own_data = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
                for source in tl.static_range(WORLD):
                    flag = source * rounds + round_
                    wait_flag(own_flags + flag * 4, epoch, abort_ptr, error_address,
                              rank * 0 + source, flag, timeout_ns)
                for sub in tl.static_range(0, BM, REDUCE_ROWS):
                    chunk_rows = tile_m * BM + sub + tl.arange(0, REDUCE_ROWS)
                    chunk_mask = (chunk_rows[:, None] < M_CHUNK) & (cols[None, :] < N)
                    sum_ = tl.zeros((REDUCE_ROWS, BN), dtype=tl.float32)
                    for source in tl.static_range(WORLD):
                        slot_offsets = (source * M_CHUNK + chunk_rows)[:, None] * N + cols[None, :]
                        sum_ += tl.load(peer_pointers(own_data, slot_offsets, ELEMENT, ALIGNED),
                                        mask=chunk_mask, other=0.0).to(tl.float32)
                    tl.store(out_ptr + chunk_rows[:, None] * N + cols[None, :],
                             sum_.to(ELEMENT), mask=chunk_mask)
            else:
                flag = rank * rounds + round_
                for step in tl.static_range(WORLD):
                    peer = (rank + step) % WORLD
                    address = pick(peer, F0, F1, F2, F3, F4, F5, F6, F7) + flag * 4
                    wait_flag(address, epoch, abort_ptr, error_address, peer, flag, timeout_ns)
                own_row0 = rank * M_CHUNK + tile_m * BM
                for sub in tl.static_range(0, BM, REDUCE_ROWS):
                    own_rows = own_row0 + sub + tl.arange(0, REDUCE_ROWS)
                    own_mask = (own_rows[:, None] < (rank + 1) * M_CHUNK) & (cols[None, :] < N)
                    offsets = own_rows[:, None] * N + cols[None, :]
                    total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base, offsets,
                                        own_mask, rank, ELEMENT, WORLD, MULTIMEM, ALIGNED)
                    local = (own_rows[:, None] - rank * M_CHUNK) * N + cols[None, :]
                    tl.store(out_ptr + local, total.to(ELEMENT), mask=own_mask)
        task = claim_task(state_ptr)
    if DEFER:
        if pending >= 0:
            _release(F0, F1, F2, F3, F4, F5, F6, F7, pending_owner, pending, epoch, SCOPE,
                     TMA_PUSH)
    if TMA_PUSH:
        bulk_stores_complete(task)  # no TMA store may outlive the kernel unfinished
    finish_call(state_ptr, epoch)


@triton.jit
def _chunk_tiles(group, band, tiles_m, tiles_n, GROUP_M: tl.constexpr, band_tiles):
    """Tiles of the /ce comm chunk (group of GROUP_M tile rows, band of band_tiles columns)."""
    size_m = tl.minimum(tiles_m - group * GROUP_M, GROUP_M)
    size_n = tl.minimum(tiles_n - band * band_tiles, band_tiles)
    return size_m * size_n


@triton.jit
def _trace_task(trace_ptr, task, started, cycle0, cycle1, waited):
    """A /ce kernel's TRACE record of `task` (row `task` of trace_ptr [tasks, 6]): its start and
    end (globaltimer ns), SM, cycles in the main loop (cycle0 to cycle1), in waits, in all."""
    record = trace_ptr + task.to(tl.int64) * 6
    tl.store(record, started)
    tl.store(record + 1, globaltimer(task))
    tl.store(record + 2, sm_id(task).to(tl.int64))
    tl.store(record + 3, cycle1 - cycle0)
    tl.store(record + 4, waited)
    tl.store(record + 5, clock_cycles(task) - cycle0)


@triton.jit
def _count_chunk_tile(counts_ptr, out_flags, counter, chunk_tiles, epoch, BULK: tl.constexpr):
    """Count one stored peer tile of /ce comm chunk `counter` (BULK: once the program's TMA
    stores of it have completed); the chunk's last tile fences at system scope (the copy engine
    reads the chunk) and releases the chunk's out flag to the epoch. counts_ptr only grows (a
    call adds a chunk's tile count, so the last tile of a call sees a multiple of it); the
    barrier before the count orders every thread's stores of the tile before its release at
    GPU scope: one system fence per chunk, not per tile."""
    if BULK:
        bulk_stores_complete(counter)
    tl.debug_barrier()
    done = tl.atomic_add(counts_ptr + counter, 1, sem="acq_rel", scope="gpu")
    if (done + 1) % chunk_tiles == 0:
        fence_acq_rel_sys(counter)
        tl.debug_barrier()
        st_release_sys(out_flags + counter * 4, epoch)


@triton.jit(do_not_specialize=["rank", "timeout_ns", "half_bytes", "engine_flag0",
                               "band_tiles"])
def engine_gemm_reduce_scatter_kernel(
        a_desc, a_ptr, b_desc, b_ptr, staging_ptr, out_ptr, incoming_address, own_flags,
        out_flags, counts_ptr, state_ptr, abort_ptr, error_address, timeout_ns,
        M, N, K, M_CHUNK, stride_am, stride_ak, stride_bk, stride_bn, engine_flag0, band_tiles,
        rank, half_bytes, trace_ptr,
        WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr,
        B_TRANSPOSED: tl.constexpr, ENGINE_CHUNKS: tl.constexpr, PHASES: tl.constexpr,
        TRACE: tl.constexpr):
    """GEMM + reduce-scatter with the partials moved by copy engine ("/ce"; EngineReduceScatter
    issues the copies). Tasks in claim order: slot s < W - 1 holds the tiles of the chunk of
    peer (rank + 1 + s) % W, slot W - 1 this rank's own chunk, each slot in grouped tile order.
    A peer tile goes to staging_ptr [W - 1, M_CHUNK, N] (local memory); when the last tile of a
    comm chunk (a band of band_tiles tile columns of one group of GROUP_M tile rows: a rectangle,
    contiguous in the order) is stored, its program releases the int32 at address out_flags +
    4 * (s * chunks + chunk) to the epoch, which the side stream waits for (a graph's wait:
    non-zero, then takes it down) before copying the rectangle into the peer's
    data half (slot `rank`) and this rank's last finished epoch into the peer's flag of it
    (schedule.engine_flag). An own tile adds every peer's partial of it from this rank's data
    half (slot = source) once that source's flag holds >= epoch - 1 (see ag_gemm's
    _wait_engine_rows), then stores the output. Peer tiles precede own tiles in the claim order
    and never wait, so a waiting own tile always finds its peers' producers claimed: no
    deadlock. counts_ptr: per (slot, chunk) tile counts (_count_chunk_tile).
    TRACE: trace_ptr [tasks, 6] int64 gets, per task, its start and end
    (globaltimer ns), SM, and cycles in the main loop, in waits, in all (probes only).
    PHASES (interpreter tests): 1 the peer tiles, 2 the own tiles, without flags and waits;
    3 everything."""
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    SIGNAL: tl.constexpr = PHASES == 3
    epoch = call_epoch(state_ptr)
    parity = epoch % 2
    incoming = (incoming_address + parity.to(tl.int64) * half_bytes).to(tl.pointer_type(ELEMENT))
    tiles_m = tl.cdiv(M_CHUNK, BM)
    tiles_n = tl.cdiv(N, BN)
    per_slot = tiles_m * tiles_n
    bands = tl.cdiv(tiles_n, band_tiles)
    chunks = tl.cdiv(tiles_m, GROUP_M) * bands
    task = claim_task(state_ptr)
    while task < WORLD * per_slot:
        slot = task // per_slot
        tile_m, tile_n = grouped_tile(task % per_slot, tiles_m, tiles_n, GROUP_M)
        group = tile_m // GROUP_M
        band = tile_n // band_tiles
        chunk_id = group * bands + band
        is_peer = slot < WORLD - 1
        owner = tl.where(is_peer, (rank + 1 + slot) % WORLD, rank)
        run = tl.where(is_peer, PHASES & 1, PHASES & 2) != 0
        if run:  # one gemm_tile call site: one set of pipeline buffers
            if TRACE:
                started = globaltimer(task)
                cycle0 = clock_cycles(task)
                waited = cycle0 - cycle0
            row0 = owner * M_CHUNK + tile_m * BM
            col0 = tile_n * BN
            rows = tile_m * BM + tl.arange(0, BM)
            cols = col0 + tl.arange(0, BN)
            mask = (rows[:, None] < M_CHUNK) & (cols[None, :] < N)
            offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
            accumulator = gemm_tile(a_desc, a_ptr, b_desc, b_ptr, row0, col0, 0, tl.cdiv(K, BK),
                                    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BM, BN,
                                    BK, STAGES, USE_TMA, B_TRANSPOSED)
            if TRACE:
                cycle1 = clock_cycles(task)
            if is_peer:
                tl.store(staging_ptr + slot.to(tl.int64) * M_CHUNK * N + offsets,
                         accumulator.to(ELEMENT), mask=mask)
                if SIGNAL:
                    _count_chunk_tile(counts_ptr, out_flags, slot * chunks + chunk_id,
                                      _chunk_tiles(group, band, tiles_m, tiles_n, GROUP_M,
                                                   band_tiles), epoch, False)
            else:
                # this rank's partial rounded first, as every peer's was (the sum of the W
                # rounded partials in fp32, as the push kernel and NCCL): the fp32 tile is dead
                # before the partials are loaded (with both live, 8 warps spill registers)
                total = accumulator.to(ELEMENT).to(tl.float32)
                for step in tl.static_range(1, WORLD):
                    source = (rank + step) % WORLD
                    if SIGNAL:
                        if TRACE:
                            before = clock_cycles(task)
                        wait_engine_chunk(own_flags, engine_flag0, epoch, source, chunk_id,
                                          abort_ptr, error_address, timeout_ns, ENGINE_CHUNKS)
                        if TRACE:
                            waited += clock_cycles(task) - before
                    partial = tl.load(incoming + source.to(tl.int64) * M_CHUNK * N + offsets,
                                      mask=mask, other=0.0)
                    total += partial.to(tl.float32)
                tl.store(out_ptr + offsets, total.to(ELEMENT), mask=mask)
            if TRACE:
                _trace_task(trace_ptr, task, started, cycle0, cycle1, waited)
        task = claim_task(state_ptr)
    finish_call(state_ptr, epoch)


@gluon.jit
def _engine_task_tile(task, rank, per_slot, tiles_m, tiles_n, M_CHUNK, WORLD: gl.constexpr,
                      BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """(slot, tile row, tile column, first row of A, first column) of /ce task `task`'s tile
    (the claim order of engine_gemm_reduce_scatter_kernel: slot s < W - 1 the chunk of peer
    rank + 1 + s, slot W - 1 this rank's own)."""
    slot = task // per_slot
    tile_m, tile_n = grouped_tile(task % per_slot, tiles_m, tiles_n, GROUP_M)
    owner = gl.where(slot < WORLD - 1, (rank + 1 + slot) % WORLD, rank)
    return slot, tile_m, tile_n, owner * M_CHUNK + tile_m * BM, tile_n * BN


@gluon.jit
def _fetch_partial_half(own_flags, engine_flag0, epoch, source, chunk_id, abort_ptr,
                        error_address, timeout_ns, incoming0_desc, incoming1_desc, row, col, bar,
                        buffer, task, ENGINE_CHUNKS: gl.constexpr, TRACE: gl.constexpr):
    """Wait until source's copy of comm chunk chunk_id has arrived in this rank's data half,
    make the data it acquired visible to TMA loads, and load the [BM, BN / 2] block at
    [row, col] of it into `buffer` once the buffer's last TMA store has read it (completing on
    `bar`). Returns the cycles spent waiting for the flag (TRACE; 0 otherwise)."""
    if TRACE:
        before = clock_cycles(task)
    wait_engine_chunk(own_flags, engine_flag0, epoch, source, chunk_id, abort_ptr,
                      error_address, timeout_ns, ENGINE_CHUNKS)
    spent = 0
    if TRACE:
        spent = clock_cycles(task) - before
    fence_proxy_async(source)
    tma.store_wait(pendings=0)  # the staging buffer is free
    _load_partial_half(incoming0_desc, incoming1_desc, epoch % 2, row, col, bar, buffer)
    return spent


@gluon.jit
def _load_partial_half(incoming0_desc, incoming1_desc, parity, row, col, bar, buffer):
    """TMA load of the [BM, BN / 2] block at [row, col] of this rank's data half `parity` into
    `buffer`, completing on `bar`."""
    mbarrier.expect(bar, incoming0_desc.block_type.nbytes)
    if parity == 0:
        tma.async_copy_global_to_shared(incoming0_desc, [row, col], bar, buffer)
    else:
        tma.async_copy_global_to_shared(incoming1_desc, [row, col], bar, buffer)


@gluon.jit
def _engine_step_extras(kk, count_step, partial_step, pending, pending_tiles, own, waited,
                        counts_ptr, out_flags, own_flags, engine_flag0, epoch, rank, chunk_id,
                        abort_ptr, error_address, timeout_ns, incoming0_desc, incoming1_desc,
                        M_CHUNK, tile_m, tile_n, partial_bar, c_smem, task, WORLD: gl.constexpr,
                        BM: gl.constexpr, BN: gl.constexpr, ENGINE_CHUNKS: gl.constexpr,
                        TRACE: gl.constexpr, PARTIAL_AHEAD: gl.constexpr):
    """What K step kk of a /gl/ce tile does besides its wgmma and load: at count_step the last
    peer tile's chunk counted (its stores drained meanwhile), at partial_step of an own tile
    the first source's first partial half fetched (while wgmmas run). Returns (pending,
    waited)."""
    if (kk == count_step) & (pending >= 0):
        _count_chunk_tile(counts_ptr, out_flags, pending, pending_tiles, epoch, True)
        pending = pending * 0 - 1
    if PARTIAL_AHEAD >= 0:
        if own & (kk == partial_step):
            source = (rank + 1) % WORLD
            spent = _fetch_partial_half(
                own_flags, engine_flag0, epoch, source, chunk_id, abort_ptr, error_address,
                timeout_ns, incoming0_desc, incoming1_desc,
                (source * M_CHUNK + tile_m * BM).to(gl.int32), tile_n * BN, partial_bar, c_smem,
                task, ENGINE_CHUNKS, TRACE)
            if TRACE:
                waited += spent
    return pending, waited


@gluon.jit(do_not_specialize=["rank", "timeout_ns", "half_bytes", "engine_flag0", "band_tiles"])
def pipelined_engine_gemm_reduce_scatter_kernel(
        a_desc, a_ptr, b_desc, b_ptr, staging_desc, out_desc, incoming_address, own_flags,
        out_flags, counts_ptr, state_ptr, abort_ptr, error_address, timeout_ns,
        M, N, K, M_CHUNK, stride_am, stride_ak, stride_bk, stride_bn, engine_flag0, band_tiles,
        rank, half_bytes, trace_ptr, incoming0_desc, incoming1_desc,
        WORLD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, USE_TMA: gl.constexpr,
        B_TRANSPOSED: gl.constexpr, ENGINE_CHUNKS: gl.constexpr, PHASES: gl.constexpr,
        TRACE: gl.constexpr, COUNT_STEP: gl.constexpr, PARTIAL_AHEAD: gl.constexpr):
    """engine_gemm_reduce_scatter_kernel ("/gl/ce") on the Gluon tile loop of gemm_gluon.py:
    the same tasks, chunks, flags and copies, the same arguments but for staging_desc and
    out_desc (TMA descriptors of the staging buffer as [(W - 1) * M_CHUNK, N] and of the
    output, blocks [BM, BN / EPILOGUE_SPLIT]), incoming0_desc and incoming1_desc after them
    (this rank's data half of each epoch parity as [W * M_CHUNK, N]), and incoming_address
    and half_bytes, unused (the descriptors describe them).

    Tasks are assigned statically (program p runs p, p + P, ... in order), so a program knows
    its next tile and loads it while the current one's last K steps run. Peer tiles precede own
    tiles in every program's list and never wait, so the producers of every chunk an own tile
    waits for run to the end: no deadlock. A peer tile leaves through TMA stores into the
    staging buffer; the program counts it (_count_chunk_tile) once the stores have completed,
    in the next tile's main loop after K step min(COUNT_STEP, K steps - 1) (0: right after its
    first wgmma is issued; probes try later steps), so the tensor cores do not wait for the
    drain, and never while it waits itself. An own tile adds the peers' partials, which come
    in by TMA loads, half a tile at a time, through the output's staging buffer (measured
    0.9 us a tile faster than 32-bit loads in the accumulator's layout, b2d18c0), and leaves
    through TMA stores into the output. The first source's first half is loaded while the
    tile's last wgmmas run: its flag awaited and its load issued at K step
    k_tiles - 1 - PARTIAL_AHEAD, never before the count step (a program waits for a peer's
    chunk only once it has counted its own last peer tile); PARTIAL_AHEAD -1 (probes): after
    the main loop, as before. Whole row tiles only (engine_pipelined_fits). TRACE as
    the Triton kernel's (the main loop: this tile's K steps)."""
    gl.static_assert(USE_TMA and PHASES == 3)
    dtype: gl.constexpr = a_desc.dtype
    a_bufs, b_bufs, bars = allocate_ring(a_desc, b_desc, STAGES)
    c_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    partial_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(partial_bar, count=1)
    partial_loads = rank * 0

    epoch = call_epoch(state_ptr)
    tiles_m = gl.cdiv(M_CHUNK, BM)
    tiles_n = gl.cdiv(N, BN)
    per_slot = tiles_m * tiles_n
    tasks = WORLD * per_slot
    bands = gl.cdiv(tiles_n, band_tiles)
    chunks = gl.cdiv(tiles_m, GROUP_M) * bands
    k_tiles = gl.cdiv(K, BK)
    first = gl.program_id(0)
    programs = gl.num_programs(0)

    # loads run at most one tile ahead (the host launches this kernel only when
    # k_tiles >= STAGES - 1)
    slot, tile_m, tile_n, row0, col0 = _engine_task_tile(first, rank, per_slot, tiles_m, tiles_n,
                                                         M_CHUNK, WORLD, BM, BN, GROUP_M)
    for step in gl.static_range(STAGES - 1):
        issue_load(step, row0, col0, step * BK, first < tasks, a_desc, b_desc, bars, a_bufs,
                   b_bufs, STAGES, B_TRANSPOSED)
    layout: gl.constexpr = accumulator_layout(BM, BN, gl.num_warps())
    SUB_N: gl.constexpr = BN // 2
    step = 0
    pending = first * 0 - 1       # the chunk of a peer tile whose stores are in flight
    pending_tiles = first * 0 + 1
    count_step = gl.minimum(k_tiles - 1, COUNT_STEP)
    # an own tile's first partial half is loaded during its main loop, never before the last
    # peer tile is counted (a program waiting for a peer's chunk has released its own)
    partial_step = gl.maximum(k_tiles - 1 - PARTIAL_AHEAD, count_step)
    task = first
    while task < tasks:
        waited = (task * 0).to(gl.int64)  # (TRACE: cycles spent waiting for partials)
        if TRACE:
            started = globaltimer(task)
            cycle0 = clock_cycles(task)
        next_task = task + programs
        group = tile_m // GROUP_M
        band = tile_n // band_tiles
        own = slot == WORLD - 1
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        # two loops (gemm_gluon.py's tile loop): the K steps loading later blocks of this tile,
        # then the last STAGES - 1 loading the next tile's first ones, that tile decoded between
        # them while a wgmma runs (not before this tile's first wgmma); a step's extras after
        # its load, so that the load follows the wgmma's wait
        main_steps = k_tiles - (STAGES - 1)
        for kk in range(main_steps):
            acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
            issue_load(step + STAGES - 1, row0, col0, (kk + STAGES - 1) * BK, True, a_desc,
                       b_desc, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
            pending, waited = _engine_step_extras(
                kk, count_step, partial_step, pending, pending_tiles, own, waited, counts_ptr,
                out_flags, own_flags, engine_flag0, epoch, rank, group * bands + band, abort_ptr,
                error_address, timeout_ns, incoming0_desc, incoming1_desc, M_CHUNK, tile_m,
                tile_n, partial_bar, c_smem, task, WORLD, BM, BN, ENGINE_CHUNKS, TRACE,
                PARTIAL_AHEAD)
            step += 1
        next_slot, next_tile_m, next_tile_n, next_row, next_col = _engine_task_tile(
            next_task, rank, per_slot, tiles_m, tiles_n, M_CHUNK, WORLD, BM, BN, GROUP_M)
        for kk in range(main_steps, k_tiles):
            acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
            issue_load(step + STAGES - 1, next_row, next_col, (kk - main_steps) * BK,
                       next_task < tasks, a_desc, b_desc, bars, a_bufs, b_bufs, STAGES,
                       B_TRANSPOSED)
            pending, waited = _engine_step_extras(
                kk, count_step, partial_step, pending, pending_tiles, own, waited, counts_ptr,
                out_flags, own_flags, engine_flag0, epoch, rank, group * bands + band, abort_ptr,
                error_address, timeout_ns, incoming0_desc, incoming1_desc, M_CHUNK, tile_m,
                tile_n, partial_bar, c_smem, task, WORLD, BM, BN, ENGINE_CHUNKS, TRACE,
                PARTIAL_AHEAD)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if TRACE:
            cycle1 = clock_cycles(task)
        if not own:
            store_tile_halves(acc.to(dtype), staging_desc, c_smem, slot * M_CHUNK + tile_m * BM,
                              tile_n * BN)
            pending = slot * chunks + group * bands + band
            pending_tiles = _chunk_tiles(group, band, tiles_m, tiles_n, GROUP_M, band_tiles)
        else:
            # this rank's partial rounded first, as every peer's was (the sum of the W rounded
            # partials in fp32, as the Triton kernel, the push kernel and NCCL)
            halves = gl.reshape(acc.to(dtype).to(gl.float32), [BM, 2, SUB_N]).permute(
                0, 2, 1).split()
            first_half = halves[0]
            second_half = halves[1]
            for source_step in range(1, WORLD):  # (a loop, not unrolled)
                source = (rank + source_step) % WORLD
                row = (source * M_CHUNK + tile_m * BM).to(gl.int32)
                if (source_step > 1) | (PARTIAL_AHEAD < 0):
                    spent = _fetch_partial_half(
                        own_flags, engine_flag0, epoch, source, group * bands + band, abort_ptr,
                        error_address, timeout_ns, incoming0_desc, incoming1_desc, row,
                        tile_n * BN, partial_bar, c_smem, task, ENGINE_CHUNKS, TRACE)
                    if TRACE:
                        waited += spent
                mbarrier.wait(partial_bar, partial_loads & 1)
                first_half += c_smem.load(first_half.type.layout).to(gl.float32)
                gl.thread_barrier()  # every warp has read it before the next load
                _load_partial_half(incoming0_desc, incoming1_desc, epoch % 2, row,
                                   tile_n * BN + SUB_N, partial_bar, c_smem)
                mbarrier.wait(partial_bar, (partial_loads + 1) & 1)
                second_half += c_smem.load(second_half.type.layout).to(gl.float32)
                gl.thread_barrier()
                partial_loads += 2
            c_smem.store(first_half.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [tile_m * BM, tile_n * BN], c_smem)
            tma.store_wait(pendings=0)
            c_smem.store(second_half.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [tile_m * BM, tile_n * BN + SUB_N], c_smem)
        if TRACE:
            _trace_task(trace_ptr, task, started, cycle0, cycle1, waited)
        slot, tile_m, tile_n, row0, col0 = next_slot, next_tile_m, next_tile_n, next_row, next_col
        task = next_task
    if pending >= 0:
        _count_chunk_tile(counts_ptr, out_flags, pending, pending_tiles, epoch, True)
    bulk_stores_complete(task)  # no TMA store may outlive the kernel unfinished
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(partial_bar)
    finish_call(state_ptr, epoch)


@gluon.jit
def _gemm_task_at_or_after(task, step, tasks, rounds, lag, WORLD: gl.constexpr,
                           MODE: gl.constexpr):
    """The first GEMM task among task, task + step, ... (>= tasks: none left)."""
    if MODE == 0:
        is_gemm, round_, slot = _decode_task(task, rounds, lag, WORLD)
        while (task < tasks) & (is_gemm == 0):
            task += step
            is_gemm, round_, slot = _decode_task(task, rounds, lag, WORLD)
    return task


@gluon.jit
def _gemm_task_origin(task, rank, rounds, lag, tiles_m, tiles_n, M_CHUNK, WORLD: gl.constexpr,
                      BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
                      MODE: gl.constexpr):
    """(first row, first column, chunk, round) of GEMM task `task`'s tile of the product."""
    if MODE == 0:
        is_gemm, round_, slot = _decode_task(task, rounds, lag, WORLD)
    else:
        round_ = task // WORLD
        slot = task % WORLD
    tile_m, tile_n = grouped_tile(round_, tiles_m, tiles_n, GROUP_M)
    chunk = (rank + 1 + slot) % WORLD
    return chunk * M_CHUNK + tile_m * BM, tile_n * BN, chunk, round_


@gluon.jit(do_not_specialize=["rank", "timeout_ns", "lag", "half_bytes", "push_rows"])
def pipelined_gemm_reduce_scatter_kernel(
        a_desc, a_ptr, b_desc, b_ptr, part_ptr, out_ptr,
        P0, P1, P2, P3, P4, P5, P6, P7,
        D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
        F0, F1, F2, F3, F4, F5, F6, F7,
        state_ptr, abort_ptr, error_address, timeout_ns,
        M, N, K, M_CHUNK, stride_am, stride_ak, stride_bk, stride_bn,
        rank, lag, half_bytes, push_rows,
        WORLD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, USE_TMA: gl.constexpr,
        B_TRANSPOSED: gl.constexpr, MODE: gl.constexpr, MULTIMEM: gl.constexpr,
        ALIGNED: gl.constexpr, REDUCE_ROWS: gl.constexpr, DEFER: gl.constexpr,
        SCOPE: gl.constexpr, PUSH: gl.constexpr, TMA_PUSH: gl.constexpr):
    """gemm_reduce_scatter_kernel's pull mode (and GEMM_ONLY) with the Gluon tile loop of
    gemm_gluon.py, whose TMA pipeline runs across the program's GEMM tiles. Same arguments.

    Tasks are the same global order (_decode_task), assigned statically: program p runs tasks
    p, p + P, p + 2P, ... in order (no claiming), so it knows its next GEMM tile while it
    computes the current one and loads it ahead. Deadlock freedom holds as with claiming: the
    lowest unfinished task of all ranks is its program's current one (the program finished its
    lower tasks), and a reduce task depends only on lower GEMM tasks. A GEMM tile leaves through
    TMA stores (P0: this rank's data region, both halves as rows of N, half 1 at row push_rows;
    in GEMM_ONLY `part`) and its flag is released after the next tile's main loop (or before a
    reduce task, or at the end), once cp.async.bulk.wait_group has seen its stores complete."""
    gl.static_assert(USE_TMA and not PUSH and not MULTIMEM and (MODE == 0 or MODE == 1))
    ELEMENT: gl.constexpr = part_ptr.dtype.element_ty
    dtype: gl.constexpr = a_desc.dtype
    a_bufs, b_bufs, bars = allocate_ring(a_desc, b_desc, STAGES)
    c_smem = gl.allocate_shared_memory(dtype, P0.block_type.shape, P0.layout)

    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(gl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    row_base = parity.to(gl.int32) * push_rows
    tiles_m = gl.cdiv(M_CHUNK, BM)
    tiles_n = gl.cdiv(N, BN)
    rounds = tiles_m * tiles_n
    if MODE == 0:
        tasks = rounds * (WORLD + 1)
    else:
        tasks = rounds * WORLD
    k_tiles = gl.cdiv(K, BK)
    first = gl.program_id(0)
    programs = gl.num_programs(0)

    # the GEMM task computed next and its origin; loads run at most one GEMM task ahead (the
    # host launches this kernel only when k_tiles >= STAGES - 1)
    gemm_task = _gemm_task_at_or_after(first, programs, tasks, rounds, lag, WORLD, MODE)
    row0, col0, chunk, round_ = _gemm_task_origin(gemm_task, rank, rounds, lag, tiles_m, tiles_n,
                                                  M_CHUNK, WORLD, BM, BN, GROUP_M, MODE)
    for step in gl.static_range(STAGES - 1):
        issue_load(step, row0, col0, step * BK, gemm_task < tasks, a_desc, b_desc, bars, a_bufs,
                   b_bufs, STAGES, B_TRANSPOSED)
    layout: gl.constexpr = accumulator_layout(BM, BN, gl.num_warps())
    reduce_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    cols_in_tile = gl.arange(0, BN, layout=gl.SliceLayout(0, reduce_layout))
    rows_in_part = gl.arange(0, REDUCE_ROWS, layout=gl.SliceLayout(1, reduce_layout))
    step = 0
    pending = first * 0 - 1
    task = first
    while task < tasks:
        if task == gemm_task:
            # (made per tile, so that the accumulator's registers are free in reduce tasks)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
            # two loops (gemm_gluon.py's tile loop): the K steps loading later blocks of this
            # tile, then the last STAGES - 1 loading the next GEMM task's first ones, that task
            # decoded between them while a wgmma runs
            main_steps = k_tiles - (STAGES - 1)
            for kk in range(main_steps):
                acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                issue_load(step + STAGES - 1, row0, col0, (kk + STAGES - 1) * BK, True, a_desc,
                           b_desc, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                step += 1
            next_task = _gemm_task_at_or_after(task + programs, programs, tasks, rounds, lag,
                                               WORLD, MODE)
            next_row, next_col, next_chunk, next_round = _gemm_task_origin(
                next_task, rank, rounds, lag, tiles_m, tiles_n, M_CHUNK, WORLD, BM, BN, GROUP_M,
                MODE)
            for kk in range(main_steps, k_tiles):
                acc = mma_step(step, acc, kk > 0, bars, a_bufs, b_bufs, STAGES, B_TRANSPOSED)
                issue_load(step + STAGES - 1, next_row, next_col, (kk - main_steps) * BK,
                           next_task < tasks, a_desc, b_desc, bars, a_bufs, b_bufs, STAGES,
                           B_TRANSPOSED)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if pending >= 0:  # the last tile's stores have drained under this tile's main loop
                _release(F0, F1, F2, F3, F4, F5, F6, F7, rank, pending, epoch, SCOPE, True)
            store_tile_halves(acc.to(dtype), P0, c_smem, row_base + row0, col0)
            if MODE == 0:
                pending = chunk * rounds + round_
            gemm_task, row0, col0, chunk, round_ = (next_task, next_row, next_col, next_chunk,
                                                    next_round)
        else:
            # no program holds an unreleased flag while it waits (deadlock freedom)
            if pending >= 0:
                _release(F0, F1, F2, F3, F4, F5, F6, F7, rank, pending, epoch, SCOPE, True)
            pending = pending * 0 - 1
            is_gemm, reduce_round, slot = _decode_task(task, rounds, lag, WORLD)
            tile_m, tile_n = grouped_tile(reduce_round, tiles_m, tiles_n, GROUP_M)
            flag = rank * rounds + reduce_round
            for peer_step in gl.static_range(WORLD):
                peer = (rank + peer_step) % WORLD
                address = pick(peer, F0, F1, F2, F3, F4, F5, F6, F7) + flag * 4
                wait_flag(address, epoch, abort_ptr, error_address, peer, flag, timeout_ns)
            cols = tile_n * BN + cols_in_tile
            for sub in gl.static_range(0, BM, REDUCE_ROWS):
                local_rows = tile_m * BM + sub + rows_in_part
                mask = (local_rows[:, None] < M_CHUNK) & (cols[None, :] < N)
                offsets = (rank * M_CHUNK + local_rows).to(gl.int64)[:, None] * N + cols[None, :]
                total = gl.zeros([REDUCE_ROWS, BN], gl.float32, reduce_layout)
                for peer_step in gl.static_range(WORLD):
                    peer = (rank + peer_step) % WORLD
                    base = pick(peer, D0, D1, D2, D3, D4, D5, D6, D7).to(gl.pointer_type(ELEMENT))
                    pointers = base + offsets
                    if ALIGNED:
                        pointers = gl.multiple_of(pointers, [16, 16])
                    total += gl.load(pointers, mask=mask, other=0.0).to(gl.float32)
                gl.store(out_ptr + local_rows.to(gl.int64)[:, None] * N + cols[None, :],
                         total.to(ELEMENT), mask=mask)
        task += programs
    if pending >= 0:
        _release(F0, F1, F2, F3, F4, F5, F6, F7, rank, pending, epoch, SCOPE, True)
    bulk_stores_complete(task)  # no TMA store may outlive the kernel unfinished
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    finish_call(state_ptr, epoch)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipeline of the fused kernel; the same on every rank of a call."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    # rows of a reduce tile loaded at once: 4 peers x 64 x 256 bf16 = 128 KB in flight per
    # program; 16 rows (the first version) left the reduce latency-bound (docs/gpu_notes.md)
    reduce_rows: int = 64
    # release each tile's flag one tile later, when the fence no longer waits for its stores
    defer_release: bool = False
    # p2p: producers store tiles into the owner's buffer (remote stores) instead of owners
    # pulling them (remote loads); not with multimem (its load-reduce reads every peer)
    push: bool = False
    # push: remote tile stores as asynchronous TMA stores (where the chunk is a whole number
    # of row tiles and rows are 16-byte multiples; masked stores elsewhere)
    tma_push: bool = False
    # programs per SM: 2 lets one program's epilogue (its stalled remote stores) overlap the
    # other's main loop, for tiles small enough that two fit in an SM's registers and shared
    # memory (checked against the compiled kernel before the first launch)
    ctas_per_sm: int = 1
    # the Gluon tile loop: the TMA pipeline runs across the program's GEMM tiles (pull mode:
    # pipelined_gemm_reduce_scatter_kernel; with engine, its copy-engine twin
    # pipelined_engine_gemm_reduce_scatter_kernel); where it cannot run (push, multimem,
    # operands or output TMA cannot describe, a chunk not a whole number of row tiles, fewer
    # than stages - 1 K blocks) the call runs the Triton kernel with the same tiles
    pipelined: bool = False
    # ("/ce", p2p) the peers' partials move by copy engine: every SM computes tiles, a side
    # stream copies each finished band of a peer's chunk (EngineReduceScatter).
    # Inside a CUDA graph capture, and without cuda-python, the launch pushes instead (with
    # defer_release and push as given); the copy-engine kernel itself counts each tile as it is
    # stored (a deferred count measured 1-17% slower there, docs/gpu_notes.md)
    engine: bool = False

    @classmethod
    def parse(cls, text: str) -> "GemmConfig":
        """The config that str() printed as `text` (benchmark tables store it so).

        >>> GemmConfig.parse("128x256x64/g8/s3/w8/r64/defer/push")
        GemmConfig(block_m=128, block_n=256, block_k=64, group_m=8, stages=3, warps=8, reduce_rows=64, defer_release=True, push=True, tma_push=False, ctas_per_sm=1, pipelined=False, engine=False)
        """
        tile, *parts = text.split("/")
        block_m, block_n, block_k = (int(v) for v in tile.split("x"))
        numbers = {part[0]: int(part[1:]) for part in parts if part[:1] in "gswrc" and part[1:].isdigit()}
        flags = {part for part in parts if not (part[:1] in "gswrc" and part[1:].isdigit())}
        unknown = flags - {"defer", "push", "tma", "gl", "ce"}
        if unknown or not set("gswr") <= set(numbers):
            raise ValueError(f"not a GemmConfig string: {text!r}")
        return cls(block_m, block_n, block_k, numbers["g"], numbers["s"], numbers["w"], numbers["r"],
                   "defer" in flags, "push" in flags, "tma" in flags, numbers.get("c", 1),
                   "gl" in flags, "ce" in flags)

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/g{self.group_m}/s{self.stages}"
                f"/w{self.warps}/r{self.reduce_rows}{'/defer' if self.defer_release else ''}"
                f"{'/push' if self.push else ''}{'/tma' if self.tma_push else ''}"
                f"{f'/c{self.ctas_per_sm}' if self.ctas_per_sm != 1 else ''}"
                f"{'/gl' if self.pipelined else ''}{'/ce' if self.engine else ''}")


CANDIDATES = (
    GemmConfig(128, 256, 64, 8, 3, 8),
    GemmConfig(128, 256, 64, 8, 3, 8, push=True),
    GemmConfig(64, 256, 64, 8, 4, 4, push=True),
    GemmConfig(128, 256, 64, 8, 3, 8, defer_release=True, push=True),
    GemmConfig(64, 256, 64, 8, 4, 4, defer_release=True, push=True),
    GemmConfig(128, 256, 64, 8, 4, 8, defer_release=True, push=True),
    GemmConfig(256, 128, 64, 8, 3, 8, defer_release=True, push=True),
    GemmConfig(256, 128, 64, 8, 4, 8, defer_release=True, push=True),
    GemmConfig(128, 256, 128, 8, 2, 8, defer_release=True, push=True),
    GemmConfig(128, 128, 64, 8, 4, 8),
    GemmConfig(128, 128, 64, 8, 4, 4),
    GemmConfig(64, 256, 64, 8, 4, 4),
    GemmConfig(64, 128, 64, 8, 4, 4),
    GemmConfig(128, 256, 64, 8, 3, 8, pipelined=True),
    GemmConfig(128, 256, 64, 8, 3, 8, defer_release=True, push=True, engine=True),
    # /gl/ce: the copy-engine kernel on the Gluon tile loop (the Triton one where it cannot run)
    GemmConfig(128, 256, 64, 8, 3, 8, defer_release=True, push=True, pipelined=True, engine=True),
    GemmConfig(128, 256, 64, 8, 4, 8, defer_release=True, push=True, pipelined=True, engine=True),
)
# Opt-in (not tuned by default): the remote tile stores as TMA stores. Measured no faster than
# the deferred masked push on 4x H200 (benchmarks/results/gemm_rs_w4_tma.md): Triton waits for
# the TMA unit to read the whole tile out of shared memory right after each store, and over
# NVLink that read is paced by the link, so the program stalls as long as with plain stores.
TMA_PUSH_CONFIGS = (
    GemmConfig(128, 256, 64, 8, 3, 8, defer_release=True, push=True, tma_push=True),
    GemmConfig(64, 256, 64, 8, 4, 4, defer_release=True, push=True, tma_push=True),
)

# Opt-in (not tuned by default): two programs per SM, so that one program's epilogue (its
# remote stores stalled on NVLink) overlaps the other's main loop (96 / 80 KB of shared memory
# each). Measured slower on 4x H200 (benchmarks/results/gemm_rs_w4_ctas.md): 11-17 % at
# K_local = 7168 and level at best at 2048; the smaller tiles cost more than the overlap gains.
TWO_PER_SM_CONFIGS = (
    GemmConfig(128, 128, 64, 8, 3, 4, defer_release=True, push=True, ctas_per_sm=2),
    GemmConfig(64, 256, 64, 8, 2, 4, defer_release=True, push=True, ctas_per_sm=2),
)

_TUNED_PATH = os.path.join(os.path.dirname(__file__), "gemm_rs_tuned.json")
_tuned: dict[str, GemmConfig] | None = None


def shape_key(m: int, n: int, k: int, world: int, dtype: torch.dtype) -> str:
    return f"{m}x{n}x{k}/w{world}/{str(dtype).replace('torch.', '')}"


def _load_tuned() -> dict[str, GemmConfig]:
    global _tuned
    if _tuned is None:
        _tuned = {}
        if os.path.exists(_TUNED_PATH):
            with open(_TUNED_PATH) as handle:
                for key, fields in json.load(handle).items():
                    _tuned[key] = GemmConfig(**fields)
    return _tuned


_config_version = 0


def remember_config(key: str, config: GemmConfig) -> None:
    global _config_version
    _load_tuned()[key] = config
    _config_version += 1


def config_version() -> int:
    """Changes whenever remember_config does (callers that cache a shape's config re-read it)."""
    return _config_version


def tuned_table() -> dict[str, dict]:
    return {key: dataclasses.asdict(config) for key, config in _load_tuned().items()}


def default_config(m: int, n: int, k: int, world: int, dtype: torch.dtype) -> GemmConfig:
    """A tuned entry for this shape if the benchmark recorded one, else a size heuristic
    (deterministic, so every rank picks the same)."""
    tuned = _load_tuned().get(shape_key(m, n, k, world, dtype))
    if tuned is not None:
        return tuned
    chunk = m // world
    if chunk <= 64:
        return GemmConfig(64, 128, 64, 8, 4, 4)
    if chunk * n <= 512 * 8192:
        return GemmConfig(128, 128, 64, 8, 4, 8)
    return GemmConfig(128, 256, 64, 8, 3, 8)


@dataclasses.dataclass
class _Operands:
    a: torch.Tensor
    b: torch.Tensor            # [K, N] row-major, or [N, K] row-major when b_transposed
    b_transposed: bool
    m: int
    n: int
    k: int


def prepare_operands(a: torch.Tensor, b: torch.Tensor) -> _Operands:
    """A as row-major [M, K]; B either row-major [K, N] or, as nn.Linear stores it (b = W.t()),
    row-major [N, K] used transposed. Other strides are copied once."""
    a = a if a.stride(-1) == 1 and a.stride(0) == a.shape[1] else a.contiguous()
    m, k = a.shape
    n = b.shape[1]
    if b.stride(0) == 1 and b.stride(1) == k:
        return _Operands(a, b.t(), True, m, n, k)
    b = b if b.stride(1) == 1 and b.stride(0) == n else b.contiguous()
    return _Operands(a, b, False, m, n, k)


_descriptor_cache: dict[tuple, object] = memo("kernels.gemm_rs descriptors")


def launch_template(args, refilled=()) -> list:
    """A prepared launch's arguments with no tensor kept alive: tensors as their addresses, the
    ``refilled`` slots (the TMA descriptors a call makes anew) emptied. A descriptor of the first
    call holds its tensor: kept in a template it held each shape's first operand for the
    process's life (about 1.1 GiB per rank of activation gradients in the TP=4 Llama-3-8B step,
    the eager-only memory of issue 27)."""
    return [None if i in refilled else arg.data_ptr() if isinstance(arg, torch.Tensor) else arg
            for i, arg in enumerate(args)]


def descriptor(t: torch.Tensor, block: list[int], cached: bool):
    """TMA descriptor of a row-major matrix. cached: reuse one built for the same address,
    shape, strides and block (weights always; activations when the caching allocator hands out
    the same block again) -- only for the compiled launcher, which reads nothing but the
    address, shape and strides; the JIT's first call gets one made from the tensor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not cached:
        return TensorDescriptor.from_tensor(t, block)
    key = (t.data_ptr(), t.shape, t.stride(0), t.dtype, block[0], block[1])
    descriptor = _descriptor_cache.get(key)
    if descriptor is None:
        if len(_descriptor_cache) >= 256:
            _descriptor_cache.clear()
        descriptor = _descriptor_cache[key] = TensorDescriptor(
            DescriptorBase(t.data_ptr(), t.dtype), list(t.shape), list(t.stride()), list(block))
    return descriptor


def _descriptors(ops: _Operands, config: GemmConfig, cached: bool = False):
    if not (tma_compatible(ops.a) and tma_compatible(ops.b)):
        return None, None
    block_a = [config.block_m, config.block_k]
    block_b = ([config.block_n, config.block_k] if ops.b_transposed
               else [config.block_k, config.block_n])
    if config.pipelined and not cached:  # the Gluon JIT types a descriptor by its layout too
        return _gluon_descriptor(ops.a, block_a), _gluon_descriptor(ops.b, block_b)
    return descriptor(ops.a, block_a, cached), descriptor(ops.b, block_b, cached)


def operand_strides(ops: _Operands) -> tuple[int, int, int, int]:
    if ops.b_transposed:  # b holds [N, K]: element (k, n) at n * stride(0) + k
        return ops.a.stride(0), ops.a.stride(1), ops.b.stride(1), ops.b.stride(0)
    return ops.a.stride(0), ops.a.stride(1), ops.b.stride(0), ops.b.stride(1)


_gemm_only_states: dict[int, torch.Tensor] = memo("kernels.gemm_rs gemm-only states")


def gemm_only_state(device: torch.device) -> torch.Tensor:
    """The call state (task counter, finished programs) of GEMM_ONLY launches on a device: no
    workspace is involved, and each launch zeroes the counters it used as it ends."""
    state = _gemm_only_states.get(device.index)
    if state is None:
        state = _gemm_only_states[device.index] = torch.zeros(
            STATE_WORDS, dtype=torch.int32, device=device)
    return state


# compiled kernel per specialization (see specialization_key): after the first call of a shape,
# launches go straight to Triton's C launcher, skipping its per-call argument binding
_launches: dict[tuple, object] = memo("kernels.gemm_rs launches")
_push_descriptor_cache: dict[tuple, tuple] = memo("kernels.gemm_rs push descriptors")


def cached_launches() -> int:
    """How many compiled launchers are cached (one per specialization: tests check reuse)."""
    return len(_launches)


def cached_kernel_names() -> set[str]:
    """Names of the kernels the cached launchers run (tests check which kernel a config ran)."""
    return {launch.name for launch in _launches.values()}


def _push_descriptors(workspace, world: int, n: int, config: GemmConfig,
                      dtype: torch.dtype) -> tuple:
    """TMA descriptors of every rank's push buffers, one per rank spanning both data halves as
    rows of N ([2 * half rows, N]; the caller checked that a half is a whole number of rows),
    eight, the unused ones repeating rank 0's; built once per workspace and shape."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    # keyed by the memory itself: an id() is reused once a workspace is freed, and a stale
    # descriptor would store into the old memory (its view keeps that memory alive)
    key = (tuple(workspace.data_addresses(0)[:world]), workspace.data_bytes, world, n,
           config.block_m, config.block_n, dtype)
    cached = _push_descriptor_cache.get(key)
    if cached is None:
        rows = 2 * workspace.data_bytes // (n * dtype.itemsize)
        views = [workspace.peer_data(peer, 0, dtype, rows * n, both_halves=True).view(rows, n)
                 for peer in range(world)]
        descriptors = [TensorDescriptor.from_tensor(view, [config.block_m, config.block_n])
                       for view in views]
        cached = _push_descriptor_cache[key] = tuple(descriptors + [descriptors[0]] * (8 - world))
    return cached


def pipelined_fits(ops: _Operands, config: GemmConfig, world: int, mode: int, multimem: bool,
                   half_bytes: int, part: torch.Tensor | None) -> bool:
    """Whether the Gluon kernel runs this call (else the Triton kernel, same tiles): pull mode
    (fused or GEMM_ONLY), operands TMA can describe, the chunk a whole number of row tiles (a
    tile's TMA store never crosses into the next chunk's rows), rows of 16-byte multiples and
    a data half a whole number of rows (the destination descriptor spans both halves), at least
    stages - 1 K blocks (a load runs at most one GEMM tile ahead)."""
    row_bytes = ops.n * ops.a.element_size()
    if mode == GEMM_ONLY:
        destination_ok = part is not None and tma_compatible(part)
    else:
        destination_ok = mode == FUSED and half_bytes % row_bytes == 0
    return (not config.push and not multimem and destination_ok
            and tma_compatible(ops.a) and tma_compatible(ops.b)
            and (ops.m // world) % config.block_m == 0 and row_bytes % 16 == 0
            and triton.cdiv(ops.k, config.block_k) >= config.stages - 1)


def _gluon_descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor of a row-major matrix (its shared layout part of the type)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, shared_layout(block, t.dtype))


def _tile_destination(workspace, rank: int, part: torch.Tensor | None, n: int,
                      config: GemmConfig, dtype: torch.dtype):
    """The Gluon kernel's tile-store descriptor (block [BM, BN / EPILOGUE_SPLIT]): this rank's
    data region, both halves as rows of N (built once per workspace and shape), or `part`
    (GEMM_ONLY)."""
    block = [config.block_m, config.block_n // EPILOGUE_SPLIT]
    if workspace is None:
        return _gluon_descriptor(part, block)
    key = ("pipelined", workspace.data_addresses(0)[rank], workspace.data_bytes, n, *block,
           dtype)  # (by address, as _push_descriptors)
    cached = _push_descriptor_cache.get(key)
    if cached is None:
        rows = 2 * workspace.data_bytes // (n * dtype.itemsize)
        view = workspace.peer_data(rank, 0, dtype, rows * n, both_halves=True).view(rows, n)
        cached = _push_descriptor_cache[key] = _gluon_descriptor(view, block)
    return cached


def specialization_key(ops: _Operands, strides: tuple, tensors: tuple, timeout_ns: int,
                    constexprs: tuple, warps: int, device_index: int) -> tuple:
    """Everything Triton specializes the kernel on, for the arguments that are not already
    constexpr: exact sizes and strides (so a size or stride equal to 1, which Triton folds into
    the kernel, is part of the key), 16-byte alignment of every pointer (A and B included: the
    masked pointer path loads through them), and the integer width of the timeout (an argument
    below 2**31 is compiled as i32)."""
    return (ops.m, ops.n, ops.k, ops.b_transposed, strides,
            tuple(t.data_ptr() % 16 == 0 for t in (ops.a, ops.b) + tensors),
            timeout_ns >= (1 << 31), constexprs, warps, device_index, ops.a.dtype)


def _compiled(key: tuple, args: tuple, constexprs: dict, warps: int, device_index: int,
              pipelined: bool = False):
    """The compiled launcher of one specialization: compiled through Triton's JIT the first time
    (without launching), then reused; launches go straight to its C launcher with the arguments
    (tensors passed as addresses), skipping Triton's per-call binding. pipelined: the Gluon
    kernel (same arguments)."""
    launch = _launches.get(key)
    if launch is None:
        function = pipelined_gemm_reduce_scatter_kernel if pipelined else gemm_reduce_scatter_kernel
        kernel = function.warmup(*args, **constexprs, num_warps=warps, grid=(1,))
        launch = _launches[key] = CompiledLaunch(kernel, tuple(constexprs.values()))
        launch.resident_per_sm = resident_per_sm(kernel, warps, device_index)
    return launch


def programs_per_sm(regs_per_thread: int, shared_bytes: int, warps: int, regs_per_sm: int = 65536,
                    shared_per_sm: int = 233472, threads_per_sm: int = 2048,
                    blocks_per_sm: int = 32) -> int:
    """Programs of a kernel that fit on one SM at once, from its registers per thread and
    shared memory per program (registers are allocated per warp in units of 256; each program
    also reserves 1 KB of shared memory). The defaults are Hopper's (H100/H200).

    >>> programs_per_sm(168, 98_336, 4)    # a 128x128x64 tile, 3 stages, 4 warps
    2
    >>> programs_per_sm(232, 147_480, 8)   # a 128x256x64 tile, 3 stages, 8 warps
    1
    """
    regs_per_warp = -(-regs_per_thread * 32 // 256) * 256
    by_regs = regs_per_sm // max(1, regs_per_warp * warps)
    by_shared = shared_per_sm // (shared_bytes + 1024)
    by_threads = threads_per_sm // (32 * warps)
    return max(1, min(by_regs, by_shared, by_threads, blocks_per_sm))


def resident_per_sm(kernel, warps: int, device_index: int) -> int:
    """How many programs of a compiled kernel one SM holds at once: the driver's occupancy
    query where cuda-python has it, else programs_per_sm from the device's limits."""
    shared = kernel.metadata.shared
    try:
        from cuda.bindings import driver
        error, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            driver.CUfunction(kernel.function), 32 * warps, shared)
        if int(error) == 0 and int(blocks) > 0:
            return int(blocks)
    except (ImportError, TypeError, ValueError, AttributeError):
        pass
    props = torch.cuda.get_device_properties(device_index)
    return programs_per_sm(kernel.n_regs, shared, warps,
                           getattr(props, "regs_per_multiprocessor", 65536),
                           getattr(props, "shared_memory_per_multiprocessor", 233472),
                           getattr(props, "max_threads_per_multi_processor", 2048))


def launch(ops: _Operands, config: GemmConfig, world: int, rank: int, part: torch.Tensor | None,
           out: torch.Tensor | None, workspace=None, multimem: bool = False,
           gemm_only: bool = False, mode: int | None = None, scope: str = "sys",
           lag_waves: float | None = None, prepare: bool = False,
           compile_only: bool = False) -> "Replay | None":
    """Launch the persistent kernel once: fused (mode FUSED) into `out`, GEMM_ONLY writing the
    product into `part`, or GEMM_AND_SIGNAL (benchmark only). scope="gpu" is a
    measurement-only variant. prepare=True returns the launch prepared for repetition (Replay).
    compile_only=True compiles and loads the kernel this launch would run and returns without
    launching (virtual ranks load every kernel before any rank spins); for a /ce launch it
    returns the prepared launch (EngineReduceScatter), to be called as a Replay is. The grid fills the SMs
    the workspace's rank may use (all of them on a real GPU, a W-th with W virtual ranks)."""
    mode = (GEMM_ONLY if gemm_only else FUSED) if mode is None else mode
    if config.engine and mode == FUSED and engine_fits(ops, config, world, multimem):
        # compile_only returns the built launch too (its buffers allocated: nothing allocates
        # or loads while another virtual rank's kernel spins)
        engine = EngineReduceScatter(ops, out, config, world, rank, workspace)
        if compile_only:
            return engine
        engine(ops, out)
        return engine if prepare else None
    device = ops.a.device
    processors = (multiprocessors(device.index) if workspace is None or mode == GEMM_ONLY
                  else workspace.processors)
    m_chunk = ops.m // world
    rounds = triton.cdiv(m_chunk, config.block_m) * triton.cdiv(ops.n, config.block_n)
    tasks = schedule.task_count(rounds, world, mode in (GEMM_ONLY, GEMM_AND_SIGNAL))
    use_tma = tma_compatible(ops.a) and tma_compatible(ops.b)
    element = ops.a.element_size()
    aligned = (ops.n * element) % 16 == 0 and config.block_n % 8 == 0
    if mode == GEMM_ONLY:
        state = gemm_only_state(device)
        # no flags and no reduce in this mode: placeholders typed like the fused mode's (int64)
        data = [state.data_ptr()] * 8
        flags = [state.data_ptr()] * 8
        multicast, half_bytes = 0, 0
        abort, error_address, timeout_ns = state, state.data_ptr(), 1 << 40
        out = part
    else:
        state = workspace.state
        data = workspace.data_addresses(0)
        flags = workspace.flag_addresses()
        multicast = workspace.multicast_address(0) if multimem else 0
        abort, error_address = workspace.abort, workspace.error_address()
        timeout_ns = workspace.timeout_ns()
        half_bytes = workspace.data_bytes
        part = out
    if mode != GEMM_ONLY and world * rounds > workspace.tile_flags:
        raise ValueError(f"{world * rounds} tiles exceed the workspace's {workspace.tile_flags} "
                         f"tile flags; use larger tiles")
    push = config.push and not multimem and mode != GEMM_ONLY
    row_bytes = ops.n * element
    pipelined = config.pipelined and pipelined_fits(ops, config, world, mode, multimem,
                                                    half_bytes, part)
    config = dataclasses.replace(config, pipelined=pipelined)
    # a TMA store never crosses into the next source's slot (whole row tiles), and the second
    # half starts on a whole row of the descriptor that spans both halves
    tma_push = (push and config.tma_push and use_tma and m_chunk % config.block_m == 0
                and row_bytes % 16 == 0 and half_bytes % row_bytes == 0)
    push_rows = half_bytes // row_bytes if tma_push else 0
    peers = (_push_descriptors(workspace, world, ops.n, config, ops.a.dtype)
             if tma_push else (None,) * 8)
    if pipelined:  # P0: where the tiles go (this rank's data, both halves; GEMM_ONLY: part)
        peers = (_tile_destination(workspace, rank, part, ops.n, config, ops.a.dtype),
                 *(None,) * 7)
        push_rows = 0 if mode == GEMM_ONLY else half_bytes // row_bytes
    strides = operand_strides(ops)
    constexprs = dict(
        WORLD=world, BM=config.block_m, BN=config.block_n, BK=config.block_k,
        GROUP_M=config.group_m, STAGES=config.stages, USE_TMA=use_tma,
        B_TRANSPOSED=ops.b_transposed and use_tma, MODE=mode, MULTIMEM=multimem,
        ALIGNED=aligned, REDUCE_ROWS=min(config.reduce_rows, config.block_m),
        DEFER=config.defer_release and mode != GEMM_ONLY, SCOPE=scope,
        PUSH=push, TMA_PUSH=tma_push)
    # (the width of half_bytes too: Triton types an int argument i32 or i64 by its value)
    key = specialization_key(ops, strides, (part, out, state, abort), timeout_ns,
                             (*constexprs.values(), half_bytes >= (1 << 31), pipelined),
                             config.warps, device.index)
    a_desc, b_desc = _descriptors(ops, config, cached=key in _launches)

    def arguments(lag: int) -> tuple:
        return (a_desc, ops.a, b_desc, ops.b, part, out, *peers, *data, multicast, *flags,
                state, abort, error_address, timeout_ns,
                ops.m, ops.n, ops.k, m_chunk, *strides, rank, lag, half_bytes, push_rows)

    # compiled (and its occupancy known) before any task is claimed: every program of the grid
    # must be resident at once, since a reduce task waits on tiles other programs produce
    compiled = _compiled(key, arguments(0), constexprs, config.warps, device.index, pipelined)
    if compile_only:
        return None
    programs = max(1, min(processors * min(config.ctas_per_sm, compiled.resident_per_sm), tasks))
    if lag_waves is None:  # (the Gluon kernel always releases a tile's flag one tile later)
        lag_waves = 2.5 if config.defer_release or pipelined else 1.5
    lag = schedule.choose_lag(rounds, world, programs, lag_waves)
    args = arguments(lag)
    raw = tuple(arg.data_ptr() if isinstance(arg, torch.Tensor) else arg for arg in args)
    compiled(programs, torch._C._cuda_getCurrentRawStream(device.index), raw)
    if not prepare:
        return None
    return Replay(compiled, programs, args, use_tma, config, ops.b_transposed, timeout_ns,
                  device.index)


class Replay:
    """A launch of the fused kernel prepared for repetition: the compiled launcher and every
    argument that stays the same for calls of the same shapes, config, workspace and rank
    (returned by `launch`). A call fills in A, B and the output (the epoch, the data half and
    the task counter are the rank's call state on the device); the caller must only replay it
    for operands and output as 16-byte aligned as the first call's (the compiled kernel
    assumed it) and with the same timeout.

    >>> replay = launch(ops, config, world, rank, None, out, workspace, prepare=True)
    >>> replay(ops, out)                         # the next call: a few microseconds of CPU
    """
    _A_DESC, _A, _B_DESC, _B, _OUT = 0, 1, 2, 3, 5

    def __init__(self, compiled, grid: int, args: tuple, use_tma: bool, config: GemmConfig,
                 b_transposed: bool, timeout_ns: int, device_index: int,
                 out_block: list[int] | None = None):
        self.compiled, self.grid = compiled, grid
        refilled = ((self._A_DESC, self._B_DESC) if use_tma else ()) + (
            (self._OUT, ) if out_block is not None else ())
        self.template = launch_template(args, refilled)
        self.use_tma, self.timeout_ns, self.device_index = use_tma, timeout_ns, device_index
        self.block_a = [config.block_m, config.block_k]
        self.block_b = ([config.block_n, config.block_k] if b_transposed
                        else [config.block_k, config.block_n])
        self.out_block = out_block  # the output as a TMA descriptor of this block (/gl/ce)

    def __call__(self, ops: _Operands, out: torch.Tensor) -> None:
        args = list(self.template)
        if self.use_tma:
            args[self._A_DESC] = descriptor(ops.a, self.block_a, True)
            args[self._B_DESC] = descriptor(ops.b, self.block_b, True)
        args[self._A], args[self._B] = ops.a.data_ptr(), ops.b.data_ptr()
        args[self._OUT] = (out.data_ptr() if self.out_block is None
                           else descriptor(out, self.out_block, True))
        self.compiled(self.grid, torch._C._cuda_getCurrentRawStream(self.device_index), args)


ENGINE_TARGET_CHUNKS = 4  # comm chunks per peer a /ce call aims at (bands of the tile groups)
# K steps before an own tile's last at which the Gluon /ce kernel loads its first partial half
ENGINE_PARTIAL_AHEAD = 1


def engine_chunks(m_chunk: int, n: int, config: GemmConfig,
                  target: int = ENGINE_TARGET_CHUNKS) -> tuple[int, list]:
    """(tile columns per band, rectangles) of a /ce call's comm chunks, in the kernel's chunk
    order: each group of GROUP_M tile rows cut into bands of whole tile columns so that a peer's
    chunk comes in about `target` rectangles (first row, end row, first column, end column),
    each contiguous in the claim order.

    >>> engine_chunks(1024, 8192, GemmConfig())[1]   # 8 tile rows (one group) x 32 tile columns
    [(0, 1024, 0, 2048), (0, 1024, 2048, 4096), (0, 1024, 4096, 6144), (0, 1024, 6144, 8192)]
    """
    tiles_m, tiles_n = triton.cdiv(m_chunk, config.block_m), triton.cdiv(n, config.block_n)
    group_rows = config.group_m * config.block_m
    groups = triton.cdiv(tiles_m, config.group_m)
    band_tiles = triton.cdiv(tiles_n, min(tiles_n, max(1, triton.cdiv(target, groups))))
    bands = triton.cdiv(tiles_n, band_tiles)
    rectangles = [(g * group_rows, min((g + 1) * group_rows, m_chunk),
                   b * band_tiles * config.block_n, min((b + 1) * band_tiles * config.block_n, n))
                  for g in range(groups) for b in range(bands)]
    return band_tiles, rectangles


def engine_copies(workspace, staging: int, out_flags: int, m_chunk: int, n: int, element: int,
                  rectangles: list) -> list[list[tuple]]:
    """The copies of a /ce call of this rank, per epoch parity, in issue order (peer rank + 1
    first, then by chunk): (address of the chunk's out flag, target address in the peer's data
    half (slot of this rank), source address in the staging buffer [W - 1, m_chunk, n] at
    `staging`, bytes per row, rows, the peer's flag word of the chunk); rows are n * element
    bytes apart on both sides."""
    world, rank, pitch = workspace.world_size, workspace.rank, n * element
    flags = workspace.flag_addresses()
    copies = [[], []]
    for parity in (0, 1):
        for slot in range(world - 1):
            peer = (rank + 1 + slot) % world
            target_base = workspace.data_addresses(parity)[peer] + rank * m_chunk * pitch
            source_base = staging + slot * m_chunk * pitch
            for chunk, (row0, row1, col0, col1) in enumerate(rectangles):
                offset = row0 * pitch + col0 * element
                flag = flags[peer] + 4 * (
                    workspace.engine_flag0 + schedule.engine_flag(parity, rank, chunk))
                copies[parity].append((out_flags + 4 * (slot * len(rectangles) + chunk),
                                       target_base + offset, source_base + offset,
                                       (col1 - col0) * element, row1 - row0, flag))
    return copies


def engine_pipelined_fits(ops: _Operands, config: GemmConfig, world: int,
                          out: torch.Tensor) -> bool:
    """Whether a /ce call of a /gl config runs the Gluon kernel (else the Triton one, same
    tiles): operands and output TMA can describe, whole row tiles (a tile's TMA store or load
    never crosses into the next chunk's rows of the staging buffer or the data half), rows of
    16-byte multiples, at least stages - 1 K blocks (a load runs at most one tile ahead)."""
    return (config.pipelined and tma_compatible(ops.a) and tma_compatible(ops.b)
            and tma_compatible(out) and (ops.m // world) % config.block_m == 0
            and (ops.n * ops.a.element_size()) % 16 == 0
            and triton.cdiv(ops.k, config.block_k) >= config.stages - 1)


def engine_fits(ops: _Operands, config: GemmConfig, world: int, multimem: bool) -> bool:
    """Whether a fused call can move its partials by copy engine: unicast, several ranks, whole
    chunks, at most schedule.ENGINE_CHUNKS comm chunks, and cuda-python there to issue them."""
    return (world > 1 and not multimem and ops.m % world == 0
            and len(engine_chunks(ops.m // world, ops.n, config)[1]) <= schedule.ENGINE_CHUNKS
            and copy_engines_usable())


class EngineReduceScatter:
    """The /ce fused GEMM + reduce-scatter of one rank for one shape, config and workspace,
    compiled and ready (engine_gemm_reduce_scatter_kernel, or its Gluon twin for a /gl config
    where engine_pipelined_fits): a call launches the kernel and, on
    the workspace's side streams (chunks dealt over them in turn), for each peer and comm
    chunk, waits for the chunk's tiles (its out flag to reach the epoch), copies the rectangle
    of partials into the peer's data half (slot of this rank) and then this rank's last
    finished epoch into the peer's flag of it; the current stream waits for the side streams
    after the kernel. With AXEDIST_CE_GRAPHS on, those copies and waits are captured once per
    epoch parity as a CUDA graph (launch.StreamGraph; each wait then takes its flag down, so
    the same waits serve every call) and a call issues them with one launch; else, or where
    the driver cannot capture them, one by one (graph_error says why). Inside the caller's
    CUDA graph capture it runs the push kernel (a captured copy's destination half and wait
    value would be fixed).

    trace (probes only): an int64 [W * tiles, 6] tensor the kernel fills (the kernel's TRACE).
    target_chunks, streams, count_step, partial_ahead (probes only): comm chunks per peer to
    aim at (engine_chunks), side streams to deal them over (at most schedule.COPY_STREAMS), the
    K step of the next tile after which the Gluon kernel counts a peer tile (its COUNT_STEP),
    K steps before an own tile's last at which it loads its first partial (its PARTIAL_AHEAD;
    None: ENGINE_PARTIAL_AHEAD, read per build).

    >>> engine = EngineReduceScatter(ops, out, config, world, rank, workspace)
    >>> engine(ops, out)           # out [M / W, N]
    """
    def __init__(self, ops: _Operands, out: torch.Tensor, config: GemmConfig, world: int,
                 rank: int, workspace, trace: torch.Tensor | None = None,
                 target_chunks: int = ENGINE_TARGET_CHUNKS, streams: int = schedule.COPY_STREAMS,
                 count_step: int = 0, partial_ahead: int | None = None):
        device = ops.a.device
        partial_ahead = ENGINE_PARTIAL_AHEAD if partial_ahead is None else partial_ahead
        m_chunk, element = ops.m // world, ops.a.element_size()
        if not 1 <= streams <= schedule.COPY_STREAMS:
            raise ValueError(f"gemm_reduce_scatter /ce: 1 to {schedule.COPY_STREAMS} side streams, "
                             f"got {streams}")
        if world * m_chunk * ops.n * element > workspace.data_bytes:
            raise ValueError(f"gemm_reduce_scatter /ce: {world * m_chunk * ops.n * element} bytes "
                             f"per half needed, the workspace has {workspace.data_bytes}")
        band_tiles, rectangles = engine_chunks(m_chunk, ops.n, config, target_chunks)
        chunks = len(rectangles)
        if chunks > schedule.ENGINE_CHUNKS:
            raise ValueError(f"gemm_reduce_scatter /ce: {chunks} comm chunks, at most "
                             f"{schedule.ENGINE_CHUNKS} have flags")
        tasks = world * triton.cdiv(m_chunk, config.block_m) * triton.cdiv(ops.n, config.block_n)
        if trace is not None and (trace.dtype != torch.int64 or trace.device != device
                                  or not trace.is_contiguous() or trace.numel() < 6 * tasks):
            raise ValueError(f"gemm_reduce_scatter /ce trace: a contiguous int64 tensor of at least "
                             f"[{tasks}, 6] on {device} needed, got {trace.dtype} "
                             f"{tuple(trace.shape)} on {trace.device}")
        self.workspace, self.world, self.rank = workspace, world, rank
        self.timeout_ns = workspace.timeout_ns()
        # the peer chunks' partials until the copy engines take them: the workspace's buffer,
        # shared by every /ce call on it (one call at a time: each waits for the last's copies)
        staged = (world - 1) * m_chunk * ops.n
        self.staging = workspace.staging(staged * element).view(ops.a.dtype).view(
            world - 1, m_chunk, ops.n)
        self.out_flags = torch.zeros((world - 1) * chunks, dtype=torch.int32, device=device)
        self.counts = torch.zeros((world - 1) * chunks, dtype=torch.int32, device=device)
        # /gl: the Gluon tile loop where it fits
        self.pipelined = engine_pipelined_fits(ops, config, world, out)
        use_tma = tma_compatible(ops.a) and tma_compatible(ops.b)
        a_desc, b_desc = _descriptors(ops, dataclasses.replace(config, pipelined=self.pipelined))
        staging, destination, out_block = self.staging, out, None
        if self.pipelined:
            out_block = [config.block_m, config.block_n // EPILOGUE_SPLIT]
            staging, destination = (_gluon_descriptor(t, out_block) for t in (
                self.staging.view(-1, ops.n), out))
        strides = operand_strides(ops)
        constexprs = dict(WORLD=world, BM=config.block_m, BN=config.block_n, BK=config.block_k,
                          GROUP_M=config.group_m, STAGES=config.stages, USE_TMA=use_tma,
                          B_TRANSPOSED=ops.b_transposed and use_tma,
                          ENGINE_CHUNKS=schedule.ENGINE_CHUNKS, PHASES=3,
                          TRACE=trace is not None)
        args = (a_desc, ops.a, b_desc, ops.b, staging, destination,
                workspace.data_addresses(0)[rank],
                workspace.flag_addresses()[rank], self.out_flags.data_ptr(), self.counts,
                workspace.state, workspace.abort, workspace.error_address(), self.timeout_ns,
                ops.m, ops.n, ops.k, m_chunk, *strides, workspace.engine_flag0, band_tiles, rank,
                workspace.data_bytes, self.counts if trace is None else trace)
        if self.pipelined:
            constexprs.update(COUNT_STEP=count_step, PARTIAL_AHEAD=partial_ahead)
            # this rank's data halves as [W * M_CHUNK, N]: where the peers' partials arrive
            halves = [workspace.peer_data(rank, half, ops.a.dtype, world * m_chunk * ops.n)
                      for half in (0, 1)]
            args += tuple(_gluon_descriptor(t.view(-1, ops.n), out_block) for t in halves)
            kernel = pipelined_engine_gemm_reduce_scatter_kernel.warmup(
                *args, **constexprs, num_warps=config.warps, grid=(1,))
        else:
            kernel = engine_gemm_reduce_scatter_kernel.warmup(
                *args, **constexprs, num_warps=config.warps, num_stages=config.stages, grid=(1,))
        grid = max(1, min(workspace.processors, tasks))
        # (A, B, the output and their descriptors at Replay's positions: a call refills them)
        self.kernel = Replay(CompiledLaunch(kernel, tuple(constexprs.values())), grid, args,
                             use_tma, config, ops.b_transposed, self.timeout_ns, device.index,
                             out_block)
        self.copies = engine_copies(workspace, self.staging.data_ptr(), self.out_flags.data_ptr(),
                                    m_chunk, ops.n, element, rectangles)
        self.row_pitch = ops.n * element
        self.sides = workspace.copy_streams()[:streams]
        self.ready = torch.cuda.Event()
        self.sent = [torch.cuda.Event() for _ in self.sides]
        # per epoch parity, the call's copies as a CUDA graph, made now (before any virtual
        # rank's kernel spins: instantiating may wait for the GPU); graph_error: why they are
        # issued one by one instead
        self.graphs, self.graph_error = graphs_per_parity(lambda parity: StreamGraph(
            self.sides, lambda: self._issue_copies(parity, None)))
        # the push kernel a CUDA graph capture runs, loaded now (no module loads while capturing)
        self.pushing = dataclasses.replace(config, engine=False, push=True)
        launch(ops, self.pushing, world, rank, None, out, workspace, compile_only=True)

    def _issue_copies(self, parity: int, epoch: int | None) -> None:
        """The copies of a call of this epoch parity on the side streams, chunks dealt over
        them in turn: each waits for its chunk's out flag (to reach `epoch`; None, for a graph
        that serves every call: to be non-zero, and takes it down), copies the rectangle of
        partials into the peer's data half, then this rank's last finished epoch (state word 0,
        read when the copy runs) into the peer's flag of the chunk."""
        runtime, driver, pitch = copy_engine_runtime(), stream_memory_driver(), self.row_pitch
        handles, state = [side.cuda_stream for side in self.sides], self.workspace.state.data_ptr()
        for index, (out_flag, target, source, row_bytes, rows, flag) in enumerate(
                self.copies[parity]):
            stream = handles[index % len(handles)]
            if epoch is None:
                take_flag_async(driver, stream, out_flag)
            else:
                wait_value_async(driver, stream, out_flag, epoch)
            copy_rows_async(runtime, target, pitch, source, pitch, row_bytes, rows, stream)
            copy_rows_async(runtime, flag, 4, state, 4, 4, 1, stream)

    def __call__(self, ops: _Operands, out: torch.Tensor) -> None:
        workspace = self.workspace
        if torch.cuda.is_current_stream_capturing():
            launch(ops, self.pushing, self.world, self.rank, None, out, workspace)
            return
        epoch = workspace.call_epoch()
        current = torch.cuda.current_stream(ops.a.device)
        sides = self.sides[:1] if self.graphs else self.sides  # a graph forks from the first
        self.ready.record(current)
        for side in sides:
            side.wait_event(self.ready)
        # the kernel is queued before the side streams' waits on it: were two streams to share
        # a hardware queue, a wait queued first would block the kernel it waits for
        self.kernel(ops, out)
        if self.graphs:
            self.graphs[epoch % 2].launch(sides[0].cuda_stream)
        else:
            self._issue_copies(epoch % 2, epoch)
        for side, sent in zip(sides, self.sent):
            sent.record(side)
            current.wait_event(sent)
