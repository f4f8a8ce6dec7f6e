"""Host side of the symmetric-memory collectives (p2p, or multimem where allowed).

One kernel launch per call and nothing else on the host's critical path: the kernel reads the
caller's input itself (collective_kernels.py), so there is no copy kernel, no allocation but the
output (none when `out` is given), no host synchronization. What does not change between calls
of the same op, shape, dtype and group -- compiled kernel, grid, workspace addresses, the
launch arguments of both workspace halves -- is a `CallPlan`, built on the first call.

Variants (`variant="auto"` picks by size from the measured table, backend.TUNED):
  push  each rank stores its data into the peers' workspaces, then combines locally;
  pull  each rank copies its data into its own workspace, then loads the peers' over NVLink.
        An input already in the workspace (`symmetric_input`) skips the copy (zero-copy).

    >>> out = reduce_scatter(x, group)      # x: [W * m, ...] bf16 on cuda -> [m, ...]
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from ..caches import memo
from ..env import read as read_environment
from .backend import TUNED
from .symmetric import MAX_BARRIER_PROGRAMS, get_workspace

COLS = 1024
NUM_WARPS = 8
VARIANTS = ("auto", "push", "pull")
# all_reduce "auto": one-shot up to this many input bytes, two-shot above (measured)
ONE_SHOT_ALL_REDUCE_MAX_BYTES: int = TUNED["one_shot_all_reduce_max_bytes"]
# kernel op -> [(max bytes of the call's input, variant), ...]: the faster variant per size
# (axedist/kernels/collectives_tuned.json); the last entry also covers everything larger.
MEASURED_VARIANT: dict[str, list[tuple[int, str]]] = TUNED["variant"]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _programs(work: int, block: int, processors: int) -> int:
    # at most one program per SM the rank may fill: always co-resident, so the block-wise
    # barrier cannot deadlock
    return max(1, min((work + block - 1) // block, processors, MAX_BARRIER_PROGRAMS))


def _rows(work: int) -> int:
    # small calls: 2048-element tiles spread the NVLink traffic over more SMs (lower latency);
    # large calls: 4096-element tiles (8192 measured slower at 64 and 256 MB: reduce-scatter
    # 682 vs 664 us and two-shot all-reduce 1270 vs 1240 us at 256 MB, W=4; 16384 slower still;
    # benchmarks/results/collectives_rows_w4.md).
    # AXEDIST_P2P_ROWS forces a tile height (for the benchmark's sweeps, not for production)
    forced = read_environment("AXEDIST_P2P_ROWS")
    if forced:
        return forced
    return 4 if work >= 8192 * 132 else 2


# reduce-scatter / all-gather: (bytes of per-rank work from which, ranges) the place and
# combine phases are pipelined over (kernels/collective_kernels.py, ROUNDS). Measured on 4x H200
# (benchmarks/results/collectives_rounds_w4.md, push, device time): 4 ranges cut 64 MB calls
# (16 MB per rank) from 186 / 192 us to 167 / 171 (reduce-scatter / all-gather; NCCL 193 / 192),
# 7 cut 256 MB calls from 697 / 725 to 623 / 632 (NCCL 674 / 663); at 16 MB ranges only cost.
PIPELINE: tuple[tuple[int, int], ...] = ((16 << 20, 4), (64 << 20, 8))


def rounds_for(op: str, work_bytes: int, programs: int) -> int:
    """Ranges the reduce-scatter / all-gather kernel pipelines its phases over (1 for the other
    ops and small calls). Each range has its own barrier slot per program, and the barrier area
    holds 2 * MAX_BARRIER_PROGRAMS slots. AXEDIST_P2P_ROUNDS forces it (benchmark sweeps).

    >>> rounds_for("all_reduce_one_shot", 1 << 30, 132)
    1
    """
    if op not in ("reduce_scatter", "all_gather"):
        return 1
    forced = read_environment("AXEDIST_P2P_ROUNDS")
    if forced:
        rounds = forced
    else:
        rounds = max((count for least, count in PIPELINE if work_bytes >= least), default=1)
    if rounds < 1:
        raise ValueError(f"AXEDIST_P2P_ROUNDS must be >= 1, got {rounds}")
    return max(1, min(rounds, 2 * MAX_BARRIER_PROGRAMS // max(1, programs)))


def _check_input(x: torch.Tensor, op: str) -> None:
    if not x.is_cuda:
        raise ValueError(f"{op}: tensor must be on a CUDA device, got {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{op}: dtype must be bf16, fp16 or fp32, got {x.dtype}")
    if x.numel() >= (1 << 31) // 2:
        raise ValueError(f"{op}: {x.numel()} elements exceed the kernels' int32 indexing")


def call_geometry(op: str, shape, world: int) -> dict:
    """Sizes of one call: per-rank work, chunk, 16-aligned stride, workspace elements (the
    larger of the push and pull layouts, so that the variant never changes the allocation).
    Raises for a reduce-scatter whose dim 0 the ranks cannot split evenly."""
    if op == "reduce_scatter" and (len(shape) == 0 or shape[0] % world != 0):
        raise ValueError(f"reduce_scatter: dim 0 of shape {tuple(shape)} is not divisible "
                         f"by the group size {world}")
    numel = 1
    for size in shape:
        numel *= size
    if op == "reduce_scatter":
        chunk = numel // world
        stride = _round_up(chunk, 16)
        return dict(numel=numel, chunk=chunk, stride=stride, work=chunk, elements=world * stride,
                    zero_copy_elements=numel if stride == chunk else -1)
    if op == "all_gather":
        stride = _round_up(numel, 16)
        return dict(numel=numel, chunk=numel, stride=stride, work=numel,
                    elements=world * stride, zero_copy_elements=numel)
    if op == "all_reduce_one_shot":
        stride = _round_up(numel, 16)
        return dict(numel=numel, chunk=numel, stride=stride, work=numel,
                    elements=world * stride, zero_copy_elements=numel)
    stride = _round_up((numel + world - 1) // world, 16)
    return dict(numel=numel, chunk=numel, stride=stride, work=stride, elements=2 * world * stride,
                zero_copy_elements=numel)


def _kernel(op: str):
    from ..kernels import collective_kernels
    return getattr(collective_kernels, f"{op}_kernel")


TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def kernel_signature(op: str, dtype: torch.dtype) -> dict:
    """Triton types of the runtime arguments of `op`'s kernel, in order."""
    element = TRITON_DTYPE[dtype]
    signature = dict(x_ptr=f"*{element}", out_ptr=f"*{element}", state_ptr="*i32",
                     timeout_ns="i64")
    for name in [f"D{i}" for i in range(8)] + ["multicast_base"] + [f"F{i}" for i in range(8)]:
        signature[name] = "i64"
    signature.update({_size_name(op): "i32", "chunk_stride": "i32", "rank": "i32",
                      "abort_ptr": "*i32", "error_address": "i64", "half_bytes": "i64",
                      "barrier_bytes": "i64"})
    if op == "all_gather":  # a gather has nothing to reduce: no multicast address
        del signature["multicast_base"]
    return signature


def kernel_constexprs(op: str, world: int, rows: int, push: bool, copy_in: bool,
                      multimem: bool, rounds: int = 1) -> dict:
    """Compile-time arguments of `op`'s kernel, in the kernel's order (every phase runs;
    reduce-scatter and all-gather pipelined over `rounds` ranges)."""
    values = dict(WORLD=world, ROWS=rows, COLS=COLS, MULTIMEM=multimem, PUSH=push,
                  COPY_IN=copy_in, PHASES=7 if op == "all_reduce_two_shot" else 3, ROUNDS=rounds)
    return {name: values[name] for name in _kernel(op).arg_names if name in values}


def divisible_arguments(op: str, chunk: int, aligned: bool) -> list[str]:
    """Arguments Triton may assume divisible by 16 (16-byte aligned pointers, sizes): what makes
    the loads and stores 16-byte vectors. The host compiles separate kernels otherwise."""
    names = ["state_ptr", "abort_ptr", "chunk_stride"] + (["x_ptr", "out_ptr"] if aligned else [])
    return names + ([_size_name(op)] if chunk % 16 == 0 else [])


def compile_collective(op: str, dtype: torch.dtype, world: int, rows: int, push: bool,
                       copy_in: bool, multimem: bool, chunk: int, aligned: bool,
                       capability: int = 90, rounds: int = 1):
    """`op`'s kernel compiled for one call shape class (Triton caches it on disk): what the GPU
    launches, what the CPU tests inspect and what launch/precompile_collectives.py warms.

    >>> compile_collective("reduce_scatter", torch.bfloat16, 4, 8, True, True, False,
    ...                    1 << 20, True).asm["ptx"].count("st.relaxed.sys")   # 3 peers: 3
    """
    from ..kernels.compile_check import compile_for_target
    constexprs = kernel_constexprs(op, world, rows, push, copy_in, multimem, rounds)
    return compile_for_target(_kernel(op), kernel_signature(op, dtype), constexprs,
                              divisible_arguments(op, chunk, aligned), capability=capability,
                              num_warps=NUM_WARPS)


def static_arguments(op: str, workspace, geometry: dict, rank: int, multimem: bool) -> tuple:
    """The kernel arguments after (x_ptr, out_ptr, state_ptr, timeout_ns): data half 0 and
    barrier region 0 (the kernel moves to those of its epoch's parity), sizes, rank, error
    words, and the two parity strides."""
    values = list(workspace.data_addresses(0))
    if op != "all_gather":
        values.append(workspace.multicast_address(0) if multimem else 0)
    values += workspace.barrier_addresses(0)
    values += [geometry["chunk"], geometry["stride"], rank, workspace.abort.data_ptr(),
               workspace.error_address(), *workspace.parity_strides()]
    return tuple(values)


def _size_name(op: str) -> str:
    return "chunk_numel" if op in ("reduce_scatter", "all_gather") else "numel"


class CallPlan:
    """What one collective call needs that does not change between calls.

    >>> plan = CallPlan("reduce_scatter", (4096,), torch.bfloat16, None, 0, "push", False)
    >>> plan          # CallPlan(reduce_scatter push, bf16 (4096,) W=4: 2 programs x 2048)
    """

    def __init__(self, op: str, shape, dtype: torch.dtype, group, device_index: int,
                 variant: str, multimem: bool, aligned: bool = True, workspace=None,
                 rounds: int | None = None):
        """workspace: the rank's workspace to run on (default: the group's, get_workspace;
        virtual ranks pass their own); rounds: force the pipelined ranges (default
        rounds_for)."""
        self.op, self.shape, self.dtype, self.group = op, tuple(shape), dtype, group
        self.device_index, self.multimem, self.aligned = device_index, multimem, aligned
        if workspace is None:
            geometry = call_geometry(op, shape, dist.get_world_size(group))
            workspace = get_workspace(group, geometry["elements"] * dtype.itemsize,
                                      torch.device("cuda", device_index))
        self.workspace = workspace
        self.world, self.rank = workspace.world_size, workspace.rank
        self.geometry = call_geometry(op, shape, self.world)
        if self.geometry["elements"] * dtype.itemsize > workspace.data_bytes:
            raise ValueError(f"{op}: {self.geometry['elements']} elements of {dtype} do not fit "
                             f"the workspace half of {workspace.data_bytes} bytes")
        self.variant = "pull" if multimem else variant
        if multimem and not self.workspace.multicast_base:
            raise ValueError(f"{op}: multimem needs a multicast mapping, and the symmetric "
                             f"workspace has none")
        self.rows = _rows(self.geometry["work"])
        self.programs = _programs(self.geometry["work"], self.rows * COLS, workspace.processors)
        if rounds is None or op not in ("reduce_scatter", "all_gather"):
            rounds = rounds_for(op, self.geometry["work"] * dtype.itemsize, self.programs)
        self.rounds = rounds
        if self.rounds * self.programs > 2 * MAX_BARRIER_PROGRAMS:
            raise ValueError(f"{op}: {self.rounds} rounds x {self.programs} programs exceed "
                             f"the barrier area's {2 * MAX_BARRIER_PROGRAMS} slots")
        self.halves = [self.workspace.tensor.data_ptr() + self.workspace.data_offset(half)
                       for half in (0, 1)]
        self._launches: dict[tuple[bool, bool], tuple] = {}
        self.state_address = self.workspace.state_address()

    def __repr__(self) -> str:
        return (f"CallPlan({self.op} {self.variant}{' multimem' if self.multimem else ''}, "
                f"{TRITON_DTYPE[self.dtype]} {self.shape} W={self.world}: "
                f"{self.programs} programs x {self.rows * COLS}"
                f"{f', {self.rounds} rounds' if self.rounds > 1 else ''})")

    # -- kernels ---------------------------------------------------------------------------
    def compile(self, push: bool, copy_in: bool, capability: int = 90):
        """This call's kernel for one variant, compiled for CUDA `capability` (Triton caches
        it on disk: a process without a GPU can compile it ahead of the launch)."""
        return compile_collective(self.op, self.dtype, self.world, self.rows, push, copy_in,
                                  self.multimem, self.geometry["chunk"], self.aligned,
                                  capability, self.rounds)

    def _launch(self, push: bool, copy_in: bool):
        """(CompiledLaunch, static arguments) for this variant."""
        entry = self._launches.get((push, copy_in))
        if entry is not None:
            return entry
        from ..kernels.launch import CompiledLaunch
        geometry = self.geometry
        major, minor = torch.cuda.get_device_capability(self.device_index)
        compiled = self.compile(push, copy_in, major * 10 + minor)
        constexprs = kernel_constexprs(self.op, self.world, self.rows, push, copy_in,
                                       self.multimem, self.rounds)
        launch = CompiledLaunch(compiled, tuple(constexprs.values()))
        entry = (launch, static_arguments(self.op, self.workspace, geometry, self.rank,
                                          self.multimem))
        self._launches[(push, copy_in)] = entry
        return entry

    def variant_for(self, x: torch.Tensor) -> tuple[bool, bool, torch.Tensor]:
        """(push, copy_in, input) of a call on x in the coming call's half: an input the caller
        wrote into that half (symmetric_input) is pulled in place; any other view of the half
        is copied out first, since the kernel would overwrite its own input."""
        push, copy_in = self.variant == "push", True
        x_address = x.data_ptr()
        if not self.halves[0] <= x_address < self.halves[1] + self.workspace.data_bytes:
            return push, copy_in, x
        if torch.cuda.is_current_stream_capturing():
            return push, copy_in, x.clone()  # the half of each replay is not known here
        start = self.halves[self.workspace.next_half()]
        if start <= x_address < start + self.workspace.data_bytes:
            if x_address == start and self.geometry["zero_copy_elements"] >= 0:
                # pushing would let the peers overwrite it while it is being read
                return False, False, x
            return push, copy_in, x.clone()
        return push, copy_in, x

    def prepare(self, x: torch.Tensor) -> None:
        """Compile and load the kernel a call on x will launch, without launching it (virtual
        ranks: no module may load while another rank's kernel spins)."""
        push, copy_in, _ = self.variant_for(x)
        self._launch(push, copy_in)

    # -- per call --------------------------------------------------------------------------
    def run(self, x: torch.Tensor, out: torch.Tensor, timeout_s: float | None) -> None:
        workspace = self.workspace
        push, copy_in, x = self.variant_for(x)  # a clone stays alive until the launch is queued
        if self.geometry["work"] == 0:
            return
        workspace.begin_call(self.op, timeout_s)
        launch, static = self._launch(push, copy_in)
        timeout = workspace.timeout_s
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        launch(self.programs, stream, (x.data_ptr(), out.data_ptr(), self.state_address,
                                       int(timeout * 1e9), *static))


_plans: dict[tuple, CallPlan] = memo("collectives.p2p plans")


def cached_plans() -> dict[tuple, CallPlan]:
    """The live cache of call plans, one per (op, shape, dtype, group, ...): tests read which
    plans ran (e.g. their rounds) and clear it to force fresh ones."""
    return _plans


def choose_variant(op: str, nbytes: int, variant: str) -> str:
    if variant != "auto":
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        return variant
    for limit, choice in MEASURED_VARIANT[op]:
        if nbytes <= limit:
            return choice
    return MEASURED_VARIANT[op][-1][1]


def _plan(op: str, x: torch.Tensor, group, variant: str, multimem: bool,
          out: torch.Tensor | None) -> CallPlan:
    aligned = x.data_ptr() % 16 == 0 and (out is None or out.data_ptr() % 16 == 0)
    key = (op, group, x.shape, x.dtype, x.get_device(), variant, multimem, aligned)
    plan = _plans.get(key)
    if plan is not None and not plan.workspace.retired:
        return plan
    _check_input(x, op.replace("_one_shot", "").replace("_two_shot", ""))
    if x.get_device() != torch.cuda.current_device():
        raise ValueError(f"{op}: tensor is on cuda:{x.get_device()} but the current device is "
                         f"cuda:{torch.cuda.current_device()} (torch.cuda.set_device first)")
    chosen = choose_variant(op, x.numel() * x.element_size(), variant)
    plan = CallPlan(op, x.shape, x.dtype, group, x.get_device(), chosen, multimem, aligned)
    _plans[key] = plan
    return plan


def _check_out(out: torch.Tensor, shape, x: torch.Tensor, op: str) -> None:
    if out.shape != shape or out.dtype != x.dtype or out.device != x.device \
            or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous {x.dtype} tensor of shape "
                         f"{tuple(shape)} on {x.device}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")


def symmetric_input(shape, dtype: torch.dtype, group=None, op: str = "reduce_scatter"):
    """A tensor in this rank's workspace half that the NEXT `op` call on `group` reads in place
    (no copy, pull variant). Write it on the current stream after the previous call on the
    group was issued. Every rank of that call must pass such a tensor (or none does): the
    ranks' variants must agree. Returns None when the op's workspace layout differs from the
    tensor's (reduce-scatter chunks whose size is not a multiple of 16 elements).
    op: "reduce_scatter", "all_gather" or "all_reduce" (one-shot or two-shot: same layout).
    """
    world = dist.get_world_size(group)
    ops = ("all_reduce_one_shot", "all_reduce_two_shot") if op == "all_reduce" else (op,)
    geometries = [call_geometry(name, shape, world) for name in ops]
    geometry = geometries[-1]
    if geometry["zero_copy_elements"] < 0:
        return None
    # as large as the call's own plan will ask for, so that the call finds this same workspace
    elements = max(g["elements"] for g in geometries)
    workspace = get_workspace(group, elements * dtype.itemsize)
    half = workspace.next_half()
    count = geometry["numel"]
    return workspace.local_data(half, dtype, count).view(shape)


def reduce_scatter(x: torch.Tensor, group=None, out: torch.Tensor | None = None,
                   multimem: bool = False, timeout_s: float | None = None,
                   variant: str = "auto") -> torch.Tensor:
    """Sum x over the group's ranks and keep this rank's slice of dim 0.

    >>> x = torch.randn(8, 5, device="cuda", dtype=torch.bfloat16)   # W = 4
    >>> reduce_scatter(x, group).shape                              # torch.Size([2, 5])
    """
    if not x.is_contiguous():
        x = x.contiguous()
    plan = _plan("reduce_scatter", x, group, variant, multimem, out)
    shape = (x.shape[0] // plan.world, *x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, shape, x, "reduce_scatter")
    plan.run(x, out, timeout_s)
    return out


def all_gather(x: torch.Tensor, group=None, out: torch.Tensor | None = None,
               timeout_s: float | None = None, variant: str = "auto") -> torch.Tensor:
    """Concatenate every rank's x along dim 0 (rank order).

    >>> all_gather(torch.ones(2, 3, device="cuda"), group).shape   # W = 4: torch.Size([8, 3])
    """
    if not x.is_contiguous():
        x = x.contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    plan = _plan("all_gather", x, group, variant, False, out)
    shape = (plan.world * x.shape[0], *x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, shape, x, "all_gather")
    plan.run(x, out, timeout_s)
    return out


def all_reduce(x: torch.Tensor, group=None, out: torch.Tensor | None = None,
               algorithm: str = "auto", multimem: bool = False,
               timeout_s: float | None = None, variant: str = "auto") -> torch.Tensor:
    """Sum x over the group's ranks (out of place). algorithm: "one_shot" (every rank combines
    everything: lowest latency), "two_shot" (reduce-scatter + all-gather: least traffic) or
    "auto" (one-shot up to ONE_SHOT_ALL_REDUCE_MAX_BYTES).

    >>> all_reduce(torch.full((3,), 2.0, device="cuda"), group)   # W = 4: tensor([8., 8., 8.])
    """
    if algorithm not in ("auto", "one_shot", "two_shot"):
        raise ValueError(f"algorithm must be auto, one_shot or two_shot, got {algorithm!r}")
    if not x.is_contiguous():
        x = x.contiguous()
    if algorithm == "auto":
        nbytes = x.numel() * x.element_size()
        algorithm = "one_shot" if nbytes <= ONE_SHOT_ALL_REDUCE_MAX_BYTES else "two_shot"
    plan = _plan(f"all_reduce_{algorithm}", x, group, variant, multimem, out)
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_out(out, x.shape, x, "all_reduce")
    plan.run(x, out, timeout_s)
    return out
