"""bench_decode's kernel table of a CUDA-graph step (``per_step_kernels``), on CPU: launches and
device time per step per kernel, robust to the few launches of a collective that waited for a
rank the profiler delayed."""

import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decode  # noqa: E402  benchmarks/bench_decode.py


def test_its_example_holds():
    assert doctest.testmod(bench_decode, verbose=False).failed == 0


@pytest.mark.parametrize("steps", [1, 5, 20])
def test_a_delayed_launch_does_not_inflate_a_kernel(steps):
    # every step: 7 tails of 8 us and 8 GEMMs of 17 us; the first step's tails waited 50 us more
    launches = []
    for step in range(steps):
        launches += [("all_reduce_rms_norm_kernel", 58.0 if step == 0 else 8.0)] * 7
        launches += [("nvjet_gemm", 17.0)] * 8
    rows = {row["name"]: row for row in bench_decode.per_step_kernels(launches, steps)}
    assert rows["nvjet_gemm"] == dict(name="nvjet_gemm", count=8, us=8 * 17.0)
    tail = rows["all_reduce_rms_norm_kernel"]
    assert tail["count"] == 7
    # one step: every launch of it waited (nothing to tell them from); more steps: the median is the 8 us
    assert tail["us"] == (7 * 58.0 if steps == 1 else 7 * 8.0)
    assert [row["name"] for row in bench_decode.per_step_kernels(launches, steps)][0] == (
        "all_reduce_rms_norm_kernel" if steps == 1 else "nvjet_gemm")
