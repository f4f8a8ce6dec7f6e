"""Run a function on W ranks of a real ``torch.distributed`` process group.

Tests (and anything else that wants real multi-process collectives without
torchrun) call ``run_on_ranks(fn, world_size)``: ``fn(rank, world_size, *args)``
runs once on each of W spawned processes that share an initialized default
process group (gloo on CPU, NCCL on CUDA with rank r on GPU r).

The processes are kept in a pool per (world size, backend) and reused across
calls, because starting W Python processes that import torch costs seconds
while a call costs milliseconds. A call that fails on any rank raises
``RankError`` with that rank's traceback; a call that does not finish in time
(a rank stuck in a collective that a failed peer never joined) kills the pool,
raises, and the next call starts a fresh one. Nothing is left hanging.

Fault tests, whose ranks raise, exit or hang on purpose, use ``run_fresh_ranks``: new processes
for one call (forks of a server that imported torch once), every rank's outcome returned.

Example::

    def body(rank, world_size, n):
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t[0].item()

    run_on_ranks(body, 4, args=(3,))   # -> [6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Sequence

from ..env import MULTICAST_OFF  # every rank gets it: multicast stays off on shared GPU hosts

__all__ = ["RankError", "RankOutcome", "process_policies", "run_fresh_ranks", "run_on_ranks", "run_torchrun",
           "shutdown_pools"]

_DUMP_STACKS = signal.SIGUSR1  # a rank that gets it prints every thread's stack


class RankError(RuntimeError):
    """A function failed (or timed out) on one or more ranks."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_policies() -> tuple:
    """The process-wide choices a task on a pooled rank may set, as (name, get, set): the
    dispatcher's GEMM deferral, the gather and layer-tail deferral policies, the planned and
    fused collectives' backend pins. A pooled rank puts back after every task what it had when
    it started, so that no task runs with a choice an earlier one left (2026-11-30: a decode
    test that ended on ``defer_tails("never")`` made a later compiled-decode test fail)."""
    from ..dtensor import DTensor
    from ..runtime import deferred, pins, tails

    def set_defer_gemm(value):
        DTensor.dispatcher.defer_gemm = value

    return (("defer_gemm", lambda: DTensor.dispatcher.defer_gemm, set_defer_gemm),
            ("defer_gathers", deferred.defer_gathers, deferred.defer_gathers),
            ("defer_tails", tails.defer_tails, tails.defer_tails),
            ("plan_backend", pins.plan_backend, pins.plan_backend),
            ("fused_backend", pins.fused_backend, pins.fused_backend))


def _worker(rank, world_size, backend, port, sys_path, tasks, results, collective_timeout_s):
    sys.path[:] = sys_path
    os.environ.update(MULTICAST_OFF)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    faulthandler.register(_DUMP_STACKS, all_threads=True)  # the pool asks a stuck rank where it is
    torch.set_num_threads(1)  # W ranks share a few cores
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s), **kwargs,
    )
    policies = process_policies()
    started = [get() for _, get, _ in policies]
    results.put((rank, "ready", None))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died: never linger as an orphan
                break
            continue
        if task is None:
            break
        call_id, module_name, qualname, args = task
        try:
            fn = importlib.import_module(module_name)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            out = fn(rank, world_size, *args)
            try:  # what the queue does in its feeder thread, where a failure is lost and the pool waits out its timeout
                ForkingPickler.dumps(out)
            except Exception as e:
                raise TypeError(f"{qualname} returned a value the test process cannot receive: {e}") from None
            results.put((rank, "ok", (call_id, out)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, "error", (call_id, traceback.format_exc())))
        finally:
            for (_, _, put_back), value in zip(policies, started):
                put_back(value)
    dist.destroy_process_group()


class _RankPool:
    def __init__(self, world_size: int, backend: str, start_timeout_s: float, collective_timeout_s: float):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.backend = backend
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, backend, port, list(sys.path), self.tasks[r], self.results, collective_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.next_call = 0
        ready = 0
        deadline = time.monotonic() + start_timeout_s
        try:
            while ready < world_size:
                rank, kind, _ = self._get(deadline, "start-up")
                ready += kind == "ready"
        except BaseException:
            self.close(graceful=False)  # no rank left running
            raise

    def _get(self, deadline: float, what: str):
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankError(f"{what} timed out on a {self.world_size}-rank {self.backend} pool")
            try:
                return self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    raise RankError(f"{what}: rank process(es) died (exit codes {codes})")

    def run(self, fn: Callable, args: Sequence[Any], timeout_s: float) -> list:
        module_name, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(f"run_on_ranks needs a module-level function, got {qualname}")
        call_id = self.next_call
        self.next_call += 1
        for q in self.tasks:
            q.put((call_id, module_name, qualname, tuple(args)))
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(outputs) + len(errors) < self.world_size:
            if errors:
                # Peers of a failed rank may wait forever in a collective it never joins.
                deadline = min(deadline, time.monotonic() + 10.0)
            try:
                rank, kind, (cid, payload) = self._get(deadline, f"{qualname} on {self.world_size} ranks")
            except RankError as e:
                self._dump_stacks(self._missing(outputs, errors))
                if errors:
                    raise RankError(_format_errors(qualname, errors, missing=self._missing(outputs, errors))) from None
                raise RankError(f"{e}; ranks still running: {self._missing(outputs, errors)}") from None
            if cid != call_id:
                continue  # a late answer from an earlier, abandoned call
            (outputs if kind == "ok" else errors)[rank] = payload
        if errors:
            raise RankError(_format_errors(qualname, errors, missing=[]))
        return [outputs[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Every thread's Python stack of each rank still running, on its stderr (a hang shows
        where it waits): asked before the pool kills them."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, _DUMP_STACKS)
        if ranks:
            time.sleep(1.0)

    def _missing(self, outputs, errors) -> list[int]:
        return [r for r in range(self.world_size) if r not in outputs and r not in errors]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _format_errors(qualname: str, errors: dict[int, str], missing: list[int]) -> str:
    first = min(errors)
    lines = [f"{qualname} failed on rank(s) {sorted(errors)}"]
    if missing:
        lines.append(f"rank(s) {missing} did not finish (killed)")
    lines.append(f"--- traceback from rank {first} ---\n{errors[first]}")
    return "\n".join(lines)


_POOLS: dict[tuple[int, str], _RankPool] = {}


def _started_pool(world_size: int, backend: str, collective_timeout_s: float) -> _RankPool:
    """A new pool. A start-up whose rank died gets two more tries, on a fresh port each: a port
    can be taken between picking and binding (other test processes pick ports too; rank 0's
    store then fails with "address already in use"), as ``run_torchrun`` retries."""
    for attempt in range(3):
        try:
            return _RankPool(world_size, backend, start_timeout_s=180.0, collective_timeout_s=collective_timeout_s)
        except RankError:
            if attempt == 2:
                raise


def run_on_ranks(
    fn: Callable,
    world_size: int,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
) -> list:
    """Run module-level ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    Raises ``RankError`` naming the failing ranks and carrying the first traceback.
    After any failure the pool is discarded, so a broken collective state never
    leaks into the next call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _started_pool(world_size, backend, timeout_s)
    try:
        return pool.run(fn, args, timeout_s)
    except BaseException:
        _POOLS.pop(key, None)
        pool.close(graceful=False)
        raise


def shutdown_pools() -> None:
    """Stop every pooled rank process (called at interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_pools)


# -- fresh ranks: one call, whatever happens on them -----------------------------------------------


@dataclass
class RankOutcome:
    """How one fresh rank ended. ``status``: ``"ok"`` (``value``), ``"raised"`` (``error``: the
    exception's type name, ``"RendezvousFailed"`` where the rank's process group did not start;
    ``message``: its text and traceback), ``"exited"`` (the process left
    without a report: ``exitcode``) or ``"killed"`` (still running when the call ended).
    ``seconds``: from the start of ``fn`` to its report."""

    rank: int
    status: str
    value: Any = None
    error: str | None = None
    message: str = ""
    seconds: float | None = None
    exitcode: int | None = None

    def __repr__(self) -> str:
        took = f" after {self.seconds:.1f} s" if self.seconds is not None else ""
        what = {"ok": f"returned {self.value!r}", "raised": f"raised {self.error}: {self.message.splitlines()[0][:200]}"
                if self.message else f"raised {self.error}", "exited": f"exited with code {self.exitcode}",
                "killed": "was killed, still running"}[self.status]
        return f"RankOutcome(rank {self.rank} {what}{took})"


_FRESH: list = []  # the forkserver context: torch and axedist imported once, each rank a fork of it


def _fresh_context():
    if not _FRESH:
        ctx = mp.get_context("forkserver")
        # torch._dynamo: the first decomposed op (addmm) imports it, 3 s on a small machine
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "axedist.dtensor", "axedist.nn",
                                    "axedist.testing.ranks"])
        _FRESH.append(ctx)
    return _FRESH[0]


def _fresh_worker(rank, world_size, port, module_name, qualname, args, env, collective_timeout_s, results):
    os.environ.update(MULTICAST_OFF)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), AXEDIST_COLLECTIVE_TIMEOUT_S=str(collective_timeout_s))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    parent = os.getppid()
    timeout = timedelta(seconds=collective_timeout_s)
    start = time.monotonic()
    try:
        # the store lives in the caller's process, as torchrun's agent hosts it: it outlives any rank
        # (its own timeout is generous: a rank that reports a failure must reach it on a loaded machine)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=max(collective_timeout_s, 30.0)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException as error:  # (gloo's rendezvous has the collective timeout: a loaded machine may miss it)
        _report(results, (rank, "raised", None, "RendezvousFailed", f"the rank's process group did not start: {error}"
                          f"\n{traceback.format_exc()}", time.monotonic() - start))
        os._exit(1)
    start = time.monotonic()
    try:
        fn = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        report = (rank, "ok", fn(rank, world_size, *args), None, "", time.monotonic() - start)
    except BaseException as error:  # report everything, including assertion failures
        report = (rank, "raised", None, type(error).__name__, f"{error}\n{traceback.format_exc()}",
                  time.monotonic() - start)
    _report(results, report)
    # A rank that raised stays alive, as a real one would (its peers must not learn of it from a
    # closed connection); every rank waits here for the caller to end it (no teardown: a process
    # group that lost a peer may hang in it).
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def _report(results, report) -> None:
    results.put(report)
    results.close()
    results.join_thread()


def run_fresh_ranks(fn: Callable, world_size: int, args: Sequence[Any] = (), *, collective_timeout_s: float = 3.0,
                    deadline_s: float = 60.0, wait_for: Sequence[int] | None = None,
                    env: dict | None = None) -> list[RankOutcome]:
    """Run module-level ``fn(rank, world_size, *args)`` once on ``world_size`` new gloo ranks and
    return every rank's ``RankOutcome``, whatever happened (a rank may raise, exit or hang).

    For fault tests: the ranks are forks of a server that imported torch once (a call costs
    well under a second plus ``fn``), their collectives and agreement checks time out after
    ``collective_timeout_s``, and the job's store lives here, so it outlives any rank. A rank
    that has reported (a result or an exception) stays alive, as a rank that caught an error
    would. The call ends when every rank of ``wait_for`` (default: all) has reported or exited;
    then every process still there is killed, as torchrun ends a failed job. None is left running.

        >>> outcomes = run_fresh_ranks(stall_rank_1_in_distribute, 2)
        >>> outcomes[0].status, outcomes[0].error, outcomes[1].status
        ('raised', 'PeerError', 'killed')
    """
    import torch.distributed as dist

    module_name, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"run_fresh_ranks needs a module-level function, got {qualname}")
    ctx = _fresh_context()
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=max(collective_timeout_s, 30.0)))
    results = ctx.Queue()
    env = dict(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
    procs = [ctx.Process(target=_fresh_worker, args=(r, world_size, server.port, module_name, qualname, tuple(args),
                                                     env, collective_timeout_s, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}  # from reports; a process that ended without one is "exited"
    awaited = set(range(world_size) if wait_for is None else wait_for)
    deadline = time.monotonic() + deadline_s
    gone_since: dict[int, float] = {}
    try:
        while not awaited <= set(outcomes) and time.monotonic() < deadline:
            try:
                rank, status, value, error, message, seconds = results.get(timeout=0.1)
                outcomes[rank] = RankOutcome(rank, status, value, error, message, seconds)
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in outcomes and p.exitcode is not None:
                    # a report may still be in the queue: give it a moment before calling the rank gone
                    if time.monotonic() - gone_since.setdefault(r, time.monotonic()) > 1.0:
                        outcomes[r] = RankOutcome(r, "exited", exitcode=p.exitcode)
    finally:
        for p in procs:
            if p.is_alive():  # done (it waits to be ended), or still running: killed as torchrun would
                p.kill()
        # (all killed first, then reaped: on a loaded machine a killed process may take seconds to go,
        # and its exit code is read only once it has)
        reap_by = time.monotonic() + 60.0
        for p in procs:
            p.join(timeout=max(0.0, reap_by - time.monotonic()))
        for r, p in enumerate(procs):
            if r not in outcomes:
                outcomes[r] = RankOutcome(r, "killed" if p.exitcode == -signal.SIGKILL else "exited",
                                          exitcode=p.exitcode)
            else:
                outcomes[r].exitcode = p.exitcode
        results.close()
        left = [r for r, p in enumerate(procs) if p.exitcode is None]
        if left:
            raise RankError(f"rank process(es) {left} could not be reaped")
    return [outcomes[r] for r in range(world_size)]


# what a failed torchrun run may say when the failure was not its script's (run_torchrun tries again)
_NOT_THE_SCRIPTS = ("address already in use", "terminate called without an active exception")


def run_torchrun(script_args: Sequence[str], nproc: int, cwd: str, timeout_s: float = 300,
                 env: dict | None = None) -> tuple[int, str, str]:
    """``torchrun --nproc-per-node nproc <script_args>`` on a free port: (returncode, stdout, stderr).

    The run has its own session, so a timeout kills torchrun and every rank it started (no
    orphans) and raises. Two failures that are not the script's get another try, on a fresh port,
    at most twice: a port taken between picking and binding (other test processes pick ports
    too), and torch's gloo backend aborting in a process's interpreter teardown after the script
    ended ("terminate called without an active exception": a plain torch DTensor script does it
    about 1 run in 10 on 2 cores; pytorch/pytorch#190489).
    """
    for attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), *script_args]
        proc = subprocess.Popen(cmd, cwd=cwd, env=dict(os.environ) if env is None else env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise RankError(f"{' '.join(script_args)} timed out after {timeout_s} s\n{stdout[-3000:]}{stderr[-3000:]}")
        said = (stdout + stderr).lower()
        if proc.returncode == 0 or attempt == 2 or not any(cause in said for cause in _NOT_THE_SCRIPTS):
            return proc.returncode, stdout, stderr
    raise AssertionError("unreachable")
