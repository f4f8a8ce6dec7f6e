"""Run the collective kernels' phases rank by rank under TRITON_INTERPRET=1 and compare every
output with a float64 reference; prints the failures, or OK. Used by tests/test_kernels_cpu.py.

CPU memory stands in for the ranks' symmetric workspaces, carved and addressed by the same code
as virtual ranks on one GPU (symmetric.carve_workspaces, p2p.static_arguments); the interpreter
dereferences the raw addresses.
The kernels take PHASES: launching phase 1 on every rank, then phase 2 on every rank (then
phase 4: the two-shot all-reduce's gather) replaces the in-kernel barrier, which needs inline
PTX the interpreter cannot run. Tiles are 1 x 64 and grids 2 programs, so 200-element chunks
exercise the grid-stride loops and the tails.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 tests/collectives_interpreter.py   # -> ... OK
"""
import itertools
import sys
import time

import torch

from axedist.collectives.p2p import call_geometry, static_arguments
from axedist.collectives.symmetric import BARRIER_BYTES, ENGINE_FLAG0, FLAG_BYTES, carve_workspaces
import triton_interpreter  # noqa: F401  (before the kernels: the interpreter's loop bounds)


def flags_touched(workspace):
    """Whether a tile flag or barrier word is not zero (the copy-engine flags, which start at
    -1, are checked apart: tests/fused_interpreter.py)."""
    words = workspace.tensor[:FLAG_BYTES + BARRIER_BYTES]
    return bool(words[:ENGINE_FLAG0 * 4].any() or words[FLAG_BYTES:].any())


from axedist.kernels import collective_kernels, layer_tail

ROWS, COLS = 1, 64
PHASES = {"reduce_scatter": (1, 2), "all_gather": (1, 2), "all_reduce_one_shot": (1, 2),
          "all_reduce_two_shot": (1, 2, 4)}


def fake_workspaces(world, data_bytes, dtype):
    """One workspace per rank over CPU memory, carved as for virtual ranks (the real region
    layout and address tables); data halves hold NaN."""
    workspaces = carve_workspaces(world, data_bytes, torch.device("cpu"))
    for workspace in workspaces:
        workspace.tensor[workspace.data_offset(0):].view(dtype).fill_(float("nan"))
    return workspaces


def run_case(op, world, count, dtype, variant, programs, seed):
    generator = torch.Generator().manual_seed(seed)
    numel = count * world if op == "reduce_scatter" else count
    xs = [torch.randn(numel, generator=generator).to(dtype) for _ in range(world)]
    geometry = call_geometry(op, (numel,), world)
    data_bytes = (geometry["elements"] * dtype.itemsize + 4095) // 4096 * 4096
    workspaces = fake_workspaces(world, data_bytes, dtype)
    half = seed % 2  # the call's epoch parity: both halves' addresses get exercised
    push, copy_in = variant == "push", variant == "pull"
    inputs = xs
    if variant == "zero_copy":
        if geometry["zero_copy_elements"] < 0:
            return None
        inputs = [w.local_data(half, dtype, numel) for w in workspaces]
        for staged, x in zip(inputs, xs):
            staged.copy_(x)
    out_numel = {"reduce_scatter": count, "all_gather": world * count}.get(op, numel)
    outs = [torch.full((out_numel,), float("nan"), dtype=dtype) for _ in range(world)]
    kernel = getattr(collective_kernels, f"{op}_kernel")
    epoch = 2 - half  # the call's epoch: the kernels read epoch - 1 from the rank's state
    failures = []
    name = f"{op} {variant} W={world} n={count} {dtype}"
    for phase in PHASES[op]:
        for rank in range(world):
            statics = static_arguments(op, workspaces[rank], geometry, rank, False)
            constexprs = dict(WORLD=world, ROWS=ROWS, COLS=COLS, PUSH=push, COPY_IN=copy_in,
                              PHASES=phase)
            if op != "all_gather":
                constexprs["MULTIMEM"] = False
            state = workspaces[rank].state
            state[0] = epoch - 1
            kernel[(programs,)](inputs[rank], outs[rank], state, 0, *statics, **constexprs)
            if state.tolist()[:3] != [epoch, 0, 0]:
                failures.append(f"{name} rank {rank}: call state {state.tolist()} after the "
                                f"launch, expected the epoch {epoch} and zeroed counters")
    stacked = torch.stack([x.double() for x in xs])
    for rank in range(world):
        if op == "reduce_scatter":
            ref = stacked.sum(0)[rank * count:(rank + 1) * count]
        elif op == "all_gather":
            ref = stacked.reshape(-1)
        else:
            ref = stacked.sum(0)
        out = outs[rank].double()
        if torch.isnan(out).any():
            failures.append(f"{name} rank {rank}: NaN left")
            continue
        tolerance = 0 if op == "all_gather" else (1e-2 if dtype == torch.bfloat16 else 1e-5)
        error = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        if error > tolerance:
            failures.append(f"{name} rank {rank}: error {error:.2e}")
        start = workspaces[rank].data_offset(1 - half)
        other = workspaces[rank].tensor[start:start + data_bytes]
        if not torch.isnan(other.view(dtype)).all():
            failures.append(f"{name} rank {rank}: wrote into the other data half")
        if flags_touched(workspaces[rank]):
            failures.append(f"{name} rank {rank}: data landed in the flag or barrier area")
    if op == "all_reduce_two_shot" and not failures:
        if not all(torch.equal(outs[0], o) for o in outs):
            failures.append(f"{name}: ranks differ")
    return failures


def run_tail_case(world, rows, hidden, dtype, variant, programs, seed, norm=True):
    """The fused layer tail (all-reduce + residual add + RMSNorm) against float64: h and y per
    rank, the same bits on every rank, nothing written outside the call's half."""
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, hidden, generator=generator).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    eps = 1e-5
    numel = rows * hidden
    geometry = call_geometry("all_reduce_one_shot", (rows, hidden), world)  # the layout TailPlan uses
    data_bytes = (geometry["elements"] * dtype.itemsize + 4095) // 4096 * 4096
    workspaces = fake_workspaces(world, data_bytes, dtype)
    half = seed % 2
    push = variant == "push"
    inputs = xs
    if variant == "zero_copy":
        inputs = [w.local_data(half, dtype, numel).view(rows, hidden) for w in workspaces]
        for staged, x in zip(inputs, xs):
            staged.copy_(x)
    hs = [torch.full((rows, hidden), float("nan"), dtype=dtype) for _ in range(world)]
    ys = [torch.full((rows, hidden), float("nan"), dtype=dtype) for _ in range(world)]
    epoch = 2 - half
    failures = []
    name = f"all_reduce_rms_norm {variant} W={world} rows={rows} hidden={hidden} {dtype}{'' if norm else ' no norm'}"
    block = max(16, 1 << (hidden - 1).bit_length())
    for phase in (1, 2):
        for rank in range(world):
            statics = static_arguments("all_reduce_one_shot", workspaces[rank], geometry, rank, False)
            state = workspaces[rank].state
            state[0] = epoch - 1
            layer_tail.all_reduce_rms_norm_kernel[(programs,)](
                inputs[rank], hs[rank], state, 0, *statics, residual, weight, ys[rank], rows, hidden, eps,
                WORLD=world, BLOCK_H=block, PUSH=push, COPY_IN=variant != "zero_copy", ALIGNED=False, PHASES=phase,
                NORM=norm)
            if state.tolist()[:3] != [epoch, 0, 0]:
                failures.append(f"{name} rank {rank}: call state {state.tolist()} after the launch")
    h_ref = residual.double() + torch.stack([x.double() for x in xs]).sum(0)
    h_rounded = h_ref.to(dtype).double()
    y_ref = h_rounded * torch.rsqrt(h_rounded.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for rank in range(world):
        if not norm and not torch.isnan(ys[rank]).all():
            failures.append(f"{name} rank {rank}: y written without the norm")
        for label, got, ref in (("h", hs[rank], h_ref), ("y", ys[rank], y_ref))[:1 + norm]:
            got = got.double()
            if torch.isnan(got).any():
                failures.append(f"{name} rank {rank}: NaN left in {label}")
                continue
            error = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if error > tolerance:
                failures.append(f"{name} rank {rank}: {label} error {error:.2e}")
        start = workspaces[rank].data_offset(1 - half)
        if not torch.isnan(workspaces[rank].tensor[start:start + data_bytes].view(dtype)).all():
            failures.append(f"{name} rank {rank}: wrote into the other data half")
        if flags_touched(workspaces[rank]):
            failures.append(f"{name} rank {rank}: data landed in the flag or barrier area")
    if not failures and not all(torch.equal(hs[0], h) and (not norm or torch.equal(ys[0], y)) for h, y in zip(hs, ys)):
        failures.append(f"{name}: ranks differ")
    return failures


def main():
    start = time.time()
    failures, cases = [], 0
    for index, (world, rows, hidden, variant) in enumerate(itertools.product(
            (2, 3, 4), (1, 5), (40, 64), ("push", "pull", "zero_copy"))):
        dtype = (torch.float32, torch.bfloat16)[index % 2]
        failures += run_tail_case(world, rows, hidden, dtype, variant, programs=2, seed=index, norm=index % 3 != 2)
        cases += 1
    grid = list(itertools.product(PHASES, (2, 4), (1, 37, 200), ("push", "pull", "zero_copy")))
    grid += itertools.product(PHASES, (3,), (37,), ("push", "pull", "zero_copy"))
    for index, (op, world, count, variant) in enumerate(grid):
        dtype = (torch.float32, torch.bfloat16)[index % 2]
        result = run_case(op, world, count, dtype, variant, programs=2, seed=index)
        if result is not None:
            cases += 1
            failures += result
    print(f"{cases} cases in {time.time() - start:.1f} s")
    print("\n".join(failures) if failures else "OK")


if __name__ == "__main__":
    main()
