"""Burst vs sustained: the GEMM tile loops against cuBLAS when the GPU runs at its power cap.

Issue 28's Llama-405B GEMM + RS reads 1.08x torch's op in device time but 0.99x eager, and the
GEMM-only mode (no communication) moved the same way (1.03 -> 0.99 of cuBLAS, gemm_rs_w2.md);
probe_gemm_rs_eager.md found both GPUs at their power cap with the SM clock between 1.1 and
1.6 GHz. Device time (timing.device_time) queues each batch behind a sleep kernel, so every batch
starts from an idle, cool GPU at a high clock; a training step runs its GEMMs back to back at the
cap. Under the cap the clock follows the power drawn, so a kernel's speed there follows its energy
per call, which its burst time does not show. One GPU, per shape and column:

  burst      device_time: 20 queued calls behind a sleep kernel, median of 7 interleaved batches
  sustained  timing.held_time: the column alone, back to back: ~1 s of calls untimed (to reach
             the cap), then `--window` seconds of calls timed (CUDA events around the window),
             the SM clock and the power sampled every 5 ms in it (timing.GpuSampler); columns
             interleaved A B C A B C over `--rounds` rounds, median over rounds

Columns: cuBLAS (torch.mm), the GEMM core (Gluon tile loop, 4 stages) and the fused GEMM + RS
kernel's GEMM-only mode (W = 2 task order, Gluon). Energy per call = mean power x time per call;
every output is checked against torch.mm's. Writes $OUT/probe_gemm_power.json; `--report RUN.json
OUT_DIR` writes OUT_DIR/probe_gemm_power.{md,json,png}.

    OUT=<dir> python3 benchmarks/device/probe_gemm_power.py [--quick]
"""
import argparse, dataclasses, json, math, os, sys
import torch, torch.distributed as dist
from axedist.collectives.fused import gemm_only
from axedist.collectives.timing import GpuSampler, device_time, held_time
from axedist.kernels import gemm_rs
from axedist.kernels.gemm import GemmCoreConfig, gemm
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # onegpu_probe.py, beside this script
from onegpu_probe import checked_outputs, one_rank_group, pyplot, read_runs, write_run  # noqa: E402

# (label, M, N, K): GEMM + RS shapes at W = 2 (K local), the TP step's at W = 4 (M = 65536)
SHAPES = (("llama3.1-405b rs w2", 8192, 16384, 26624), ("design rs w2", 16384, 8192, 7168),
          ("design rs w2", 8192, 8192, 7168), ("qwen3-32b rs w2", 8192, 5120, 12800),
          ("llama8b b16 w2 fwd w4", 65536, 4096, 3584), ("llama8b b16 w1 fwd w4", 65536, 3584, 4096))


def main(args):
    one_rank_group(29521)
    torch.manual_seed(1)
    sampler = GpuSampler()
    rows = []
    for label, m, n, k in (SHAPES[:2] if args.quick else SHAPES):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)).t()
        ref = torch.mm(a, b)
        outs = {name: torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                for name in ("cublas", "core_s4", "rs_gemm_only")}
        core = GemmCoreConfig.parse("128x256x64/g8/s4/w8/gl/k1")
        rs_config = dataclasses.replace(gemm_rs.default_config(m, n, k, 2, a.dtype), pipelined=True)
        columns = {"cublas": lambda: torch.mm(a, b, out=outs["cublas"]),
                   "core_s4": lambda: gemm(a, b, out=outs["core_s4"], config=core),
                   "rs_gemm_only": lambda: gemm_only(a, b, 2, rs_config, out=outs["rs_gemm_only"])}
        errors = checked_outputs(columns, outs, ref)
        burst = device_time(columns, calls=20, batches=7)
        held = held_time(columns, window_s=args.window, rounds=args.rounds, sampler=sampler)
        for h in held.values():
            h["mj_per_call"] = None if h["watts"] is None else h["watts"] * h["ms"]
        flops = 2.0 * m * n * k
        row = dict(label=label, M=m, N=n, K=k, burst_ms=burst, sustained=held,
                   errors=errors, configs={"core_s4": str(core), "rs_gemm_only": str(rs_config)},
                   tflops_sustained={name: flops / h["ms"] / 1e9 for name, h in held.items()})
        rows.append(row)
        print(f"{label} {m}x{n}x{k}: burst ms " + " ".join(f"{c} {burst[c]:.3f}" for c in columns)
              + " | sustained ms / MHz / W / mJ " + " ".join(
                  f"{c} {h['ms']:.3f}/{h['mhz'] or 0:.0f}/{h['watts'] or 0:.0f}/{h['mj_per_call'] or 0:.0f}"
                  for c, h in held.items()) + f" | max err {max(errors.values()):.1e}", flush=True)
        del a, b, ref, outs, columns
        torch.cuda.empty_cache()
    write_run("probe_gemm_power", rows, "python3 benchmarks/device/probe_gemm_power.py"
              + (" --quick" if args.quick else "") + f" --rounds {args.rounds} --window {args.window}")
    dist.destroy_process_group()


def report(paths, out_dir):
    """The runs' table (markdown), rows (JSON) and burst vs sustained ratios to cuBLAS (PNG)."""
    plt = pyplot()
    runs = read_runs(paths)
    lines = ["# GEMM tile loops vs cuBLAS: burst vs sustained (power-capped), one GPU", "",
             f"Machine 1x {runs[-1]['device']}, torch {runs[-1]['torch']}. burst = device_time (20 "
             "calls queued behind a sleep kernel, median of 7 interleaved batches); sustained = the "
             "column alone back to back, 1 s untimed then the timed window, columns interleaved over "
             "rounds, median over rounds. ratio = cuBLAS time / ours (> 1: faster than cuBLAS). "
             "MHz / W: mean SM clock and board power sampled every 5 ms in the window; mJ = W x ms "
             "per call. core = the GEMM core's Gluon loop (128x256x64, 4 stages); rs = the fused "
             "GEMM + RS kernel's GEMM-only mode (W = 2 task order, its default config, Gluon).", ""]
    for run in runs:
        lines += [f"## Commit {run['commit']} ({run['date']}; `{run['command']}`)", "",
                  "| shape | M x N x K | cuBLAS burst / sustained ms | core ratio burst / sustained | "
                  "rs ratio burst / sustained | MHz cuBLAS / core / rs | W cuBLAS / core / rs | "
                  "mJ per call cuBLAS / core / rs |", "|---|---|---|---|---|---|---|---|"]
        for row in run["rows"]:
            b, s = row["burst_ms"], row["sustained"]

            def fmt(key, digits=0):
                return " / ".join("n/a" if s[c][key] is None else f"{s[c][key]:.{digits}f}"
                                  for c in ("cublas", "core_s4", "rs_gemm_only"))

            lines.append(
                f"| {row['label']} | {row['M']}x{row['N']}x{row['K']} | {b['cublas']:.3f} / "
                f"{s['cublas']['ms']:.3f} | "
                + " | ".join(f"{b['cublas'] / b[c]:.3f} / {s['cublas']['ms'] / s[c]['ms']:.3f}"
                             for c in ("core_s4", "rs_gemm_only"))
                + f" | {fmt('mhz')} | {fmt('watts')} | {fmt('mj_per_call')} |")
        lines.append("")
    os.makedirs(out_dir, exist_ok=True)
    open(os.path.join(out_dir, "probe_gemm_power.md"), "w").write("\n".join(lines))
    json.dump(runs, open(os.path.join(out_dir, "probe_gemm_power.json"), "w"), indent=1)
    run = runs[-1]
    figure, axis = plt.subplots(figsize=(11, 4.5))
    labels = [f"{row['M']}x{row['N']}x{row['K']}" for row in run["rows"]]
    series = [("core burst", "core_s4", "burst"), ("core sustained", "core_s4", "sustained"),
              ("rs GEMM-only burst", "rs_gemm_only", "burst"),
              ("rs GEMM-only sustained", "rs_gemm_only", "sustained")]
    width = 0.8 / len(series)
    for index, (name, column, mode) in enumerate(series):
        values = [row["burst_ms"]["cublas"] / row["burst_ms"][column] if mode == "burst"
                  else row["sustained"]["cublas"]["ms"] / row["sustained"][column]["ms"]
                  for row in run["rows"]]
        axis.bar([i + index * width for i in range(len(labels))], values, width, label=name)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=20,
                    ha="right", fontsize=8)
    axis.set_ylim(0.8, 1.1)
    axis.set_ylabel("cuBLAS time / ours (> 1: faster)")
    axis.set_title(f"Burst vs power-capped sustained GEMM speed, 1x H200, {run['commit']}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "probe_gemm_power.png"), dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:
        report(sys.argv[2:-1], sys.argv[-1])
    else:
        parser = argparse.ArgumentParser()
        parser.add_argument("--quick", action="store_true")
        parser.add_argument("--rounds", type=int, default=3)
        parser.add_argument("--window", type=float, default=0.6, help="timed seconds per column and round")
        main(parser.parse_args())
