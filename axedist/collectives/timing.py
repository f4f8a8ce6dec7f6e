"""Timing of GPU operations for the benchmarks (collectives over ranks; one GPU: device_time).

Each sample is one call between two CUDA events on the current stream; the result is the median
over samples on each rank, then the maximum over ranks (a collective is as slow as its slowest
rank). Warm-up calls come first so that compilation and handle creation stay out.

Two modes:
  eager   calls issued back to back as an application would: when the CPU side of a call is
          slower than its GPU side, the GPU waits for the launch and the interval includes the
          host time (what an eager program sees for small calls);
  queued  the stream first runs a sleep kernel long enough for the host to enqueue every call,
          so the GPU runs them back to back: the interval is the device time of one call
          (kernel, and any launch gaps between its kernels), without host overhead.
And held_time: each candidate back to back for over a second first, so that it is timed at the
power cap a training step runs at (queued and eager samples start from a GPU that idled, at a
higher clock).

    >>> time_collective(lambda: dist.reduce_scatter_tensor(out, x), reps=30)               # ms
    >>> time_collective(lambda: dist.reduce_scatter_tensor(out, x), reps=30, queued=True)  # ms
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

# a generous upper bound of the host time per call while enqueueing (ms), and SM cycles per ms
# (H200 runs <= 1.98 GHz: a slower clock only sleeps longer)
_HOST_MS_PER_CALL = 0.5
_CYCLES_PER_MS = 2_000_000


def time_collective(fn, reps: int = 30, warmup: int = 5, group=None,
                    queued: bool = False) -> float:
    """Median over `reps` calls of fn's time in ms (eager or queued, see above), max over the
    group's ranks."""
    return time_interleaved({"call": fn}, reps, warmup, group, queued)["call"]


def time_interleaved(fns: dict, reps: int = 30, warmup: int = 3, group=None,
                     queued: bool = False, block: int = 1, align: bool = False) -> dict:
    """Like time_collective for several candidates at once, interleaved: each repetition runs
    every candidate once, in order, so that all of them see the same clocks, temperature and
    neighbours (back-to-back runs of one candidate after another drift by several percent on a
    GPU that heats up, and an H200 at its power cap moves its SM clock between 1.1 and 1.6 GHz
    within a few calls: a kernel that couples two GPUs runs at the slower one's pace). Returns
    {name: median ms, max over the group's ranks}. ``block`` > 1: each repetition runs each
    candidate ``block`` times back to back and times the last (an eager call after a call of
    its own kind, not after whatever host work the previous candidate left). ``align``: before
    each timed call, an untimed all-reduce of one float over the group puts the ranks' GPUs in
    step, so that a candidate coupling the ranks does not absorb the skew that rank-local
    candidates before it left (GPUs at different clocks: on 2x H200 a /ce call after two local
    GEMMs read 1.631 ms, 1.487 after another coupled call, results/probe_gemm_rs_ce.md).

    >>> time_interleaved({"nccl": lambda: dist.reduce_scatter_tensor(out, x),
    ...                   "p2p": lambda: p2p.reduce_scatter(x, out=out)}, queued=True)
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(reps)] for name in names}
    step = torch.zeros(1, device="cuda") if align else None
    if queued:
        torch.cuda._sleep(int((2 + reps * len(names) * (block + align) * _HOST_MS_PER_CALL)
                              * _CYCLES_PER_MS))
    for rep in range(reps):
        for name in names:
            for _ in range(block - 1):
                fns[name]()
            if align:
                dist.all_reduce(step, group=group)
            start, end = events[name][rep]
            start.record()
            fns[name]()
            end.record()
    torch.cuda.synchronize()
    medians = [statistics.median(start.elapsed_time(end) for start, end in events[name])
               for name in names]
    values = torch.tensor(medians, dtype=torch.float64, device="cuda")
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, values.tolist()))


def device_time(fns: dict, calls: int = 20, batches: int = 7, warmup: int = 2) -> dict:
    """Device time of one call of each candidate on this GPU, in ms: `batches` batches of
    `calls` calls queued back to back behind a sleep kernel (so the host's launch time stays
    out), one batch of every candidate after another (interleaved: they share clocks and
    temperature); the median over batches of batch time / calls. No process group needed.

    >>> device_time({"cublas": lambda: torch.mm(a, b, out=c), "core": lambda: gemm(a, b, c)})
    {'cublas': 0.304, 'core': 0.297}
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    torch.cuda.synchronize()
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(batches)] for name in names}
    for batch in range(batches):
        for name in names:
            start, end = events[name][batch]
            torch.cuda._sleep(int((0.2 + calls * _HOST_MS_PER_CALL) * _CYCLES_PER_MS))
            start.record()
            for _ in range(calls):
                fns[name]()
            end.record()
    torch.cuda.synchronize()
    return {name: statistics.median(start.elapsed_time(end) / calls for start, end in events[name])
            for name in names}


def host_time_us(fn, calls: int = 200, repeats: int = 5) -> float:
    """CPU time of one launch of fn in microseconds (median over `repeats` runs of `calls`
    calls issued while the GPU is held busy by a sleep kernel, so no call waits for it)."""
    import time

    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(calls * 0.1 * _CYCLES_PER_MS))
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def kernel_time_ms(fn, calls: int = 10) -> float:
    """The GPU kernels' time of one call of fn in ms, as the profiler counts it (the sum of every
    kernel's device time over `calls` calls, after one call outside the profile): time spent in
    kernels only, no launch gaps, unlike device_time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()
               if event.self_device_time_total > 0) / calls / 1e3


def profiled_counts(fn, calls: int = 1, gpu: bool = True) -> dict:
    """What one call of fn did, by name and count per call, from the profiler over `calls` calls
    after one outside the profile: gpu=True the GPU's kernels and copies (whether a copy ran on a
    copy engine or as a kernel), False the host's CUDA runtime and driver calls (a hidden
    synchronisation or allocation; the profile's own synchronisation left out). Names are cut
    to 60 characters."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    counts: dict = {}
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if on_gpu == gpu and (gpu or event.name.startswith("cu")) and event.name != "cudaDeviceSynchronize":
            counts[event.name[:60]] = counts.get(event.name[:60], 0) + 1
    return {name: round(count / calls, 2) for name, count in sorted(counts.items())}


class GpuSampler:
    """This GPU's SM clock (MHz) and board power (W), read through NVML every 5 ms on a thread
    between start() and stop(); stop() gives their means (None without NVML, which it says once).
    Read only: nothing is set on the device."""

    def __init__(self):
        self.read, self.samples, self.thread, self.running = None, [], None, False
        try:
            import pynvml
            pynvml.nvmlInit()
            # NVML counts every GPU of the machine, CUDA only the visible ones: torch maps the index
            handle = pynvml.nvmlDeviceGetHandleByIndex(
                torch.cuda._get_nvml_device_index(torch.cuda.current_device()))
            self.read = lambda: (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                                 pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
        except Exception as error:  # no NVML (or no GPU it knows): time without the readings
            print(f"GpuSampler: NVML unavailable ({type(error).__name__}); clock and power not read",
                  flush=True)

    def start(self) -> None:
        import threading

        self.samples = []
        if self.read is not None:
            self.running = True
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()

    def _loop(self) -> None:
        import time

        while self.running:
            self.samples.append(self.read())
            time.sleep(0.005)

    def stop(self) -> dict:
        if self.thread is None:
            return {"mhz": None, "watts": None}
        self.running = False
        self.thread.join()
        self.thread = None
        return {"mhz": statistics.mean(s[0] for s in self.samples),
                "watts": statistics.mean(s[1] for s in self.samples)}


def held_time(fns: dict, window_s: float = 0.5, warm_s: float = 1.0, rounds: int = 3, group=None,
              sampler: GpuSampler | None = None) -> dict:
    """Time of one call of each candidate HELD back to back, as a training step runs its GEMMs:
    per round and candidate, about warm_s seconds of calls untimed (the GPU reaches its power
    cap: an H200 there holds 690 W at ~1,440 MHz, results/probe_gemm_power.md), then window_s
    seconds of calls between two CUDA events; candidates interleaved round by round. device_time
    and queued time_interleaved start every batch from an idle GPU, at a higher clock: 2-20 %
    faster than held on one H200, by how much differing per kernel. Call counts come from one
    queued estimate, max over the group's ranks, so every rank issues the same calls; the ranks
    meet at a barrier before each window. Returns {name: {"ms": median over rounds of the max
    over ranks, "rounds": [ms per round], "mhz", "watts": this rank's means over the windows
    (sampler given; else None)}}.

    >>> held_time({"cublas": lambda: torch.mm(a, b, out=c), "fused": lambda: call(a, b)})
    """
    names = list(fns)
    estimate = time_interleaved(fns, reps=3, group=group, queued=True)
    counts = {name: (max(2, int(warm_s * 1e3 / estimate[name])), max(5, int(window_s * 1e3 / estimate[name])))
              for name in names}
    per_round = {name: [] for name in names}
    readings = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            warm, calls = counts[name]
            for _ in range(warm):
                fns[name]()
            torch.cuda.synchronize()
            dist.barrier(group=group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sampler is not None:
                sampler.start()
            start.record()
            for _ in range(calls):
                fns[name]()
            end.record()
            end.synchronize()
            if sampler is not None:
                readings[name].append(sampler.stop())
            per_round[name].append(start.elapsed_time(end) / calls)
    values = torch.tensor([per_round[name] for name in names], dtype=torch.float64, device="cuda")
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)

    def mean_of(name, key):
        taken = [r[key] for r in readings[name] if r[key] is not None]
        return statistics.mean(taken) if taken else None

    return {name: {"ms": statistics.median(row), "rounds": row, "mhz": mean_of(name, "mhz"),
                   "watts": mean_of(name, "watts")}
            for name, row in zip(names, values.tolist())}
