"""The three Gluon tile loops against cuBLAS in ONE run, one GPU: the GEMM core (gemm_gluon.py),
the fused all-gather + GEMM at W = 1 (its GEMM half) and the fused GEMM + RS's GEMM-only mode.

    OUT=<dir> python3 benchmarks/device/probe_gemm_halves.py [--quick]

Across runs the H200's clock moves by up to 15 % (docs/gpu_notes.md), so a gap between two
kernels' ratios to cuBLAS means something only when both were timed in the same run, interleaved.
ag_s4_direct: the AG call of ag_s4 launched on the current stream (VirtualRanks launches each
rank on its own stream between two events). Per shape: device time (timing.device_time: 20 queued calls, median of 7 interleaved batches) and
the profiler's kernel time; every output checked against torch.mm (relative error < 1e-2).
Writes $OUT/probe_gemm_halves.json and prints one line per shape.

    python3 benchmarks/device/probe_gemm_halves.py --report RUN.json ... OUT_DIR

writes OUT_DIR/gemm_halves_onegpu.md / .json / .png from such runs (in the order given): per run
and shape each kernel's ratio to cuBLAS and the fused kernels' time over the GEMM core's.
"""
import dataclasses, json, math, os, sys
import torch, torch.distributed as dist
from axedist.collectives.fused import gemm_only
from axedist.collectives.timing import device_time, kernel_time_ms
from axedist.kernels import gemm_rs
from axedist.kernels.ag_gemm import AllGatherGemmConfig
from axedist.kernels.gemm import GemmCoreConfig, gemm
from axedist.testing import VirtualRanks
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # onegpu_probe.py, beside this script
from onegpu_probe import checked_outputs, one_rank_group, pyplot, read_runs, write_run  # noqa: E402

# (label, M, N, K): the all-gather + GEMM shapes at TP = 4 (N local) and the GEMM + RS ones (K local)
SHAPES = (("ag design", 2048, 7168, 8192), ("ag design", 8192, 7168, 8192),
          ("ag design", 16384, 7168, 8192), ("ag design", 8192, 2048, 8192),
          ("ag design", 16384, 2048, 8192), ("ag qwen3-32b w1/w3", 8192, 6400, 5120),
          ("ag llama3.1-405b w1/w3", 8192, 13312, 16384),
          ("rs design", 8192, 8192, 7168), ("rs design", 16384, 8192, 2048),
          ("rs llama3.1-405b", 8192, 16384, 13312))
CORE = {"core_s3": "128x256x64/g8/s3/w8/gl/k1", "core_s4": "128x256x64/g8/s4/w8/gl/k1"}
AG = {"ag_s3": AllGatherGemmConfig(pipelined=True),
      "ag_s4": AllGatherGemmConfig(stages=4, pipelined=True)}


def main():
    one_rank_group(29519)
    torch.manual_seed(1)
    one_rank = VirtualRanks(1, data_bytes=1 << 30)
    shapes = SHAPES[:3] if "--quick" in sys.argv else SHAPES
    rows = []
    for label, m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)).t()
        ref = torch.mm(a, b)
        outs = {}

        def out(name):
            outs[name] = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            return outs[name]

        columns = {"cublas": lambda o=out("cublas"): torch.mm(a, b, out=o)}
        for name, text in CORE.items():
            config = GemmCoreConfig.parse(text)
            columns[name] = lambda o=out(name), c=config: gemm(a, b, out=o, config=c)
        for name, config in AG.items():
            columns[name] = lambda o=out(name), c=config: one_rank.all_gather_gemm([a], [b], [o], config=c)
        # the same W = 1 call launched on the current stream, as the real path launches it
        # (VirtualRanks launches every rank on its own stream behind an event and waits for it)
        one_rank.all_gather_gemm([a], [b], [out("ag_s4_direct")], config=AG["ag_s4"])
        direct = one_rank.last_plans[0]
        columns["ag_s4_direct"] = lambda o=outs["ag_s4_direct"]: direct.run(a, b, o)
        rs_config = dataclasses.replace(gemm_rs.GemmConfig(), pipelined=True)
        columns["rs_gemm_only"] = lambda o=out("rs_gemm_only"): gemm_only(a, b, 4, rs_config, out=o)
        errors = checked_outputs(columns, outs, ref)
        one_rank.check()
        times = device_time(columns, calls=20, batches=7)
        kernels = {name: kernel_time_ms(fn) for name, fn in columns.items()}
        row = dict(label=label, M=m, N=n, K=k, ms=times, kernel_ms=kernels, errors=errors,
                   configs=dict(CORE, **{name: str(c) for name, c in AG.items()},
                                ag_s4_direct=str(AG['ag_s4']), rs_gemm_only=str(rs_config)))
        rows.append(row)
        print(f"{label} {m}x{n}x{k}: cublas {times['cublas']:.3f} ms | cuBLAS / ours "
              + " ".join(f"{name} {times['cublas'] / times[name]:.3f}" for name in columns if name != "cublas")
              + " | kernel ms " + " ".join(f"{name} {v:.3f}" for name, v in kernels.items())
              + f" | max err {max(errors.values()):.1e}", flush=True)
        del a, b, ref, outs, columns
        torch.cuda.empty_cache()
    write_run("probe_gemm_halves", rows, "python3 benchmarks/device/probe_gemm_halves.py")
    dist.destroy_process_group()


def report(paths, out_dir):
    """The runs' table (markdown), their rows (JSON) and the fused kernels over the core (PNG)."""
    import statistics
    plt = pyplot()
    runs = read_runs(paths)
    lines = ["# The Gluon tile loops against cuBLAS and the GEMM core, one GPU", "",
             f"Machine 1x {runs[-1]['device']}, torch {runs[-1]['torch']}; command "
             f"`{runs[-1]['command']}` once per commit (each run one process: every column of a "
             "shape interleaved, 20 queued calls, median of 7 batches). ratio = cuBLAS / ours "
             "(> 1: faster than cuBLAS); `/ core` = the GEMM core's time (same stages) over the "
             "fused kernel's (< 1: the fused kernel's GEMM half is slower). ag = the all-gather + "
             "GEMM kernel at W = 1 (its GEMM half), rs = the GEMM + RS kernel's GEMM-only mode "
             "(W = 4 task order). Every output equal to torch.mm's (relative error 0).", ""]
    for run in runs:
        lines += [f"## Commit {run['commit']}", "",
                  "| shape | M x N x K | cuBLAS ms | core s3 | core s4 | ag s3 | ag s4 | rs | "
                  "ag s3 / core | ag s4 / core | rs / core s3 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in run["rows"]:
            t = row["ms"]
            lines.append(f"| {row['label']} | {row['M']}x{row['N']}x{row['K']} | {t['cublas']:.3f} | "
                         + " | ".join(f"{t['cublas'] / t[c]:.3f}" for c in
                                      ("core_s3", "core_s4", "ag_s3", "ag_s4", "rs_gemm_only"))
                         + f" | {t['core_s3'] / t['ag_s3']:.3f} | {t['core_s4'] / t['ag_s4']:.3f} | "
                         f"{t['core_s3'] / t['rs_gemm_only']:.3f} |")
        geo = {key: statistics.geometric_mean(row["ms"][base] / row["ms"][key] for row in run["rows"])
               for key, base in (("ag_s3", "core_s3"), ("ag_s4", "core_s4"), ("rs_gemm_only", "core_s3"))}
        lines += ["", f"Geomean over the shapes, core / fused: ag s3 {geo['ag_s3']:.3f}, ag s4 "
                  f"{geo['ag_s4']:.3f}, rs {geo['rs_gemm_only']:.3f}.", ""]
        run["geomean_core_over_fused"] = geo
    os.makedirs(out_dir, exist_ok=True)
    open(os.path.join(out_dir, "gemm_halves_onegpu.md"), "w").write("\n".join(lines))
    json.dump(runs, open(os.path.join(out_dir, "gemm_halves_onegpu.json"), "w"), indent=1)
    figure, axis = plt.subplots(figsize=(11, 4.5))
    labels = [f"{row['M']}x{row['N']}x{row['K']}" for row in runs[0]["rows"]]
    width = 0.8 / len(runs)
    for index, run in enumerate(runs):
        axis.bar([i + index * width for i in range(len(labels))],
                 [row["ms"]["core_s4"] / row["ms"]["ag_s4"] for row in run["rows"]], width,
                 label=f"all-gather + GEMM W=1, {run['commit']}")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30,
                    ha="right", fontsize=8)
    axis.set_ylim(0.9, 1.05)
    axis.set_ylabel("GEMM core time / fused kernel time (s4)")
    axis.set_title("The all-gather + GEMM kernel's GEMM half against the GEMM core (1x H200, same run)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "gemm_halves_onegpu.png"), dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:
        report(sys.argv[2:-1], sys.argv[-1])
    else:
        main()
