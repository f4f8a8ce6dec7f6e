"""Where a training step's GPU time goes, per side, from the Chrome traces ``--trace`` writes.

    python benchmarks/trace_summary.py runs/bench_tp/traces            # every side, rank 0
    python benchmarks/trace_summary.py DIR --rank 1 --markdown >> notes.md
    python benchmarks/trace_summary.py DIR --arrivals --markdown     # collectives: own cost vs waiting
    python benchmarks/trace_summary.py DIR --gaps 15 --markdown      # the longest idle stretches, and why

Each kernel (and memcpy / memset) of the profiled step is put in one category: cuBLAS GEMMs,
fused GEMM + collective kernels (ours and torch's symmetric-memory ops), collectives (NCCL and
ours), attention, copies (cat, copy, memcpy) and the other elementwise / reduction kernels.
Per side: each category's summed milliseconds, the step's kernel span (first kernel start to
last kernel end), the busy time (union of kernel intervals, all streams) and the idle time
inside the span (the GPU waiting on its host or on a peer). Side names come from the file
names ``trace_<side>_rank<r>.json.gz``.

``--arrivals`` reads every rank's trace of each side and splits each collective kernel (the
fused GEMM + collective and collective categories; the k-th call of a kernel name on every rank
is one call) into waiting and its own cost: a rank's kernel starts when the rank arrives and
ends, on every rank alike, once the last rank has arrived and the work is done. So per call,
the time after the last arrival is the collective's own cost, and the rest of each rank's kernel
time is that rank waiting for the slowest peer (ranks that drift apart, not a slow kernel). The
ranks' traces share the host clock (one machine).

``--gaps N`` lists one rank's N longest idle stretches of each side's step (no kernel, copy or set
on any stream): the kernel that ended before and the one that started after, when the host
launched that next kernel, relative to the gap's start, and the innermost host op around the
launch. A launch after the GPU went idle means the host was late (it bounds the step there);
a launch before it means the GPU waited on something else (an event, a peer). Host
synchronizations (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``,
blocking copies) and stream waits (``cudaStreamWaitEvent``) that overlap a gap are named.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re

from training_steps import covered  # beside this script

CATEGORIES = (  # (name, pattern on the kernel name), first match wins
    ("fused GEMM + collective", r"gemm_reduce_scatter_kernel|all_gather_gemm_kernel|gemm_all_reduce|"
                                r"fused_matmul_reduce_scatter|fused_all_gather_matmul"),
    ("GEMM (cuBLAS)", r"nvjet|cutlass|gemm|sm90_xmma|ampere_.*gemm"),
    ("collective", r"nccl|all_gather_kernel|reduce_scatter_kernel|all_reduce|barrier_kernel|one_shot|two_shot"),
    ("attention", r"sdpa|flash|fmha|attention"),
    ("copy", r"CatArrayBatchedCopy|copy_kernel|Memcpy|Memset"),
    ("elementwise / reduction", r""),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return CATEGORIES[-1][0]


_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_SYNCS = re.compile(r"cuda(Stream|Event|Device)Synchronize|cudaMemcpy$|cudaMemcpy[^A]|cudaStreamWaitEvent")


def _events(path: str) -> list[dict]:
    with gzip.open(path) if path.endswith(".gz") else open(path) as handle:
        return [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]


def _device_events(path: str, cats=_DEVICE) -> list[dict]:
    """The trace file's complete events of categories ``cats`` (GPU kernels, copies, sets)."""
    return [e for e in _events(path) if e.get("cat") in cats]


def gaps(path: str, count: int) -> list[dict]:
    """The ``count`` longest idle stretches (no device event on any stream) inside one trace's
    kernel span, longest first: ``ms``, ``before`` / ``after`` (kernel names), ``launch_ms`` (when
    the host launched ``after``, from the gap's start: positive, the host was late), ``host_op``
    (the innermost host op around that launch) and ``syncs`` (host synchronizations and stream
    waits overlapping it)."""
    events = _events(path)
    device = sorted((e for e in events if e.get("cat") in _DEVICE), key=lambda e: e["ts"])
    if not device:
        raise ValueError(f"{path}: no GPU kernels in the trace")
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    host_ops = [e for e in events if e.get("cat") == "cpu_op"]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and _SYNCS.search(e["name"])]
    found, end, last = [], device[0]["ts"] + device[0]["dur"], device[0]
    for e in device[1:]:
        if e["ts"] > end:
            found.append((end, e["ts"], last, e))
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e
    out = []
    for start, stop, before, after in sorted(found, key=lambda g: g[0] - g[1])[:count]:
        launch = runtime.get(after.get("args", {}).get("correlation"))
        around = [op for op in host_ops if launch is not None and launch.get("tid") == op.get("tid")
                  and op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]]
        out.append({"ms": (stop - start) / 1e3, "before": before["name"], "after": after["name"],
                    "launch_ms": None if launch is None else (launch["ts"] - start) / 1e3,
                    "host_op": min(around, key=lambda op: op["dur"])["name"] if around else None,
                    "syncs": sorted({s["name"] for s in syncs if s["ts"] < stop and s["ts"] + s["dur"] > start})})
    return out


def gaps_markdown(by_side: dict[str, list], rank: int) -> str:
    lines = [f"| side | idle ms (rank {rank}) | kernel before | kernel after | its launch, ms after the GPU went idle "
             "| host op around the launch | syncs and stream waits in the gap |", "|---|---|---|---|---|---|---|"]
    for side, rows in by_side.items():
        for g in rows:
            launch = "-" if g["launch_ms"] is None else f"{g['launch_ms']:+.2f}"
            lines.append(f"| {side} | {g['ms']:.2f} | `{g['before'][:50]}` | `{g['after'][:50]}` | {launch} "
                         f"| `{(g['host_op'] or '-')[:50]}` | {', '.join(g['syncs']) or '-'} |")
    return "\n".join(lines) + "\n"


def summarize(path: str) -> dict:
    """Milliseconds per category, span, busy and idle of one trace file."""
    kernels = _device_events(path)
    if not kernels:
        raise ValueError(f"{path}: no GPU kernels in the trace")
    by_category: dict[str, float] = {label: 0.0 for label, _ in CATEGORIES}
    for e in kernels:
        by_category[category(e["name"])] += e["dur"] / 1e3
    busy = covered((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e3
    return {"ms": by_category, "span_ms": span, "busy_ms": busy / 1e3, "idle_ms": span - busy / 1e3,
            "kernels": len(kernels)}


def arrivals(paths: list[str], rank: int = 0) -> dict[str, dict]:
    """Per collective kernel name (calls matched by order on every rank's trace in ``paths``):
    ``calls``, ``rank_ms`` (``rank``'s summed kernel time), ``own_ms`` (summed time from the last
    rank's arrival to the earliest end: the work itself), ``waiting_ms`` (``rank_ms - own_ms``
    summed over calls: ``rank`` waiting for its peers) and ``max_lag_ms`` (the longest any rank
    waited for the last arrival in one call)."""
    collective = {"fused GEMM + collective", "collective"}
    per_rank = []
    for path in paths:
        calls: dict[str, list[tuple[float, float]]] = {}
        for e in sorted(_device_events(path, ("kernel",)), key=lambda e: e["ts"]):
            if category(e["name"]) in collective:
                calls.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
        per_rank.append(calls)
    out = {}
    for name in per_rank[rank]:
        counts = {len(calls.get(name, ())) for calls in per_rank}
        if len(counts) != 1:
            raise ValueError(f"{name}: {sorted(counts)} calls on different ranks; the traces are not of one step")
        mine = own = waiting = lag = 0.0
        for k in range(counts.pop()):
            starts = [calls[name][k][0] for calls in per_rank]
            ends = [calls[name][k][1] for calls in per_rank]
            last = max(starts)
            done = max(min(ends) - last, 0.0)
            start, end = per_rank[rank][name][k]
            mine += end - start
            own += done
            waiting += max(end - start - done, 0.0)
            lag = max(lag, last - min(starts))
        out[name] = {"calls": len(per_rank[rank][name]), "rank_ms": mine / 1e3, "own_ms": own / 1e3,
                     "waiting_ms": waiting / 1e3, "max_lag_ms": lag / 1e3}
    return out


def arrivals_markdown(by_side: dict[str, dict], rank: int) -> str:
    lines = [f"| side | kernel | calls | rank {rank} ms | own ms (after the last arrival) | rank {rank} waiting ms "
             "| longest wait for the last rank (ms) |", "|---|---|---|---|---|---|---|"]
    for side, rows in by_side.items():
        for name, r in rows.items():
            lines.append(f"| {side} | `{name[:60]}` | {r['calls']} | {r['rank_ms']:.1f} | {r['own_ms']:.1f} "
                         f"| {r['waiting_ms']:.1f} | {r['max_lag_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def sides_in(folder: str, rank: int) -> dict[str, str]:
    found = {}
    for name in sorted(os.listdir(folder)):
        match = re.fullmatch(rf"trace_(.+)_rank{rank}\.json(\.gz)?", name)
        if match:
            found[match.group(1).replace("_", " ")] = os.path.join(folder, name)
    return found


def markdown(summaries: dict) -> str:
    names = list(summaries)
    rows = [f"| {label} | " + " | ".join(f"{summaries[n]['ms'][label]:.1f}" for n in names) + " |"
            for label, _ in CATEGORIES]
    for key, label in (("span_ms", "kernel span"), ("busy_ms", "busy (any stream)"), ("idle_ms", "idle in span")):
        rows.append(f"| **{label}** | " + " | ".join(f"{summaries[n][key]:.1f}" for n in names) + " |")
    return ("| ms | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n" + "\n".join(rows) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="the traces/ folder a --trace run wrote")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--markdown", action="store_true", help="one markdown table (else plain text)")
    p.add_argument("--arrivals", action="store_true",
                   help="per collective kernel: own cost vs the rank waiting for its peers (every rank's trace)")
    p.add_argument("--gaps", type=int, default=0, metavar="N",
                   help="one rank's N longest idle stretches per side: the kernels around each, the host's launch")
    args = p.parse_args(argv)
    if args.gaps:
        by_side = {side: gaps(path, args.gaps) for side, path in sides_in(args.folder, args.rank).items()}
        if args.markdown:
            print(gaps_markdown(by_side, args.rank))
            return
        for side, rows in by_side.items():
            for g in rows:
                print(f"{side}: idle {g['ms']:.2f} ms after {g['before'][:40]}, before {g['after'][:40]}; "
                      f"launched {g['launch_ms']} ms after idle in {g['host_op']}; syncs {g['syncs']}")
        return
    if args.arrivals:
        ranks = sorted(int(m.group(1)) for m in (re.search(r"_rank(\d+)\.json", n) for n in os.listdir(args.folder)) if m)
        by_side = {side: arrivals([sides_in(args.folder, r)[side] for r in sorted(set(ranks))], args.rank)
                   for side in sides_in(args.folder, args.rank)}
        if args.markdown:
            print(arrivals_markdown(by_side, args.rank))
            return
        for side, rows in by_side.items():
            for name, r in rows.items():
                print(f"{side}: {name[:60]}: {r['calls']} calls, rank {args.rank} {r['rank_ms']:.1f} ms, own "
                      f"{r['own_ms']:.1f}, waiting {r['waiting_ms']:.1f}, longest wait {r['max_lag_ms']:.2f}")
        return
    summaries = {side: summarize(path) for side, path in sides_in(args.folder, args.rank).items()}
    if not summaries:
        raise SystemExit(f"no trace_<side>_rank{args.rank}.json(.gz) in {args.folder}")
    if args.markdown:
        print(markdown(summaries))
        return
    for side, s in summaries.items():
        print(f"{side}: span {s['span_ms']:.1f} ms, busy {s['busy_ms']:.1f}, idle {s['idle_ms']:.1f}, "
              f"{s['kernels']} kernels")
        for label, ms in s["ms"].items():
            print(f"  {label:26s} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
