"""Benchmark records: each benchmark writes its current table (``<name>.md/.json/.png`` in the
results folder) and appends the same result as one JSON line to ``history/<name>.jsonl``, so
earlier runs stay comparable by commit and machine without a file per version.

    append_history("benchmarks/results", "gemm_rs_w4", meta, {"rows": rows})
    # -> benchmarks/results/history/gemm_rs_w4.jsonl gains {"commit": ..., "machine": ..., ...}
"""
import json
import os

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
