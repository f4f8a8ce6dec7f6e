"""Device-side primitives shared by every axedist kernel (Triton; imported lazily).

Flags are int32 words holding an *epoch* (the call number of the buffer they live in): a writer
stores the epoch with system-scope release after its data, a reader spins with system-scope
acquire until the word is >= its own epoch. Values only grow, so consecutive calls need no memset
and no host synchronization.

The two reduce backends differ only in `load_reduce`: `p2p` sums unicast loads from every peer's
buffer in fp32; `multimem` issues one `multimem.ld_reduce` on the multicast address (NVLink
SHARP), which the switch answers with the sum.

Call state lives in device memory (a few int32 words per rank, `SymmetricWorkspace.state`):
word EPOCH holds the epoch of the last finished call, so a kernel computes its own epoch
(`call_epoch`) and data half (epoch % 2) on the device and the last of its programs to finish
advances it (`finish_call`). A launch captured in a CUDA graph therefore takes a new epoch on
every replay, and no host value is baked into it.
"""
import triton
import triton.language as tl

# Error code written into the host-visible error word when a spin-wait times out.
ERROR_TIMEOUT = tl.constexpr(1)
# Words of a rank's call state (int32, device memory): the epoch of the last finished call, the
# programs of the running launch that have finished, the running launch's task counter.
STATE_EPOCH = tl.constexpr(0)
STATE_FINISHED = tl.constexpr(1)
STATE_TASKS = tl.constexpr(2)
STATE_WORDS = 4


@triton.jit
def call_epoch(state_ptr):
    """This launch's epoch: one more than the last finished call's (finish_call advances it
    after every program of the launch has read it)."""
    return tl.load(state_ptr + STATE_EPOCH, volatile=True) + 1


@triton.jit
def finish_call(state_ptr, epoch):
    """Run by every program at its end: the last one to finish stores `epoch` as the finished
    call's and zeroes the counters for the next launch. Every program has read the old epoch
    and claimed its last task before it counts itself finished, so the reset races with none."""
    tl.debug_barrier()  # every thread of this program is done with the counters
    finished = tl.atomic_add(state_ptr + STATE_FINISHED, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:
        tl.store(state_ptr + STATE_TASKS, 0)
        tl.store(state_ptr + STATE_FINISHED, 0)
        tl.atomic_xchg(state_ptr + STATE_EPOCH, epoch, sem="release")


@triton.jit
def claim_task(state_ptr):
    """The next task id of this launch (ids 0, 1, 2, ... in claim order across its programs)."""
    return tl.atomic_add(state_ptr + STATE_TASKS, 1)


@triton.jit
def shift8(p0, p1, p2, p3, p4, p5, p6, p7, offset):
    """Eight addresses moved by `offset` bytes (the data half or barrier region of this call)."""
    return (p0 + offset, p1 + offset, p2 + offset, p3 + offset, p4 + offset, p5 + offset,
            p6 + offset, p7 + offset)


@triton.jit
def ld_acquire_sys(address):
    """Load one int32 with .acquire at system scope (sees a peer's release store)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [address],
        dtype=tl.int32, is_pure=False, pack=1)


# One int32 store from thread 0 of the program; {} is the store instruction. The three
# flag stores below differ only in that word (ordering and scope).
_THREAD0_STORE = """{{
        .reg .pred %p_is_first;
        .reg .u32 %t_index;
        mov.u32 %t_index, %tid.x;
        setp.eq.u32 %p_is_first, %t_index, 0;
        @%p_is_first {} [$1], $2;
        mov.u32 $0, 0;
        }}"""
_ST_RELEASE_SYS = tl.constexpr(_THREAD0_STORE.format("st.release.sys.global.b32"))
_ST_RELAXED_SYS = tl.constexpr(_THREAD0_STORE.format("st.relaxed.sys.global.b32"))
_ST_RELEASE_GPU = tl.constexpr(_THREAD0_STORE.format("st.release.gpu.global.b32"))


@triton.jit
def _store_from_thread0(address, value, ASM: tl.constexpr):
    tl.inline_asm_elementwise(ASM, "=r,l,r", [address, value], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def st_release_sys(address, value):
    """Store one int32 with .release at system scope, from thread 0 of the program only.

    Call after tl.debug_barrier(): the barrier orders every thread's earlier stores before
    thread 0's release, and the release is cumulative, so a peer that acquires the flag sees
    the whole tile.
    """
    _store_from_thread0(address, value, _ST_RELEASE_SYS)


@triton.jit
def fence_acq_rel_sys(dummy):
    """fence.acq_rel.sys in every thread (dummy: any int32 operand).

    Each thread's earlier stores -- remote NVLink stores included -- are ordered before its
    later ones at system scope. Every thread fences before the CTA barrier that precedes
    thread 0's flag store, so the release does not rest on cumulativity through the barrier
    for the other warps' posted remote stores.
    """
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [dummy],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_stores_complete(dummy):
    """Wait until this thread's TMA (cp.async.bulk) stores have completed -- their writes
    performed, not only their shared-memory source read -- then order them before the thread's
    later generic-proxy accesses. Every thread runs it; only the thread that issued the stores
    has groups to wait for. Call before the CTA barrier that precedes a flag release."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r,r", [dummy],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_proxy_async(dummy):
    """fence.proxy.async in every thread: data this thread observed through the generic proxy
    (a peer's stores, acquired through its flag) is visible to the TMA loads it issues next."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r,r", [dummy],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def multimem_st_16bytes(addresses, w0, w1, w2, w3, valid):
    """multimem.st of 16 bytes (four 32-bit words) per multicast address where `valid` != 0:
    one store that the switch writes into every rank's copy. addresses int64 [R, G]; w0..w3
    and valid int32 [R, G]."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred %p_valid;
        setp.ne.b32 %p_valid, $6, 0;
        @%p_valid multimem.st.relaxed.sys.global.v4.f32 [$1], {$2, $3, $4, $5};
        mov.u32 $0, 0;
        }""",
        "=r,l,r,r,r,r,r", [addresses, w0, w1, w2, w3, valid], dtype=tl.int32, is_pure=False,
        pack=1)


@triton.jit
def st_relaxed_sys(address, value):
    """Store one int32 (relaxed, system scope) from thread 0 only: a release of every thread's
    earlier stores when each thread ran fence_acq_rel_sys and then a CTA barrier."""
    _store_from_thread0(address, value, _ST_RELAXED_SYS)


@triton.jit
def st_release_gpu(address, value):
    """As st_release_sys at GPU scope. NOT a correct signal to another GPU under the PTX memory
    model; exists only so the benchmark can measure what the system-scope fence costs."""
    _store_from_thread0(address, value, _ST_RELEASE_GPU)


@triton.jit
def globaltimer(dummy):
    """Nanoseconds from the GPU's global timer (dummy: any int32, Triton needs an operand)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def clock_cycles(dummy):
    """This SM's cycle counter (%clock64; dummy: any int32): durations inside one program."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [dummy], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def sm_id(dummy):
    """The multiprocessor this program runs on (%smid; dummy: any int32)."""
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r,r", [dummy], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_flag(flag_address, expected, abort_ptr, error_address, peer, flag_index, timeout_ns):
    """Spin until *flag_address >= expected, for at most timeout_ns; returns 1 when it arrived.

    On timeout it raises the local abort word (so every other wait of this launch gives up at
    once) and writes (code, peer, flag index) into the host-visible error word. The loop is
    bounded by the timer, so a peer that never signals can never hang the job.
    """
    value = ld_acquire_sys(flag_address)
    start = globaltimer(value)
    elapsed = start - start
    aborted = tl.load(abort_ptr, volatile=True)
    while (value < expected) & (elapsed < timeout_ns) & (aborted == 0):
        value = ld_acquire_sys(flag_address)
        elapsed = globaltimer(value) - start
        aborted = tl.load(abort_ptr, volatile=True)
    arrived = value >= expected
    if arrived == 0:
        # Plain stores, no atomics: every thread that gave up writes the same kind of record.
        tl.store(abort_ptr, 1)
        if aborted == 0:
            record = ((ERROR_TIMEOUT << 56) | (peer.to(tl.int64) << 40) | flag_index.to(tl.int64)
                      | ((expected.to(tl.int64) & 0xFFFF) << 24))
            tl.store(error_address.to(tl.pointer_type(tl.int64)), record)
    return arrived


@triton.jit
def engine_flag_index(engine_flag0, epoch, source, chunk, ENGINE_CHUNKS: tl.constexpr):
    """Index of the flag word that `source`'s copy engine sets on this rank after chunk `chunk`
    of its call of epoch `epoch` (schedule.engine_flag of the epoch's parity, counted from the
    flag region's start engine_flag0)."""
    return engine_flag0 + ((epoch % 2) * 8 + source) * ENGINE_CHUNKS + chunk


@triton.jit
def engine_chunk_epoch(epoch):
    """The least value of a copy-engine chunk flag that shows call `epoch`'s chunk: the flag
    holds the source's last finished epoch, copied after its call e - 1 finished (so e - 1 or
    e); flags start at -1, and the call before of the same parity left at most e - 2."""
    return epoch - 1


@triton.jit
def wait_engine_chunk(own_flags, engine_flag0, epoch, source, chunk, abort_ptr, error_address,
                      timeout_ns, ENGINE_CHUNKS: tl.constexpr):
    """Wait until `source`'s copy-engine chunk `chunk` of this epoch has arrived on this rank
    (its flag at least engine_chunk_epoch(epoch))."""
    flag = engine_flag_index(engine_flag0, epoch, source, chunk, ENGINE_CHUNKS)
    wait_flag(own_flags + flag * 4, engine_chunk_epoch(epoch), abort_ptr, error_address, source,
              flag, timeout_ns)


@triton.jit
def pick(index, p0, p1, p2, p3, p4, p5, p6, p7):
    """The index-th of eight scalars (peer addresses are passed as eight int64 arguments so that
    Triton specializes each on 16-byte divisibility and vectorizes the peer loads)."""
    r = tl.where(index == 1, p1, p0)
    r = tl.where(index == 2, p2, r)
    r = tl.where(index == 3, p3, r)
    r = tl.where(index == 4, p4, r)
    r = tl.where(index == 5, p5, r)
    r = tl.where(index == 6, p6, r)
    r = tl.where(index == 7, p7, r)
    return r


@triton.jit
def peer_pointers(address, offsets, ELEMENT: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers to address[offsets] (address: int64 byte address of a peer buffer).

    An int64 -> pointer cast loses Triton's alignment knowledge, so loads would be 2-byte scalar
    loads; ALIGNED (set by the host only when every tile row starts 16-byte aligned) restores it
    and the peer loads become 16-byte vectors.
    """
    pointers = address.to(tl.pointer_type(ELEMENT)) + offsets
    if ALIGNED:
        pointers = tl.multiple_of(pointers, [16, 16])
    return pointers


@triton.jit
def _halves(word, DTYPE: tl.constexpr):
    low = (word & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
    high = ((word >> 16) & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
    return tl.join(low, high)


@triton.jit
def multimem_ld_reduce_16bit(addresses, DTYPE: tl.constexpr):
    """multimem.ld_reduce of 8 bf16/fp16 per address (fp32 accumulation in the switch).

    addresses: int64 [R, G], one multicast address per 16-byte group; returns fp32 [R, 8 * G]
    in element order (word i of the v4 result holds elements 2i (low half) and 2i+1).
    """
    R: tl.constexpr = addresses.shape[0]
    G: tl.constexpr = addresses.shape[1]
    if DTYPE == tl.float16:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l", [addresses], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=False, pack=1)
    else:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l", [addresses], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=False, pack=1)
    q01 = tl.join(_halves(r0, DTYPE), _halves(r1, DTYPE))
    q23 = tl.join(_halves(r2, DTYPE), _halves(r3, DTYPE))
    return tl.reshape(tl.join(q01, q23), [R, G * 8]).to(tl.float32)


@triton.jit
def multimem_ld_reduce_f32(addresses):
    """multimem.ld_reduce of 4 fp32 per address; addresses int64 [R, G] -> fp32 [R, 4 * G]."""
    R: tl.constexpr = addresses.shape[0]
    G: tl.constexpr = addresses.shape[1]
    r0, r1, r2, r3 = tl.inline_asm_elementwise(
        "multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l", [addresses], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=False, pack=1)
    return tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [R, G * 4])


@triton.jit
def load_reduce(bases_0, bases_1, bases_2, bases_3, bases_4, bases_5, bases_6, bases_7,
                multicast_base, offsets, mask, rank, ELEMENT: tl.constexpr,
                WORLD: tl.constexpr, MULTIMEM: tl.constexpr, ALIGNED: tl.constexpr):
    """Sum over all ranks of buffer[offsets] in fp32: the one primitive the backends differ in.

    offsets: [R, C] element offsets (the same in every rank's buffer); bases_*: int64 byte
    addresses of the ranks' buffers. p2p: WORLD unicast loads, peer order staggered by rank so
    that links share the traffic. multimem: one multimem.ld_reduce per 16 bytes on the multicast
    mapping; the host selects it only when ALIGNED holds (rows 16-byte aligned, C % 8 == 0), and
    a 16-byte group is read when any element of it is in the mask.
    """
    if MULTIMEM:
        VEC: tl.constexpr = 128 // ELEMENT.primitive_bitwidth
        R: tl.constexpr = offsets.shape[0]
        C: tl.constexpr = offsets.shape[1]
        first = tl.min(tl.reshape(offsets, [R, C // VEC, VEC]), axis=2)
        group_mask = tl.max(tl.reshape(mask.to(tl.int32), [R, C // VEC, VEC]), axis=2) > 0
        addresses = multicast_base + first.to(tl.int64) * (ELEMENT.primitive_bitwidth // 8)
        # masked-off groups read the (always mapped) first 16 bytes instead; the value is dropped
        addresses = tl.where(group_mask, addresses, multicast_base)
        if ELEMENT == tl.float32:
            values = multimem_ld_reduce_f32(addresses)
        else:
            values = multimem_ld_reduce_16bit(addresses, ELEMENT)
        total = tl.where(mask, values, 0.0)
    else:
        total = sum_peer_loads(bases_0, bases_1, bases_2, bases_3, bases_4, bases_5, bases_6,
                               bases_7, offsets, mask, rank, ELEMENT, WORLD, 0, ALIGNED)
    return total


@triton.jit
def sum_peer_loads(bases_0, bases_1, bases_2, bases_3, bases_4, bases_5, bases_6, bases_7,
                   offsets, mask, rank, ELEMENT: tl.constexpr, WORLD: tl.constexpr,
                   FIRST_STEP: tl.constexpr, ALIGNED: tl.constexpr):
    """fp32 sum of buffer_p[offsets] over peers p = rank + FIRST_STEP, ..., rank + WORLD - 1
    (mod WORLD): staggered by rank so that the links share the traffic. FIRST_STEP = 1 leaves
    out this rank's own buffer (the caller adds its input from local memory instead)."""
    total = tl.zeros(offsets.shape, tl.float32)
    for step in tl.static_range(FIRST_STEP, WORLD):
        peer = (rank + step) % WORLD
        base = pick(peer, bases_0, bases_1, bases_2, bases_3, bases_4, bases_5, bases_6, bases_7)
        pointers = peer_pointers(base, offsets, ELEMENT, ALIGNED)
        total += tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    return total


@triton.jit
def grouped_tile(index, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of tile `index`, rows walked in groups of GROUP_M (column-major
    inside a group, so that a wave of programs shares B columns in L2); schedule.grouped_tile
    is the host twin."""
    per_group = GROUP_M * tiles_n
    first_m = (index // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    within = index % per_group
    return first_m + within % size_m, within // size_m
