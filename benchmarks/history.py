"""Benchmark records: each benchmark writes its current table (``<name>.md/.json/.png`` in the
results folder) and appends the same result as one JSON line to ``history/<name>.jsonl``, so
earlier runs stay comparable by commit and machine without a file per version.

    append_history("benchmarks/results", "gemm_rs_w4", meta, {"rows": rows})
    # -> benchmarks/results/history/gemm_rs_w4.jsonl gains {"commit": ..., "machine": ..., ...}
"""
import datetime
import json
import os
import platform
import re
import socket
import subprocess

from axedist.env import MULTICAST_OFF  # checked and recorded by every benchmark

KEYS = ("commit", "machine", "date", "command")


def append_history(out_dir: str, name: str, meta: dict, data: dict) -> str:
    """Append one run (``meta`` must name commit, machine, date and command) to the history."""
    missing = [k for k in KEYS if k not in meta]
    if missing:
        raise ValueError(f"history record of {name} lacks {missing} in its meta")
    folder = os.path.join(out_dir, "history")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.jsonl")
    line = {k: meta[k] for k in KEYS}
    line.update(meta=meta, **data)
    with open(path, "a") as handle:
        handle.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


def table_source(meta: dict) -> str:
    """How an auto table names the run it was derived from: "machine, commit C, date, `command`"."""
    return f"{meta['machine']}, commit {meta['commit']}, {meta['date']}, `{meta['command']}`"


def merged_sources(earlier: list[str], new: list[str]) -> list[str]:
    """The sources of a rewritten auto table ("machine, commit C, date, `command`" each): the
    earlier ones, less any the new results supersede (the same command on the same machine,
    apart from the options that do not change which shapes it measures: ``--out``,
    ``--configs``, ``--reps``, ``--tune``), then the new ones."""
    def run(source: str) -> tuple[str, str]:
        command = source[source.index("`"):]
        return (source.split(", commit ")[0],
                re.sub(r" --(out|configs|reps|tune)[ =]\S+", "", command))
    rerun = {run(source) for source in new}
    return [source for source in earlier if run(source) not in rerun] + new


def merged_with_earlier(earlier: dict, table: dict, measured: set) -> dict:
    """A rewritten auto table: ``table`` (derived from new results), with the earlier table's
    "fused_loses" / "symm_wins" shapes that the new results did not measure kept (sorted), and
    the two tables' sources merged (``merged_sources``)."""
    out = dict(table, source=merged_sources(earlier["source"], table["source"]))
    for key in ("fused_loses", "symm_wins"):
        out[key] = sorted(table[key] + [shape for shape in earlier.get(key, []) if tuple(shape) not in measured])
    return out


def require_multicast_off() -> None:
    """Exit unless the multicast switches are off and AXEDIST_ENABLE_MULTICAST is not 1."""
    if os.environ.get("AXEDIST_ENABLE_MULTICAST") == "1":
        raise SystemExit("refusing to benchmark with AXEDIST_ENABLE_MULTICAST=1 (policy)")
    for name, expected in MULTICAST_OFF.items():
        if os.environ.get(name) != expected:
            raise SystemExit(f"set {name}={expected} (multicast must stay off)")


def commit() -> str:
    """AXEDIST_COMMIT if set (a device call runs a copy without .git), else git's short HEAD."""
    if os.environ.get("AXEDIST_COMMIT"):
        return os.environ["AXEDIST_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_meta(world: int, command: str, device: str | None = None, **extra) -> dict:
    """Date, machine, commit, torch, command and multicast settings of a run, plus ``extra``:
    ``run_meta(4, "torchrun ... bench_gemm_rs.py")["machine"] == "host: 4x NVIDIA H200"``."""
    import torch

    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=f"{socket.gethostname()}: {world}x {device}", world=world, commit=commit(), torch=torch.__version__,
                command=command, env={k: os.environ.get(k) for k in MULTICAST_OFF})
    meta.update(extra)
    return meta


def unfused_time(times: dict) -> float:
    """The unfused pair's time in a fused-op benchmark row: cuBLAS then the collective, the faster
    of NCCL's (``seq``, timed as one sequence) and ours (``cublas`` + ``p2p_rs`` / ``p2p_ag``,
    timed apart), as the unfused path of "auto" runs ours."""
    ours = [times["cublas"] + times[key] for key in ("p2p_rs", "p2p_ag") if times.get(key) and times.get("cublas")]
    return min([times["seq"]] + ours)


def symm_fastest(row: dict) -> bool:
    """A fused-op benchmark row (``bench_gemm_rs``, ``bench_ag_gemm``) where torch's symmetric-memory
    op was faster than both our fused kernel and the unfused pair, in device time (``queued``) and
    (where the run timed it) issued eagerly: ``--tables-from`` lists the shape in "symm_wins",
    where "auto" runs torch's op."""
    timings = [row["queued"], row] if "queued" in row else [row]
    return all(t.get("symm") and t["symm"] < min(t["fused"], unfused_time(t)) for t in timings)


def auto_vs_best(times: dict) -> float | None:
    """How the "auto" backend's time compares with the fastest of what it chooses among (our fused
    kernel, torch's symmetric-memory op, the unfused pair): best / auto, so 1.00 means auto ran the
    fastest, below 1.00 that it was slower than the best alternative (issue 28's first goal: never).
    None where the row has no auto column (results written before it existed)."""
    if not times.get("auto"):
        return None
    return min(t for t in (times.get("fused"), times.get("symm"), unfused_time(times)) if t) / times["auto"]


def auto_cell(times: dict) -> str:
    """The table cells ``auto ms | best / auto`` of a row (n/a where it has no auto column)."""
    ratio = auto_vs_best(times)
    return "n/a | n/a" if ratio is None else f"{times['auto']:.3f} | {ratio:.2f}"

