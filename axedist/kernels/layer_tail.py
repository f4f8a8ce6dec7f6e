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
"""
import triton
import triton.language as tl

from .collective_kernels import block_barrier, place_whole
from .primitives import call_epoch, finish_call, peer_pointers, pick, shift8


@triton.jit
def all_reduce_rms_norm_kernel(x_ptr, out_ptr, state_ptr, timeout_ns, D0, D1, D2, D3, D4, D5, D6,
                               D7, multicast_base, F0, F1, F2, F3, F4, F5, F6, F7, numel,
                               chunk_stride, rank, abort_ptr, error_address, half_bytes,
                               barrier_bytes, residual_ptr, weight_ptr, y_ptr, n_rows, hidden, eps,
                               WORLD: tl.constexpr, BLOCK_H: tl.constexpr, PUSH: tl.constexpr,
                               COPY_IN: tl.constexpr, ALIGNED: tl.constexpr, PHASES: tl.constexpr,
                               NORM: tl.constexpr):
    """out = residual + sum_r x_r and y = rms_norm(out) * weight, rows of ``hidden`` elements
    (NORM = False: out alone; weight_ptr and y_ptr are not read or written).

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
    if PHASES & 2:
        # what the combine needs of this rank alone, loaded before the place and the barrier so that
        # its latency hides behind theirs: the weight, and the residual of the program's first row
        # (at decode sizes its only one: the grid has a program per row)
        if NORM:
            weight = tl.load(weight_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
        first_residual = tl.load(residual_ptr + pid * hidden + columns, mask=in_row & (pid < n_rows), other=0.0)
    if (PHASES & 1) and (COPY_IN or PUSH):
        for row in range(pid, n_rows, programs):
            # push: every rank's slot `rank`, this rank's own included (the combine reads them all)
            place_whole(x_ptr, own, D0, D1, D2, D3, D4, D5, D6, D7, row * hidden + columns, in_row, rank,
                        chunk_stride, WORLD, 0, PUSH, ALIGNED)
    if (PHASES & 3) == 3:
        block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr,
                      error_address, timeout_ns, WORLD)
    # every program read the epoch at its start and claims no tasks: the launch may count itself
    # finished now, the counter's round trip overlapping the combine (the next call on the workspace
    # starts after this kernel ends, stream order)
    finish_call(state_ptr, epoch)
    if PHASES & 2:
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
            if row == pid:
                residual = first_residual
            else:
                residual = tl.load(residual_ptr + index, mask=in_row, other=0.0)
            total += residual.to(tl.float32)
            h = total.to(ELEMENT)
            tl.store(out_ptr + index, h, mask=in_row)
            if NORM:
                hf = h.to(tl.float32)
                mean_square = tl.sum(hf * hf, axis=1)[:, None] / hidden
                y = hf * tl.math.rsqrt(mean_square + eps) * weight
                tl.store(y_ptr + index, y.to(ELEMENT), mask=in_row)
