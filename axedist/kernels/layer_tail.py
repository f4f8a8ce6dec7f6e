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

The low-latency variant (``all_reduce_rms_norm_ll_kernel``, 16-bit types) has no barrier: each
rank stores its rows into every peer's slot as LL words (primitives.ll_words: two elements and
the call's epoch in one 64-bit store), and a rank combines a peer's row as soon as every word of
it carries the call's epoch (local spinning). That removes the system-scope fence, the flag
stores and the wait for them, at twice the bytes over NVLink, which at decode sizes are few.
It runs on a workspace of its own that only these calls write ("ll", collectives/symmetric.py),
zeroed when allocated, so a stale word always carries an older epoch.
"""
import triton
import triton.language as tl

from .collective_kernels import block_barrier, place_whole
from .primitives import (call_epoch, finish_call, ll_words, pair_of, peer_pointers, pick, shift8, wait_ll_words,
                         word_of)


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
            total += tl.load(residual_ptr + index, mask=in_row, other=0.0).to(tl.float32)
            h = total.to(ELEMENT)
            tl.store(out_ptr + index, h, mask=in_row)
            hf = h.to(tl.float32)
            mean_square = tl.sum(hf * hf, axis=1)[:, None] / hidden
            y = hf * tl.math.rsqrt(mean_square + eps) * weight
            tl.store(y_ptr + index, y.to(ELEMENT), mask=in_row)
    finish_call(state_ptr, epoch)


@triton.jit
def all_reduce_rms_norm_ll_kernel(x_ptr, out_ptr, residual_ptr, weight_ptr, y_ptr, state_ptr, abort_ptr,
                                  error_address, timeout_ns, D0, D1, D2, D3, D4, D5, D6, D7, half_bytes,
                                  slot_words, rank, n_rows, hidden, eps, WORLD: tl.constexpr,
                                  BLOCK_W: tl.constexpr, PHASES: tl.constexpr):
    """As all_reduce_rms_norm_kernel, by LL words (16-bit types, hidden even, tensors 4-byte aligned).

    The tensors are read and written as int32 words of two elements. D0..D7: every rank's data
    half 0 of its "ll" workspace; half_bytes: from half 0 to half 1 (the call's epoch parity
    picks one); slot of source rank q: words [q * slot_words, (q + 1) * slot_words) of a half,
    row r at r * hidden / 2 inside it. PHASES as the barrier kernel's (the interpreter runs 1,
    then 2, rank by rank); the combine sums the ranks in rank order, so every rank computes the
    same bits, and the same bits as all_reduce_rms_norm_kernel."""
    epoch = call_epoch(state_ptr)
    parity = (epoch % 2).to(tl.int64)
    D0, D1, D2, D3, D4, D5, D6, D7 = shift8(D0, D1, D2, D3, D4, D5, D6, D7, parity * half_bytes)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    WORD: tl.constexpr = tl.pointer_type(tl.int32)
    x_words, out_words, y_words = x_ptr.to(WORD, bitcast=True), out_ptr.to(WORD, bitcast=True), \
        y_ptr.to(WORD, bitcast=True)
    pairs = hidden // 2
    words = tl.arange(0, BLOCK_W)[None, :]  # a [1, BLOCK_W] tile of word indices
    in_row = words < pairs
    if PHASES & 1:
        for row in range(pid, n_rows, programs):
            stamped = ll_words(tl.load(x_words + row * pairs + words, mask=in_row), epoch)
            for step in tl.static_range(1, WORLD):
                peer = (rank + step) % WORLD
                slot = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7),
                                     rank * slot_words + row * pairs + words, tl.int64, True)
                tl.store(slot, stamped, mask=in_row)
    if PHASES & 2:
        own = pick(rank, D0, D1, D2, D3, D4, D5, D6, D7)
        w_low, w_high = pair_of(tl.load(weight_ptr.to(WORD, bitcast=True) + words, mask=in_row, other=0), ELEMENT)
        w_low, w_high = w_low.to(tl.float32), w_high.to(tl.float32)
        for row in range(pid, n_rows, programs):
            index = row * pairs + words
            low = tl.zeros([1, BLOCK_W], tl.float32)
            high = tl.zeros([1, BLOCK_W], tl.float32)
            for q in tl.static_range(WORLD):  # rank order: the same sum on every rank
                if q == rank:
                    data = tl.load(x_words + index, mask=in_row, other=0)
                else:
                    data = wait_ll_words(peer_pointers(own, q * slot_words + index, tl.int64, True), in_row, epoch,
                                         abort_ptr, error_address, q, row, timeout_ns)
                a, b = pair_of(data, ELEMENT)
                low += a.to(tl.float32)
                high += b.to(tl.float32)
            a, b = pair_of(tl.load(residual_ptr.to(WORD, bitcast=True) + index, mask=in_row, other=0), ELEMENT)
            h_low, h_high = (low + a.to(tl.float32)).to(ELEMENT), (high + b.to(tl.float32)).to(ELEMENT)
            tl.store(out_words + index, word_of(h_low, h_high), mask=in_row)
            f_low, f_high = h_low.to(tl.float32), h_high.to(tl.float32)
            mean_square = (tl.sum(f_low * f_low, axis=1) + tl.sum(f_high * f_high, axis=1))[:, None] / hidden
            scale = tl.math.rsqrt(mean_square + eps)
            y_low, y_high = (f_low * scale * w_low).to(ELEMENT), (f_high * scale * w_high).to(ELEMENT)
            tl.store(y_words + index, word_of(y_low, y_high), mask=in_row)
    finish_call(state_ptr, epoch)
