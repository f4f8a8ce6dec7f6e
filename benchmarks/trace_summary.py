"""Where a training step's GPU time goes, per side, from the Chrome traces ``--trace`` writes.

    python benchmarks/trace_summary.py runs/bench_tp/traces            # every side, rank 0
    python benchmarks/trace_summary.py DIR --rank 1 --markdown >> notes.md
    python benchmarks/trace_summary.py DIR --arrivals --markdown     # collectives: own cost vs waiting

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


def _device_events(path: str, cats=("kernel", "gpu_memcpy", "gpu_memset")) -> list[dict]:
    """The trace file's complete events of categories ``cats`` (GPU kernels, copies, sets)."""
    with gzip.open(path) if path.endswith(".gz") else open(path) as handle:
        events = json.load(handle)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]


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
    args = p.parse_args(argv)
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
