"""CPU cost of one op call on DTensors: axedist (cached rules/plans) vs PyTorch DTensor.

    torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py                # gloo, 4 CPU ranks
    torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --no-fastpath  # axedist's __torch_dispatch__ route only
    torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --breakdown    # + where a cached add's time goes
    torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --profile      # + cProfile of axedist's calls
    torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py --clock wall   # wall-clock time instead of CPU time
    torchrun --nproc-per-node 2 benchmarks/bench_dispatch.py --decode       # + a Llama block's decode step

Same ops, same placements, same (small) tensors on both sides, so the time is framework
overhead: per op, the median over ``--repeats`` batches of ``--calls`` calls (after a warm-up
that fills every cache) of the time per call, batches of the three sides interleaved and
ranks timed in turn (the others wait in a barrier); the same op on the plain local tensors is timed
too and subtracted, giving each framework's *overhead* per call. Time is the timing thread's
CPU time by default (``time.thread_time_ns``): on a shared machine, wall-clock batches also
count the time the thread waits for a core (``--clock wall`` measures that way). Rank 0 prints a table with
the ratio (axedist overhead / DTensor overhead; the goal is <= 0.5), from the medians and
from each side's fastest batch (less sensitive to a loaded machine). No op here communicates
(every placement is kept), so ranks never wait on each other inside a timed loop.

Two tables: inputs that do not require grad (the fast path of ``ops/fastpath.py`` serves
them), and inputs that require grad with grad mode on (autograd records every call on all
three sides, the plain one included; a cached axedist call computes its output on the
fast path and lets autograd record it through torch's dispatcher); each has its own
geomean and says whether it meets the goal. A getter (``x.shape``) is timed too: with the
fast path on, every attribute read of a DTensor passes its ``__torch_function__``.

Ops: ``x + y`` (Shard(0) + Shard(0)), ``x * 2.0``, ``a @ b`` giving a pending sum (Shard(1) @
Shard(0) -> Partial; the local product is read with ``to_local()`` on both sides, since axedist
defers it), ``x.view(...)`` merging the two leading dims of a dim-0-sharded tensor,
``x.sum(1)`` (over an unsharded dim), and ``F.linear`` column-parallel (input Replicate, weight
Shard(0) -> output Shard(1), no redistribute).

``--decode``: one decode step of a Llama block (``nn.llama.TransformerBlock``, dim 256, 8 heads,
4 key/value heads, one position of one sequence) under ``torch.inference_mode``, tensor parallel
over the ranks: axedist's ``llama_tp_plan`` vs torch's ``parallelize_module`` (Colwise /
Rowwise, per-rank head counts: ``bench_decode.torch_parallel``) vs the block on one process.
Its all-reduces make every rank run the step at once (not in turns); CPU time per step, so a
rank's wait for the others is not counted. The host cost an eager decode step pays per layer
(``bench_decode.py`` times it on GPUs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import axedist as ax
from axedist.dtensor import DTensor, distribute

fastpath = DTensor.dispatcher.fastpath


def _cases(mesh, torch_mesh, requires_grad: bool):
    """(name, axedist fn, torch DTensor fn, plain-local fn) per op; each fn takes no arguments.
    With ``requires_grad`` every input is a leaf that requires grad (grad mode on: autograd
    records each call on all three sides)."""
    g = torch.Generator().manual_seed(0)

    def both(shape, placements):
        t = torch.randn(shape, generator=g)
        ours = distribute(t, mesh, placements).requires_grad_(requires_grad)
        theirs = distribute_tensor(t, torch_mesh, placements).requires_grad_(requires_grad)
        return ours, theirs, ours.to_local().detach().requires_grad_(requires_grad)

    x, tx, lx = both((64, 32), [Shard(0)])
    y, ty, ly = both((64, 32), [Shard(0)])
    a, ta, la = both((16, 64), [Shard(1)])
    b, tb, lb = both((64, 16), [Shard(0)])
    v, tv, lv = both((8, 4, 16), [Shard(0)])
    inp, tinp, linp = both((16, 32), [Replicate()])
    w, tw, lw = both((64, 32), [Shard(0)])
    vshape, lvshape = (32, 16), (lv.shape[0] * 4, 16)
    return [
        ("add  S0 + S0", lambda: x + y, lambda: tx + ty, lambda: lx + ly, x, tx, lx, y),
        ("mul  S0 * 2.0", lambda: x * 2.0, lambda: tx * 2.0, lambda: lx * 2.0),
        ("mm   S1 @ S0 -> P", lambda: torch.mm(a, b).to_local(), lambda: torch.mm(ta, tb).to_local(),
         lambda: torch.mm(la, lb)),
        ("view S0 (8,4,16)->(32,16)", lambda: v.view(vshape), lambda: tv.view(vshape), lambda: lv.view(lvshape)),
        ("sum  S0 over dim 1", lambda: x.sum(1), lambda: tx.sum(1), lambda: lx.sum(1)),
        ("linear R x S0 -> S1", lambda: F.linear(inp, w), lambda: F.linear(tinp, tw), lambda: F.linear(linp, lw)),
    ]


def _decode_case(mesh, torch_mesh):
    """(name, axedist step, torch step, plain step) of one Llama block decoding one position."""
    import copy
    import sys

    from axedist.nn import parallelize, to_inference
    from axedist.nn.llama import LlamaConfig, llama_tp_plan

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode import LayerStack, torch_parallel

    world = mesh.size()
    cfg = LlamaConfig(dim=256, n_layers=1, n_heads=8, n_kv_heads=4, ffn_hidden=512, max_seq_len=8)
    torch.manual_seed(0)  # the same weights on every rank
    base = LayerStack(cfg).eval()
    ours = copy.deepcopy(base)
    parallelize(ours, mesh, {k: v for k, v in llama_tp_plan(cfg, sequence_parallel=False).items()
                             if k.startswith("layers.")}, src_rank=None)
    to_inference(ours)
    theirs = torch_parallel(copy.deepcopy(base), cfg, world, torch_mesh)
    h = torch.randn(1, 1, cfg.dim)
    with torch.inference_mode():
        x = DTensor.from_local(h, mesh, [Replicate()])
    return ("decode step, Llama block (dim 256)", lambda: ours(x), lambda: theirs(h), lambda: base(h))


def _decode_timed(case, args, world: int) -> torch.Tensor:
    """(plain, axedist, torch) median and best batch per step, every rank timing at once (the
    steps' all-reduces pair the ranks), the median over ranks."""
    _, ours, theirs, plain = case
    with torch.inference_mode():
        row = torch.tensor(_measure([plain, ours, theirs], max(1, args.calls // 10), args.repeats))
    gathered = [torch.zeros_like(row) for _ in range(world)]
    dist.all_gather(gathered, row)
    return torch.stack(gathered).median(dim=0).values[None]


_CLOCK = time.thread_time_ns  # --clock: thread CPU time (default) or wall time (time.perf_counter_ns)


def _batch_us(fn, calls: int) -> float:
    start = _CLOCK()
    for _ in range(calls):
        fn()
    return (_CLOCK() - start) / calls / 1e3


def _measure(fns, calls: int, repeats: int) -> list[float]:
    """Median time per call (us) of each fn; batches interleaved so load changes hit all alike."""
    for fn in fns:
        for _ in range(50):  # warm-up: rules, plans, meta shapes, torch's sharding-prop cache
            fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            out.append(_batch_us(fn, calls))
    return [statistics.median(s) for s in samples] + [min(s) for s in samples]


class _Probe(torch.Tensor):
    """A wrapper subclass whose handlers return a fixed tensor: the cost of entering and
    leaving ``__torch_dispatch__`` (or ``__torch_function__``) and nothing else."""

    RESULT = torch.empty(0)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, requires_grad=requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls.RESULT


def _breakdown(x, y, calls: int, repeats: int) -> list[tuple[str, float]]:
    """Where the microseconds of ``x + y`` (cached) go, on the normal route and the fast path,
    without and with autograd (inputs that require grad)."""
    dispatcher = DTensor.dispatcher
    add = torch.ops.aten.add.Tensor
    lx, ly = x.to_local(), y.to_local()
    glx, gly = lx.detach().clone().requires_grad_(), ly.detach().clone().requires_grad_()
    p, q = _Probe(x.shape), _Probe(x.shape)
    gp, gq = _Probe(x.shape, True), _Probe(x.shape, True)
    value = lx + ly
    spec = x._spec
    fastpath.enable(False)
    key = dispatcher.cache_key(add, (x, y))
    x + y
    table = dispatcher.cache.positional
    gx, gy = x.detach().requires_grad_(), y.detach().requires_grad_()
    wrap = torch.Tensor._make_wrapper_subclass
    probe_tf = classmethod(lambda cls, func, types, args=(), kwargs=None: _Probe.RESULT)

    def wrapped():
        out = wrap(DTensor, spec.shape, None, None, None, value.dtype, torch.strided, value.device)
        out._value, out._spec, out._tag = value, spec, None
        return out

    normal = _measure([lambda: lx + ly, lambda: x + y, lambda: p + q,
                       lambda: dispatcher.cache_key(add, (x, y)), lambda: table.get(key),
                       wrapped, lambda: glx + gly], calls, repeats)
    fastpath.enable(True)
    fastpath.clear()
    _Probe.RESULT = _Probe(x.shape)  # autograd records on what __torch_dispatch__ returns
    hx = x.detach().requires_grad_()  # y does not require grad: the call enters __torch_function__
    # gx and gy carry the disabled handler after their first call: the dispatcher's route
    fast = _measure([lambda: lx + ly, lambda: x + y, lambda: gx + gy, lambda: hx + y, lambda: gp + gq,
                     lambda: glx + gly], calls, repeats)
    _Probe.__torch_function__ = probe_tf
    fast += _measure([lambda: p + q, wrapped], calls, repeats)
    _Probe.__torch_function__ = torch._C._disabled_torch_function_impl
    local, call, entry, make_key, lookup, wrap_us, local_grad = normal[:7]
    f_local, f_call, f_marked, f_hit, f_trip, f_local_grad = fast[:6]
    f_entry, f_wrap = fast[12:14]
    return [
        ("normal route (fast path off): local add (subtracted as the op itself)", local),
        ("normal route: whole call", call),
        ("  torch's dispatcher -> __torch_dispatch__ -> back (empty handler)", entry),
        ("  dispatch: cache key (a tag per DTensor)", make_key),
        ("  dispatch: plan lookup", lookup),
        ("  dispatch: wrap the output (_make_wrapper_subclass + attributes)", wrap_us),
        ("  dispatch: the rest (argument slots, local op call, shape check)",
         call - local - entry - make_key - lookup - wrap_us),
        ("fast path: whole call", f_call),
        ("  __torch_function__ entry and exit (empty handler)", f_entry),
        ("  wrap the output (positional _make_wrapper_subclass + attributes)", f_wrap),
        ("  key, lookup, checks (grad, modes, autocast), local call overhead", f_call - f_local - f_entry - f_wrap),
        ("inputs require grad: plain local add (subtracted as the op itself)", f_local_grad),
        ("  autograd's share on plain tensors (over the local add without grad)", f_local_grad - f_local),
        ("inputs require grad, both marked (no __torch_function__): whole call", f_marked),
        ("  torch's dispatcher + autograd node + __torch_dispatch__ (empty handler)", f_trip),
        ("  dispatch's cached route after that (normal route's whole call less its entry)", call - entry),
        ("  the rest (marking the output; autograd's work on a subclass)", f_marked - f_trip - (call - entry)),
        ("one input requires grad (a grad-mode hit through __torch_function__): whole call", f_hit),
        ("  the fast path's work as without grad (its whole call above)", f_call),
        ("  second trip: dispatcher + autograd node + __torch_dispatch__ (empty handler)", f_trip),
        ("  the rest: requires-grad check, handing the output over", f_hit - f_call - f_trip),
    ]


def _timed(cases, args, world: int) -> torch.Tensor:
    """Per case: median and best batch of (plain, axedist, DTensor), the median over ranks."""
    rows = torch.zeros(len(cases), 6, dtype=torch.float64)
    # ranks take turns (the others wait in a barrier), so the timed rank has the cores to itself
    for turn in range(world):
        dist.barrier()
        if dist.get_rank() == turn:
            for i, (name, ours, theirs, plain, *_) in enumerate(cases):
                rows[i] = torch.tensor(_measure([plain, ours, theirs], args.calls, args.repeats))
        dist.barrier()
    gathered = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(gathered, rows)
    return torch.stack(gathered).median(dim=0).values  # the median rank


def _print_table(cases, table, title: str) -> None:
    print(f"\n{title}:\n")
    print("| op | local op | axedist | torch DTensor | axedist overhead | DTensor overhead | ratio "
          "| ratio (best batch) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios, best = [], []
    for (name, *_), (p, o, t, bp, bo, bt) in zip(cases, table.tolist()):
        ours_over, theirs_over = o - p, t - p
        ratio = ours_over / theirs_over if theirs_over > 0 else float("nan")
        ratios.append(ratio)
        best.append((bo - bp) / (bt - bp) if bt > bp else float("nan"))
        print(f"| {name} | {p:.1f} | {o:.1f} | {t:.1f} | {ours_over:.1f} | {theirs_over:.1f} | {ratio:.2f} "
              f"| {best[-1]:.2f} |")
    mean = statistics.geometric_mean(ratios)
    print(f"\ngeomean ratio {mean:.2f} (best batches: {statistics.geometric_mean(best):.2f}; goal <= 0.50: "
          f"{'met' if mean <= 0.5 else 'NOT met'}); worst {max(ratios):.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=25, help="timed batches (the median is reported)")
    parser.add_argument("--profile", action="store_true", help="cProfile axedist's calls (rank 0 prints the top)")
    parser.add_argument("--no-fastpath", action="store_true",
                        help="axedist without its torch-function fast path (ops/fastpath.py): every call "
                             "takes __torch_dispatch__")
    parser.add_argument("--breakdown", action="store_true",
                        help="rank 0 also times the parts of a cached x + y on both routes")
    parser.add_argument("--grad", choices=("both", "no", "yes"), default="both",
                        help="inputs that do not require grad, that do (grad mode on), or both tables")
    parser.add_argument("--decode", action="store_true",
                        help="also time a Llama block's decode step (TP over the ranks, inference_mode)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="time a batch by the thread's CPU time (default: robust on a shared machine) "
                             "or by wall-clock time")
    args = parser.parse_args()
    global _CLOCK
    _CLOCK = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    mesh = ax.init_mesh((int(os.environ.get("WORLD_SIZE", "4")),), device_type="cpu")
    world = dist.get_world_size()
    torch_mesh = mesh.to_torch()
    torch.set_num_threads(1)
    fastpath.enable(not args.no_fastpath)
    kinds = {"both": (False, True), "no": (False,), "yes": (True,)}[args.grad]
    tables = []
    for requires_grad in kinds:
        cases = _cases(mesh, torch_mesh, requires_grad)
        tables.append((requires_grad, cases, _timed(cases, args, world)))
    x, tx, lx, y = tables[0][1][0][4:]  # the inputs the add case carries
    # a getter: every attribute read of a DTensor passes __torch_function__ while the fast path is on
    getter = _timed([("x.shape (getter)", lambda: x.shape, lambda: tx.shape, lambda: lx.shape)], args, world)
    decode = None
    if args.decode:
        decode_case = _decode_case(mesh, torch_mesh)
        decode = ([decode_case], _decode_timed(decode_case, args, world))
    breakdown = None
    if args.breakdown and dist.get_rank() == 0:
        breakdown = _breakdown(x, y, args.calls, args.repeats)
        fastpath.enable(not args.no_fastpath)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            for case in tables[0][1]:
                case[1]()
        profiler.disable()
    if dist.get_rank() == 0:
        print(f"\nCPU cost per op call, {world} gloo ranks, torch {torch.__version__}, axedist fast path "
              f"{'off' if args.no_fastpath else 'on'}; median of {args.repeats} batches x {args.calls} calls, "
              f"{'thread CPU' if args.clock == 'cpu' else 'wall-clock'} time; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
              f"overhead = call - same op on the local tensors (us)")
        for requires_grad, cases, table in tables:
            _print_table(cases, table, "inputs require grad (autograd records every call)" if requires_grad
                         else "inputs do not require grad")
        if decode:
            _print_table(*decode, f"a decode step under inference_mode, TP = {world} (every rank at once), "
                                  f"{max(1, args.calls // 10)} steps a batch")
        (p, o, t, _, _, _), = getter.tolist()
        print(f"\ngetter x.shape: plain {p:.2f} us, axedist {o:.2f} us, torch DTensor {t:.2f} us")
        if breakdown:
            print("\nwhere the time of a cached `x + y` goes (us per call, rank 0):\n")
            print("| part | us |\n|---|---:|")
            for name, us in breakdown:
                print(f"| {name} | {us:.2f} |")
        if args.profile:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
