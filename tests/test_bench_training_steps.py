"""The training-step benchmarks (``benchmarks/bench_tp.py``, ``bench_train_2d.py``) and what they
share (``benchmarks/training_steps.py``), on CPU: model FLOPs against issue 27's anchor, the
memory estimate against its measured peak, the peak table, presets; sides built before any
step, warmed up alone, then timed round-robin (the order checked on 2 gloo ranks); a side that
fails on every rank is left out with its error; each compiled side keeps its own graphs under
its own backend object (no recompiles when sides alternate; Inductor gets the side's config
patches); the fp32 loss check passes on equal losses and fails on a perturbed side; profiler
summaries (busy time as the union of intervals), the traces' collective arrivals (waiting vs own cost); and both scripts under torchrun, their
results files' fields (interleaving order, loss check, profile, per-side stats, history line).
"""

import json
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from axedist.nn.llama import LlamaConfig
from axedist.testing import run_on_ranks, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import training_steps as ts  # noqa: E402  benchmarks/training_steps.py

ANCHOR = LlamaConfig(vocab_size=8192, dim=4096, n_layers=2, n_heads=16, ffn_hidden=16384, max_seq_len=4096)
ENV = dict(os.environ, OMP_NUM_THREADS="1")
# the runs that compile (aot_eager) several sides on 2 and 4 ranks: bench_train_2d's took 122 s
# alone on the 2-core CI machine and over 300 s beside another xdist worker (4521b50's CI run)
COMPILED_RUN_TIMEOUT_S = 600


def test_model_flops_of_the_issue_anchor_are_60_ms_per_gpu_at_tp4():
    flops = ts.model_flops(ANCHOR, 16, 4096)
    # 6 x (2 x (4 x 4096^2 + 3 x 4096 x 16384) + 4096 x 8192) x 65536 + 6 x 2 x 16 x 4096^2 x 4096
    assert flops == 6 * (2 * (4 * 4096**2 + 3 * 4096 * 16384) + 4096 * 8192) * 65536 + 6 * 2 * 16 * 4096**3
    assert flops / 4 / 989e12 == pytest.approx(0.060, abs=0.001)
    # torch eager at TP=4 took 136 ms: about 44% MFU, as DESIGN.md says
    assert flops / (0.136 * 4 * 989e12) == pytest.approx(0.44, abs=0.01)


def test_grouped_query_attention_counts_fewer_kv_parameters():
    cfg, batch = ts.preset_config("llama8b", {}, {})
    per_layer = (cfg.dim * cfg.dim * 2 + 2 * cfg.dim * 1024) + 3 * cfg.dim * 14336
    assert ts.matmul_params(cfg) == 4 * per_layer + cfg.dim * cfg.vocab_size
    assert (cfg.n_heads, cfg.kv_heads, cfg.ffn_hidden, cfg.max_seq_len, batch) == (32, 8, 14336, 4096, 8)


def test_memory_estimate_matches_the_anchor_and_fits_the_preset_on_80_gb():
    anchor = ts.memory_estimate(ANCHOR, 16, 4)
    assert anchor["one_side"] / ts.GIB == pytest.approx(12.2, rel=0.05)  # torch measured 12.2 GiB
    cfg, batch = ts.preset_config("llama8b", {}, {})
    run = ts.memory_estimate(cfg, batch, 2, sides=5)
    step = run["all_sides"] - 5 * run["state_per_side"]
    # axedist at 1.5x torch's step memory, with 10 GiB for workspaces and fragmentation
    assert 5 * run["state_per_side"] + 1.5 * step + 10 * ts.GIB < 80e9
    assert "all 5 sides" in ts.describe_estimate(run)


def test_peak_flops_table():
    assert ts.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert ts.peak_flops("NVIDIA H200") == 989e12
    assert ts.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert ts.peak_flops("Some Future GPU") is None
    assert ts.peak_flops("Some Future GPU", 1000) == 1e15


def test_preset_overrides():
    cfg, batch = ts.preset_config("llama8b", {}, {"layers": 2, "seq": None, "batch": 4})
    assert (cfg.n_layers, cfg.max_seq_len, cfg.dim, batch) == (2, 4096, 4096, 4)
    default = dict(vocab_size=512, dim=128, n_layers=2, n_heads=8, ffn_hidden=512, max_seq_len=64, batch=8)
    cfg, batch = ts.preset_config("default", default, {"dim": 64})
    assert (cfg.dim, cfg.n_heads, batch) == (64, 8, 8)
    small = ts.check_config(ts.preset_config("llama8b", {}, {})[0], 4)
    assert small.n_heads // small.kv_heads == 4 and small.kv_heads % 4 == 0


def test_percentile_and_stats():
    side = ts.Side("a", None)
    side.times_ms, side.peaks, side.losses = [10.0, 30.0, 20.0, 40.0, 50.0], [5, 7, 6, 5, 5], [1.0] * 5
    side.raw_peaks, side.host_ms = [9, 9, 12, 9, 9], [3.0, 1.0, 2.0, 5.0, 4.0]
    stats = ts.side_stats(side, flops_per_step=1e12, world=2, peak=1e14)
    assert (stats["median_ms"], stats["min_ms"], stats["max_ms"]) == (30.0, 10.0, 50.0)
    assert stats["host_median_ms"] == 3.0
    assert stats["p10_ms"] == pytest.approx(14.0) and stats["p90_ms"] == pytest.approx(46.0)
    assert stats["mfu"] == pytest.approx(1e12 / (0.030 * 2 * 1e14))
    assert stats["peak_bytes"] == 7 and stats["process_peak_bytes"] == 12
    assert ts.side_stats(side, 1e12, 2, None)["mfu"] is None


def test_loss_comparison_passes_equal_and_fails_perturbed():
    same = ts.compare_losses({"torch": [6.0, 5.9], "axedist": [6.0, 5.9000001]}, "torch", 1e-4)
    assert same["passed"] and same["max_rel_diff"]["axedist"] < 1e-6
    off = ts.compare_losses({"torch": [6.0, 5.9], "axedist": [6.0, 5.91]}, "torch", 1e-4)
    assert not off["passed"] and off["max_rel_diff"]["axedist"] == pytest.approx(0.01 / 5.9)


def test_goals():
    stats = {"axedist": {"median_ms": 100.0, "peak_bytes": 10}, "torch": {"median_ms": 120.0, "peak_bytes": 10},
             "axedist compiled": {"median_ms": 90.0, "peak_bytes": 11},
             "torch compiled async-TP": {"median_ms": 100.0, "peak_bytes": 10}}
    met = {g["goal"]: g["met"] for g in ts.goals(stats)}
    assert met == {"eager step: torch eager / axedist eager": True,
                   "compiled step: torch compiled + async-TP / axedist compiled": True,
                   "peak memory eager: axedist / torch": True,
                   "peak memory compiled: axedist compiled / torch compiled async-TP": False}


def _event(name, start, end, device="CPU", parent=None, self_time=None):
    from torch.autograd import DeviceType

    return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start, end=end),
                                 device_type=getattr(DeviceType, device), cpu_parent=parent,
                                 self_cpu_time_total=end - start if self_time is None else self_time)


def test_profile_summary_busy_time_is_the_union_of_kernel_intervals():
    # two streams: a GEMM 0-1000 us, an NCCL kernel 500-1500 us beside it, a GEMM 2000-2500 us
    events = [_event("gemm", 0, 1000, "CUDA"), _event("nccl", 500, 1500, "CUDA"), _event("gemm", 2000, 2500, "CUDA"),
              _event("aten::mm", 0, 3000)]  # a CPU op: not a kernel
    summary = ts.profile_summary(events, cuda=True, top=15)
    assert summary["busy_ms"] == pytest.approx(2.0) and summary["summed_ms"] == pytest.approx(2.5)
    assert [t["name"] for t in summary["top"]] == ["gemm", "nccl"] and summary["top"][0]["calls"] == 2
    top = _event("step", 0, 3000, self_time=1000)
    cpu = ts.profile_summary([top, _event("aten::mm", 100, 2100, parent=top)], cuda=False, top=1)
    assert cpu["busy_ms"] == pytest.approx(3.0) and cpu["top"][0]["name"] == "aten::mm"


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


def test_each_compiled_side_keeps_its_own_graphs():
    """Three sides of the same module type, each block compiled under its side's backend object:
    each side compiles once (its blocks share the graph), none reuses another's, and alternating
    sides never recompiles; no dynamo reset in between."""
    import copy

    torch._dynamo.reset()
    ts.allow_compiled_sides()
    base = torch.nn.Sequential(*[_Block() for _ in range(3)])
    sides = []
    for _ in range(3):
        model, counter = copy.deepcopy(base), ts.GraphCounter("eager")
        for block in model:
            block.compile(backend=counter, dynamic=False)
        sides.append((model, counter))
    x = torch.randn(4, 8, requires_grad=True)  # every block's input requires grad, as in the Llama
    counts = []
    for _ in range(3):
        for model, _counter in sides:
            model(x).sum().backward()
        counts.append([c.graphs for _, c in sides])
    assert counts == [[1, 1, 1]] * 3
    torch._dynamo.reset()


def test_inductor_side_gets_its_config_patches(monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    monkeypatch.setattr(compile_fx_module, "compile_fx",
                        lambda gm, inputs, config_patches=None: seen.append(config_patches) or gm.forward)
    ts.GraphCounter("inductor", {"_micro_pipeline_tp": True})(torch.fx.symbolic_trace(_Block()), [])
    ts.GraphCounter("inductor")(torch.fx.symbolic_trace(_Block()), [])
    assert seen == [{"_micro_pipeline_tp": True}, {}]
    with pytest.raises(ValueError, match="Inductor's"):
        ts.GraphCounter("eager", {"_micro_pipeline_tp": True})(torch.fx.symbolic_trace(_Block()), [])


def _interleaved(rank, world):
    """Three fake sides (one fails to build on every rank): the order steps ran in."""
    built = []

    def maker(name, fail=False):
        def make():
            if fail:
                raise RuntimeError("no such kernel")
            built.append(name)

            def step(tokens):
                assert len(built) == 2, "every side is built before any step"
                return torch.tensor(float(tokens))
            return step
        return ts.Side(name, make, loss_value=float)

    sides = [maker("a"), maker("broken", fail=True), maker("b")]
    failed = {}
    timed, order = ts.run_interleaved(sides, list(range(10)), warmup=2, steps=3, cuda=False, say=lambda *a: None,
                                      failed=failed)
    return ([s.name for s in timed], order, [s.losses for s in timed], [len(s.times_ms) for s in timed],
            [s.warmup_ms != [] for s in timed], failed)


def test_sides_are_built_first_then_timed_round_robin():
    for names, order, losses, counts, warmed, failed in run_on_ranks(_interleaved, 2):
        assert names == ["a", "b"]
        assert order == [[0, "a"], [0, "b"], [1, "a"], [1, "b"], [2, "a"], [2, "b"]]
        assert losses == [[0.0, 1.0, 2.0, 3.0, 4.0]] * 2  # warm-up batches 0-1, then timed 2-4: the same per side
        assert counts == [3, 3] and warmed == [True, True]
        assert list(failed) == ["broken"] and "no such kernel" in failed["broken"]


def _loss_check(rank, world, perturb):
    def side(name, offset):
        return ts.Side(name, lambda: (lambda tokens: torch.tensor(6.0 - 0.1 * tokens + offset)), loss_value=float)

    sides = [side("torch", 0.0), side("axedist", perturb), ts.Side("crashes", lambda: 1 / 0)]
    return ts.run_loss_check(sides, [0, 1, 2], 3, False, 1e-4, "torch", lambda *a: None)


def test_loss_check_on_ranks():
    result = run_on_ranks(_loss_check, 2, args=(0.0,))[0]
    assert result["max_rel_diff"] == {"axedist": 0.0} and "ZeroDivisionError" in result["errors"]["crashes"]
    assert not result["passed"]  # a side that crashed fails the check
    result = run_on_ranks(_loss_check, 2, args=(1e-3,))[0]
    assert result["max_rel_diff"]["axedist"] == pytest.approx(1e-3 / 5.8, rel=1e-3)  # float32 losses
    assert not result["passed"]


def _read(out: Path, stem: str) -> dict:
    record = json.loads((out / f"{stem}.json").read_text())
    assert (out / f"{stem}.md").read_text().startswith("# ")
    assert (out / f"{stem}.png").stat().st_size > 0
    history = (out / "history" / f"{stem}.jsonl").read_text().splitlines()
    assert len(history) == 1 and json.loads(history[0])["commit"] == record["commit"]
    return record


def _check_record(record: dict, names: list, steps: int) -> None:
    assert list(record["sides"]) == names
    # interleaved: step i of every side before step i + 1 of any
    assert record["order"] == [[i, n] for i in range(steps) for n in names]
    for s in record["sides"].values():
        assert len(s["times_ms"]) == steps and s["min_ms"] <= s["median_ms"] <= s["max_ms"]
        assert s["mfu"] is None and s["peak_bytes"] is None  # CPU: no peak FLOPs, no CUDA memory
    check = record["loss_check"]
    assert check["passed"] and check["reference"] == "torch" and set(check["losses"]) == set(names)
    assert all(len(v) == check["steps"] for v in check["losses"].values())
    assert record["model_flops_per_step"] > 0 and "causal" in record["flops_formula"]
    assert record["failed"] == {}


def test_bench_tp_default_size_under_torchrun(tmp_path):
    rc, out, err = run_torchrun(["benchmarks/bench_tp.py", "--steps", "3", "--warmup", "1", "--profile",
                                 "--memory", "--out", str(tmp_path)], 2, cwd=str(ROOT), env=ENV)
    assert rc == 0, out[-3000:] + err[-3000:]
    record = _read(tmp_path, "bench_tp_cpu_w2")
    _check_record(record, ["axedist", "torch"], 3)
    assert record["preset"] == "default" and record["config"]["dim"] == 128
    assert set(record["profile"]) == {"axedist", "torch"}
    assert set(record["memory"]) == {"axedist", "torch"}  # CPU --memory: the profiler's allocation events
    for m in record["memory"].values():
        assert m["peak_bytes"] > 0 and 0 < sum(t["bytes"] for t in m["top"]) <= m["peak_bytes"]
    assert record["profile"]["axedist"]["top"] and record["profile"]["torch"]["busy_ms"] > 0
    assert "fp32 loss check passed" in out and "timed step 3/3" in out
    # the libraries warmed before any side's first step (at one rank's shapes), and the table says so
    assert record["library_warmup_s"] > 0 and "libraries warmed" in out
    assert "after `warm_libraries`" in (tmp_path / "bench_tp_cpu_w2.md").read_text()


def test_bench_tp_llama8b_structure_compiled_under_torchrun(tmp_path):
    """The llama8b preset's structure (32 heads, 8 KV heads) shrunk to CPU size, with compiled sides
    (aot_eager: no C++ compile): each compiles during its warm-up, never in the timed steps."""
    rc, out, err = run_torchrun(["benchmarks/bench_tp.py", "--preset", "llama8b", "--dim", "64", "--layers", "1",
                                 "--seq", "32", "--batch", "2", "--vocab", "256", "--ffn", "128", "--compile",
                                 "aot_eager", "--steps", "2", "--warmup", "2", "--check-steps", "2", "--out", str(tmp_path)], 2,
                                cwd=str(ROOT), env=ENV, timeout_s=COMPILED_RUN_TIMEOUT_S)
    assert rc == 0, out[-3000:] + err[-3000:]
    record = _read(tmp_path, "bench_tp_cpu_w2_llama8b")
    names = ["axedist", "torch", "axedist compiled", "torch compiled"]
    _check_record(record, names, 2)
    assert record["config"]["n_kv_heads"] == 8 and record["config"]["n_heads"] == 32
    assert record["loss_check"]["config"].count("n_kv_heads=4")
    for name in names[2:]:
        assert record["sides"][name]["graphs_compiled"] >= 1
        assert record["sides"][name]["recompiles_in_timed_steps"] == 0
    assert record["sides"]["axedist compiled"]["time_over_axedist"] == 1.0
    assert math.isfinite(record["sides"]["torch compiled"]["time_over_axedist"])


def test_bench_train_2d_under_torchrun(tmp_path):
    rc, out, err = run_torchrun(["benchmarks/bench_train_2d.py", "--preset", "llama8b", "--dim", "64", "--layers",
                                 "1", "--seq", "32", "--batch", "4", "--vocab", "256", "--ffn", "128", "--steps", "2",
                                 "--warmup", "1", "--compile", "aot_eager", "--eager-backends", "nccl", "--out",
                                 str(tmp_path)], 4, cwd=str(ROOT), env=ENV,
                                timeout_s=COMPILED_RUN_TIMEOUT_S)
    assert rc == 0, out[-3000:] + err[-3000:]
    record = _read(tmp_path, "bench_train_2d_cpu_w4_llama8b")
    _check_record(record, ["axedist", "torch", "axedist nccl", "axedist compiled", "torch compiled"], 2)
    assert record["mesh"] == {"dp": 2, "tp": 2} and record["batch"] == 4 and record["library_warmup_s"] > 0
    for name in ("axedist", "torch"):
        assert record["sides"][name]["bytes_per_step"] > 0
    assert record["sides"]["axedist nccl"]["bytes_per_step"] == record["sides"]["axedist"]["bytes_per_step"]
    assert all(s["state_bytes"] > 0 for s in record["sides"].values())
    assert 0.9 < record["axedist_over_torch_bytes"] < 1.1  # (_check_record: the compiled sides' fp32 losses match too)


def test_pinned_side_pins_its_backend_while_it_steps_and_restores_it():
    from axedist.runtime import fused_backend, plan_backend

    plan, fused = plan_backend(), fused_backend()
    seen = []

    def step(tokens):
        seen.append((tokens, plan_backend(), fused_backend()))
        if tokens == "bad":
            raise RuntimeError("step failed")
        return tokens

    assert ts.pinned("nccl", step)("t") == "t" and seen[-1] == ("t", "torch", fused)
    assert ts.pinned("p2p", step)("u") == "u" and seen[-1] == ("u", plan, "p2p")
    with pytest.raises(RuntimeError, match="step failed"):
        ts.pinned("torch", step)("bad")
    assert seen[-1] == ("bad", plan, "torch")
    assert (plan_backend(), fused_backend()) == (plan, fused)
    with pytest.raises(ValueError, match="plan_backend must be one of"):
        plan_backend("nccl")
    assert plan_backend() == plan


def test_live_at_peak_replays_the_allocator_trace():
    mine = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"},
            {"filename": "/work/axedist/nn/llama.py", "line": 42, "name": "forward"}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": mine},
             {"action": "alloc", "addr": 2, "size": 50, "frames": []},
             {"action": "free_requested", "addr": 1, "size": 100},
             {"action": "free_completed", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 3, "size": 60, "frames": mine[1:]},
             {"action": "alloc", "addr": 4, "size": 70, "frames": mine},   # peak: 50 + 60 + 70 = 180
             {"action": "free_completed", "addr": 4, "size": 70},
             {"action": "alloc", "addr": 5, "size": 10, "frames": []}]
    got = ts.live_at_peak(trace, top=5)
    assert got["peak_bytes"] == 180 and got["blocks"] == 3
    sites = {t["site"]: (t["bytes"], t["blocks"]) for t in got["top"]}
    assert sites == {"nn/llama.py:42 forward < nn/functional.py:9 linear": (70, 1),
                     "nn/llama.py:42 forward": (60, 1), "(no Python frame)": (50, 1)}
    assert [t["bytes"] for t in got["top"]] == [70, 60, 50]


def test_cpu_allocation_trace_replays_what_the_profiler_saw_allocated_and_freed():
    kept = []

    def allocate_some():
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(3 << 20, dtype=torch.uint8)  # both live: the peak
        del a
        kept.append(b)

    def run(around):
        torch.empty(5 << 20, dtype=torch.uint8)  # outside around(): not seen
        with around():
            allocate_some()

    trace = ts.cpu_allocation_trace(run)
    got = ts.live_at_peak(trace)
    assert 4 << 20 <= got["peak_bytes"] < (4 << 20) + (256 << 10), got
    mine = [t for t in got["top"] if "allocate_some" in t["site"]]
    assert mine and mine[0]["bytes"] == 4 << 20 and mine[0]["blocks"] == 2, got["top"]
    live = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
        else:
            live.pop(event["addr"], None)
    assert (3 << 20) <= sum(live.values()) < (3 << 20) + (256 << 10)  # what was kept, a freed


def _each_side(rank, world):
    def one(side):
        if side.name == "b" and rank == 1:
            raise RuntimeError("out of memory")
        return {"rank": rank} if rank == 0 else None
    return ts.each_side([ts.Side("a", None), ts.Side("b", None), ts.Side("c", None)], False, one)


def test_each_side_records_a_side_that_failed_on_one_rank_on_every_rank():
    first, second = run_on_ranks(_each_side, 2)
    assert first == {"a": {"rank": 0}, "b (failed)": {"error": "failed on another rank"}, "c": {"rank": 0}}
    assert second == {"b (failed)": {"error": "RuntimeError: out of memory"}}


def _slow_part():
    return sum(math.sqrt(i) for i in range(200_000))


def test_first_step_profile_names_where_the_time_went():
    import cProfile
    profiler = cProfile.Profile()
    with profiler:
        _slow_part()
        sum(range(10))
    found = ts.functions_by_time(profiler, top=5)
    assert found["profiled_s"] > 0
    cumulative = [r["function"] for r in found["by_cumulative_time"]]
    assert any(name.endswith("_slow_part") for name in cumulative), cumulative
    own = found["by_own_time"]
    assert own == sorted(own, key=lambda r: -r["own_s"]) and len(own) <= 5
    text = ts.markdown_tables({"sides": {"axedist": {
        "time_over_axedist": None, "recompiles_in_timed_steps": None, "warmup_ms": [1.0], "host_median_ms": 1.0,
        "median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "mfu": None,
        "peak_bytes": None, "resident_bytes": None, "losses": [1.0], "first_step_profile": found}},
        "model_flops_per_step": 1.0, "flops_formula": "-", "world": 1, "peak_flops_per_gpu": None})
    assert "First step of axedist under cProfile" in text and "_slow_part" in text


def test_trace_arrivals_split_each_collective_into_waiting_and_its_own_cost(tmp_path):
    """Two ranks' traces of one step, made up: per call, the time after the last rank arrives is
    the collective's own cost, the rest of each rank's kernel time that rank waiting; GEMMs are
    not collectives; a kernel called a different number of times on the ranks is an error."""
    import trace_summary  # benchmarks/trace_summary.py

    def write(rank, kernels):
        events = [dict(ph="X", cat="kernel", name=n, ts=ts, dur=dur) for n, ts, dur in kernels]
        path = tmp_path / f"trace_ours_rank{rank}.json"
        path.write_text(json.dumps(dict(traceEvents=events)))
        return str(path)

    # call 1: rank 0 arrives at 100, rank 1 at 400, both end at 1400 (own cost 1000, rank 0 waits 300);
    # call 2: both arrive at 5000 and end at 5500
    paths = [write(0, [("reduce_scatter_kernel", 100, 1300), ("nvjet_gemm", 2000, 900),
                       ("reduce_scatter_kernel", 5000, 500)]),
             write(1, [("reduce_scatter_kernel", 400, 1000), ("nvjet_gemm", 2000, 900),
                       ("reduce_scatter_kernel", 5000, 500)])]
    got = trace_summary.arrivals(paths, rank=0)
    assert set(got) == {"reduce_scatter_kernel"}
    r = got["reduce_scatter_kernel"]
    assert r["calls"] == 2
    assert r["rank_ms"] == pytest.approx(1.8) and r["own_ms"] == pytest.approx(1.5)
    assert r["waiting_ms"] == pytest.approx(0.3) and r["max_lag_ms"] == pytest.approx(0.3)
    assert trace_summary.arrivals(paths, rank=1)["reduce_scatter_kernel"]["waiting_ms"] == pytest.approx(0.0)
    table = trace_summary.arrivals_markdown({"ours": got}, 0)
    assert "| ours | `reduce_scatter_kernel` | 2 | 1.8 | 1.5 | 0.3 | 0.30 |" in table
    uneven = write(1, [("reduce_scatter_kernel", 400, 1000)])
    with pytest.raises(ValueError, match="calls on different ranks"):
        trace_summary.arrivals([paths[0], uneven])


def test_trace_gaps_name_the_kernels_around_each_idle_stretch_and_the_late_launch(tmp_path):
    """One rank's made-up trace: two idle stretches on the GPU (kernels on two streams overlap,
    so the union, not each stream, decides idleness); the longest comes first, with the kernels
    around it, when the host launched the next kernel relative to the GPU going idle (late: +),
    the innermost host op around that launch and a host synchronization inside it."""
    import trace_summary  # benchmarks/trace_summary.py

    def kernel(name, ts, dur, corr):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(correlation=corr))

    def launch(ts, corr):
        return dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=5, tid=1,
                    args=dict(correlation=corr))

    events = [kernel("gemm_a", 0, 1000, 1), kernel("side_stream", 500, 1500, 2),  # busy 0 - 2000
              kernel("norm", 2300, 100, 3),                                          # idle 2000 - 2300
              kernel("gemm_b", 4000, 500, 4),                                        # idle 2400 - 4000
              launch(10, 1), launch(20, 2), launch(1900, 3), launch(3900, 4),
              dict(ph="X", cat="cpu_op", name="aten::mm", ts=3800, dur=200, tid=1),
              dict(ph="X", cat="cpu_op", name="aten::linear", ts=3000, dur=1100, tid=1),
              dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=2500, dur=900, tid=1)]
    path = tmp_path / "trace_ours_rank0.json"
    path.write_text(json.dumps(dict(traceEvents=events)))
    got = trace_summary.gaps(str(path), 5)
    assert [round(g["ms"], 3) for g in got] == [1.6, 0.3]
    longest, short = got
    assert (longest["before"], longest["after"]) == ("norm", "gemm_b")
    assert longest["launch_ms"] == pytest.approx(1.5) and longest["host_op"] == "aten::mm"
    assert longest["syncs"] == ["cudaStreamSynchronize"]
    assert (short["before"], short["after"]) == ("side_stream", "norm")
    assert short["launch_ms"] == pytest.approx(-0.1) and short["host_op"] is None and short["syncs"] == []
    table = trace_summary.gaps_markdown({"ours": got}, 0)
    assert "| ours | 1.60 | `norm` | `gemm_b` | +1.50 | `aten::mm` | cudaStreamSynchronize |" in table
