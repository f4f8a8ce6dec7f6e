"""Compile every collective kernel the tests and benchmarks launch, in parallel, into Triton's
disk cache: the ranks then load them instead of compiling one by one on first use.

    python3 benchmarks/precompile_collectives.py --worlds 2 4 --jobs 32      # needs no GPU

Kernels differ by op, dtype, W, tile rows (2 or 4), variant (push / pull / pull zero-copy) and
whether the sizes are multiples of 16; each is compiled through p2p.compile_collective, the
function the GPU path calls, so the cache keys are the ones the launches look up.
"""
import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch


from axedist.collectives import p2p  # noqa: E402

OPS = ("reduce_scatter", "all_gather", "all_reduce_one_shot", "all_reduce_two_shot")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (push, copy_in): push, pull with the copy fused in, pull of an input already in the workspace
VARIANTS = ((True, True), (False, True), (False, False))


def _compile(case):
    op, dtype, world, rows, (push, copy_in), chunk = case
    p2p.compile_collective(op, dtype, world, rows, push, copy_in, False, chunk, True, 90)
    return case


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args()
    cases = list(itertools.product(OPS, DTYPES, args.worlds, (2, 4), VARIANTS, (16, 1)))
    start = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        for _ in pool.map(_compile, cases):
            pass
    print(f"precompiled {len(cases)} collective kernels in {time.time() - start:.1f} s "
          f"with {args.jobs} processes", flush=True)


if __name__ == "__main__":
    main()
