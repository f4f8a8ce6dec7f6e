"""torch's whole OpInfo database through axedist DTensors (tests/opinfo_sweep.py), with a table.

Each op runs on its own call of a pooled set of gloo ranks; an op that hangs or kills a rank
is recorded as such and the pool starts again. Results are written after every op, so a run
that is stopped keeps what it finished (``--resume`` carries on from them).

    python benchmarks/sweep_opinfo.py                       # 2 ranks, every op: results/opinfo_sweep.{md,json}
    python benchmarks/sweep_opinfo.py --mesh 2x2 --ops add,cat,matmul
    python benchmarks/sweep_opinfo.py --torch               # also each run on torch's DTensor, side by side
    nohup python benchmarks/sweep_opinfo.py --resume > /tmp/sweep.log 2>&1 &
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package holds the harness

from axedist.testing import RankError, run_on_ranks, shutdown_pools  # noqa: E402
from tests.opinfo_sweep import OUTCOMES, op_entries, summarize, sweep_op  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _run_one(key: str, args) -> dict:
    world = 2 if args.mesh == "2" else 4
    start = time.monotonic()
    try:
        results = run_on_ranks(sweep_op, world, args=(args.mesh, key, tuple(args.dtypes.split(",")),
                                                      tuple(args.samples), args.plans, args.budget, args.torch),
                               timeout_s=args.timeout)
    except RankError as error:
        shutdown_pools()
        lines = [line for line in str(error).splitlines() if line.strip()]
        crash = lines[-1][:300] if lines else ""
        if args.torch:  # whose hang? axedist's side again alone: torch's DTensor hangs on some ops itself
            ours = _run_one(key, argparse.Namespace(**dict(vars(args), torch=False)))
            if ours["outcome"] != "hang or crash":
                return dict(ours, torch_outcome="fail", torch_detail=f"hang or crash: {crash}",
                            seconds=round(time.monotonic() - start, 2))
        return {"op": key, "outcome": "hang or crash", "torch_outcome": "unknown" if args.torch else None,
                "torch_detail": "", "samples": 0, "runs": 0, "kinds": {}, "fallback": 0,
                "fallback_ops": [], "details": {"crash": crash}, "seconds": round(time.monotonic() - start, 2)}
    first = results[0]
    if any(r["outcome"] != first["outcome"] for r in results[1:]):
        shutdown_pools()  # ranks that parted ways may have left a collective half-run
        first = dict(first, outcome="other error",
                     details=dict(first["details"], ranks=f"ranks disagree: {[r['outcome'] for r in results]}"))
    return first


def _table(results: list, args, started: str, seconds: float) -> str:
    counts = summarize(results)
    lines = [
        "# torch's OpInfo database through axedist DTensors",
        "",
        f"`python benchmarks/sweep_opinfo.py --mesh {args.mesh}{' --torch' if args.torch else ''}"
        f"{' --ops <' + str(len(args.ops.split(','))) + ' ops>' if args.ops else ''}` at commit {_commit()}, {started} UTC, "
        f"{seconds / 60:.0f} minutes on this project's shared 2-core machine (gloo). Per op: up to "
        f"{args.samples[0]} float64 and {args.samples[1]} float32 samples, each with every tensor argument "
        f"Replicate and under {args.plans - 1} more placement plans (Shard(0), Shard(-1), mixes; "
        f"tests/opinfo_sweep.py); forward values and gradients against the plain op."
        + (" Every run also on torch's DTensor (same placements, same checks): its outcome per op in the "
           "'torch' column (pass, or fail with its first problem)." if args.torch else ""),
        "",
        "| outcome | ops |",
        "|---|---|",
    ]
    for name in OUTCOMES + ("hang or crash", "skipped"):
        lines.append(f"| {name} | {counts.get(name, 0)} |")
    lines.append(f"| pass, through the gather fallback | {counts['pass through the fallback']} |")
    lines.append(f"| ops tried | {counts['ops']} |")
    torch_names = ("torch's DTensor passes", "torch passes, axedist does not", "axedist passes, torch does not")
    for name in torch_names:
        if name in counts:
            lines.append(f"| {name} | {counts[name]} |")
    if "torch passes, axedist does not" in counts:
        behind = sorted(r["op"] for r in results if r.get("torch_outcome") == "pass" and r["outcome"] != "pass")
        lines += ["", "Ops torch's DTensor passes and axedist does not: " + (", ".join(behind) or "none") + "."]
    lines += ["", "## Per op", "", "| op | outcome | " + ("torch | " if args.torch else "")
              + "samples | runs | fallback calls | fallback ops | first problem |",
              "|---|---|" + ("---|" if args.torch else "") + "---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["outcome"] == "pass", r["op"])):
        problem = next(iter(r["details"].values()), "") if r["outcome"] != "pass" else ""
        problem = problem.replace("|", "/").replace("\n", " ")[:200]
        fell = ", ".join(f.replace("aten.", "") for f in r["fallback_ops"])
        theirs = f"{r.get('torch_outcome') or '-'} | " if args.torch else ""
        lines.append(f"| {r['op']} | {r['outcome']} | {theirs}{r['samples']} | {r['runs']} | {r['fallback']} | {fell} | "
                     f"{problem} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", choices=("2", "2x2"), default="2")
    parser.add_argument("--ops", default="", help="comma-separated op keys (default: every op)")
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--samples", type=int, nargs=2, default=(4, 1), help="samples per op: float64, float32")
    parser.add_argument("--plans", type=int, default=3, help="placement plans per sample (the first all Replicate)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per op before no new sample starts")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per op before its ranks are killed")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "opinfo_sweep"))
    parser.add_argument("--resume", action="store_true", help="keep the ops already in OUT.json")
    parser.add_argument("--torch", action="store_true",
                        help="also run every sample on torch's DTensor (same placements) and compare the outcomes")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    keys = args.ops.split(",") if args.ops else sorted(op_entries())
    out = Path(args.out)
    done = {}
    if args.resume and out.with_suffix(".json").exists():
        done = {r["op"]: r for r in json.loads(out.with_suffix(".json").read_text())["results"]}
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    start = time.monotonic()
    # every op already there is kept (also those --ops does not list: a resumed subset adds to the table)
    results = [r for k, r in done.items() if k not in keys] + [done[k] for k in keys if k in done]
    for i, key in enumerate(k for k in keys if k not in done):
        result = _run_one(key, args)
        results.append(result)
        print(f"[{len(results)}/{len(keys)}] {key}: {result['outcome']} ({result['seconds']} s, "
              f"{result['fallback']} fallback calls)", flush=True)
        record = {"mesh": args.mesh, "commit": _commit(), "started": started, "summary": summarize(results),
                  "results": results}
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        out.with_suffix(".md").write_text(_table(results, args, started, time.monotonic() - start))
    print(json.dumps(summarize(results)))


if __name__ == "__main__":
    main()
