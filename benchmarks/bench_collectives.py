"""axedist p2p collectives vs NCCL vs PyTorch's symmetric-memory ops, 64 KB to 256 MB.

    torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --out benchmarks/results

Size = bytes of each rank's full input (reduce-scatter, all-reduce) or of the gathered output
(all-gather), bf16. Latency in us: median over calls of CUDA events around each call, issued
back to back as an application would (so host-bound calls show their host time), max over
ranks. Bus bandwidth as nccl-tests defines it: size / time * (W-1)/W (RS, AG) or * 2(W-1)/W (AR).
  push / pull   p2p.<op>(x, variant=...): the public call on an ordinary tensor
  zc            pull of an input already in the symmetric workspace (p2p.symmetric_input)
  nccl          torch.distributed (NCCL, NVLS off)
  symm          torch.ops.symm_mem one_shot_all_reduce / two_shot_all_reduce_ (input in symm mem)
Every timed axedist variant is also checked against NCCL's result at every size.
Writes collectives_w{W}.json / .md / .png. The choice tables that "auto" uses come from such a
result file (no GPU needed):
    python3 benchmarks/bench_collectives.py --tables-from benchmarks/results/collectives_w4.json
writes axedist/kernels/collectives_tuned.json (backend.TUNED: p2p or NCCL per size, push or
pull per size, the one-shot / two-shot all-reduce switch).
Multicast stays off (refuses AXEDIST_ENABLE_MULTICAST=1).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


from axedist.collectives import all_gather_into, p2p, reduce_scatter_into  # noqa: E402
from axedist.collectives.timing import time_collective as _time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py, beside this script
from history import append_history, run_meta  # noqa: E402

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
ONE_SHOT_MAX = 16 << 20
# column key -> (op, label)
SERIES = {
    "rs_nccl": ("reduce_scatter", "NCCL"), "rs_push": ("reduce_scatter", "push"),
    "rs_pull": ("reduce_scatter", "pull"), "rs_zc": ("reduce_scatter", "pull zc"),
    "ag_nccl": ("all_gather", "NCCL"), "ag_push": ("all_gather", "push"),
    "ag_pull": ("all_gather", "pull"),
    "ar_nccl": ("all_reduce", "NCCL"), "ar1_push": ("all_reduce", "1-shot push"),
    "ar1_pull": ("all_reduce", "1-shot pull"), "ar2_push": ("all_reduce", "2-shot push"),
    "ar2_pull": ("all_reduce", "2-shot pull"), "ar_symm1": ("all_reduce", "torch-symm 1-shot"),
    "ar_symm2": ("all_reduce", "torch-symm 2-shot"),
}
OURS = {"reduce_scatter": ["rs_push", "rs_pull"], "all_gather": ["ag_push", "ag_pull"],
        "all_reduce": ["ar1_push", "ar1_pull", "ar2_push", "ar2_pull"]}


def bus_factor(op, world):
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def measure_size(size, world, rank, reps, group_name, symm_mem):
    queued = {}

    def time_collective(fn, reps, key=None):
        # eager (the table's main numbers) and queued (device time: see axedist/collectives/timing.py)
        eager = _time(fn, reps)
        if key is not None:
            queued[key] = _time(fn, reps, queued=True)
        return eager
    numel = size // 2
    numel -= numel % (world * 16)
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    row = dict(bytes=size, world=world)
    errors = {}
    # reduce-scatter
    out = torch.empty(numel // world, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty_like(out)
    reduce_scatter_into(ref, x)
    row["rs_nccl"] = time_collective(lambda: reduce_scatter_into(out, x), reps, "rs_nccl")
    for variant in ("push", "pull"):
        row[f"rs_{variant}"] = time_collective(
            lambda: p2p.reduce_scatter(x, out=out, variant=variant), reps, f"rs_{variant}")
        errors[f"rs_{variant}"] = _rel(out, ref)

    def rs_zero_copy():
        staged = p2p.symmetric_input(x.shape, x.dtype, None, "reduce_scatter")
        p2p.reduce_scatter(staged, out=out)
    row["rs_zc"] = time_collective(rs_zero_copy, reps)  # the staged tensor holds stale data
    # all-gather (size = gathered output)
    piece = x[:numel // world]
    gathered = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
    ag_ref = torch.empty_like(gathered)
    all_gather_into(ag_ref, piece)
    row["ag_nccl"] = time_collective(lambda: all_gather_into(gathered, piece), reps, "ag_nccl")
    for variant in ("push", "pull"):
        row[f"ag_{variant}"] = time_collective(
            lambda: p2p.all_gather(piece, out=gathered, variant=variant), reps, f"ag_{variant}")
        errors[f"ag_{variant}"] = 0.0 if torch.equal(gathered, ag_ref) else _rel(gathered, ag_ref)
    # all-reduce
    y = torch.empty_like(x)
    ar_ref = x.clone()
    dist.all_reduce(ar_ref)
    row["ar_nccl"] = time_collective(lambda: (y.copy_(x), dist.all_reduce(y)), reps, "ar_nccl")
    for algorithm, prefix in (("one_shot", "ar1"), ("two_shot", "ar2")):
        if algorithm == "one_shot" and size > ONE_SHOT_MAX:
            continue
        for variant in ("push", "pull"):
            row[f"{prefix}_{variant}"] = time_collective(
                lambda: p2p.all_reduce(x, out=y, algorithm=algorithm, variant=variant), reps,
                f"{prefix}_{variant}")
            errors[f"{prefix}_{variant}"] = _rel(y, ar_ref)
    try:
        symm = symm_mem.empty(numel, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(symm, group_name)
        symm.copy_(x)
        if size <= ONE_SHOT_MAX:
            row["ar_symm1"] = time_collective(
                lambda: torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", group_name), reps)
        row["ar_symm2"] = time_collective(
            lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name), reps)
    except Exception as error:  # noqa: BLE001 - record why PyTorch's op did not run
        row["torch_symm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    torch.cuda.synchronize()
    worst = torch.tensor([max(errors.values())], dtype=torch.float64, device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row["errors_rank0"] = errors
    row["queued"] = queued
    row["max_rel_err_vs_nccl"] = worst.item()
    for key in list(row):
        if key in SERIES and row[key] is not None:
            row[key.replace("_", "_busbw_", 1)] = (
                size / (row[key] * 1e-3) * bus_factor(SERIES[key][0], world) / 1e9)
    return row


def host_overhead(world, calls=300):
    """CPU time per call (no synchronization inside the loop) at 64 KB: what bounds latency
    when the device part is a few microseconds."""
    x = torch.randn(32768, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(32768 // world, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    cases = {
        "rs_nccl": lambda: reduce_scatter_into(out, x),
        "rs_push": lambda: p2p.reduce_scatter(x, out=out, variant="push"),
        "rs_push_alloc": lambda: p2p.reduce_scatter(x, variant="push"),
        "ag_push": lambda: p2p.all_gather(out, out=x, variant="push"),
        "ar1_push": lambda: p2p.all_reduce(x, out=y, algorithm="one_shot", variant="push"),
        "empty_like": lambda: torch.empty_like(out),
    }
    result = {}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        result[name] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        dist.barrier()
    return result


def _best(row, keys):
    timed = [(row[key], key) for key in keys if row.get(key) is not None]
    return min(timed) if timed else (None, None)


def _runs(points):
    """[(max bytes, choice)] with runs of one choice merged; the last covers everything above."""
    merged = []
    for limit, choice in points:
        if merged and merged[-1][1] == choice:
            merged[-1] = [limit, choice]
        else:
            merged.append([limit, choice])
    if merged:  # (a sweep of large sizes only has no one-shot all-reduce rows)
        merged[-1][0] = 1 << 40
    return merged


def tuned_tables(rows, world, source):
    """The tables of axedist/kernels/collectives_tuned.json from one benchmark's rows: per size
    the faster p2p variant, the one-shot / two-shot switch, and p2p or torch for "auto" (p2p
    only where its fastest choice beat NCCL). Sizes are the call's input bytes (all-gather:
    the gathered size / W). Choices come from device time (the rows' "queued" numbers) where a
    row has it: eager times of small calls are host-bound, equal for every variant within the
    noise, and vary 2x between runs with the host."""
    rows = sorted(({**row, **row.get("queued", {})} for row in rows), key=lambda row: row["bytes"])
    variant = {
        "reduce_scatter": [(r["bytes"], _best(r, ["rs_push", "rs_pull"])[1][3:]) for r in rows],
        "all_gather": [(r["bytes"] // world, _best(r, ["ag_push", "ag_pull"])[1][3:]) for r in rows],
        "all_reduce_one_shot": [(r["bytes"], _best(r, ["ar1_push", "ar1_pull"])[1][4:])
                                for r in rows if r.get("ar1_push") is not None],
        "all_reduce_two_shot": [(r["bytes"], _best(r, ["ar2_push", "ar2_pull"])[1][4:]) for r in rows],
    }
    one_shot_max = 0
    for r in rows:  # one-shot from the smallest size up to where two-shot starts winning
        one, _ = _best(r, ["ar1_push", "ar1_pull"])
        two, _ = _best(r, ["ar2_push", "ar2_pull"])
        if one is None or one >= two:
            break
        one_shot_max = r["bytes"]
    backend = {"reduce_scatter": [], "all_gather": [], "all_reduce": []}
    for r in rows:
        for op, keys, nccl, size in (
                ("reduce_scatter", ["rs_push", "rs_pull"], "rs_nccl", r["bytes"]),
                ("all_gather", ["ag_push", "ag_pull"], "ag_nccl", r["bytes"] // world),
                ("all_reduce", ["ar1_push", "ar1_pull"] if r["bytes"] <= one_shot_max
                 else ["ar2_push", "ar2_pull"], "ar_nccl", r["bytes"])):
            best, _ = _best(r, keys)
            backend[op].append((size, "p2p" if best < r[nccl] else "torch"))
    return dict(source=source, backend={op: _runs(v) for op, v in backend.items()},
                variant={op: _runs(v) for op, v in variant.items()},
                one_shot_all_reduce_max_bytes=one_shot_max)


def write_tuned(results_json, target):
    with open(results_json) as handle:
        result = json.load(handle)
    meta, rows = result["meta"], result["rows"]
    source = (f"{os.path.relpath(results_json)}: {meta['machine']}, commit {meta['commit']}, "
              f"{meta['date']}, `{meta['command']}`")
    tables = tuned_tables(rows, rows[0]["world"], source)
    with open(target, "w") as handle:
        json.dump(tables, handle, indent=1)
        handle.write("\n")
    print(json.dumps(tables, indent=1))


def sweep_rounds(sizes, rounds_list, reps, world, rank, out_dir):
    """Reduce-scatter and all-gather (push and pull) with their phases pipelined over each of
    `rounds_list` ranges, timed interleaved with NCCL in one run (device time, queued, and eager);
    every candidate is checked against NCCL's result first. Writes collectives_rounds_w{W}.json/.md."""
    from axedist.collectives.timing import time_interleaved
    device = torch.cuda.current_device()
    rows = []
    for size in sizes:
        numel = size // 2
        numel -= numel % (world * 16)
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        piece = x[:numel // world]
        scattered = torch.empty(numel // world, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        cases = {"reduce_scatter": (x, scattered, lambda: reduce_scatter_into(scattered, x)),
                 "all_gather": (piece, gathered, lambda: all_gather_into(gathered, piece))}
        for op, (source, target, nccl) in cases.items():
            nccl()
            reference = target.clone()
            fns, errors, programs = {"nccl": nccl}, {}, None
            for variant in ("push", "pull"):
                for rounds in rounds_list:
                    os.environ["AXEDIST_P2P_ROUNDS"] = str(rounds)
                    plan = p2p.CallPlan(op, source.shape, source.dtype, None, device, variant, False)
                    del os.environ["AXEDIST_P2P_ROUNDS"]
                    programs = plan.programs
                    name = f"{variant} r{plan.rounds}"
                    fns[name] = lambda plan=plan, source=source, target=target: plan.run(source, target, None)
                    target.fill_(float("nan"))
                    fns[name]()
                    errors[name] = 0.0 if torch.equal(target, reference) else _rel(target, reference)
            row = dict(op=op, bytes=size, world=world, programs=programs, errors=errors,
                       queued=time_interleaved(fns, reps, 3, None, queued=True),
                       eager=time_interleaved(fns, reps, 3, None, queued=False))
            rows.append(row)
            if rank == 0:
                print(f"{op} {size >> 20} MB: " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in row["queued"].items())
                      + f" | max err {max(errors.values()):.1e}", flush=True)
        torch.cuda.empty_cache()
    if rank != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    meta = run_meta(world, f"torchrun --nproc_per_node={world} benchmarks/bench_collectives.py " + " ".join(sys.argv[1:]))
    with open(os.path.join(out_dir, f"collectives_rounds_w{world}.json"), "w") as handle:
        json.dump(dict(meta=meta, rows=rows), handle, indent=1)
    append_history(out_dir, f"collectives_rounds_w{world}", meta, dict(rows=rows))
    names = list(rows[0]["queued"])
    lines = [f"# Pipelined reduce-scatter / all-gather (ROUNDS), W={world} ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
             f"command: `{meta['command']}`", "",
             "Device time in us (queued, median of calls, max over ranks), all candidates interleaved in one run; "
             "`r1` is the unpipelined kernel. busbw = size * (W-1)/W / time.", "",
             "| op | size | " + " | ".join(names) + " | best axedist busbw / NCCL busbw |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for row in rows:
        times = row["queued"]
        best = min(v for k, v in times.items() if k != "nccl")
        factor = row["bytes"] * (world - 1) / world / 1e6   # GB/s from ms
        lines.append(f"| {row['op']} | {row['bytes'] >> 20} MB | " + " | ".join(f"{times[n] * 1e3:.1f}" for n in names)
                     + f" | {factor / best:.0f} / {factor / times['nccl']:.0f} |")
    lines += ["", "Eager (calls issued back to back by the host), us:", "",
              "| op | size | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for row in rows:
        lines.append(f"| {row['op']} | {row['bytes'] >> 20} MB | "
                     + " | ".join(f"{row['eager'][n] * 1e3:.1f}" for n in names) + " |")
    worst = max(max(row["errors"].values()) for row in rows)
    lines += ["", f"max relative error vs NCCL over all candidates: {worst:.1e}"]
    with open(os.path.join(out_dir, f"collectives_rounds_w{world}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="bytes")
    parser.add_argument("--rounds", type=int, nargs="*", default=None,
                        help="only sweep the pipelined reduce-scatter / all-gather over these "
                             "ROUNDS values (with --sizes), interleaved with NCCL")
    parser.add_argument("--tables-from", default=None, metavar="RESULTS_JSON",
                        help="no benchmark: write the choice tables of this result file into "
                             "axedist/kernels/collectives_tuned.json (what 'auto' uses)")
    parser.add_argument("--render", default=None, metavar="RESULTS_JSON",
                        help="no benchmark: write the .md and .png of this result file (same meta) into --out")
    args = parser.parse_args()
    if args.render:
        with open(args.render) as handle:
            saved = json.load(handle)
        world = int(saved["meta"]["machine"].split(": ")[-1].split("x")[0])
        write_outputs(saved["rows"], saved["host_us_per_call_64KB"], world, args.out, meta=saved["meta"])
        return
    if args.tables_from:
        from axedist.collectives.backend import TUNED_PATH
        write_tuned(args.tables_from, TUNED_PATH)
        return
    if os.environ.get("AXEDIST_ENABLE_MULTICAST") == "1":
        raise SystemExit("refusing to benchmark with AXEDIST_ENABLE_MULTICAST=1 (policy)")
    if os.environ.get("NCCL_NVLS_ENABLE") != "0" or os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        raise SystemExit("set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    group_name = dist.group.WORLD.group_name
    if args.rounds:
        sweep_rounds(args.sizes or [16 << 20, 64 << 20, 256 << 20], args.rounds, args.reps, world,
                     rank, args.out)
        dist.barrier()
        dist.destroy_process_group()
        return
    import torch.distributed._symmetric_memory as symm_mem
    rows = []
    for size in args.sizes or SIZES:
        row = measure_size(size, world, rank, args.reps, group_name, symm_mem)
        rows.append(row)
        if rank == 0:
            print(f"{size >> 10:>8} KB " + " ".join(
                f"{key} {row[key] * 1e3:.1f}" for key in SERIES if row.get(key) is not None)
                + f" | max rel err {row['max_rel_err_vs_nccl']:.1e}", flush=True)
        torch.cuda.empty_cache()
    host = host_overhead(world)
    if rank == 0:
        print("host us/call at 64 KB: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()),
              flush=True)
        write_outputs(rows, host, world, args.out)
    dist.barrier()
    dist.destroy_process_group()


def _fmt(value, scale=1e3):
    return "n/a" if value is None else f"{value * scale:.1f}"


def write_outputs(rows, host, world, out_dir, meta=None):
    os.makedirs(out_dir, exist_ok=True)
    meta = meta or run_meta(world, f"torchrun --nproc_per_node={world} benchmarks/bench_collectives.py " + " ".join(sys.argv[1:]))
    tables = tuned_tables(rows, world, "this run")
    with open(os.path.join(out_dir, f"collectives_w{world}.json"), "w") as handle:
        json.dump(dict(meta=meta, rows=rows, host_us_per_call_64KB=host, tuned=tables), handle,
                  indent=1)
    append_history(out_dir, f"collectives_w{world}", meta, dict(rows=rows, host_us_per_call_64KB=host))
    lines = [f"# Collectives, W={world}, bf16 ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; NVLS/multicast off",
             f"command: `{meta['command']}`", "",
             "Latency in us (median of CUDA-event intervals of back-to-back calls, max over ranks); "
             "busbw in GB/s. push / pull: the public call on an ordinary tensor; zc: input already "
             "in the symmetric workspace. `best/NCCL` = NCCL latency / fastest axedist latency.", ""]
    for op, keys in (("reduce_scatter", ["rs_nccl", "rs_push", "rs_pull", "rs_zc"]),
                     ("all_gather", ["ag_nccl", "ag_push", "ag_pull"]),
                     ("all_reduce", ["ar_nccl", "ar1_push", "ar1_pull", "ar2_push", "ar2_pull",
                                     "ar_symm1", "ar_symm2"])):
        lines += [f"## {op}", "", "| size | " + " | ".join(SERIES[k][1] for k in keys)
                  + " | best/NCCL | busbw NCCL / best |", "|---" * (len(keys) + 3) + "|"]
        for r in rows:
            best = min(r[k] for k in OURS[op] if r.get(k) is not None)
            lines.append(f"| {r['bytes'] >> 10} KB | " + " | ".join(_fmt(r.get(k)) for k in keys)
                         + f" | {r[keys[0]] / best:.2f}x | {r[keys[0].replace('_', '_busbw_', 1)]:.0f} / "
                         f"{r['bytes'] / (best * 1e-3) * bus_factor(op, world) / 1e9:.0f} |")
        lines.append("")
    if all("queued" in r for r in rows):
        lines += ["## Device time (queued)", "",
                  "The same calls with the stream held by a sleep kernel while the host enqueues "
                  "them all, so the GPU runs them back to back: the interval is device time "
                  "without host overhead (axedist/collectives/timing.py). In us; best/NCCL as above.",
                  "", "| size | RS NCCL | RS best | RS best/NCCL | AG NCCL | AG best | AG best/NCCL "
                  "| AR NCCL | AR best | AR best/NCCL |", "|---" * 10 + "|"]
        for r in rows:
            cells = []
            for op, nccl in (("reduce_scatter", "rs_nccl"), ("all_gather", "ag_nccl"),
                             ("all_reduce", "ar_nccl")):
                best = min(r["queued"][k] for k in OURS[op] if k in r["queued"])
                cells += [_fmt(r["queued"][nccl]), _fmt(best), f"{r['queued'][nccl] / best:.2f}x"]
            lines.append(f"| {r['bytes'] >> 10} KB | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["host CPU us per call at 64 KB (no sync in the loop): "
              + ", ".join(f"{k} {v:.1f}" for k, v in host.items()), "",
              f"max relative error vs NCCL over all sizes and variants: "
              f"{max(r['max_rel_err_vs_nccl'] for r in rows):.2e}", ""]
    with open(os.path.join(out_dir, f"collectives_w{world}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    print("tables for axedist/kernels/collectives_tuned.json:", json.dumps(tables), flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        sizes = [r["bytes"] for r in rows]
        figure, axes = plt.subplots(2, 3, figsize=(15, 8))
        for column, op in enumerate(("reduce_scatter", "all_gather", "all_reduce")):
            for key, (series_op, label) in SERIES.items():
                if series_op != op:
                    continue
                points = [(s, r[key]) for s, r in zip(sizes, rows) if r.get(key) is not None]
                if not points:
                    continue
                busbw = key.replace("_", "_busbw_", 1)
                axes[0][column].plot([p[0] for p in points], [p[1] * 1e3 for p in points], marker="o", label=label)
                axes[1][column].plot([p[0] for p in points], [r[busbw] for r in rows if r.get(key) is not None],
                                     marker="o", label=label)
            axes[0][column].set_title(op)
            for axis, name in ((axes[0][column], "latency (us)"), (axes[1][column], "bus bandwidth (GB/s)")):
                axis.set_xscale("log", base=2)
                axis.set_xlabel("bytes")
                axis.set_ylabel(name)
                axis.legend(fontsize=7)
            axes[0][column].set_yscale("log")
        figure.suptitle(f"bf16 collectives, W={world}, {meta['machine']}, commit {meta['commit']}", fontsize=9)
        figure.tight_layout()
        figure.savefig(os.path.join(out_dir, f"collectives_w{world}.png"), dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
