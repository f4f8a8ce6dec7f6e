"""Triton kernels for reduce-scatter, all-gather and all-reduce over a symmetric workspace.

Every rank's kernel starts with a block-wise barrier: program b of each rank publishes the call's
epoch in flag slot b of its own signal area and waits for slot b on every peer. That is all the
synchronization needed, because each rank's input was written into its symmetric buffer by an
earlier operation on the same stream, and the two halves (parities) of the workspace alternate
between calls, so a buffer is never rewritten while a peer may still read it (see
axedist/collectives/symmetric.py).

Data layout in the workspace (elements of the call's dtype, one parity half):
  reduce_scatter: rank chunks at [r * chunk_stride, r * chunk_stride + chunk_numel)
  all_gather:     this rank's chunk at [0, chunk_numel)
  all_reduce:     the whole tensor at [0, numel); two-shot splits it in chunks of chunk_stride.
"""
import triton
import triton.language as tl

from .primitives import load_reduce, peer_pointers, pick, st_release_sys, wait_flag


@triton.jit
def block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, slot, epoch, rank, abort_ptr, error_address,
                  timeout_ns, WORLD: tl.constexpr):
    """Program-level barrier across ranks on flag `slot`: returns 1 when every peer arrived."""
    tl.debug_barrier()
    own = pick(rank, F0, F1, F2, F3, F4, F5, F6, F7)
    st_release_sys(own + slot * 4, epoch)
    arrived = 1
    for step in tl.static_range(1, WORLD):
        peer = (rank + step) % WORLD
        address = pick(peer, F0, F1, F2, F3, F4, F5, F6, F7) + slot * 4
        arrived &= wait_flag(address, epoch, abort_ptr, error_address, peer, slot, timeout_ns)
    return arrived


@triton.jit
def _tile(start, ROWS: tl.constexpr, COLS: tl.constexpr):
    # a [ROWS, COLS] tile of consecutive element indices beginning at `start`
    return start + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]


@triton.jit(do_not_specialize=["rank", "epoch", "timeout_ns"])
def reduce_scatter_kernel(out_ptr, D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                          F0, F1, F2, F3, F4, F5, F6, F7,
                          chunk_numel, chunk_stride, rank, epoch, abort_ptr, error_address,
                          timeout_ns, WORLD: tl.constexpr, ROWS: tl.constexpr,
                          COLS: tl.constexpr, MULTIMEM: tl.constexpr, ALIGNED: tl.constexpr):
    """out[i] = sum_r buffer_r[rank * chunk_stride + i] for i < chunk_numel (one-shot pull)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr, error_address,
                  timeout_ns, WORLD)
    BLOCK: tl.constexpr = ROWS * COLS
    base = rank * chunk_stride
    for start in range(pid * BLOCK, chunk_numel, programs * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = index < chunk_numel
        total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base, base + index, mask,
                            rank, out_ptr.dtype.element_ty, WORLD, MULTIMEM, ALIGNED)
        tl.store(out_ptr + index, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "epoch", "timeout_ns"])
def all_gather_kernel(out_ptr, D0, D1, D2, D3, D4, D5, D6, D7,
                      F0, F1, F2, F3, F4, F5, F6, F7,
                      chunk_numel, rank, epoch, abort_ptr, error_address, timeout_ns,
                      WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                      ALIGNED: tl.constexpr):
    """out[r * chunk_numel + i] = buffer_r[i] (one-shot pull; peers in staggered order)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr, error_address,
                  timeout_ns, WORLD)
    BLOCK: tl.constexpr = ROWS * COLS
    for start in range(pid * BLOCK, chunk_numel, programs * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = index < chunk_numel
        for step in tl.static_range(WORLD):
            peer = (rank + step) % WORLD
            source = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7), index,
                                   out_ptr.dtype.element_ty, ALIGNED)
            values = tl.load(source, mask=mask)
            tl.store(out_ptr + peer * chunk_numel + index, values, mask=mask)


@triton.jit(do_not_specialize=["rank", "epoch", "timeout_ns"])
def all_reduce_one_shot_kernel(out_ptr, D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                               F0, F1, F2, F3, F4, F5, F6, F7,
                               numel, rank, epoch, abort_ptr, error_address, timeout_ns,
                               WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                               MULTIMEM: tl.constexpr, ALIGNED: tl.constexpr):
    """out[i] = sum_r buffer_r[i]: every rank pulls everything (lowest latency, small sizes)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr, error_address,
                  timeout_ns, WORLD)
    BLOCK: tl.constexpr = ROWS * COLS
    for start in range(pid * BLOCK, numel, programs * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = index < numel
        total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base, index, mask, rank,
                            out_ptr.dtype.element_ty, WORLD, MULTIMEM, ALIGNED)
        tl.store(out_ptr + index, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "epoch", "timeout_ns"])
def all_reduce_two_shot_kernel(out_ptr, D0, D1, D2, D3, D4, D5, D6, D7, multicast_base,
                               F0, F1, F2, F3, F4, F5, F6, F7,
                               numel, chunk_stride, rank, epoch, abort_ptr, error_address,
                               timeout_ns, WORLD: tl.constexpr, ROWS: tl.constexpr,
                               COLS: tl.constexpr, MULTIMEM: tl.constexpr, ALIGNED: tl.constexpr):
    """Reduce-scatter into the own buffer, barrier, then all-gather the reduced chunks.

    Program b handles the same element range of every chunk in both phases, so the second
    barrier (flag slot programs + b) only has to cover program b of each peer.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, pid, epoch, rank, abort_ptr, error_address,
                  timeout_ns, WORLD)
    BLOCK: tl.constexpr = ROWS * COLS
    ELEMENT: tl.constexpr = out_ptr.dtype.element_ty
    base = rank * chunk_stride
    for start in range(pid * BLOCK, chunk_stride, programs * BLOCK):
        index = _tile(start, ROWS, COLS)
        mask = (index < chunk_stride) & (base + index < numel)
        total = load_reduce(D0, D1, D2, D3, D4, D5, D6, D7, multicast_base, base + index, mask,
                            rank, ELEMENT, WORLD, MULTIMEM, ALIGNED).to(ELEMENT)
        # in place: peers only read chunk `rank` of this buffer after the second barrier
        own = peer_pointers(pick(rank, D0, D1, D2, D3, D4, D5, D6, D7), base + index, ELEMENT,
                            ALIGNED)
        tl.store(own, total, mask=mask)
        tl.store(out_ptr + base + index, total, mask=mask)
    block_barrier(F0, F1, F2, F3, F4, F5, F6, F7, programs + pid, epoch, rank, abort_ptr,
                  error_address, timeout_ns, WORLD)
    for start in range(pid * BLOCK, chunk_stride, programs * BLOCK):
        index = _tile(start, ROWS, COLS)
        for step in tl.static_range(1, WORLD):
            peer = (rank + step) % WORLD
            offset = peer * chunk_stride + index
            mask = (index < chunk_stride) & (offset < numel)
            source = peer_pointers(pick(peer, D0, D1, D2, D3, D4, D5, D6, D7), offset, ELEMENT,
                                   ALIGNED)
            tl.store(out_ptr + offset, tl.load(source, mask=mask), mask=mask)
