"""Fused GEMM + reduce-scatter vs cuBLAS + NCCL vs PyTorch's fused op, side by side in one run.

    torchrun --nproc_per_node=4 benchmarks/bench_gemm_rs.py --out benchmarks/results

Per shape (bf16, A [M, K_local], B [K_local, N], scatter dim 0), times in ms (median of --reps
calls timed with CUDA events, max over ranks). Every column is timed twice
(axedist/collectives/timing.py), both with the columns interleaved: eager (calls as a program issues
them, each column three calls back to back, the last timed: a call whose CPU side is slower than
its GPU side shows its host time) and queued (the GPU runs the calls back
to back behind a sleep kernel: device time). The tile config is chosen on queued time.
  cublas     torch.mm alone            nccl_rs    NCCL reduce-scatter of the [M, N] partial alone
  seq        torch.mm then NCCL RS     symm       torch.ops.symm_mem.fused_matmul_reduce_scatter
  fused      axedist.gemm_reduce_scatter (p2p, best tile config of --tune, same on all ranks)
  gemm_only  the fused kernel with its reduce tasks removed
  p2p_rs     axedist's p2p reduce-scatter of the [M, N] partial (with copy-in)
  limit      max(cublas, RS bytes in per GPU / 478 GB/s)
--held S adds a third timing of cublas, seq, symm, fused and auto: each held back to back at the
GPU's power cap (timing.held_time: 1 s untimed, then S seconds timed, 3 rounds), as a training step
runs them; burst timings start from an idle GPU at a higher clock (results/probe_gemm_power.md).
Writes gemm_rs_w{W}.json / .md / .png (gemm_rs_w{W}_held.* with --held: such runs time a few
shapes); also the tuned configs (gemm_rs_tuned_w{W}.json).
Multicast stays off: this script refuses to run with AXEDIST_ENABLE_MULTICAST=1 set.
"""
import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist


from axedist.collectives import p2p, plan_gemm_reduce_scatter, reduce_scatter_into  # noqa: E402
from axedist.collectives.fused import gemm_only, gemm_reduce_scatter, gemm_reduce_scatter_variant  # noqa: E402
from axedist.collectives.timing import GpuSampler, held_time, time_interleaved  # noqa: E402
from axedist.kernels import gemm_rs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py, beside this script
from history import (append_history, auto_cell, auto_vs_best, merged_with_earlier, run_meta, symm_fastest,  # noqa: E402
                     table_source, unfused_time)

LINK_BYTES_PER_S = 478e9


def model_shapes(world, batch: int = 8):
    """The GEMM + reduce-scatter calls of one step of bench_tp's --preset llama8b at TP = world (Llama-3-8B
    layers, batch x 4096 rows, batch 8 unless given): wo and w2 forward, the q/k/v and w1/w3 input gradients, the output layer's."""
    rows, dim, kv, ffn, vocab = batch * 4096, 4096, 8 * 128, 14336, 16384
    model = "llama8b" if batch == 8 else f"llama8b b{batch}"
    return [(f"{model} wo", rows, dim, dim // world), (f"{model} w2", rows, dim, ffn // world),
            (f"{model} qkv grad", rows, dim, (dim + 2 * kv) // world),
            (f"{model} w1w3 grad", rows, dim, 2 * ffn // world), (f"{model} output grad", rows, dim, vocab // world)]


def shapes(world, which: str = "design", batch: int = 8):
    if which == "llama8b":
        return model_shapes(world, batch)
    rows = []
    for m in (2048, 8192, 16384):
        for k in (7168, 2048):
            rows.append(("design", m, 8192, k))
    rows.append(("qwen3-32b", 8192, 5120, 25600 // world))
    rows.append(("llama3.1-405b", 8192, 16384, 53248 // world))
    for m in (128, 512):
        rows.append(("inference", m, 8192, 7168))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tune", default="all", help="'all' candidate configs, or 'default'")
    parser.add_argument("--only", default="", help="comma list of shape indices to run")
    parser.add_argument("--shapes", default="design", choices=["design", "llama8b"],
                        help="design: the six design shapes and model/inference rows; llama8b: the calls of "
                             "bench_tp.py --preset llama8b at this world size")
    parser.add_argument("--batch", type=int, default=8,
                        help="--shapes llama8b: bench_tp's batch (rows = batch x 4096; its GPU-bound TP=4 size is 16)")
    parser.add_argument("--configs", default="",
                        help="comma list of gemm_rs.CANDIDATES indices or config strings such as "
                             "128x128x64/g8/s3/w4/r64/defer/push/c2 (with --tune all)")
    parser.add_argument("--variants", action="store_true",
                        help="also time signal-only and GPU-scope variants (where the time goes)")
    parser.add_argument("--held", type=float, default=0.0, metavar="SECONDS",
                        help="also time cuBLAS, seq, symm, fused and auto HELD back to back at the "
                             "power cap (timing.held_time: 1 s untimed, then SECONDS timed, 3 rounds)")
    parser.add_argument("--render", default=None, metavar="RESULTS_JSON",
                        help="no benchmark: write the .md and .png of this result file into --out")
    parser.add_argument("--tables-from", nargs="+", default=None, metavar="RESULTS_JSON",
                        help="no benchmark: write what 'auto' uses (axedist/kernels/gemm_rs_auto.json: "
                             "the shapes where fused lost; gemm_rs_tuned.json: the best tile config per "
                             "shape) from these result files (one per world size)")
    args = parser.parse_args()
    if args.tables_from:
        write_tables(args.tables_from)
        return
    if args.render:
        with open(args.render) as handle:
            saved = json.load(handle)
        write_outputs(saved["rows"], saved["rows"][0]["world"], args.out, meta=saved["meta"])
        return
    if os.environ.get("AXEDIST_ENABLE_MULTICAST") == "1":
        raise SystemExit("refusing to benchmark with AXEDIST_ENABLE_MULTICAST=1 (policy)")
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        expected = "0" if name == "NCCL_NVLS_ENABLE" else "1"
        if os.environ.get(name) != expected:
            raise SystemExit(f"set {name}={expected} (multicast must stay off)")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    group_name = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)
    torch.manual_seed(1234 + rank)
    results = []
    sampler = GpuSampler() if args.held else None
    selected = [int(i) for i in args.only.split(",") if i] or None
    for index, (label, m, n, k) in enumerate(shapes(world, args.shapes, args.batch)):
        if selected is not None and index not in selected:
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        partial = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        rs_out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
        row = dict(label=label, M=m, N=n, K_local=k, world=world)
        queued = row["queued"] = {}

        def seq():
            torch.mm(a, b, out=partial)
            reduce_scatter_into(rs_out, partial)

        def symm():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)
        torch.mm(a, b, out=partial)
        try:
            symm()
        except Exception as error:  # keep the run going; say why in the table
            symm = None
            row["symm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        # tile config: every candidate timed fused (device time, interleaved); the same
        # max-over-ranks numbers on every rank give every rank the same choice
        key = gemm_rs.shape_key(m, n, k, world, torch.bfloat16)
        every = ([gemm_rs.CANDIDATES[int(c)] if c.isdigit() else gemm_rs.GemmConfig.parse(c)
                  for c in args.configs.split(",")] if args.configs else gemm_rs.CANDIDATES)
        candidates = (every if args.tune == "all" else gemm_rs.CANDIDATES[:1] if args.tune == "first"
                      else (gemm_rs.default_config(m, n, k, world, torch.bfloat16),))
        runnable = {}
        fitting = [c for c in candidates if not (m // world < c.block_m // 2 and c.block_m > 64)]
        # mostly-empty tiles are not worth compile time; the heuristic's choice if none is left
        for config in fitting or [gemm_rs.default_config(m, n, k, world, torch.bfloat16)]:
            try:  # compile and check that it runs before it enters the timed set
                gemm_reduce_scatter_variant(a, b, None, config, gemm_rs.FUSED, out=rs_out)
                torch.cuda.synchronize()
                runnable[str(config)] = (lambda c: lambda: gemm_reduce_scatter_variant(
                    a, b, None, c, gemm_rs.FUSED, out=rs_out))(config)
            except Exception as error:
                row.setdefault("config_errors", {})[str(config)] = f"{type(error).__name__}: {str(error)[:300]}"
        tried = time_interleaved(runnable, args.reps, queued=True)
        best_name = min(tried, key=tried.get)
        best = next(config for config in list(candidates) + [gemm_rs.default_config(m, n, k, world, torch.bfloat16)]
                    if str(config) == best_name)
        gemm_rs.remember_config(key, best)
        row["config"] = best_name
        row["fused_by_config_queued"] = tried
        only_out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        columns = {"cublas": lambda: torch.mm(a, b, out=partial),
                   "nccl_rs": lambda: reduce_scatter_into(rs_out, partial),
                   "p2p_rs": lambda: p2p.reduce_scatter(partial, out=rs_out),
                   "seq": seq, "symm": symm,
                   "fused": lambda: gemm_reduce_scatter(a, b, None, backend="p2p", out=rs_out),
                   "auto": lambda: gemm_reduce_scatter(a, b, None),  # what a user's call runs (the shipped tables)
                   "gemm_only": lambda: gemm_only(a, b, world, best, out=only_out)}
        # where the fused time goes: the same kernel with flag releases but no reduce tasks,
        # with stores, flags and reduce but no GEMM math, and other reduce lags
        if args.variants:
            for name, mode, lag_waves in (("signal_only", gemm_rs.GEMM_AND_SIGNAL, None),
                                          ("no_math", gemm_rs.NO_MATH, None),
                                          ("fused_lag4", gemm_rs.FUSED, 4.0),
                                          ("fused_lag_end", gemm_rs.FUSED, 1e9)):
                columns[name] = (lambda mode, lag: lambda: gemm_reduce_scatter_variant(
                    a, b, None, best, mode, out=rs_out, lag_waves=lag))(mode, lag_waves)
        columns = {name: fn for name, fn in columns.items() if fn is not None}
        # device time: all columns in one interleaved loop (same clocks and temperature for
        # all); eager: interleaved too, in blocks of three calls of a column, the last timed,
        # since an eager call's interval also depends on what the host did just before it
        # (after PyTorch's symm op, whose host side is several hundred us, the next call finds
        # an idle GPU). Until 2026-11-29 the eager columns ran one after another, and at
        # the power cap the H200s' clocks moved between them: the 405B shape's "eager wait"
        # (12.77 vs 10.90 ms device at d9d6530) was a column timed while a GPU ran at 1.1 GHz
        # (benchmarks/probe_gemm_rs_eager.py)
        # aligned: the columns that couple the ranks (NCCL RS after the local cuBLAS and GEMM-only
        # columns) no longer absorb the ranks' skew (until 330c04f NCCL RS's device column did:
        # 0.678 ms device vs 0.326 eager at 8192 x 8192 x 7168)
        queued.update(time_interleaved(columns, args.reps, queued=True, align=True))
        row.update(time_interleaved(columns, args.reps, block=3))
        row.setdefault("symm", None)
        queued.setdefault("symm", None)
        if args.held:  # what a training step sees: every column at the clock its power allows
            held = held_time({name: columns[name] for name in ("cublas", "seq", "symm", "fused", "auto")
                              if name in columns}, window_s=args.held, sampler=sampler)
            row["held"] = {name: value["ms"] for name, value in held.items()}
            row["held_gpu"] = {name: {"mhz": value["mhz"], "watts": value["watts"]} for name, value in held.items()}
        row["auto_backend"] = plan_gemm_reduce_scatter(a, b, None).backend
        host = row["host_us"] = {}
        for name in ("seq", "symm", "fused", "auto", "gemm_only"):  # auto: W=4's eager gap at M = 128 / 512
            if name in columns:
                torch.cuda.synchronize()
                begin = time.perf_counter()
                for _ in range(20):
                    columns[name]()
                host[name] = (time.perf_counter() - begin) / 20 * 1e6
        torch.cuda.synchronize()
        dist.barrier()
        # correctness of what was timed: fused vs cuBLAS + NCCL, gemm-only vs cuBLAS
        fused_out = gemm_reduce_scatter(a, b, None, backend="p2p", check=True)
        seq()
        torch.cuda.synchronize()
        row["fused_rel_err_vs_seq"] = ((fused_out.float() - rs_out.float()).norm() / rs_out.float().norm()).item()
        gemm_only(a, b, world, best, out=only_out)
        torch.mm(a, b, out=partial)
        row["gemm_only_rel_err"] = ((only_out.float() - partial.float()).norm() / partial.float().norm()).item()
        rs_bytes_in = (world - 1) / world * m * n * 2
        for times in (row, queued):
            times["limit"] = max(times["cublas"], rs_bytes_in / LINK_BYTES_PER_S * 1e3)
            times["speedup_vs_seq"] = times["seq"] / times["fused"]
            times["speedup_vs_symm"] = (times["symm"] / times["fused"]) if times["symm"] else None
            times["gemm_only_vs_cublas"] = times["cublas"] / times["gemm_only"]
            times["fused_over_limit"] = times["fused"] / times["limit"]
            times["auto_vs_best"] = auto_vs_best(times)
        results.append(row)
        if rank == 0 and args.variants:
            print(f"    variants (queued): signal_only {queued['signal_only']:.3f} no_math {queued['no_math']:.3f} "
                  f"fused_lag4 {queued['fused_lag4']:.3f} fused_lag_end {queued['fused_lag_end']:.3f}", flush=True)
        if rank == 0:
            print(f"[{index}] {label} M={m} N={n} K={k}: cublas {row['cublas']:.3f} nccl_rs {row['nccl_rs']:.3f} "
                  f"seq {row['seq']:.3f} symm {row['symm'] if row['symm'] is None else round(row['symm'], 3)} "
                  f"fused {row['fused']:.3f} ({best_name}) gemm_only {row['gemm_only']:.3f} p2p_rs {row['p2p_rs']:.3f} "
                  f"limit {row['limit']:.3f} | x{row['speedup_vs_seq']:.2f} vs seq, err {row['fused_rel_err_vs_seq']:.1e}"
                  f" | queued: seq {queued['seq']:.3f} fused {queued['fused']:.3f} gemm_only {queued['gemm_only']:.3f}"
                  f" cublas {queued['cublas']:.3f} x{queued['speedup_vs_seq']:.2f} | host us fused {host['fused']:.0f}"
                  f" seq {host['seq']:.0f}", flush=True)
        del a, b, partial, only_out, fused_out
        torch.cuda.empty_cache()
    if rank == 0:
        write_outputs(results, world, args.out)
    dist.barrier()
    dist.destroy_process_group()


def auto_tables(results: list[dict]) -> tuple[dict, dict]:
    """(gemm_rs_auto.json, tuned configs) from benchmark result files: a shape where fused was
    slower than the unfused pair (cuBLAS + the faster of NCCL's and our reduce-scatter,
    ``unfused_time``) in device time (the queued table; eager for runs that have none) goes to
    "fused_loses"; every shape's chosen config to the tuned table."""
    loses, wins, configs, sources = [], [], {}, []
    for result in results:
        meta = result["meta"]
        sources.append(table_source(meta))
        for row in result["rows"]:
            times = row.get("queued", row)
            shape = [row["M"], row["N"], row["K_local"], row["world"]]
            if symm_fastest(row):
                wins.append(shape)
            elif times["fused"] > unfused_time(times):
                loses.append(shape)
            key = gemm_rs.shape_key(row["M"], row["N"], row["K_local"], row["world"], torch.bfloat16)
            configs[key] = dataclasses.asdict(gemm_rs.GemmConfig.parse(row["config"]))
    return dict(source=sources, fused_loses=sorted(loses), symm_wins=sorted(wins)), configs


def write_tables(paths: list[str]) -> None:
    results = []
    for path in paths:
        with open(path) as handle:
            results.append(json.load(handle))
    auto, configs = auto_tables(results)
    from axedist.collectives.fused import AUTO_TABLE_PATH
    # shapes these results did not measure keep what earlier runs found
    measured = {(row["M"], row["N"], row["K_local"], row["world"]) for result in results for row in result["rows"]}
    with open(AUTO_TABLE_PATH) as handle:
        earlier = json.load(handle)
    auto = merged_with_earlier(earlier, auto, measured)
    with open(AUTO_TABLE_PATH, "w") as handle:
        shapes = {key: ",\n  ".join(json.dumps(shape) for shape in auto[key]) for key in ("fused_loses", "symm_wins")}
        handle.write(f'{{"source": {json.dumps(auto["source"], indent=1)},\n'
                     f' "fused_loses": [\n  {shapes["fused_loses"]}\n ],\n'
                     f' "symm_wins": [\n  {shapes["symm_wins"]}\n ]}}\n')
    tuned_path = os.path.join(os.path.dirname(gemm_rs.__file__), "gemm_rs_tuned.json")
    with open(tuned_path) as handle:
        tuned = json.load(handle)
    tuned.update(configs)  # the shapes these results measured get their new configs; the rest stay
    with open(tuned_path, "w") as handle:
        json.dump(dict(sorted(tuned.items())), handle, indent=1)
        handle.write("\n")
    print(json.dumps(auto, indent=1))


def _summary(six):
    if not six:
        return {}
    vs_symm = [t["speedup_vs_symm"] for t in six if t["speedup_vs_symm"]]
    return dict(
        geomean_speedup_vs_seq_six=math.exp(sum(math.log(t["speedup_vs_seq"]) for t in six) / len(six)),
        min_speedup_vs_seq_six=min(t["speedup_vs_seq"] for t in six),
        min_speedup_vs_symm_six=min(vs_symm) if vs_symm else None,
        geomean_gemm_only_vs_cublas_six=math.exp(sum(math.log(t["gemm_only_vs_cublas"]) for t in six) / len(six)))


def _table(results, times_of):
    lines = ["| shape | M | N | K_local | cuBLAS | NCCL RS | seq | symm | fused | auto | best / auto | GEMM-only | p2p RS | limit | vs seq | vs symm | GEMM-only/cuBLAS | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = times_of(r)
        symm = f"{t['symm']:.3f}" if t["symm"] else "n/a"
        vs_symm = f"{t['speedup_vs_symm']:.2f}x" if t["speedup_vs_symm"] else "n/a"
        lines.append(f"| {r['label']} | {r['M']} | {r['N']} | {r['K_local']} | {t['cublas']:.3f} | {t['nccl_rs']:.3f} | "
                     f"{t['seq']:.3f} | {symm} | {t['fused']:.3f} | {auto_cell(t)} | {t['gemm_only']:.3f} | {t['p2p_rs']:.3f} | "
                     f"{t['limit']:.3f} | {t['speedup_vs_seq']:.2f}x | {vs_symm} | {t['gemm_only_vs_cublas']:.2f} | {r['config']} |")
    return lines


def write_outputs(results, world, out_dir, meta=None):
    os.makedirs(out_dir, exist_ok=True)
    model = all(r["label"].startswith("llama8b") for r in results)
    # "llama8b wo" -> _llama8b; "llama8b b16 wo" (bench_tp's batch 16) -> _llama8b_b16
    batch = re.match(r"llama8b (b\d+) ", results[0]["label"]) if model else None
    stem = (f"gemm_rs_w{world}" + ("_llama8b" if model else "") + (f"_{batch.group(1)}" if batch else "")
            + ("_held" if any("held" in r for r in results) else ""))
    meta = meta or run_meta(world, f"torchrun --nproc_per_node={world} benchmarks/bench_gemm_rs.py " + " ".join(sys.argv[1:]))
    six = [r for r in results if r["label"] == "design"] or results  # the model rows summarise themselves
    summary = _summary(six)
    summary_queued = _summary([r["queued"] for r in six]) if all("queued" in r for r in results) else {}
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as handle:
        json.dump(dict(meta=meta, summary=summary, summary_queued=summary_queued, rows=results), handle, indent=1)
    append_history(out_dir, stem, meta, dict(summary=summary, summary_queued=summary_queued, rows=results))
    if gemm_rs.tuned_table():
        with open(os.path.join(out_dir, f"gemm_rs_tuned_w{world}.json"), "w") as handle:
            json.dump({key: value for key, value in gemm_rs.tuned_table().items() if f"/w{world}/" in key}, handle, indent=1)
    lines = [f"# Fused GEMM + reduce-scatter, W={world} ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
             f"command: `{meta['command']}`", ""]
    if summary_queued:
        lines += ["## Device time (queued: the GPU runs the calls back to back behind a sleep kernel)", "",
                  "times in ms (median of calls, max over ranks); speedup = seq / fused", ""]
        lines += _table(results, lambda r: r["queued"]) + [""]
        lines += [f"- {name}: {value:.3f}" if value is not None else f"- {name}: n/a"
                  for name, value in summary_queued.items()] + [""]
        lines += ["## Eager (calls issued by the host, columns interleaved in blocks of three calls, the last timed; host-bound calls show their host time)", ""]
    lines += ["times in ms (median of calls, max over ranks); speedup = seq / fused", ""]
    lines += _table(results, lambda r: r) + [""]
    lines += [f"- {name}: {value:.3f}" if value is not None else f"- {name}: n/a" for name, value in summary.items()]
    if all("host_us" in r for r in results):
        lines += ["", "CPU us per call (20 calls, no sync inside): "
                  + "; ".join(f"{r['M']}x{r['N']}x{r['K_local']}: fused {r['host_us']['fused']:.0f}, "
                              f"seq {r['host_us']['seq']:.0f}, symm "
                              f"{r['host_us'].get('symm') or float('nan'):.0f}, auto "
                              f"{r['host_us'].get('auto') or float('nan'):.0f}" for r in results)]
    held = [r for r in results if "held" in r]
    if held:
        lines += ["", "## Held (each column back to back at the power cap: 1 s untimed, then the timed window; "
                  "columns interleaved over 3 rounds; timing.held_time)", "",
                  "times in ms (median over rounds, max over ranks); clock and power: rank 0's means over the windows", "",
                  "| shape | M | N | K_local | cuBLAS | seq | symm | fused | auto | vs seq | vs symm | best / auto | MHz cuBLAS / fused | W cuBLAS / fused |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in held:
            t, gpu = r["held"], r["held_gpu"]
            best = min(t[name] for name in ("seq", "symm", "fused") if t.get(name))
            symm = f"{t['symm']:.3f}" if t.get("symm") else "n/a"
            vs_symm = f"{t['symm'] / t['fused']:.2f}x" if t.get("symm") else "n/a"

            def reading(name, key):
                value = gpu.get(name, {}).get(key)
                return "n/a" if value is None else f"{value:.0f}"

            lines.append(f"| {r['label']} | {r['M']} | {r['N']} | {r['K_local']} | {t['cublas']:.3f} | {t['seq']:.3f} | "
                         f"{symm} | {t['fused']:.3f} | {t['auto']:.3f} | {t['seq'] / t['fused']:.2f}x | {vs_symm} | "
                         f"{best / t['auto']:.2f} | {reading('cublas', 'mhz')} / {reading('fused', 'mhz')} | "
                         f"{reading('cublas', 'watts')} / {reading('fused', 'watts')} |")
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = [f"{r['M']}x{r['N']}x{r['K_local']}" for r in results]
        columns = ["seq", "symm", "fused", "gemm_only", "limit"]
        figure, axis = plt.subplots(figsize=(max(8, len(names) * 1.1), 4.5))
        width = 0.16
        for i, column in enumerate(columns):
            values = [(t["seq"] / t[column]) if t.get(column) else 0
                      for t in (r.get("queued", r) for r in results)]
            axis.bar([x + i * width for x in range(len(names))], values, width, label=column)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([x + 2 * width for x in range(len(names))])
        axis.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        axis.set_ylabel("speed vs cuBLAS + NCCL, device time (higher is faster)")
        axis.set_title(f"GEMM + reduce-scatter, bf16, W={world} ({meta['machine']})", fontsize=9)
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(os.path.join(out_dir, f"{stem}.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
