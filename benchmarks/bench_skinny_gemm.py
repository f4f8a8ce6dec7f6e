"""Products of a few rows (decode) on one GPU: axedist's skinny GEMM (kernels/skinny_gemm.py, one
launch a product) against cuBLAS (``torch.mm(x, weight.t())``: split-K tiles plus a reduce
kernel), at the per-rank linear shapes of a Llama-3-8B-sized decode stack at TP = 1, 2, 4 and
1, 8, 64 rows. Device time of one call (calls queued back to back behind a sleep kernel, each on
another copy of the weight, so that every call reads its weight from HBM as a decode step does:
a step reads about 0.9 GB of weights, the L2 holds 50 MB), median of interleaved batches; every
output checked against an fp32 product.

    python3 benchmarks/bench_skinny_gemm.py --out benchmarks/results            # shipped configs
    python3 benchmarks/bench_skinny_gemm.py --sweep --write-table --out <dir>   # + every candidate

--sweep times every candidate config per shape; --write-table writes the fastest per shape into
axedist/kernels/skinny_tuned.json ("cublas" where no config beats cuBLAS by WIN_MARGIN: a closer
call is within the run-to-run spread); --table-from JSON rewrites that table from a run's
skinny_gemm.json without a GPU. Writes skinny_gemm.{json,md,png} and a history line.
"""
import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's axedist
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py
from history import append_history, run_meta  # noqa: E402

from axedist.collectives.timing import host_time_us  # noqa: E402
from axedist.kernels import skinny_gemm  # noqa: E402
from axedist.kernels.skinny_gemm import SkinnyConfig, skinny_mm  # noqa: E402

DIM, FFN, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
L2_ROTATION_BYTES = 256 << 20   # weights read between two reads of one copy: well past the L2
WIN_MARGIN = 1.05               # how much faster than cuBLAS a config must be to be shipped (two sweeps of
                                # one commit differed by up to 0.05 on a shape)


def layer_shapes(tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of each linear's local product at tensor parallelism tp (y = x @ w.t())."""
    return [("wq", HEADS * HEAD_DIM // tp, DIM), ("wk/wv", KV_HEADS * HEAD_DIM // tp, DIM),
            ("wo", DIM, HEADS * HEAD_DIM // tp), ("w1/w3", FFN // tp, DIM), ("w2", DIM, FFN // tp)]


def candidates(rows: int) -> list[SkinnyConfig]:
    if rows == 1:
        return [SkinnyConfig(n, k, w, s) for n, k, w, s in itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3))]
    return [SkinnyConfig(n, k, 4, s) for n, k, s in itertools.product((16, 32), (128, 256), (3, 4))] + \
        [SkinnyConfig(64, 64, 4, 4), SkinnyConfig(16, 512, 8, 3)]


def queued_ms(fns: dict, calls: int, batches: int = 5) -> dict:
    """Device ms per call of each candidate: `batches` interleaved batches of `calls` calls
    queued behind a sleep kernel (0.1 ms of sleep per call covers the host's launches)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int((0.2 + calls * 0.1) * 2_000_000))
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) / calls for s, e in pairs) for name, pairs in events.items()}


def rotating(fn, copies: list):
    """fn(copy) over the copies in turn, one per call."""
    state = [0]

    def call():
        state[0] = (state[0] + 1) % len(copies)
        fn(copies[state[0]])
    return call


def measure(rows: int, n: int, k: int, sweep: bool) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(rows * 7 + n + k)
    weight_bytes = n * k * 2
    count = max(2, -(-L2_ROTATION_BYTES // weight_bytes))
    weights = [(torch.randn(n, k, device="cuda", generator=generator) / k ** 0.5).to(torch.bfloat16)
               for _ in range(count)]
    x = torch.randn(rows, k, device="cuda", generator=generator).to(torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    reference = x.float() @ weights[0].float().t()
    shipped = skinny_gemm.skinny_config(rows, n, k)
    configs = {"default": skinny_gemm.heuristic_config(rows, n, k)}
    if shipped is not None:
        configs["shipped"] = shipped
    if sweep:
        configs.update({repr(c): c for c in candidates(rows)})
    errors = {"cublas": ((torch.mm(x, weights[0].t()).float() - reference).norm() / reference.norm()).item()}
    fns = {"cublas": rotating(lambda w: torch.mm(x, w.t(), out=out), weights)}
    for name, config in list(configs.items()):
        try:
            got = skinny_mm(x, weights[0].t(), config=config)
        except triton.runtime.errors.OutOfResources:  # a sweep candidate whose tiles do not fit
            del configs[name]
            continue
        errors[name] = ((got.float() - reference).norm() / reference.norm()).item()
        fns[name] = rotating(lambda w, c=config: skinny_mm(x, w.t(), out=out, config=c), weights)
    ms = queued_ms(fns, calls=max(20, count))
    best = min((name for name in ms if name != "cublas"), key=ms.get)
    host = {"cublas": host_time_us(lambda: torch.mm(x, weights[0].t(), out=out)),
            "ours": host_time_us(lambda: skinny_mm(x, weights[0].t(), out=out, config=configs[best]))}
    return dict(rows=rows, n=n, k=k, copies=count, ms=ms, errors=errors, best=best, host_us=host,
                best_config=list(configs[best]), shipped=list(shipped) if shipped else "cublas",
                tb_per_s={name: weight_bytes / (t * 1e-3) / 1e12 for name, t in ms.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--write-table", action="store_true")
    parser.add_argument("--table-from", default=None, help="a run's skinny_gemm.json: rewrite the table only")
    parser.add_argument("--render", nargs=2, default=None, metavar=("JSON", "OUT_DIR"),
                        help="redraw a run's skinny_gemm.md / .png from its skinny_gemm.json (no GPU, no history line)")
    args = parser.parse_args()
    command = "python3 benchmarks/bench_skinny_gemm.py " + " ".join(sys.argv[1:])
    if args.table_from:
        with open(args.table_from) as f:
            write_table(json.load(f)["results"])
        return
    if args.render:
        with open(args.render[0]) as f:
            run = json.load(f)
        write(args.render[1], run["results"], run["meta"], history=False)
        return
    results = []
    for tp in (int(t) for t in args.tp.split(",")):
        for name, n, k in layer_shapes(tp):
            for rows in (int(r) for r in args.rows.split(",")):
                result = measure(rows, n, k, args.sweep)
                result.update(tp=tp, name=name)
                results.append(result)
                ms = result["ms"]
                ours = ms.get("shipped", ms["default"])
                print(f"tp{tp} {name:6s} M={rows:2d} N={n:5d} K={k:5d}: cublas {ms['cublas'] * 1e3:6.1f} us, "
                      f"ours {ours * 1e3:6.1f} ({ms['cublas'] / ours:.2f}x), best {result['best']} "
                      f"{ms[result['best']] * 1e3:6.1f} us ({ms['cublas'] / ms[result['best']]:.2f}x, "
                      f"{result['tb_per_s'][result['best']]:.2f} TB/s); host us cublas "
                      f"{result['host_us']['cublas']:.1f} ours {result['host_us']['ours']:.1f}; "
                      f"err cublas {result['errors']['cublas']:.1e} best {result['errors'][result['best']]:.1e}",
                      flush=True)
    if args.write_table:
        write_table(results)
    if args.out:
        write(args.out, results, run_meta(1, command, sweep=args.sweep))


def write_table(results: list) -> None:
    """axedist/kernels/skinny_tuned.json from measured rows: per key (skinny_gemm.table_key) the
    fastest config where it beats cuBLAS by WIN_MARGIN, else "cublas"."""
    table = {}
    for r in results:
        ms = r["ms"]
        wins = ms["cublas"] / ms[r["best"]] >= WIN_MARGIN
        table[skinny_gemm.table_key(r["rows"], r["n"], r["k"])] = r["best_config"] if wins else "cublas"
    path = os.path.join(os.path.dirname(skinny_gemm.__file__), "skinny_tuned.json")
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f' "{key}": {json.dumps(value)}' for key, value in sorted(table.items())) + "\n}\n")
    print("wrote", path)


def write(out_dir: str, results: list, meta: dict, history: bool = True) -> None:
    """skinny_gemm.json / .md / .png in out_dir (and a history line unless ``history`` is off)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "skinny_gemm.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    lines = [f"# Skinny GEMM (decode products) vs cuBLAS, one GPU ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}",
             f"command: `{meta['command']}`", "",
             "Device time per call (us), each call on another copy of the weight (read from HBM). best: the "
             "fastest config timed; choice: what `--write-table` ships for that row count bucket (best where it "
             f"beats cuBLAS by {WIN_MARGIN:.2f}x, else cuBLAS). Host: CPU us per call.", "",
             "| TP | linear | M | N | K | cuBLAS us | best config | best us | cuBLAS / best | best TB/s | choice "
             "| host us cuBLAS / ours | rel err cuBLAS / best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms = r["ms"]
        ratio = ms["cublas"] / ms[r["best"]]
        host = r.get("host_us")
        lines.append(f"| {r['tp']} | {r['name']} | {r['rows']} | {r['n']} | {r['k']} | {ms['cublas'] * 1e3:.1f} | "
                     f"{SkinnyConfig(*r['best_config'][:4])!r} | {ms[r['best']] * 1e3:.1f} | {ratio:.2f}x | "
                     f"{r['tb_per_s'][r['best']]:.2f} | {'skinny' if ratio >= WIN_MARGIN else 'cuBLAS'} | "
                     + (f"{host['cublas']:.0f} / {host['ours']:.0f}" if host else "-")
                     + f" | {r['errors']['cublas']:.1e} / {r['errors'][r['best']]:.1e} |")
    with open(os.path.join(out_dir, "skinny_gemm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    draw(results, meta, os.path.join(out_dir, "skinny_gemm.png"))
    if history:
        append_history(out_dir, "skinny_gemm", meta, dict(results=results))


def draw(results: list, meta: dict, path: str) -> None:
    """cuBLAS time / best skinny time per product, one panel per row count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted({r["rows"] for r in results})
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4.5), sharey=True, squeeze=False)
    for axis, count in zip(axes[0], rows):
        mine = [r for r in results if r["rows"] == count]
        ratios = [r["ms"]["cublas"] / r["ms"][r["best"]] for r in mine]
        colors = ["tab:green" if x >= WIN_MARGIN else "tab:gray" for x in ratios]
        axis.bar(range(len(mine)), ratios, color=colors)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(range(len(mine)), [f"tp{r['tp']} {r['name']}" for r in mine], rotation=70, fontsize=8)
        axis.set_title(f"M = {count} rows")
    axes[0][0].set_ylabel("cuBLAS time / skinny GEMM time (green: shipped)")
    fig.suptitle(f"Skinny GEMM vs cuBLAS, {meta['machine']}, {meta['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
