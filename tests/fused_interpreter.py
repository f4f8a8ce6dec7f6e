"""Run the fused all-gather + GEMM and GEMM + all-reduce kernels phase by phase, rank by rank,
under TRITON_INTERPRET=1 and compare every output with a float64 reference; prints the failures,
or OK. Used by tests/test_kernels_cpu.py.

CPU memory stands in for the ranks' symmetric workspaces (symmetric.carve_workspaces: the real
region layout and address tables, data halves filled with NaN). The flags and waits need inline
PTX the interpreter cannot run, so each kernel takes PHASES: launching phase 1 on every rank,
then phase 2 on every rank (then 4: the two-shot all-reduce's gather) replaces them. Each launch
reads the call's epoch from the rank's state words and must leave them advanced and zeroed.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 tests/fused_interpreter.py   # -> ... OK
"""
import ctypes
import itertools
import sys
import time

import torch

import triton_interpreter  # noqa: F401  (before the kernels: the interpreter's loop bounds)
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from axedist.collectives.symmetric import (ENGINE_FLAG0, FLAG_BYTES,  # noqa: E402
                                           carve_workspaces)
from axedist.kernels import ag_gemm, gemm_ar, gemm_rs, schedule  # noqa: E402
from tests.collectives_interpreter import flags_touched  # noqa: E402


def fake_workspaces(world, data_bytes, dtype):
    workspaces = carve_workspaces(world, data_bytes, torch.device("cpu"))
    for workspace in workspaces:
        workspace.tensor[workspace.data_offset(0):].view(dtype).fill_(float("nan"))
    return workspaces


def _state_check(workspace, epoch, name, rank):
    state = workspace.state.tolist()[:3]
    if state != [epoch, 0, 0]:
        return [f"{name} rank {rank}: call state {state} after a launch, expected [{epoch}, 0, 0]"]
    return []


def _launch_phases(workspaces, epoch, phases, launch_rank):
    failures = []
    for phase in phases:
        for rank, workspace in enumerate(workspaces):
            workspace.state[0] = epoch - 1
            launch_rank(rank, phase)
            failures += _state_check(workspace, epoch, "", rank)
    return failures


def _error(out, ref):
    if torch.isnan(out).any():
        return float("nan")
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _operand_arguments(a, b, transposed, tma, block):
    """(A's descriptor, B's descriptor, B's K stride, B's N stride) of a kernel launch (TMA
    descriptors None on the pointer path)."""
    bm, bn, bk = block
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk]) if tma else None
    b_desc = (TensorDescriptor.from_tensor(b, [bn, bk] if transposed else [bk, bn]) if tma else None)
    stride_bk, stride_bn = (b.stride(1), b.stride(0)) if transposed else (b.stride(0), b.stride(1))
    return a_desc, b_desc, stride_bk, stride_bn


def _memcpy_2d(target, target_pitch, source, source_pitch, row_bytes, rows):
    """cudaMemcpy2DAsync on CPU memory: what the launch's copy engine does, byte for byte."""
    for row in range(rows):
        ctypes.memmove(target + row * target_pitch, source + row * source_pitch, row_bytes)


def _engine_rows(workspaces, as_, epoch, dtype, m_local, k, block_m, pieces, half_rows):
    """Every rank's copy-engine transfers of a call of `epoch` done on the host, in the order
    the launch issues them (ag_gemm.engine_transfers), each chunk's flag copied from the rank's
    state word (its last finished epoch, epoch - 1 here); returns the chunk size in blocks."""
    for rank, workspace in enumerate(workspaces):
        workspace.state[0] = epoch - 1
        row_bytes = k * as_[rank].element_size()
        chunk_blocks, copies = ag_gemm.engine_transfers(workspace, m_local, row_bytes, block_m,
                                                        pieces, half_rows)
        for begin, rows, target, flag in copies[epoch % 2]:
            _memcpy_2d(target, row_bytes, as_[rank][begin:].data_ptr(), as_[rank].stride(0)
                       * as_[rank].element_size(), row_bytes, rows)
            _memcpy_2d(flag, 4, workspace.state.data_ptr(), 4, 4, 1)
    return chunk_blocks


def _engine_flag_failures(workspaces, epoch, world, chunks, name):
    """Rank r's copy-engine flags: epoch - 1 at (parity, source, chunk) for every peer source
    and chunk of this call, -1 everywhere else in the region."""
    failures = []
    for rank, workspace in enumerate(workspaces):
        region = workspace.tensor[ENGINE_FLAG0 * 4:FLAG_BYTES].view(torch.int32)
        expected = torch.full_like(region, -1)
        for source in range(world):
            for chunk in range(chunks if source != rank else 0):
                expected[schedule.engine_flag(epoch % 2, source, chunk)] = epoch - 1
        if not torch.equal(region, expected):
            failures.append(f"{name} rank {rank}: copy-engine flags differ from the chunks sent")
    return failures


def run_all_gather_gemm(world, m_local, n, k, transposed, tma, dtype, block, seed, pieces=1,
                        copy_out=False, engine=False):
    generator = torch.Generator().manual_seed(seed)
    bm, bn, bk = block
    config = ag_gemm.AllGatherGemmConfig(bm, bn, bk, 2, 2, 4, 4, 32, pieces)
    element = torch.tensor([], dtype=dtype).element_size()
    data_bytes = (ag_gemm.workspace_bytes_needed(world, m_local, k, element) + 4095) // 4096 * 4096
    workspaces = fake_workspaces(world, data_bytes, dtype)
    as_ = [torch.randn(m_local, k, generator=generator).to(dtype) for _ in range(world)]
    weights = [torch.randn((n, k) if transposed else (k, n), generator=generator).to(dtype)
               for _ in range(world)]
    outs = [torch.full((world * m_local, n), float("nan"), dtype=dtype) for _ in range(world)]
    gathered_outs = [torch.full((world * m_local, k), float("nan"), dtype=dtype) for _ in range(world)]
    epoch = 2 - seed % 2
    name = (f"copy_out={copy_out} engine={engine} all_gather_gemm W={world} {m_local}x{n}x{k} "
            f"B^T={transposed} tma={tma} pieces={pieces} {dtype}")
    half_rows = ag_gemm.gathered_rows(data_bytes, k, element)
    chunk_blocks = (_engine_rows(workspaces, as_, epoch, dtype, m_local, k, bm, pieces, half_rows)
                    if engine else 1)

    def launch(rank, phase):
        workspace = workspaces[rank]
        b = weights[rank]
        gathered = workspace.local_data(0, dtype, 2 * data_bytes // element, both_halves=True)
        g_desc = TensorDescriptor(gathered, [2 * data_bytes // (k * element), k], [k, 1], [bm, bk]) if tma else None
        a_desc, b_desc, stride_bk, stride_bn = _operand_arguments(as_[rank], b, transposed, tma, block)
        ag_gemm.all_gather_gemm_kernel[(3,)](
            as_[rank], a_desc, g_desc, b_desc, b, outs[rank],
            gathered_outs[rank].data_ptr() if copy_out else 0, *workspace.data_addresses(0), 0,
            *workspace.flag_addresses(), workspace.state, workspace.abort,
            workspace.error_address(), 0, m_local, n, k, as_[rank].stride(0), stride_bk,
            stride_bn, outs[rank].stride(0), workspace.engine_flag0, chunk_blocks, rank,
            half_rows, WORLD=world, BM=bm, BN=bn, BK=bk, GROUP_M=2, STAGES=2, USE_TMA=tma,
            B_TRANSPOSED=transposed, MULTIMEM=False, ALIGNED=False, COPY_ROWS=config.copy_rows,
            COPY_COLS=config.copy_cols, PIECES=pieces, COPY_OUT=copy_out, PHASES=phase,
            ENGINE=engine)

    phases = (2,) if engine else (1, 2)  # engine: the rows arrived before, by the host's copies
    failures = [f"{name}{f}" for f in _launch_phases(workspaces, epoch, phases, launch)]
    if engine:
        chunks = schedule.engine_chunks(-(-m_local // bm), pieces)[1]
        failures += _engine_flag_failures(workspaces, epoch, world, chunks, name)
    gathered_a = torch.cat([a.double() for a in as_])
    for rank in range(world):
        b = weights[rank].double()
        ref = gathered_a @ (b.t() if transposed else b)
        error = _error(outs[rank], ref)
        if not error < 1e-2:
            failures.append(f"{name} rank {rank}: error {error:.2e} (NaN: unwritten)")
        if copy_out and not torch.equal(gathered_outs[rank], torch.cat(as_)):
            failures.append(f"{name} rank {rank}: the gathered A copied out differs")
        # an even call's rows end before half 1; an odd call's start at row half_rows, in half 1
        other = workspaces[rank].local_data(1 - epoch % 2, dtype, data_bytes // element)
        if not torch.isnan(other).all():
            failures.append(f"{name} rank {rank}: wrote into the other data half")
        if flags_touched(workspaces[rank]):
            failures.append(f"{name} rank {rank}: data landed in the flag or barrier area")
    return failures


def run_gemm_all_reduce(world, m, n, k, transposed, tma, dtype, two_shot, push, block, seed):
    generator = torch.Generator().manual_seed(seed)
    bm, bn, bk = block
    element = torch.tensor([], dtype=dtype).element_size()
    data_bytes = (gemm_ar.workspace_bytes_needed(world, m, n, element) + 4095) // 4096 * 4096
    workspaces = fake_workspaces(world, data_bytes, dtype)
    as_ = [torch.randn(m, k, generator=generator).to(dtype) for _ in range(world)]
    weights = [torch.randn((n, k) if transposed else (k, n), generator=generator).to(dtype)
               for _ in range(world)]
    outs = [torch.full((m, n), float("nan"), dtype=dtype) for _ in range(world)]
    epoch = 2 - seed % 2
    name = (f"gemm_all_reduce W={world} {m}x{n}x{k} {'two' if two_shot else 'one'}-shot "
            f"{'push' if push else 'pull'} B^T={transposed} tma={tma} {dtype}")

    def launch(rank, phase):
        workspace = workspaces[rank]
        a, b = as_[rank], weights[rank]
        a_desc, b_desc, stride_bk, stride_bn = _operand_arguments(a, b, transposed, tma, block)
        gemm_ar.gemm_all_reduce_kernel[(3,)](
            a_desc, a, b_desc, b, outs[rank], *workspace.data_addresses(0), 0,
            *workspace.flag_addresses(), workspace.state, workspace.abort,
            workspace.error_address(), 0, m, n, k, a.stride(0), stride_bk, stride_bn, rank,
            data_bytes, WORLD=world, BM=bm, BN=bn, BK=bk, STAGES=2, USE_TMA=tma,
            B_TRANSPOSED=transposed, TWO_SHOT=two_shot, PUSH=push, MULTIMEM=False,
            ALIGNED=False, PHASES=phase)

    phases = (1, 2, 4) if two_shot else (1, 2)
    failures = [f"{name}{f}" for f in _launch_phases(workspaces, epoch, phases, launch)]
    total = sum(a.double() @ (b.double().t() if transposed else b.double())
                for a, b in zip(as_, weights))
    for rank in range(world):
        error = _error(outs[rank], total)
        if not error < 1e-2:
            failures.append(f"{name} rank {rank}: error {error:.2e} (NaN: unwritten)")
        other = workspaces[rank].local_data(1 - epoch % 2, dtype, data_bytes // element)
        if not torch.isnan(other).all():
            failures.append(f"{name} rank {rank}: wrote into the other data half")
        if flags_touched(workspaces[rank]):
            failures.append(f"{name} rank {rank}: data landed in the flag or barrier area")
    if two_shot and not failures and not all(torch.equal(outs[0], o) for o in outs):
        failures.append(f"{name}: ranks differ (two-shot results must be bit-identical)")
    return failures


def run_engine_gemm_reduce_scatter(world, m_chunk, n, k, transposed, tma, dtype, block, seed):
    """The /ce GEMM + reduce-scatter: phase 1 (the peers' chunks into staging) on every rank,
    then the copies the launch issues (gemm_rs.engine_copies: the same addresses, done by
    memmove, each chunk's flag from the rank's state word), then phase 2 (own chunk plus the
    received partials)."""
    generator = torch.Generator().manual_seed(seed)
    bm, bn, bk = block
    config = gemm_rs.GemmConfig(bm, bn, bk, 2, 2, 4, engine=True)
    element = torch.tensor([], dtype=dtype).element_size()
    m = world * m_chunk
    data_bytes = (world * m_chunk * n * element + 4095) // 4096 * 4096
    workspaces = fake_workspaces(world, data_bytes, dtype)
    as_ = [torch.randn(m, k, generator=generator).to(dtype) for _ in range(world)]
    weights = [torch.randn((n, k) if transposed else (k, n), generator=generator).to(dtype)
               for _ in range(world)]
    outs = [torch.full((m_chunk, n), float("nan"), dtype=dtype) for _ in range(world)]
    band_tiles, rectangles = gemm_rs.engine_chunks(m_chunk, n, config)
    chunks = len(rectangles)
    staging = [torch.full((world - 1, m_chunk, n), float("nan"), dtype=dtype) for _ in range(world)]
    out_flags = [torch.zeros((world - 1) * chunks, dtype=torch.int32) for _ in range(world)]
    counts = [torch.zeros((world - 1) * chunks, dtype=torch.int32) for _ in range(world)]
    epoch = 2 - seed % 2
    name = f"gemm_reduce_scatter /ce W={world} {m_chunk}x{n}x{k} B^T={transposed} tma={tma} {dtype}"

    def launch(rank, phase):
        workspace = workspaces[rank]
        a, b = as_[rank], weights[rank]
        a_desc, b_desc, stride_bk, stride_bn = _operand_arguments(a, b, transposed, tma, block)
        gemm_rs.engine_gemm_reduce_scatter_kernel[(3,)](
            a_desc, a, b_desc, b, staging[rank], outs[rank], workspace.data_addresses(0)[rank],
            workspace.flag_addresses()[rank], out_flags[rank].data_ptr(), counts[rank],
            workspace.state, workspace.abort, workspace.error_address(), 0, m, n, k, m_chunk,
            a.stride(0), a.stride(1), stride_bk, stride_bn, workspace.engine_flag0, band_tiles,
            rank, data_bytes, None, WORLD=world, BM=bm, BN=bn, BK=bk, GROUP_M=2, STAGES=2,
            USE_TMA=tma, B_TRANSPOSED=transposed, ENGINE_CHUNKS=schedule.ENGINE_CHUNKS, PHASES=phase,
            TRACE=False)

    failures = [f"{name}{f}" for f in _launch_phases(workspaces, epoch, (1,), launch)]
    for rank, workspace in enumerate(workspaces):
        workspace.state[0] = epoch - 1
        for _, target, source, row_bytes, rows, flag in gemm_rs.engine_copies(
                workspace, staging[rank].data_ptr(), out_flags[rank].data_ptr(), m_chunk, n,
                element, rectangles)[epoch % 2]:
            _memcpy_2d(target, n * element, source, n * element, row_bytes, rows)
            _memcpy_2d(flag, 4, workspace.state.data_ptr(), 4, 4, 1)
    failures += [f"{name}{f}" for f in _launch_phases(workspaces, epoch, (2,), launch)]
    failures += _engine_flag_failures(workspaces, epoch, world, chunks, name)
    total = sum(a.double() @ (b.double().t() if transposed else b.double())
                for a, b in zip(as_, weights))
    for rank in range(world):
        error = _error(outs[rank], total[rank * m_chunk:(rank + 1) * m_chunk])
        if not error < 1e-2:
            failures.append(f"{name} rank {rank}: error {error:.2e} (NaN: unwritten)")
        other = workspaces[rank].local_data(1 - epoch % 2, dtype, data_bytes // element)
        if not torch.isnan(other).all():
            failures.append(f"{name} rank {rank}: a copy went into the other data half")
        if flags_touched(workspaces[rank]):
            failures.append(f"{name} rank {rank}: data landed in the flag or barrier area")
    return failures


def main():
    start = time.time()
    failures, cases = [], 0
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    # fp16: Triton 3.6's interpreter computes tl.dot of bf16 operands wrongly (its numpy has no
    # bf16); the copies and sums of bf16 are checked by tests/collectives_interpreter.py
    dtype = torch.float16
    if which in ("all", "ag"):
        grid = [(2, 40, 48, 72, False, True), (3, 33, 40, 64, True, True), (2, 24, 32, 40, False, False),
                (4, 16, 16, 32, True, True), (1, 40, 24, 40, False, True)]
        for index, (world, m_local, n, k, transposed, tma) in enumerate(grid):
            failures += run_all_gather_gemm(world, m_local, n, k, transposed, tma, dtype,
                                            (16, 16, 16), seed=index, pieces=1 + index % 3,
                                            copy_out=index % 2 == 0)
            cases += 1
        # the rows by copy engine ("/ce"): chunks of 1 - 3 row blocks, both parities
        for index, (world, m_local, n, k, transposed, tma) in enumerate(grid[:4]):
            failures += run_all_gather_gemm(world, m_local, n, k, transposed, tma, dtype,
                                            (16, 16, 16), seed=index, pieces=2 + index % 2,
                                            copy_out=index % 2 == 1, engine=True)
            cases += 1
    if which in ("all", "ar"):
        grid = itertools.product([(2, 5, 40, 48, False, True), (3, 33, 24, 40, True, True),
                                  (2, 20, 16, 24, False, False)], (False, True), (True, False))
        for index, ((world, m, n, k, transposed, tma), two_shot, push) in enumerate(grid):
            failures += run_gemm_all_reduce(world, m, n, k, transposed, tma, dtype, two_shot,
                                            push, (16, 16, 16), seed=index)
            cases += 1
    if which in ("all", "rs"):
        grid = [(2, 40, 48, 72, False, True), (3, 33, 40, 64, True, True), (2, 24, 100, 40, False, False),
                (4, 16, 16, 32, True, True)]
        for index, (world, m_chunk, n, k, transposed, tma) in enumerate(grid):
            failures += run_engine_gemm_reduce_scatter(world, m_chunk, n, k, transposed, tma, dtype,
                                                       (16, 16, 16), seed=index)
            cases += 1
    print(f"{cases} cases in {time.time() - start:.1f} s")
    print("\n".join(failures) if failures else "OK")


if __name__ == "__main__":
    main()
