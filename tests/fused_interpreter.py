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
import itertools
import sys
import time

import torch
from triton.runtime import interpreter

# Triton 3.6's interpreter converts 1-element scalars with int(array), an error since numpy 2.3;
# convert through .item() instead (as tests/collectives_interpreter.py).
_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_item(tensor, scope):
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_with_item
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from axedist.collectives.symmetric import BARRIER_BYTES, FLAG_BYTES, carve_workspaces  # noqa: E402
from axedist.kernels import ag_gemm, gemm_ar  # noqa: E402


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


def run_all_gather_gemm(world, m_local, n, k, transposed, tma, dtype, block, seed, pieces=1,
                        copy_out=False):
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
    name = f"copy_out={copy_out} all_gather_gemm W={world} {m_local}x{n}x{k} B^T={transposed} tma={tma} pieces={pieces} {dtype}"
    half_rows = ag_gemm.gathered_rows(data_bytes, k, element)

    def launch(rank, phase):
        workspace = workspaces[rank]
        b = weights[rank]
        gathered = workspace.local_data(0, dtype, 2 * data_bytes // element, both_halves=True)
        g_desc = TensorDescriptor(gathered, [2 * data_bytes // (k * element), k], [k, 1], [bm, bk]) if tma else None
        b_desc = (TensorDescriptor.from_tensor(b, [bn, bk] if transposed else [bk, bn]) if tma else None)
        a_desc = TensorDescriptor.from_tensor(as_[rank], [bm, bk]) if tma else None
        stride_bk, stride_bn = (b.stride(1), b.stride(0)) if transposed else (b.stride(0), b.stride(1))
        ag_gemm.all_gather_gemm_kernel[(3,)](
            as_[rank], a_desc, g_desc, b_desc, b, outs[rank],
            gathered_outs[rank].data_ptr() if copy_out else 0, *workspace.data_addresses(0), 0,
            *workspace.flag_addresses(), workspace.state, workspace.abort,
            workspace.error_address(), 0, m_local, n, k, as_[rank].stride(0), stride_bk,
            stride_bn, outs[rank].stride(0), rank, half_rows, WORLD=world, BM=bm, BN=bn, BK=bk,
            GROUP_M=2, STAGES=2, USE_TMA=tma, B_TRANSPOSED=transposed, MULTIMEM=False,
            ALIGNED=False, COPY_ROWS=config.copy_rows, COPY_COLS=config.copy_cols,
            PIECES=pieces, COPY_OUT=copy_out, PHASES=phase)

    failures = [f"{name}{f}" for f in _launch_phases(workspaces, epoch, (1, 2), launch)]
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
        if workspaces[rank].tensor[:FLAG_BYTES + BARRIER_BYTES].any():
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
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk]) if tma else None
        b_desc = (TensorDescriptor.from_tensor(b, [bn, bk] if transposed else [bk, bn]) if tma else None)
        stride_bk, stride_bn = (b.stride(1), b.stride(0)) if transposed else (b.stride(0), b.stride(1))
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
        if workspaces[rank].tensor[:FLAG_BYTES + BARRIER_BYTES].any():
            failures.append(f"{name} rank {rank}: data landed in the flag or barrier area")
    if two_shot and not failures and not all(torch.equal(outs[0], o) for o in outs):
        failures.append(f"{name}: ranks differ (two-shot results must be bit-identical)")
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
    if which in ("all", "ar"):
        grid = itertools.product([(2, 5, 40, 48, False, True), (3, 33, 24, 40, True, True),
                                  (2, 20, 16, 24, False, False)], (False, True), (True, False))
        for index, ((world, m, n, k, transposed, tma), two_shot, push) in enumerate(grid):
            failures += run_gemm_all_reduce(world, m, n, k, transposed, tma, dtype, two_shot,
                                            push, (16, 16, 16), seed=index)
            cases += 1
    print(f"{cases} cases in {time.time() - start:.1f} s")
    print("\n".join(failures) if failures else "OK")


if __name__ == "__main__":
    main()
