"""Time the layout algebra's hot operations for layouts of 2 to 16 iters.

These run on every redistribute call, so they must stay in microseconds.
Each operation is timed on freshly built layouts (no cached canonical form)
and, where a cache exists, on a layout that has been used before.

    python benchmarks/bench_layout.py            # table on stdout
    python benchmarks/bench_layout.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from axedist.layout import Iter, Layout, tile

AXES = ("m", "gpuid", "m", "lane")


def make_layout(n_iters: int) -> tuple[Layout, tuple[int, ...]]:
    """A row-major-ish layout of ``n_iters`` extent-2 iters over several axes, plus an admitted shape."""
    strides: dict[str, int] = {}
    shard = []
    for k in reversed(range(n_iters)):
        axis = AXES[k % len(AXES)]
        s = strides.get(axis, 1)
        shard.append(Iter(2, s, axis))
        strides[axis] = s * 2
    shard.reverse()
    shape = (2 ** (n_iters // 2), 2 ** (n_iters - n_iters // 2))
    replica = (Iter(2, strides.get("gpuid", 1), "gpuid"),)
    return Layout(shard, replica, {"gpuid": 0}), shape


def fresh(layout: Layout) -> Layout:
    return Layout(layout.shard, layout.replica, layout.offset)


def median_us(fn, repeat: int = 7, number: int = 200) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(samples)


def bench(n_iters: int) -> dict[str, float]:
    L, shape = make_layout(n_iters)
    other = fresh(L)
    inner = Layout([Iter(2, 2), Iter(2, 1)])
    begin = tuple(0 for _ in shape)
    end = tuple(max(1, s // 2) for s in shape)
    half = tuple(s // 2 for s in shape)
    return {
        "iters": n_iters,
        "canonicalize (fresh)": median_us(lambda: fresh(L).canonicalize()),
        "canonicalize (cached)": median_us(L.canonicalize),
        "== (fresh)": median_us(lambda: fresh(L) == fresh(other)),
        "== (cached)": median_us(lambda: L == other),
        "group": median_us(lambda: fresh(L).group(shape)),
        "tile": median_us(lambda: tile(L, inner, shape, (2, 2)), number=50),
        "slice": median_us(lambda: fresh(L).slice(shape, begin, end)),
        "slice (offset box)": median_us(lambda: fresh(L).slice(shape, half, shape)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    rows = [bench(n) for n in (2, 4, 8, 12, 16)]
    columns = list(rows[0])
    print(f"layout algebra, microseconds per call (median of 7), {platform.processor() or platform.machine()}")
    print(" | ".join(f"{c:>20}" if i else f"{c:>5}" for i, c in enumerate(columns)))
    for row in rows:
        print(" | ".join(f"{row[c]:>20.1f}" if i else f"{row[c]:>5}" for i, c in enumerate(columns)))
    worst = max(v for row in rows for k, v in row.items() if k != "iters")
    print(f"slowest operation: {worst:.1f} us ({'within' if worst < 1000 else 'OVER'} a millisecond)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": platform.python_version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
