"""The fused GEMM + reduce-scatter kernel's GEMM half on one GPU: its GEMM_ONLY mode (same tiles,
W = 4 task order, no flags, no reduce) on the Triton kernel (the shape's shipped config) and on
the Gluon kernel (/gl), against cuBLAS. Both B orientations (B^T: nn.Linear's weight), the
per-rank GEMMs of the Llama-3-8B TP = 4 step at batch 16 and three design shapes; every output
checked against torch.mm. Device time (timing.device_time: 20 queued calls, median of 7
interleaved batches) and the profiler's kernel time (10 calls).

    python3 benchmarks/bench_fused_gemm_half.py OUT_DIR     # writes fused_gemm_half.json / .md
"""
import dataclasses, datetime, json, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from axedist.collectives.fused import gemm_only
from axedist.collectives.timing import device_time, kernel_time_ms
from axedist.kernels import gemm_rs

SHAPES = (("wo fwd", 65536, 4096, 1024, True), ("w2 fwd", 65536, 4096, 3584, True),
          ("qkv dgrad", 65536, 4096, 1536, False), ("out dgrad", 65536, 4096, 4096, False),
          ("w1w3 dgrad", 65536, 4096, 7168, False),
          ("design", 8192, 8192, 7168, False), ("design", 8192, 8192, 2048, False),
          ("design", 16384, 8192, 2048, False))


rows = []
for label, m, n, k, transposed in SHAPES:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn((n, k) if transposed else (k, n), device="cuda") / k ** 0.5).to(torch.bfloat16)
    b = w.t() if transposed else w
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    triton_config = gemm_rs.default_config(m, n, k, 4, torch.bfloat16)
    gluon_config = dataclasses.replace(gemm_rs.GemmConfig(), pipelined=True)
    ref = torch.mm(a, b).float()
    errors = {}
    for name, config in (("triton", triton_config), ("gluon", gluon_config)):
        out = torch.full_like(c, float("nan"))
        gemm_only(a, b, 4, config, out=out)
        errors[name] = ((out.float() - ref).norm() / ref.norm()).item()
    fns = {"cublas": lambda: torch.mm(a, b, out=c),
           "triton": lambda: gemm_only(a, b, 4, triton_config, out=c),
           "gluon": lambda: gemm_only(a, b, 4, gluon_config, out=c)}
    times = device_time(fns)
    kernels = {name: kernel_time_ms(fn) for name, fn in fns.items()}
    row = dict(shape=label, m=m, n=n, k=k, transposed=transposed, ms=times, kernel_ms=kernels,
               errors=errors, triton_config=str(triton_config), gluon_config=str(gluon_config))
    rows.append(row)
    print(f"{label} {m}x{n}x{k} B^T={transposed}: cublas {times['cublas']:.3f} ms | GEMM-only / cuBLAS: "
          f"triton {times['cublas']/times['triton']:.3f} gluon {times['cublas']/times['gluon']:.3f} | kernel ms "
          + " ".join(f"{key} {value:.3f}" for key, value in kernels.items())
          + f" | errors {errors['triton']:.1e} {errors['gluon']:.1e}", flush=True)
    del a, w, b, c, ref
    torch.cuda.empty_cache()
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            commit=os.environ.get("AXEDIST_COMMIT", "?"), device=torch.cuda.get_device_name(),
            torch=torch.__version__, command="python3 benchmarks/bench_fused_gemm_half.py OUT_DIR")
json.dump(dict(meta, rows=rows), open(os.path.join(out, "fused_gemm_half.json"), "w"), indent=1)
lines = [f"# The fused GEMM + RS kernel's GEMM half, Triton vs Gluon, one GPU", "",
         f"Date {meta['date']}, 1x {meta['device']}, torch {meta['torch']}, commit {meta['commit']}, "
         f"command `{meta['command']}`.", "",
         "GEMM_ONLY mode (W = 4 task order). ratio = cuBLAS / ours (> 1: faster than cuBLAS); "
         "device time in ms, then the profiler's kernel time.", "",
         "| shape | M x N x K | B^T | cuBLAS | Triton (ratio) | Gluon (ratio) | kernel ms cuBLAS / Triton / Gluon |",
         "|---|---|---|---|---|---|---|"]
for row in rows:
    ms, km = row["ms"], row["kernel_ms"]
    lines.append(f"| {row['shape']} | {row['m']}x{row['n']}x{row['k']} | {'yes' if row['transposed'] else 'no'} "
                 f"| {ms['cublas']:.3f} | {ms['triton']:.3f} ({ms['cublas'] / ms['triton']:.3f}) "
                 f"| {ms['gluon']:.3f} ({ms['cublas'] / ms['gluon']:.3f}) "
                 f"| {km['cublas']:.3f} / {km['triton']:.3f} / {km['gluon']:.3f} |")
open(os.path.join(out, "fused_gemm_half.md"), "w").write("\n".join(lines) + "\n")
