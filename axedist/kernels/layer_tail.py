"""The decode layer tail in one launch: all-reduce of the row-parallel output, residual add, RMSNorm.

A tensor-parallel transformer layer ends each half with a row-parallel linear whose output is a
partial sum on every rank, then adds the residual and normalizes the result for the next half:

    h = residual + sum_r x_r            (the all-reduce, then the add)
    y = h * rsqrt(mean(h ** 2, -1) + eps) * weight

At decode sizes (a few rows of 4096-8192) each of those steps is a launch of a few microseconds
that moves almost nothing; this kernel does all of them in one, over the symmetric workspace of
the p2p collectives (collective_kernels.py: same workspace layout, epochs, barrier and timeout):

  place    program p copies its rows of x into this rank's own workspace (pull), or stores
           them into every rank's slot ``rank`` (push: into each peer's workspace and its own);
  barrier  program p of every rank meets program p of every peer (block_barrier);
  combine  program p sums its rows over the ranks **in rank order 0, 1, ..., W-1** (fp32), so
           every rank computes bit-identical h and y; adds the residual, rounds h to the
           element type (as the unfused sequence stores it), and normalizes the rounded h.

Program p handles rows p, p + P, p + 2P, ... in both phases, so the per-program barrier is all
the synchronization needed. One row is one tile of BLOCK_H >= hidden columns.

The low-latency variant (``all_reduce_rms_norm_ll_kernel``) sends each 32 bits of a row as one
8-byte word whose high half is the call's epoch (primitives.tag_words): the word is its own flag,
so there is no fence, no barrier and no second trip over NVLink; a reader polls its own memory
until every word of a peer's row carries the epoch (primitives.wait_tagged_words). It runs on a
workspace only such words are written to, zeroed when allocated (symmetric.get_workspace
``tagged=True``), so no stale word can carry the live epoch.
"""
import triton
import triton.language as tl

from .collective_kernels import block_barrier, place_whole
from .primitives import call_epoch, finish_call, peer_pointers, pick, shift8, tag_words, wait_tagged_words


@triton.jit
def all_reduce_rms_norm_kernel(x_ptr, out_ptr, state_ptr, timeout_ns, D0, D1, D2, D3, D4, D5, D6,
                               D7, multicast_base, F0, F1, F2, F3, F4, F5, F6, F7, numel,
                               chunk_stride, rank, abort_ptr, error_address, half_bytes,
                               barrier_bytes, residual_ptr, weight_ptr, y_ptr, n_rows, hidden, eps,
                               WORLD: tl.constexpr, BLOCK_H: tl.constexpr, PUSH: tl.constexpr,
                               COPY_IN: tl.constexpr, ALIGNED: tl.constexpr, PHASES: tl.constexpr):
    """out = residual + sum_r x_r and y = rms_norm(out) * weight, rows of ``hidden`` elements.

    numel = n_rows * hidden; chunk_stride: a push slot's size (numel rounded up to 16);
    multicast_base is unused (the multimem path is not written for this kernel)."""
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    F0, F1, F2, F3, F4, F5, F6, F7 = shift8(F0, F1, F2, F3, F4, F5, F6, F7, parity * barrier_bytes)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    own = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
    columns = tl.arange(0, BLOCK_H)[None, :]  # a [1, BLOCK_H] tile (peer_pointers' 2-D alignment hint)
    in_row = columns < hidden
    if (PHASES & 1) and (COPY_IN or PUSH):
        for row in range(pid, n_rows, programs):
            # push: every rank's slot `rank`, this rank's own included (the combine reads them all)
            place_whole(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, row * hidden + columns, in_row, rank,
                        chunk_stride, WORLD, 0, PUSH, ALIGNED)
    if (PHASES & 3) == 3:
        block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr,
                      error_address, timeout_ns, WORLD)
    if PHASES & 2:
        weight = tl.load(weight_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
        for row in range(pid, n_rows, programs):
            index = row * hidden + columns
            total = tl.zeros([1, BLOCK_H], tl.float32)
            for q in tl.static_range(WORLD):  # rank order: the same sum on every rank
                if PUSH:
                    source = peer_pointers(own, q * chunk_stride + index, ELEMENT, ALIGNED)
                else:
                    source = peer_pointers(pick(q, D0, D1, D2, D3, D4, D5, D6, D7), index,
                                           ELEMENT, ALIGNED)
                total += tl.load(source, mask=in_row, other=0.0).to(tl.float32)
            residual_add_norm(total, residual_ptr, weight, out_ptr, y_ptr, index, in_row, hidden, eps)
    finish_call(state_ptr, epoch)


@triton.jit
def residual_add_norm(total, residual_ptr, weight, out_ptr, y_ptr, index, mask, hidden, eps):
    """One row's epilogue: h = total (the fp32 sum over the ranks) + residual, rounded to the
    element type (as the unfused sequence stores it) into out; y = rms_norm(h) * weight into y."""
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    total += tl.load(residual_ptr + index, mask=mask, other=0.0).to(tl.float32)
    h = total.to(ELEMENT)
    tl.store(out_ptr + index, h, mask=mask)
    hf = h.to(tl.float32)
    mean_square = tl.sum(hf * hf) / hidden
    y = hf * tl.math.rsqrt(mean_square + eps) * weight
    tl.store(y_ptr + index, y.to(ELEMENT), mask=mask)


@triton.jit
def _unpacked(payloads, ELEMENT: tl.constexpr, PER_WORD: tl.constexpr):
    """fp32 [1, BLOCK_W * PER_WORD]: the elements int32 payloads [1, BLOCK_W] hold, in memory
    order (a 16-bit pair's low half is the earlier element)."""
    if PER_WORD == 2:
        low = (payloads & 0xFFFF).to(tl.int16).to(ELEMENT, bitcast=True).to(tl.float32)
        high = ((payloads >> 16) & 0xFFFF).to(tl.int16).to(ELEMENT, bitcast=True).to(tl.float32)
        values = tl.reshape(tl.join(low, high), [1, 2 * payloads.shape[1]])
    else:
        values = payloads.to(tl.float32, bitcast=True)
    return values


@triton.jit
def all_reduce_rms_norm_ll_kernel(x_ptr, out_ptr, state_ptr, timeout_ns, D0, D1, D2, D3, D4, D5, D6,
                                  D7, rank, abort_ptr, error_address, half_bytes, residual_ptr,
                                  weight_ptr, y_ptr, n_rows, hidden, eps, WORLD: tl.constexpr,
                                  BLOCK_W: tl.constexpr, PER_WORD: tl.constexpr,
                                  PHASES: tl.constexpr):
    """out = residual + sum_r x_r and y = rms_norm(out) * weight by the low-latency protocol.

    D0..D7: the ranks' data half 0 of a tagged workspace; rank q's slot in every workspace holds
    n_rows * hidden / PER_WORD words (PER_WORD elements of 32 bits each; rows 16-byte aligned).
    place: program p tags its rows' 32-bit payloads with the epoch and stores them into slot
    `rank` of every rank's workspace, its own included; combine: it reads slots 0, 1, ..., W-1
    of its own workspace in rank order, each once its words carry the epoch, and sums them in
    fp32 (the same bits on every rank). PHASES: 1 place, 2 combine, 3 both (the interpreter
    runs them one at a time)."""
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    own = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
    words = tl.arange(0, BLOCK_W)[None, :]  # a [1, BLOCK_W] tile (peer_pointers' 2-D alignment hint)
    n_words = hidden // PER_WORD
    in_row = words < n_words
    slot_words = n_rows * n_words
    payloads = x_ptr.to(tl.pointer_type(tl.int32))
    if PHASES & 1:
        for row in range(pid, n_rows, programs):
            tagged = tag_words(tl.load(payloads + row * n_words + words, mask=in_row, other=0), epoch)
            for step in tl.static_range(WORLD):
                peer = (rank + step) % WORLD
                target = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7),
                                       rank * slot_words + row * n_words + words, tl.int64, True)
                tl.store(target, tagged, mask=in_row)
        tl.debug_barrier()  # every store issued before any thread polls
    if PHASES & 2:
        columns = tl.arange(0, BLOCK_W * PER_WORD)[None, :]
        in_columns = columns < hidden
        weight = tl.load(weight_ptr + columns, mask=in_columns, other=0.0).to(tl.float32)
        for row in range(pid, n_rows, programs):
            total = tl.zeros([1, BLOCK_W * PER_WORD], tl.float32)
            for q in tl.static_range(WORLD):  # rank order: the same sum on every rank
                source = peer_pointers(own, q * slot_words + row * n_words + words, tl.int64, True)
                total += _unpacked(wait_tagged_words(source, in_row, epoch, abort_ptr, error_address,
                                                     q, row, timeout_ns), ELEMENT, PER_WORD)
            residual_add_norm(total, residual_ptr, weight, out_ptr, y_ptr, row * hidden + columns,
                              in_columns, hidden, eps)
    finish_call(state_ptr, epoch)
