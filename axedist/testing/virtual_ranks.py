"""W ranks of axedist's symmetric-memory kernels in ONE process on ONE GPU ("virtual ranks").

Each rank gets a workspace carved from one allocation of this GPU (symmetric.carve_workspaces:
the region layout and peer address tables of the real path), its own stream, and the real
call path: p2p.CallPlan for the collectives, fused.FusedCall for GEMM + reduce-scatter,
fused_tp.AllGatherGemmCall / GemmAllReduceCall for all-gather + GEMM and GEMM + all-reduce, with
their epochs, alternating halves, flags and timeouts. Every rank's grid fills at most a W-th of
the SMs, so all W ranks' programs are resident at once and in-kernel waits cannot deadlock.
The epoch and half live in each rank's call state on the device, so calls can be captured in
one CUDA graph (each rank's launches a branch of it) and replayed.

No module may load while a rank's kernel spins (a module load waits for the GPU to go idle):
every call compiles and loads the kernels of all ranks before it launches the first, and the
kernels take rank ids and epochs unspecialized. Set CUDA_DEVICE_MAX_CONNECTIONS to at least
W + 1 before CUDA starts, so that no rank's launch queues behind another rank's spinning kernel.

What this cannot show: NVLink bandwidth and latency, the ordering of stores and flags across
two GPUs' memory systems (every access here is local), and multicast.

    >>> ranks = VirtualRanks(4, data_bytes=64 << 20)
    >>> xs = [torch.randn(4096, device="cuda") for _ in range(4)]
    >>> outs = ranks.reduce_scatter(xs)            # rank r: sum of xs, elements r*1024 ...
    >>> ranks.check()                              # synchronizes; raises a rank's timeout
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing

import torch

from ..collectives.errors import CollectiveTimeoutError
from ..collectives.fused import FusedCall, GemmReduceScatterPlan
from ..collectives.fused_tp import AllGatherGemmCall, FusedPlan, GemmAllReduceCall
from ..collectives.p2p import CallPlan
from ..collectives.symmetric import carve_workspaces
from ..kernels.launch import multiprocessors


class VirtualRanks:
    """W virtual ranks on one GPU with `data_bytes` per workspace half (fixed: a call that
    needs more raises). absent=(r, ...) in a call leaves those ranks out of it (a rank that
    never arrives: the others time out and name it). W = 1 is one rank with the whole GPU
    (the fused kernels' GEMM part, for the one-GPU benchmarks). processors: the SMs each rank's
    grids may fill (default a W-th of the GPU; fewer leave SMs to work beside the kernels, such
    as copies the driver may run on SMs)."""

    def __init__(self, world: int, data_bytes: int = 16 << 20, device: torch.device | None = None,
                 processors: int | None = None):
        if not 1 <= world <= 8:
            raise ValueError(f"virtual ranks: world must be 1..8, got {world}")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self.world, self.device = world, device
        most = multiprocessors(device.index) // world
        if processors is not None and not 1 <= processors <= most:
            raise ValueError(f"virtual ranks: processors must be 1..{most}, got {processors}")
        self.processors = most if processors is None else processors
        self.workspaces = carve_workspaces(world, data_bytes, device, self.processors)
        self.streams = [torch.cuda.Stream(device) for _ in range(world)]
        self._plans: dict[tuple, list[CallPlan]] = {}
        self._fused: dict[tuple, list[FusedCall]] = {}
        self.last_plans: list = []  # each rank's CallPlan / FusedCall of the last call
        torch.cuda.synchronize(device)

    def __repr__(self) -> str:
        return (f"VirtualRanks(W={self.world}, {self.processors} SMs each, "
                f"{self.workspaces[0].data_bytes} bytes per half)")

    # -- collectives ----------------------------------------------------------------------
    def reduce_scatter(self, xs, outs=None, variant: str = "push", rounds: int | None = None,
                       absent=(), timeout_s: float | None = None) -> list:
        """outs[r] = (sum over ranks of xs)[r-th of W slices of dim 0]."""
        shape = (xs[0].shape[0] // self.world, *xs[0].shape[1:])
        return self._collective("reduce_scatter", xs, outs, shape, variant, rounds, absent,
                                timeout_s)

    def all_gather(self, xs, outs=None, variant: str = "push", rounds: int | None = None,
                   absent=(), timeout_s: float | None = None) -> list:
        """outs[r] = concatenation of xs along dim 0."""
        shape = (self.world * xs[0].shape[0], *xs[0].shape[1:])
        return self._collective("all_gather", xs, outs, shape, variant, rounds, absent,
                                timeout_s)

    def all_reduce(self, xs, outs=None, algorithm: str = "one_shot", variant: str = "push",
                   absent=(), timeout_s: float | None = None) -> list:
        """outs[r] = sum over ranks of xs (algorithm "one_shot" or "two_shot")."""
        if algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"algorithm must be one_shot or two_shot, got {algorithm!r}")
        return self._collective(f"all_reduce_{algorithm}", xs, outs, xs[0].shape, variant, None,
                                absent, timeout_s)

    def _collective(self, op, xs, outs, out_shape, variant, rounds, absent, timeout_s):
        if len(xs) != self.world:
            raise ValueError(f"{op}: {len(xs)} inputs for {self.world} ranks")
        x = xs[0]
        aligned = all(t.data_ptr() % 16 == 0 for t in xs) and (
            outs is None or all(o.data_ptr() % 16 == 0 for o in outs if o is not None))
        key = (op, tuple(x.shape), x.dtype, variant, rounds, aligned)
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = [
                CallPlan(op, x.shape, x.dtype, None, self.device.index, variant, False, aligned,
                         workspace=workspace, rounds=rounds) for workspace in self.workspaces]
        if outs is None:
            outs = [torch.empty(out_shape, dtype=x.dtype, device=x.device)
                    for _ in range(self.world)]
        present = [r for r in range(self.world) if r not in absent]
        for rank in present:  # every kernel loaded before the first rank can spin
            plans[rank].prepare(xs[rank])
        self.last_plans = plans
        self._launch(present, lambda rank: plans[rank].run(xs[rank], outs[rank], timeout_s))
        return outs

    def all_reduce_rms_norm(self, xs, residual, weight, eps: float, variant: str = "push", absent=(),
                            timeout_s: float | None = None) -> list:
        """[(h_r, y_r)]: h = residual + sum over ranks of xs, y = rms_norm(h) * weight, on every
        rank (the fused decode layer tail, collectives/layer_tail.py)."""
        from ..collectives.layer_tail import TailPlan
        if len(xs) != self.world:
            raise ValueError(f"all_reduce_rms_norm: {len(xs)} inputs for {self.world} ranks")
        rows, hidden = xs[0].shape
        aligned = hidden % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in (*xs, residual, weight))
        key = ("all_reduce_rms_norm", rows, hidden, xs[0].dtype, variant, aligned)
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = [TailPlan(rows, hidden, xs[0].dtype, None, self.device.index, variant,
                                                 aligned, workspace=workspace) for workspace in self.workspaces]
        outs = [(torch.empty_like(xs[0]), torch.empty_like(xs[0])) for _ in range(self.world)]
        present = [r for r in range(self.world) if r not in absent]
        for rank in present:  # every kernel loaded before the first rank can spin
            plans[rank].launch()
        self.last_plans = plans
        self._launch(present, lambda rank: plans[rank].run(xs[rank], residual, weight, *outs[rank], eps, timeout_s))
        return outs

    # -- fused GEMM + reduce-scatter --------------------------------------------------------
    def gemm_reduce_scatter(self, as_, bs, outs=None, config=None, absent=(),
                            timeout_s: float | None = None) -> list:
        """outs[r] = (sum over ranks of as_[p] @ bs[p])[rows of rank r], through the fused
        kernel (config: a gemm_rs.GemmConfig, default the tuned / heuristic one)."""
        a, b = self._pairs("gemm_reduce_scatter", as_, bs)
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        if m % self.world:
            raise ValueError(f"gemm_reduce_scatter: M = {m} is not divisible by {self.world}")
        key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, config)
        calls = self._fused.get(key)
        if calls is None:
            plan = GemmReduceScatterPlan("p2p", m, n, k, self.world, str(config or ""),
                                         "virtual ranks")
            calls = self._fused[key] = [
                FusedCall(plan, self.world, rank, self._workspace_for(rank), config)
                for rank in range(self.world)]
        if outs is None:
            outs = [torch.empty((m // self.world, n), dtype=a.dtype, device=a.device)
                    for _ in range(self.world)]
        return self._run_calls(calls, as_, bs, outs, absent, timeout_s)

    # -- fused all-gather + GEMM, GEMM + all-reduce -------------------------------------------
    def all_gather_gemm(self, as_, bs, outs=None, config=None, absent=(),
                        timeout_s: float | None = None, gathered=None) -> list:
        """outs[r] = concatenation of as_ along dim 0, times bs[r], through the fused kernel
        (config: a kernels.ag_gemm.AllGatherGemmConfig, default the heuristic one); gathered
        (a tensor per rank): receives the concatenation too."""
        a, b = self._pairs("all_gather_gemm", as_, bs)
        m_local, k, n = a.shape[0], a.shape[1], b.shape[1]
        key = ("all_gather_gemm", a.shape, a.stride(), b.shape, b.stride(), a.dtype, config)
        calls = self._fused.get(key)
        if calls is None:
            plan = FusedPlan("all_gather_gemm", "p2p", self.world * m_local, n, k, self.world,
                             str(config or ""), "virtual ranks")
            calls = self._fused[key] = [
                AllGatherGemmCall(plan, self.world, rank, self._workspace_for(rank), config)
                for rank in range(self.world)]
        if outs is None:
            outs = [torch.empty((self.world * m_local, n), dtype=a.dtype, device=a.device)
                    for _ in range(self.world)]
        extras = None if gathered is None else [{"gathered": g} for g in gathered]
        return self._run_calls(calls, as_, bs, outs, absent, timeout_s, extras)

    def gemm_all_reduce(self, as_, bs, outs=None, algorithm: str = "one_shot",
                        push: bool = True, config=None, absent=(),
                        timeout_s: float | None = None) -> list:
        """outs[r] = sum over ranks of as_[p] @ bs[p] on every rank, through the fused decode
        kernel (algorithm "one_shot" or "two_shot"; push or pull; config: a
        kernels.gemm_ar.DecodeConfig)."""
        if algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"algorithm must be one_shot or two_shot, got {algorithm!r}")
        a, b = self._pairs("gemm_all_reduce", as_, bs)
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        key = ("gemm_all_reduce", a.shape, a.stride(), b.shape, b.stride(), a.dtype, algorithm,
               push, config)
        calls = self._fused.get(key)
        if calls is None:
            plan = FusedPlan("gemm_all_reduce", "p2p", m, n, k, self.world, str(config or ""),
                             "virtual ranks", algorithm)
            calls = self._fused[key] = [
                GemmAllReduceCall(plan, self.world, rank, self._workspace_for(rank), push, config)
                for rank in range(self.world)]
        if outs is None:
            outs = [torch.empty((m, n), dtype=a.dtype, device=a.device)
                    for _ in range(self.world)]
        return self._run_calls(calls, as_, bs, outs, absent, timeout_s)

    def _pairs(self, op, as_, bs):
        if len(as_) != self.world or len(bs) != self.world:
            raise ValueError(f"{op}: {len(as_)} A and {len(bs)} B for {self.world} ranks")
        return as_[0], bs[0]

    def _run_calls(self, calls, as_, bs, outs, absent, timeout_s, extras=None) -> list:
        """Every present rank's call (extras[r]: its further keyword arguments)."""
        present = [r for r in range(self.world) if r not in absent]
        extras = extras or [{}] * self.world
        for rank in present:  # every kernel loaded before the first rank can spin
            calls[rank].prepare(as_[rank], bs[rank], outs[rank], timeout_s, **extras[rank])
        self.last_plans = calls
        self._launch(present, lambda rank: calls[rank].run(as_[rank], bs[rank], outs[rank],
                                                            timeout_s, **extras[rank]))
        return outs

    def _workspace_for(self, rank: int):
        workspace = self.workspaces[rank]

        def workspace_for(nbytes: int):
            if nbytes > workspace.data_bytes:
                raise ValueError(f"virtual rank {rank}: a call needs {nbytes} bytes per half, "
                                 f"the workspace has {workspace.data_bytes}")
            return workspace
        return workspace_for

    # -- launching and errors ---------------------------------------------------------------
    def _launch(self, ranks, launch_rank) -> None:
        """Every rank's launch on its own stream, after the work queued so far on the current
        stream (the inputs); the current stream then waits for all of them."""
        current = torch.cuda.current_stream(self.device)
        ready = current.record_event()
        for rank in ranks:
            stream = self.streams[rank]
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                launch_rank(rank)
        for rank in ranks:
            current.wait_stream(self.streams[rank])

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def errors(self) -> list[str]:
        """Each rank's timeout message ("" if none), after synchronizing. A rank whose kernel
        timed out retires its workspace: make a new VirtualRanks for further calls."""
        self.synchronize()
        messages = []
        for workspace in self.workspaces:
            try:
                workspace.check()
                messages.append("")
            except CollectiveTimeoutError as error:
                messages.append(str(error))
        return messages

    def check(self) -> None:
        """Synchronize and raise CollectiveTimeoutError if any rank's kernel timed out."""
        failed = [message for message in self.errors() if message]
        if failed:
            raise CollectiveTimeoutError("\n".join(failed))


def _compile_case(world: int, processors: int, capability: int, case: tuple) -> str:
    # a process of its own, no GPU needed: the plan over CPU memory computes the same kernel
    # parameters as on the GPU, and the compiled kernel lands in Triton's disk cache
    op, shape, dtype, variant, rounds, aligned = case
    numel = 1
    for size in shape:
        numel *= size
    workspace = carve_workspaces(world, 2 * world * (numel + 16 * world) * dtype.itemsize + 4096,
                                 torch.device("cpu"), processors)[0]
    plan = CallPlan(op, shape, dtype, None, 0, variant, False, aligned, workspace=workspace,
                    rounds=rounds)
    plan.compile(variant == "push", True, capability)
    return repr(plan)


def precompile_collectives(world: int, cases, processes: int = 8,
                           device: torch.device | None = None) -> list[str]:
    """Compile the collective kernels of `cases` for W virtual ranks on this GPU in parallel
    processes (into Triton's disk cache, so the calls themselves only load them). A case is
    (op, shape, dtype, variant, rounds or None, aligned), op a kernel op of p2p ("reduce_scatter",
    "all_gather", "all_reduce_one_shot", "all_reduce_two_shot").

    >>> precompile_collectives(4, [("reduce_scatter", (4096,), torch.bfloat16, "push", None, True)])
    ['CallPlan(reduce_scatter push, bf16 (4096,) W=4: 1 programs x 2048)']
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    major, minor = torch.cuda.get_device_capability(device)
    processors = multiprocessors(device.index) // world
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        futures = [pool.submit(_compile_case, world, processors, major * 10 + minor, tuple(case))
                   for case in cases]
        return [future.result() for future in futures]
