"""Time plan construction (``plan_layouts``) for a few transitions: cold, and from the cache.

A redistribute call looks its plan up on every call, so the cached time is the one that
matters per step of training; the cold time is paid once per (layouts, shape, mesh).
Shapes are large (the planner never enumerates elements on the digit path).

    python benchmarks/bench_plan.py            # table on stdout
    python benchmarks/bench_plan.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from axedist.layout import Layout
from axedist.planning import clear_plan_cache, plan_layouts

G8 = (("gpuid", 8),)
XY = (("x", 2), ("y", 4))

# (name, source, target, mesh, shape, partial)
TRANSITIONS = [
    ("Shard(0) -> Replicate, 8", "S[(8,1024,8192):(1@gpuid,8192,1)]",
     "S[(8192,8192):(8192,1)] + R[8:1@gpuid]", G8, (8192, 8192), None),
    ("Shard(0) -> Shard(1), 8", "S[(8,1024,8192):(1@gpuid,8192,1)]",
     "S[(8192,8,1024):(1024,1@gpuid,1)]", G8, (8192, 8192), None),
    ("Partial -> Shard(0), 8", "S[(8,8192,8192):(1@gpuid,8192,1)]",
     "S[(8,1024,8192):(1@gpuid,8192,1)]", G8, (8192, 8192), "sum"),
    ("Partial -> Replicate, 8", "S[(8,8192,8192):(1@gpuid,8192,1)]",
     "S[(8192,8192):(8192,1)] + R[8:1@gpuid]", G8, (8192, 8192), "sum"),
    ("[S0,S1] -> [S1,S0], 2x4", "S[(2,2048,4,2048):(1@x,2048,1@y,1)]",
     "S[(4,1024,2,4096):(1@y,4096,1@x,1)]", XY, (4096, 8192), None),
    ("[P,P] -> [R,S0], 2x4", "S[(2,4,4096,8192):(1@x,1@y,8192,1)]",
     "S[(4,1024,8192):(1@y,8192,1)] + R[2:1@x]", XY, (4096, 8192), "sum"),
    ("block-cyclic -> reversed devices, 8", "S[(4,8,256,8192):(256,1@gpuid,1,1024)]",
     "S[(8,1024,8192):(-1@gpuid,8192,1)] + 7@gpuid", G8, (8192, 8192), None),
    ("blocks of 3 vs 2 (no refinement), 2", "S[(1048576,2,2,3):(6,3,1@gpuid,1)]",
     "S[(1048576,3,2,2):(6,2,1@gpuid,1)]", (("gpuid", 2),), (1048576, 12), None),
    ("partial, no refinement (elements), 4", "S[(2,2,2,3):(1@gpuid,3,2@gpuid,1)]",
     "S[(3,2,2):(2,1@gpuid,1)]", (("gpuid", 4),), (12,), "sum"),
]


def time_us(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    for name, src_text, dst_text, mesh, shape, partial in TRANSITIONS:
        def cold():
            clear_plan_cache()
            # fresh layouts: no canonical form cached on them either
            return plan_layouts(Layout.parse(src_text), Layout.parse(dst_text), mesh, shape, partial=partial)

        src, dst = Layout.parse(src_text), Layout.parse(dst_text)
        plan = plan_layouts(src, dst, mesh, shape, partial=partial)
        rows.append({
            "transition": name,
            "steps": " + ".join(plan.kinds) or "-",
            "method": plan.method,
            "max_sent_MB": max(plan.bytes_sent.values()) / 2**20,
            "cold_us": time_us(cold, max(3, args.repeat // 4)),
            "cached_us": time_us(lambda: plan_layouts(src, dst, mesh, shape, partial=partial), args.repeat * 10),
        })
    header = f"{'transition':38} {'steps':34} {'method':8} {'max sent MB':>11} {'cold us':>9} {'cached us':>9}"
    print(f"# plan construction, python {platform.python_version()}, {platform.machine()}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['transition']:38} {r['steps']:34} {r['method']:8} {r['max_sent_MB']:11.2f} "
              f"{r['cold_us']:9.0f} {r['cached_us']:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
