"""The benchmarks' held timing (collectives.timing.held_time) on one GPU: a candidate doing twice
the work of another reads about twice its time held, every round is reported, and the clock and
power readings, where NVML gives them, are a running GPU's."""
import math

import torch

from axedist.collectives.timing import GpuSampler, held_time


def test_held_time_scales_with_the_work(group, seed):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / math.sqrt(4096)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out, again = torch.empty_like(a), torch.empty_like(a)

    def once():
        torch.mm(a, b, out=out)

    def twice():
        torch.mm(a, b, out=out)
        torch.mm(out, b, out=again)

    sampler = GpuSampler()
    held = held_time({"once": once, "twice": twice}, window_s=0.2, warm_s=0.2, rounds=3, group=group,
                     sampler=sampler)
    assert set(held) == {"once", "twice"}
    for name, value in held.items():
        assert len(value["rounds"]) == 3 and all(ms > 0 for ms in value["rounds"]), (name, value, seed)
        assert min(value["rounds"]) <= value["ms"] <= max(value["rounds"]), (name, value)
        if value["mhz"] is not None:  # NVML present: a GPU running GEMMs, not an idle or absent one
            assert 300 < value["mhz"] < 2500 and 50 < value["watts"] < 1500, (name, value)
    ratio = held["twice"]["ms"] / held["once"]["ms"]
    assert 1.6 < ratio < 2.4, (ratio, held, seed)
