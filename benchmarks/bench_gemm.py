"""The GEMM core against cuBLAS on one GPU (bf16, A [M, K] @ B [K, N], fp32 accumulation).

    python3 benchmarks/bench_gemm.py --out benchmarks/results        # measure (one GPU)
    python3 benchmarks/bench_gemm.py --render benchmarks/results/gemm_onegpu.json
    python3 benchmarks/bench_gemm.py --tables-from benchmarks/results/gemm_onegpu.json

Shapes: the six design shapes (M in 2048 / 8192 / 16384, N = 8192, K_local in 7168 / 2048),
the row-parallel layers of Qwen3-32B (TP = 4) and Llama-3.1-405B (TP = 8) at 8192 tokens,
inference M = 128, 512 (N = 8192, K = 7168), and three per-rank GEMMs of the Llama-3-8B TP = 4
training step at batch 16 (M = 65536). Columns (device time, ms: batches of 20 calls
queued back to back behind a sleep kernel, median of 7 batches, every candidate's batches
interleaved; timing.device_time):
  cublas           torch.mm
  core             axedist.kernels.gemm.gemm with its shipped config (tuned table or heuristic)
  best             the fastest of every candidate config of the core (CORE_CANDIDATES)
  fused_gemm_only  the fused GEMM + reduce-scatter kernel's GEMM-only mode (W = 4 tile order)
Host time per launch (us, timing.host_time_us) of cublas, core and fused_gemm_only. Every
candidate's output is checked against cuBLAS's once (relative error <= 1e-2, output poisoned).
Writes gemm_onegpu.{json,md,png} into --out and appends a line to history/gemm_onegpu.jsonl.
--tables-from writes axedist/kernels/gemm_tuned.json (the best config per shape) from a result.
--probe first runs every candidate config alone in a subprocess with a time limit (compile,
one call on a few shapes checked against cuBLAS, a short timing); only the configs that pass
are benchmarked, so a kernel that hangs or fails costs its time limit, not the run.
"""
import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = (
    ("design", 2048, 8192, 7168), ("design", 2048, 8192, 2048),
    ("design", 8192, 8192, 7168), ("design", 8192, 8192, 2048),
    ("design", 16384, 8192, 7168), ("design", 16384, 8192, 2048),
    ("qwen3-32b o_proj tp4", 8192, 5120, 2048), ("qwen3-32b down_proj tp4", 8192, 5120, 6400),
    ("llama-405b o_proj tp8", 8192, 16384, 2048), ("llama-405b down_proj tp8", 8192, 16384, 6656),
    ("inference", 128, 8192, 7168), ("inference", 512, 8192, 7168),
    ("llama-3-8b tp4 b16 wo", 65536, 4096, 1024), ("llama-3-8b tp4 b16 qkv", 65536, 1536, 4096),
    ("llama-3-8b tp4 b16 out grad", 65536, 4096, 4096),
)
NAME = "gemm_onegpu"


PROBE_SHAPES = ((300, 1000, 520, True), (2048, 8192, 2048, False), (128, 8192, 7168, False),
                (8192, 8192, 7168, False))


def probe_one(text):
    """One config alone: compile, check, time (prints one JSON line)."""
    import faulthandler

    import torch

    from axedist.collectives.timing import device_time
    from axedist.kernels import gemm as core

    faulthandler.dump_traceback_later(40, exit=True)  # where a hang sits, then give up
    config = core.GemmCoreConfig.parse(text)
    result = dict(config=text, shapes={})
    for m, n, k, transposed in PROBE_SHAPES:
        if config.split_k > 1 and m > 2048:
            continue
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
        b = w.t() if transposed else w.t().contiguous()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        start = time.perf_counter()
        core.gemm(a, b, out=out, config=config)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        reference = a.float() @ b.float()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        c = torch.empty_like(out)
        times = device_time({"cublas": lambda: torch.mm(a, b, out=c),
                             "core": lambda: core.gemm(a, b, out=out, config=config)},
                            calls=10, batches=3)
        result["shapes"][f"{m}x{n}x{k}"] = dict(error=error, first_call_s=first, **times)
        print(f"  probe {text} {m}x{n}x{k}: error {error:.2e}, cublas {times['cublas']:.4f} ms, "
              f"core {times['core']:.4f} ms", file=sys.stderr, flush=True)
    result["ok"] = all(v["error"] <= 1e-2 for v in result["shapes"].values())
    print("PROBE " + json.dumps(result), flush=True)


def probe(configs, limit_s):
    """Every config in a subprocess of its own; returns {config: result or failure}."""
    results = {}
    hung = set()  # families (specialized?, device descriptors?, flattened?) with a hang
    for text in configs:
        from axedist.kernels.gemm import GemmCoreConfig
        parsed = GemmCoreConfig.parse(text)
        family = (parsed.warp_specialize, parsed.device_descriptors, parsed.flatten)
        if family in hung:
            results[text] = dict(config=text, ok=False, failure="skipped: a config of its "
                                 "family did not answer", probe_s=0.0)
            print(f"probe {text}: skipped (family hung)", flush=True)
            continue
        start = time.perf_counter()
        try:
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe-one", text],
                                 capture_output=True, text=True, timeout=limit_s)
            lines = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")]
            if lines:
                results[text] = json.loads(lines[-1][6:])
            else:
                results[text] = dict(config=text, ok=False, failure=f"exit {run.returncode}: "
                                     + (run.stderr or run.stdout)[-1500:])
        except subprocess.TimeoutExpired as expired:
            stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
            results[text] = dict(config=text, ok=False, failure=f"no answer in {limit_s} s: "
                                 + stderr[-1500:])
            hung.add(family)
        if "no answer" in results[text].get("failure", "") or "Timeout" in results[text].get("failure", ""):
            hung.add(family)
        results[text]["probe_s"] = time.perf_counter() - start
        print(f"probe {text}: {'ok' if results[text]['ok'] else 'FAILED'} "
              f"({results[text]['probe_s']:.0f} s) "
              + json.dumps({k: (v.get('core'), v.get('cublas'), v.get('error'))
                            for k, v in results[text].get('shapes', {}).items()})
              + ("" if results[text]["ok"] else " " + results[text].get("failure", "")[-600:]),
              flush=True)
    return results


def measure(args):
    import torch

    from axedist.collectives.fused import gemm_only
    from axedist.collectives.timing import device_time, host_time_us
    from axedist.kernels import gemm as core
    from axedist.kernels.gemm_rs import default_config

    torch.manual_seed(1234)
    rows = []
    selected = [int(i) for i in args.only.split(",") if i] or range(len(SHAPES))
    for index in selected:
        label, m, n, k = SHAPES[index]
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(k, n, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
        reference = torch.mm(a, b).float()
        outs = {}
        fns = {}

        def output(name):
            outs[name] = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            return outs[name]

        c = output("cublas")
        fns["cublas"] = lambda c=c: torch.mm(a, b, out=c)
        if args.candidates is None or core.core_config(m, n, k, 0) in args.candidates:
            c = output("core")
            fns["core"] = lambda c=c: core.gemm(a, b, out=c)
        fused_config = default_config(m, n, k, 4, torch.bfloat16)
        c = output("fused_gemm_only")
        fns["fused_gemm_only"] = lambda c=c: gemm_only(a, b, 4, fused_config, out=c)
        candidates = [config for config in (args.candidates or core.CORE_CANDIDATES)
                      if config.split_k == 1 or m <= 2048]
        for config in candidates:
            c = output(str(config))
            fns[str(config)] = lambda c=c, config=config: core.gemm(a, b, out=c, config=config)
        errors = {}
        for name, fn in list(fns.items()):
            try:
                fn()
                torch.cuda.synchronize()
                error = ((outs[name].float() - reference).norm() / reference.norm()).item()
            except Exception as failure:  # a config that does not fit: say so, time the rest
                error = f"{type(failure).__name__}: {str(failure)[:200]}"
            errors[name] = error
            if not (isinstance(error, float) and error <= 1e-2):
                print(f"  {label} {m}x{n}x{k} {name}: WRONG or failed ({error})", flush=True)
                del fns[name]
        times = device_time(fns, calls=args.calls, batches=args.batches)
        host = {name: host_time_us(fns[name]) for name in ("cublas", "core", "fused_gemm_only")
                if name in fns}
        by_config = {name: times[name] for name in times
                     if name not in ("cublas", "core", "fused_gemm_only")}
        best = min(by_config, key=by_config.get)
        flops = 2.0 * m * n * k
        row = dict(label=label, M=m, N=n, K=k, cublas=times["cublas"], core=times.get("core"),
                   core_config=str(core.core_config(m, n, k, 0)), best=by_config[best],
                   best_config=best, fused_gemm_only=times.get("fused_gemm_only"),
                   fused_config=str(fused_config), host_us=host, by_config=by_config,
                   errors=errors,
                   tflops={name: flops / (times[name] * 1e9) for name in times})
        rows.append(row)
        print(f"{label:26s} {m:6d}x{n:5d}x{k:5d} cublas {row['cublas']:.4f} core "
              f"{row['core'] or float('nan'):.4f} ({row['core_config']}) best {row['best']:.4f} "
              f"({best}) fused_gemm_only {row['fused_gemm_only'] or float('nan'):.4f} | host us "
              + " ".join(f"{key} {value:.1f}" for key, value in host.items()), flush=True)
        del a, b, reference, outs, fns
        torch.cuda.empty_cache()
    return rows


def _ratio(row, column):
    return row["cublas"] / row[column] if row.get(column) else None


def summary(rows):
    design = [row for row in rows if row["label"] == "design"]
    result = {}
    for column in ("core", "best", "fused_gemm_only"):
        ratios = [_ratio(row, column) for row in design if _ratio(row, column)]
        if ratios:
            result[column] = dict(geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)),
                                  min=min(ratios))
        small = {row["M"]: _ratio(row, column) for row in rows if row["label"] == "inference"}
        result.setdefault(column, {})["inference"] = small
    return result


def write_outputs(rows, meta, out_dir, png=True):
    os.makedirs(out_dir, exist_ok=True)
    totals = summary(rows)
    with open(os.path.join(out_dir, f"{NAME}.json"), "w") as handle:
        json.dump(dict(meta=meta, summary=totals, rows=rows), handle, indent=1)
    lines = [f"# GEMM core vs cuBLAS, one GPU ({meta.get('machine', '?')})", "",
             f"Date {meta.get('date')}, commit {meta.get('commit')}, command `{meta.get('command')}`.",
             f"Device time in ms (batches of {meta.get('calls', 20)} calls queued back to back, median of "
             f"{meta.get('batches', 7)} interleaved batches); ratio = cuBLAS time / ours (> 1: faster than cuBLAS); host = CPU time per "
             "launch (us). `core` runs the shipped config, `best` the fastest candidate of this "
             "run (what --tables-from ships next), `fused gemm-only` the fused GEMM + "
             "reduce-scatter kernel's GEMM-only mode.", "",
             "| shape | M x N x K | cuBLAS | core | ratio | best (config) | ratio | fused gemm-only "
             "| ratio | host us cuBLAS / core / fused |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        host = row["host_us"]

        def fmt(value, digits=4):
            return "-" if value is None else f"{value:.{digits}f}"
        lines.append(
            f"| {row['label']} | {row['M']}x{row['N']}x{row['K']} | {row['cublas']:.4f} | "
            f"{fmt(row['core'])} | {fmt(_ratio(row, 'core'), 3)} | {row['best']:.4f} "
            f"({row['best_config']}) | {fmt(_ratio(row, 'best'), 3)} | "
            f"{fmt(row['fused_gemm_only'])} | {fmt(_ratio(row, 'fused_gemm_only'), 3)} | "
            f"{fmt(host.get('cublas'), 1)} / {fmt(host.get('core'), 1)} / "
            f"{fmt(host.get('fused_gemm_only'), 1)} |")
    lines += ["", "Six design shapes, cuBLAS / ours: " + "; ".join(
        f"{column} geomean {value['geomean']:.3f}, min {value['min']:.3f}, M=128/512: "
        + "/".join(f"{v:.3f}" for v in value["inference"].values())
        for column, value in totals.items() if "geomean" in value), ""]
    with open(os.path.join(out_dir, f"{NAME}.md"), "w") as handle:
        handle.write("\n".join(lines))
    if png:
        render_png(rows, meta, os.path.join(out_dir, f"{NAME}.png"))


def render_png(rows, meta, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{row['M']}x{row['N']}x{row['K']}" for row in rows]
    figure, axis = plt.subplots(figsize=(12, 4.5))
    width = 0.27
    for offset, column in enumerate(("core", "best", "fused_gemm_only")):
        values = [_ratio(row, column) or 0 for row in rows]
        axis.bar([i + (offset - 1) * width for i in range(len(rows))], values, width, label=column)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
    axis.set_ylabel("cuBLAS time / ours")
    axis.set_title(f"GEMM core vs cuBLAS, {meta.get('machine', '')}, {meta.get('commit', '')}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def append_history(rows, meta, out_dir):
    os.makedirs(os.path.join(out_dir, "history"), exist_ok=True)
    line = dict(commit=meta.get("commit"), machine=meta.get("machine"), date=meta.get("date"),
                summary=summary(rows),
                ratios={f"{r['M']}x{r['N']}x{r['K']}": _ratio(r, "core") for r in rows})
    with open(os.path.join(out_dir, "history", f"{NAME}.jsonl"), "a") as handle:
        handle.write(json.dumps(line) + "\n")


def write_tables(path):
    from axedist.kernels import gemm as core
    with open(path) as handle:
        saved = json.load(handle)
    best = {f"{row['M']}x{row['N']}x{row['K']}": row["best_config"] for row in saved["rows"]}
    meta = saved["meta"]
    table = dict(source=f"{os.path.basename(path)}: {meta.get('machine')}, commit "
                        f"{meta.get('commit')}, {meta.get('date')}", best=best)
    target = os.path.join(os.path.dirname(core.__file__), "gemm_tuned.json")
    with open(target, "w") as handle:
        json.dump(table, handle, indent=1, sort_keys=True)
        handle.write("\n")
    print(f"wrote {target}: {len(best)} shapes")


def machine_meta(command):
    import torch
    import triton

    name = torch.cuda.get_device_name()
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "?"
    return dict(machine=f"1x {name}, driver {driver}, torch {torch.__version__}, triton "
                        f"{triton.__version__}, {platform.node()}",
                commit=os.environ.get("AXEDIST_COMMIT", "unknown"),
                date=datetime.datetime.now().isoformat(timespec="minutes"), command=command)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--only", default="", help="comma list of shape indices")
    parser.add_argument("--render", default=None, metavar="RESULTS_JSON")
    parser.add_argument("--tables-from", default=None, metavar="RESULTS_JSON")
    parser.add_argument("--no-history", action="store_true")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--probe", type=float, default=0, metavar="SECONDS",
                        help="probe every candidate alone first, at most SECONDS each")
    parser.add_argument("--probe-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-only", action="store_true", help="stop after the probe")
    parser.add_argument("--configs-from", default=None, metavar="PROBE_JSON",
                        help="benchmark only the configs a recorded probe passed")
    args = parser.parse_args()
    if args.probe_one:
        probe_one(args.probe_one)
        return
    if args.tables_from:
        write_tables(args.tables_from)
        return
    if args.render:
        with open(args.render) as handle:
            saved = json.load(handle)
        write_outputs(saved["rows"], saved["meta"], args.out)
        return
    meta = machine_meta("python3 benchmarks/bench_gemm.py " + " ".join(sys.argv[1:]))
    meta.update(calls=args.calls, batches=args.batches)
    from axedist.kernels import gemm as core
    args.candidates = None
    if args.probe:
        probes = probe([str(config) for config in core.CORE_CANDIDATES], args.probe)
        meta["probe"] = probes
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{NAME}_probe.json"), "w") as handle:
            json.dump(probes, handle, indent=1)
        args.candidates = [config for config in core.CORE_CANDIDATES if probes[str(config)]["ok"]]
        print("passing: " + ",".join(map(str, args.candidates)), flush=True)
        if not args.candidates or args.probe_only:
            return
    if args.configs_from:
        with open(args.configs_from) as handle:
            probes = json.load(handle)
        args.candidates = [config for config in core.CORE_CANDIDATES
                           if probes.get(str(config), {}).get("ok")]
    rows = measure(args)
    write_outputs(rows, meta, args.out, png=not args.no_png)
    if not args.no_history:
        append_history(rows, meta, args.out)
    print(json.dumps(summary(rows), indent=1))


if __name__ == "__main__":
    main()
