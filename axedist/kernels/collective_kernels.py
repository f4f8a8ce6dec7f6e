"""Triton kernels for reduce-scatter, all-gather and all-reduce over a symmetric workspace.

One launch per call, and the kernel reads the caller's input itself (no separate copy kernel):

  place    program b moves its element range of the input to where the reduction reads it:
           PUSH: straight into each peer's workspace (remote stores over NVLink);
           pull: into this rank's own workspace (local copy; skipped when the caller wrote the
           input there already: COPY_IN = False, see p2p.symmetric_input).
  barrier  program b of every rank meets program b of every peer (block_barrier).
  combine  PUSH: sum / copy the slots the peers stored here (local loads);
           pull: load the peers' workspaces over NVLink (p2p) or one multimem.ld_reduce on the
           multicast mapping (MULTIMEM), summing in fp32.

Program b handles the same element range in every phase on every rank, so a per-program barrier
is all the synchronization needed. The two workspace halves alternate between calls, so a half
is never rewritten while a peer may still read it (axedist/collectives/symmetric.py). A kernel
reads its epoch from the rank's call state in device memory and picks the half and barrier
region of that epoch's parity itself (D*, F* are half 0's and region 0's addresses), so a launch
replayed from a CUDA graph is a new call every time.

PHASES selects which phases one launch runs (bit 0 place, bit 1 combine, bit 2 the two-shot
all-reduce's gather); a barrier runs only between two phases of the same launch. The GPU always
runs every phase; the CPU tests run the phases rank by rank under TRITON_INTERPRET=1, where the
order of launches replaces the barrier.

Workspace layout (elements of the call's dtype, one half; s = chunk_stride, a multiple of 16):
  reduce_scatter  pull: rank chunk c at [c*s, c*s + chunk)   push: slot of source q at [q*s, ...)
  all_gather      pull: this rank's chunk at [0, chunk)      push: slot of source q at [q*s, ...)
  all_reduce 1    pull: the whole tensor at [0, numel)        push: slot of source q at [q*s, ...)
  all_reduce 2    pull: the tensor at [0, numel), chunk c at [c*s, ...)
                  push: slot of source q at [q*s, ...), reduced chunk of rank q at [(W+q)*s, ...)
"""
import triton
import triton.language as tl

from .primitives import (call_epoch, fence_acq_rel_sys, finish_call, load_reduce, peer_pointers,
                         pick, shift8, st_relaxed_sys, sum_peer_loads, wait_flag)


@triton.jit
def block_signal(F0, F1, F2, F3, F4, F5, F6, F7, slot, epoch, rank, WORLD: tl.constexpr):
    """Program b tells program b of every peer that its stores so far are visible: every thread
    fences at system scope, a CTA barrier, then thread 0 writes the call's epoch into word
    slot * 8 + rank of every peer's barrier area (relaxed stores: a release pattern)."""
    fence_acq_rel_sys(epoch)
    tl.debug_barrier()
    for step in tl.static_range(1, WORLD):
        peer = (rank + step) % WORLD
        st_relaxed_sys(pick(peer, F0, F1, F2, F3, F4, F5, F6, F7) + (slot * 8 + rank) * 4, epoch)


@triton.jit
def block_wait(F0, F1, F2, F3, F4, F5, F6, F7, slot, epoch, rank, abort_ptr, error_address,
               timeout_ns, WORLD: tl.constexpr):
    """Spin on words slot * 8 + p of this rank's own barrier area until every peer p signalled
    slot `slot` of this call (local spinning: no NVLink round trip in the wait); 1 if all came."""
    own = pick(rank, F0, F1, F2, F3, F4, F5, F6, F7)
    arrived = 1
    for step in tl.static_range(1, WORLD):
        peer = (rank + step) % WORLD
        arrived &= wait_flag(own + (slot * 8 + peer) * 4, epoch, abort_ptr, error_address, peer,
                             slot, timeout_ns)
    return arrived


@triton.jit
def block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, slot, epoch, rank, abort_ptr, error_address,
                  timeout_ns, WORLD: tl.constexpr):
    """Program-level barrier across ranks on barrier `slot`; returns 1 when every peer arrived.

    F0..F7 are the barrier areas of the call's parity: a word is rewritten only two calls
    later, after its reader observed it (symmetric.py).
    """
    block_signal(F0, F1, F2, F3, F4, F5, F6, F7, slot, epoch, rank, WORLD)
    return block_wait(F0, F1, F2, F3, F4, F5, F6, F7, slot, epoch, rank, abort_ptr, error_address,
                      timeout_ns, WORLD)


@triton.jit
def place_whole(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, index, mask, rank, chunk_stride,
                WORLD: tl.constexpr, FIRST: tl.constexpr, PUSH: tl.constexpr, ALIGNED: tl.constexpr):
    """The place phase of a call every rank combines whole (one-shot all-reduce, the layer tail):
    x[index] goes into slot `rank` of the workspaces of ranks rank + FIRST, ..., rank + WORLD - 1
    (PUSH; FIRST = 1 leaves out this rank's own), or into this rank's own workspace (pull)."""
    ELEMENT: tl.constexpr = x_ptr.dtype.element_ty
    values = tl.load(x_ptr + index, mask=mask)
    if PUSH:
        for step in tl.static_range(FIRST, WORLD):
            peer = (rank + step) % WORLD
            target = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7),
                                   rank * chunk_stride + index, ELEMENT, ALIGNED)
            tl.store(target, values, mask=mask)
    else:
        tl.store(peer_pointers(own, index, ELEMENT, ALIGNED), values, mask=mask)


@triton.jit
def _tile(start, ROWS: tl.constexpr, COLS: tl.constexpr):
    # a [ROWS, COLS] tile of consecutive element indices beginning at `start`
    return start + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]


@triton.jit
def _rs_place(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel, chunk_stride, rank,
              first, last, WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
              FIRST: tl.constexpr, PUSH: tl.constexpr):
    # this program's tiles with first element in [first, last): every peer's part of them goes
    # to the peer's slot (PUSH) or into this rank's own workspace (pull)
    pid = tl.program_id(0)
    BLOCK: tl.constexpr = ROWS * COLS
    ELEMENT: tl.constexpr = x_ptr.dtype.element_ty
    for start in range(first + pid * BLOCK, last, tl.num_programs(0) * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = index < chunk_numel
        for step in tl.static_range(FIRST, WORLD):
            peer = (rank + step) % WORLD
            values = tl.load(x_ptr + peer * chunk_numel + index, mask=mask)
            if PUSH:
                target = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7),
                                       rank * chunk_stride + index, ELEMENT, True)
            else:
                target = peer_pointers(own, peer * chunk_stride + index, ELEMENT, True)
            tl.store(target, values, mask=mask)


@triton.jit
def _rs_combine(x_ptr, out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                chunk_numel, chunk_stride, rank, first, last, WORLD: tl.constexpr,
                ROWS: tl.constexpr, COLS: tl.constexpr, MULTIMEM: tl.constexpr,
                PUSH: tl.constexpr):
    pid = tl.program_id(0)
    BLOCK: tl.constexpr = ROWS * COLS
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    for start in range(first + pid * BLOCK, last, tl.num_programs(0) * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = index < chunk_numel
        if MULTIMEM:
            total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                                rank * chunk_stride + index, mask, rank, ELEMENT, WORLD,
                                MULTIMEM, True)
        else:
            total = tl.load(x_ptr + rank * chunk_numel + index, mask=mask,
                            other=0.0).to(tl.float32)
            if PUSH:
                for step in tl.static_range(1, WORLD):
                    peer = (rank + step) % WORLD
                    slot = peer_pointers(own, peer * chunk_stride + index, ELEMENT, True)
                    total += tl.load(slot, mask=mask, other=0.0).to(tl.float32)
            else:
                total += sum_peer_loads(D0, D1, D2, D3, D4, D5, D6, D7,
                                        rank * chunk_stride + index, mask, rank, ELEMENT,
                                        WORLD, 1, True)
        tl.store(out_ptr + index, total.to(ELEMENT), mask=mask)


@triton.jit
def reduce_scatter_kernel(x_ptr, out_ptr, state_ptr, timeout_ns, D0, D1, D2, D3, D4, D5, D6, D7,
                          multicast_base, F0, F1, F2, F3, F4, F5, F6, F7, chunk_numel,
                          chunk_stride, rank, abort_ptr, error_address, half_bytes, barrier_bytes, WORLD: tl.constexpr,
                          ROWS: tl.constexpr, COLS: tl.constexpr, MULTIMEM: tl.constexpr,
                          PUSH: tl.constexpr, COPY_IN: tl.constexpr, PHASES: tl.constexpr,
                          ROUNDS: tl.constexpr = 1):
    """out[i] = sum_r x_r[i] for i < chunk_numel, r over ranks.

    ROUNDS > 1 (with every phase in this launch) pipelines the phases: the chunk is cut into
    ROUNDS consecutive ranges; program b places range j + 1 before it waits for range j and
    combines it, and signals range j + 1 only after that combine (its stores have drained by
    then), on barrier slot (j + 1) * programs + b. Programs drift apart, so while some combine
    (local memory), others keep the links busy."""
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    F0, F1, F2, F3, F4, F5, F6, F7 = shift8(F0, F1, F2, F3, F4, F5, F6, F7, parity * barrier_bytes)
    multicast_base += parity * half_bytes  # (used by MULTIMEM only)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    BLOCK: tl.constexpr = ROWS * COLS
    # multimem reduces every rank's buffer, this rank's own chunk included
    FIRST: tl.constexpr = 0 if MULTIMEM else 1
    PLACE: tl.constexpr = COPY_IN or PUSH
    own = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
    if ROUNDS > 1 and PHASES == 3:
        stride = programs * BLOCK
        span = tl.cdiv(tl.cdiv(chunk_numel, stride), ROUNDS) * stride  # elements per round
        if PLACE:
            _rs_place(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel, chunk_stride,
                      rank, 0, tl.minimum(span, chunk_numel), WORLD, ROWS, COLS, FIRST, PUSH)
        block_signal(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, WORLD)
        for r in tl.static_range(ROUNDS):
            if r + 1 < ROUNDS:
                if PLACE:
                    _rs_place(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel,
                              chunk_stride, rank, (r + 1) * span,
                              tl.minimum((r + 2) * span, chunk_numel), WORLD, ROWS, COLS, FIRST,
                              PUSH)
            block_wait(F0, F1, F2, F3, F4, F5, F6, F7, r * programs + pid, epoch, rank,
                       abort_ptr, error_address, timeout_ns, WORLD)
            _rs_combine(x_ptr, out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                        chunk_numel, chunk_stride, rank, r * span,
                        tl.minimum((r + 1) * span, chunk_numel), WORLD, ROWS, COLS, MULTIMEM,
                        PUSH)
            if r + 1 < ROUNDS:
                block_signal(F0, F1, F2, F3, F4, F5, F6, F7, (r + 1) * programs + pid, epoch,
                             rank, WORLD)
    else:
        if (PHASES & 1) and PLACE:
            _rs_place(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel, chunk_stride,
                      rank, 0, chunk_numel, WORLD, ROWS, COLS, FIRST, PUSH)
        if (PHASES & 3) == 3:
            block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr,
                          error_address, timeout_ns, WORLD)
        if PHASES & 2:
            _rs_combine(x_ptr, out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                        chunk_numel, chunk_stride, rank, 0, chunk_numel, WORLD, ROWS, COLS,
                        MULTIMEM, PUSH)
    finish_call(state_ptr, epoch)


@triton.jit
def _ag_place(x_ptr, out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel, chunk_stride,
              rank, first, last, WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
              PUSH: tl.constexpr, COPY_IN: tl.constexpr):
    # this rank's own part of the output, and its chunk into every peer's slot (PUSH) or into
    # its own workspace (pull), for this program's tiles with first element in [first, last)
    pid = tl.program_id(0)
    BLOCK: tl.constexpr = ROWS * COLS
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    for start in range(first + pid * BLOCK, last, tl.num_programs(0) * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = index < chunk_numel
        values = tl.load(x_ptr + index, mask=mask)
        tl.store(out_ptr + rank * chunk_numel + index, values, mask=mask)
        if PUSH:
            for step in tl.static_range(1, WORLD):
                peer = (rank + step) % WORLD
                target = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7),
                                       rank * chunk_stride + index, ELEMENT, True)
                tl.store(target, values, mask=mask)
        elif COPY_IN:
            tl.store(peer_pointers(own, index, ELEMENT, True), values, mask=mask)


@triton.jit
def _ag_combine(out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel, chunk_stride, rank,
                first, last, WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                PUSH: tl.constexpr):
    pid = tl.program_id(0)
    BLOCK: tl.constexpr = ROWS * COLS
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    for start in range(first + pid * BLOCK, last, tl.num_programs(0) * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = index < chunk_numel
        for step in tl.static_range(1, WORLD):
            peer = (rank + step) % WORLD
            if PUSH:
                source = peer_pointers(own, peer * chunk_stride + index, ELEMENT, True)
            else:
                source = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7), index,
                                       ELEMENT, True)
            tl.store(out_ptr + peer * chunk_numel + index, tl.load(source, mask=mask),
                     mask=mask)


@triton.jit
def all_gather_kernel(x_ptr, out_ptr, state_ptr, timeout_ns, D0, D1, D2, D3, D4, D5, D6, D7,
                      F0, F1, F2, F3, F4, F5, F6, F7, chunk_numel, chunk_stride, rank,
                      abort_ptr, error_address, half_bytes, barrier_bytes, WORLD: tl.constexpr, ROWS: tl.constexpr,
                      COLS: tl.constexpr, PUSH: tl.constexpr, COPY_IN: tl.constexpr,
                      PHASES: tl.constexpr, ROUNDS: tl.constexpr = 1):
    """out[r * chunk_numel + i] = x_r[i] for every rank r and i < chunk_numel.
    ROUNDS > 1: the phases pipelined over consecutive ranges, as in reduce_scatter_kernel."""
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    F0, F1, F2, F3, F4, F5, F6, F7 = shift8(F0, F1, F2, F3, F4, F5, F6, F7, parity * barrier_bytes)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    BLOCK: tl.constexpr = ROWS * COLS
    own = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
    if ROUNDS > 1 and PHASES == 3:
        stride = programs * BLOCK
        span = tl.cdiv(tl.cdiv(chunk_numel, stride), ROUNDS) * stride  # elements per round
        _ag_place(x_ptr, out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel,
                  chunk_stride, rank, 0, tl.minimum(span, chunk_numel), WORLD, ROWS, COLS, PUSH,
                  COPY_IN)
        block_signal(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, WORLD)
        for r in tl.static_range(ROUNDS):
            if r + 1 < ROUNDS:
                _ag_place(x_ptr, out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel,
                          chunk_stride, rank, (r + 1) * span,
                          tl.minimum((r + 2) * span, chunk_numel), WORLD, ROWS, COLS, PUSH,
                          COPY_IN)
            block_wait(F0, F1, F2, F3, F4, F5, F6, F7, r * programs + pid, epoch, rank,
                       abort_ptr, error_address, timeout_ns, WORLD)
            _ag_combine(out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel, chunk_stride,
                        rank, r * span, tl.minimum((r + 1) * span, chunk_numel), WORLD, ROWS,
                        COLS, PUSH)
            if r + 1 < ROUNDS:
                block_signal(F0, F1, F2, F3, F4, F5, F6, F7, (r + 1) * programs + pid, epoch,
                             rank, WORLD)
    else:
        if PHASES & 1:
            _ag_place(x_ptr, out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel,
                      chunk_stride, rank, 0, chunk_numel, WORLD, ROWS, COLS, PUSH, COPY_IN)
        if (PHASES & 3) == 3:
            block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr,
                          error_address, timeout_ns, WORLD)
        if PHASES & 2:
            _ag_combine(out_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, chunk_numel, chunk_stride,
                        rank, 0, chunk_numel, WORLD, ROWS, COLS, PUSH)
    finish_call(state_ptr, epoch)


@triton.jit
def all_reduce_one_shot_kernel(x_ptr, out_ptr, state_ptr, timeout_ns, D0, D1, D2, D3, D4, D5, D6,
                               D7, multicast_base, F0, F1, F2, F3, F4, F5, F6, F7, numel,
                               chunk_stride, rank, abort_ptr, error_address, half_bytes, barrier_bytes,
                               WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                               MULTIMEM: tl.constexpr, PUSH: tl.constexpr,
                               COPY_IN: tl.constexpr, PHASES: tl.constexpr):
    """out[i] = sum_r x_r[i]: every rank combines everything (lowest latency, small sizes).
    chunk_stride: the push slot size (numel rounded up to 16)."""
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    F0, F1, F2, F3, F4, F5, F6, F7 = shift8(F0, F1, F2, F3, F4, F5, F6, F7, parity * barrier_bytes)
    multicast_base += parity * half_bytes  # (used by MULTIMEM only)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    BLOCK: tl.constexpr = ROWS * COLS
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    own = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
    if (PHASES & 1) and (COPY_IN or PUSH):
        for start in range(pid * BLOCK, numel, programs * BLOCK):
            index = _tile(start, ROWS, COLS)
            mask = index < numel
            place_whole(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, index, mask, rank, chunk_stride,
                        WORLD, 1, PUSH, True)
    if (PHASES & 3) == 3:
        block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr,
                      error_address, timeout_ns, WORLD)
    if PHASES & 2:
        for start in range(pid * BLOCK, numel, programs * BLOCK):
            index = _tile(start, ROWS, COLS)
            mask = index < numel
            if MULTIMEM:
                total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base, index, mask,
                                    rank, ELEMENT, WORLD, MULTIMEM, True)
            else:
                total = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
                if PUSH:
                    for step in tl.static_range(1, WORLD):
                        peer = (rank + step) % WORLD
                        slot = peer_pointers(own, peer * chunk_stride + index, ELEMENT, True)
                        total += tl.load(slot, mask=mask, other=0.0).to(tl.float32)
                else:
                    total += sum_peer_loads(D0, D1, D2, D3, D4, D5, D6, D7, index, mask, rank,
                                            ELEMENT, WORLD, 1, True)
            tl.store(out_ptr + index, total.to(ELEMENT), mask=mask)
    finish_call(state_ptr, epoch)


@triton.jit
def all_reduce_two_shot_kernel(x_ptr, out_ptr, state_ptr, timeout_ns, D0, D1, D2, D3, D4, D5, D6,
                               D7, multicast_base, F0, F1, F2, F3, F4, F5, F6, F7, numel,
                               chunk_stride, rank, abort_ptr, error_address, half_bytes, barrier_bytes,
                               WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                               MULTIMEM: tl.constexpr, PUSH: tl.constexpr,
                               COPY_IN: tl.constexpr, PHASES: tl.constexpr):
    """Reduce-scatter (rank r reduces chunk r), barrier, then all-gather the reduced chunks:
    least traffic for large sizes, and every rank ends with bit-identical results.

    Program b handles the same element range of every chunk in all three phases, so the
    barriers (slots b and programs + b) only have to cover program b of each peer.
    """
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    F0, F1, F2, F3, F4, F5, F6, F7 = shift8(F0, F1, F2, F3, F4, F5, F6, F7, parity * barrier_bytes)
    multicast_base += parity * half_bytes  # (used by MULTIMEM only)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    BLOCK: tl.constexpr = ROWS * COLS
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    FIRST: tl.constexpr = 0 if MULTIMEM else 1
    own = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
    base = rank * chunk_stride
    if (PHASES & 1) and (COPY_IN or PUSH):
        for start in range(pid * BLOCK, chunk_stride, programs * BLOCK):
            index = _tile(start, ROWS, COLS)
            for step in tl.static_range(FIRST, WORLD):
                peer = (rank + step) % WORLD
                offset = peer * chunk_stride + index
                mask = (index < chunk_stride) & (offset < numel)
                values = tl.load(x_ptr + offset, mask=mask)
                if PUSH:
                    target = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7),
                                           base + index, ELEMENT, True)
                else:
                    target = peer_pointers(own, offset, ELEMENT, True)
                tl.store(target, values, mask=mask)
    if (PHASES & 3) == 3:
        block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr,
                      error_address, timeout_ns, WORLD)
    if PHASES & 2:
        for start in range(pid * BLOCK, chunk_stride, programs * BLOCK):
            index = _tile(start, ROWS, COLS)
            mask = (index < chunk_stride) & (base + index < numel)
            if MULTIMEM:
                total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                                    base + index, mask, rank, ELEMENT, WORLD, MULTIMEM, True)
            else:
                total = tl.load(x_ptr + base + index, mask=mask, other=0.0).to(tl.float32)
                if PUSH:
                    for step in tl.static_range(1, WORLD):
                        peer = (rank + step) % WORLD
                        slot = peer_pointers(own, peer * chunk_stride + index, ELEMENT, True)
                        total += tl.load(slot, mask=mask, other=0.0).to(tl.float32)
                else:
                    total += sum_peer_loads(D0, D1, D2, D3, D4, D5, D6, D7, base + index, mask,
                                            rank, ELEMENT, WORLD, 1, True)
            reduced = total.to(ELEMENT)
            tl.store(out_ptr + base + index, reduced, mask=mask)
            if PUSH:
                for step in tl.static_range(1, WORLD):
                    peer = (rank + step) % WORLD
                    target = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7),
                                           (WORLD + rank) * chunk_stride + index, ELEMENT, True)
                    tl.store(target, reduced, mask=mask)
            else:
                # in place: peers read chunk `rank` of this buffer only after the second barrier
                tl.store(peer_pointers(own, base + index, ELEMENT, True), reduced, mask=mask)
    if (PHASES & 6) == 6:
        block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, programs + pid, epoch, rank, abort_ptr,
                      error_address, timeout_ns, WORLD)
    if PHASES & 4:
        for start in range(pid * BLOCK, chunk_stride, programs * BLOCK):
            index = _tile(start, ROWS, COLS)
            for step in tl.static_range(1, WORLD):
                peer = (rank + step) % WORLD
                offset = peer * chunk_stride + index
                mask = (index < chunk_stride) & (offset < numel)
                if PUSH:
                    source = peer_pointers(own, (WORLD + peer) * chunk_stride + index, ELEMENT,
                                           True)
                else:
                    source = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7), offset,
                                           ELEMENT, True)
                tl.store(out_ptr + offset, tl.load(source, mask=mask), mask=mask)
    finish_call(state_ptr, epoch)
