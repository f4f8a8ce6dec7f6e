"""Fused all-gather + GEMM vs NCCL all-gather + cuBLAS vs PyTorch's fused op, side by side.

    torchrun --nproc_per_node=4 benchmarks/bench_ag_gemm.py --out benchmarks/results
    python3 benchmarks/bench_ag_gemm.py --onegpu --out benchmarks/results   # one GPU: TP = 1

Per shape (bf16, A_r [M/W, K] per rank, B [K, N_local], gathered on dim 0), ms, median of
--reps calls, max over ranks, timed both eager and queued (device time; timing.py):
  cublas     torch.mm of the gathered [M, K] alone    nccl_ag   NCCL all-gather of A alone
  seq        NCCL all-gather then torch.mm            symm      torch.ops.symm_mem.fused_all_gather_matmul
  fused      axedist.all_gather_gemm (p2p)            p2p_ag    axedist's p2p all-gather of A
  kernel_w1  the fused kernel on one rank's whole M (its GEMM half: local copy + tiles)
  fused_gl   the Gluon fused kernel (AllGatherGemmConfig /gl, opt-in: not what "fused" or "auto" run)
  fused_ce   the Triton fused kernel with the rows moved by copy engine (/ce: the shape's tiles,
             no push tasks)
  fused_gl_ce the Gluon fused kernel with the rows moved by copy engine (/gl/ce: the shape's
             tiles; what "fused" runs at W = 2 where cuda-python can issue the copies)
  limit      max(cublas, all-gather bytes in per GPU / 478 GB/s)
Shapes: M in {2048, 8192, 16384} x N_local in {7168, 2048} at K = 8192, and the column-parallel
shapes of Qwen3-32B (w1/w3, qkv) and Llama-3.1-405B (w1/w3) at M = 8192.
--onegpu (no torchrun): the TP = 1 path (ax.all_gather_gemm on a one-rank group: a plain
matmul) and the GEMM half (the fused kernel on one virtual rank with the whole GPU: the shape's
config on the Triton kernel, the Gluon kernel /gl, and /gl/sk: with its stream-K tail where the
shape has one) against cuBLAS, device time. Writes ag_gemm_w{W}.json / .md / .png (ag_gemm_onegpu.* with --onegpu)
and a history line. --tables-from writes axedist/kernels/ag_gemm_auto.json.
Multicast stays off: this script refuses to run with AXEDIST_ENABLE_MULTICAST=1 set.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import axedist as ax
from axedist.collectives import all_gather_into, p2p, plan_all_gather_gemm
from axedist.collectives.fused_tp import AllGatherGemmCall
from axedist.collectives.symmetric import get_workspace
from axedist.collectives.timing import device_time, host_time_us, time_interleaved
from axedist.kernels.ag_gemm import AllGatherGemmConfig, default_config
from axedist.testing import VirtualRanks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/history.py, beside this script
from history import (append_history, auto_cell, auto_vs_best, merged_with_earlier, require_multicast_off, run_meta, symm_fastest,  # noqa: E402
                     table_source, unfused_time)

LINK_BYTES_PER_S = 478e9


def model_shapes(world, batch: int = 8):
    """The fused all-gather + GEMM calls of one step of bench_tp.py --preset llama8b at TP = world (batch x 4096
    gathered rows, batch 8 unless given): wq (whose gathered input wk / wv reuse), w1 (w3 likewise), the output layer."""
    rows, dim, ffn, vocab = batch * 4096, 4096, 14336, 16384
    model = "llama8b" if batch == 8 else f"llama8b b{batch}"
    return [(f"{model} wq", rows, dim // world, dim), (f"{model} w1", rows, ffn // world, dim),
            (f"{model} output", rows, vocab // world, dim)]


def shapes(world, which: str = "design", batch: int = 8):
    """(label, M, N_local, K) of the column-parallel GEMMs."""
    if which == "llama8b":
        return model_shapes(world, batch)
    rows = [("design", m, n, 8192) for m in (2048, 8192, 16384) for n in (7168, 2048)]
    rows.append(("qwen3-32b w1/w3", 8192, 25600 // world, 5120))
    rows.append(("qwen3-32b qkv", 8192, (8192 + 2 * 1024) // world, 5120))
    rows.append(("llama3.1-405b w1/w3", 8192, 53248 // world, 16384))
    return rows


def _relative(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_multi(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    group_name = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)
    torch.manual_seed(1234 + rank)
    one_rank = VirtualRanks(1, data_bytes=1 << 30)  # the kernel's GEMM half on this GPU
    results = []
    selected = [int(i) for i in args.only.split(",") if i] or None
    for index, (label, m, n, k) in enumerate(shapes(world, args.shapes, args.batch)):
        if selected is not None and index not in selected:
            continue
        a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        b = weight.t()                                   # nn.Linear's layout
        gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        row = dict(label=label, M=m, N=n, K=k, world=world)

        def seq():
            all_gather_into(gathered, a)
            torch.mm(gathered, b, out=out)

        def symm():
            return torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name)
        try:
            symm()
        except Exception as error:  # keep the run going; say why in the table
            symm = None
            row["symm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        row["plan"] = str(plan_all_gather_gemm(a, b))
        fused_out, gl_out, ce_out, glce_out, glce4_out, w1_out = (
            torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(6))

        def pinned(config):  # the fused call of this rank pinned to `config`, on its real workspace
            return AllGatherGemmCall(plan_all_gather_gemm(a, b, backend="p2p"), world, rank,
                                     lambda nbytes: get_workspace(dist.group.WORLD, nbytes, a.device),
                                     pinned_config=config)

        gluon = pinned(AllGatherGemmConfig(pipelined=True))  # (/gl, opt-in: not what "fused" runs)
        # the rows by copy engine beside the Triton kernel (/ce) and the Gluon kernel (/gl/ce:
        # what "fused" runs at W = 2), the shape's tiles
        engine_config = dataclasses.replace(default_config(m // world, n, k, world), engine=True,
                                            pipelined=False)
        gluon_engine_config = dataclasses.replace(engine_config, pipelined=True)
        engine, gluon_engine = pinned(engine_config), pinned(gluon_engine_config)
        # the same at 4 stages (on one GPU its GEMM half was 0.3-1.6 % faster than at 3:
        # gemm_halves_onegpu.md)
        gluon_engine_s4 = pinned(dataclasses.replace(gluon_engine_config, stages=4))
        columns = {"cublas": lambda: torch.mm(gathered, b, out=out),
                   "nccl_ag": lambda: all_gather_into(gathered, a),
                   "p2p_ag": lambda: p2p.all_gather(a, out=gathered),
                   "seq": seq, "symm": symm,
                   "fused": lambda: ax.all_gather_gemm(a, b, backend="p2p", out=fused_out),
                   "fused_gl": lambda: gluon.run(a, b, gl_out),
                   "fused_ce": lambda: engine.run(a, b, ce_out),
                   "fused_gl_ce": lambda: gluon_engine.run(a, b, glce_out),
                   "fused_gl_ce_s4": lambda: gluon_engine_s4.run(a, b, glce4_out),
                   "auto": lambda: ax.all_gather_gemm(a, b),  # what a user's call runs (the shipped tables)
                   "kernel_w1": lambda: one_rank.all_gather_gemm([gathered], [b], [w1_out])}
        columns = {name: fn for name, fn in columns.items() if fn is not None}
        # aligned: a coupled column after the local cuBLAS / W=1 ones no longer absorbs the
        # ranks' skew (the NCCL AG device column did until f4d35fa: 405B 1.038 ms device vs 0.632 eager)
        queued = row["queued"] = time_interleaved(columns, args.reps, queued=True, align=True)
        # eager interleaved too, in blocks of three calls of a column (the last timed): columns
        # timed one after another read the GPUs' clock of their moment (bench_gemm_rs.py)
        row.update(time_interleaved(columns, args.reps, block=3))
        row.setdefault("symm", None)
        queued.setdefault("symm", None)
        row["host_us"] = {name: host_time_us(columns[name], calls=20, repeats=3)
                          for name in ("seq", "fused", "fused_ce", "fused_gl_ce", "auto") if name in columns}
        torch.cuda.synchronize()
        dist.barrier()
        ax.all_gather_gemm(a, b, backend="p2p", out=fused_out, check=True)
        gluon.run(a, b, gl_out, check=True)
        engine.run(a, b, ce_out, check=True)
        gluon_engine.run(a, b, glce_out, check=True)
        gluon_engine_s4.run(a, b, glce4_out, check=True)
        seq()
        one_rank.all_gather_gemm([gathered], [b], [w1_out])
        one_rank.check()
        row["fused_rel_err_vs_seq"] = _relative(fused_out, out)
        row["fused_gl_rel_err_vs_seq"] = _relative(gl_out, out)
        row["fused_ce_rel_err_vs_seq"] = _relative(ce_out, out)
        row["fused_ce_config"] = str(engine_config)
        row["fused_gl_ce_rel_err_vs_seq"] = _relative(glce_out, out)
        row["fused_gl_ce_config"] = str(gluon_engine_config)
        row["fused_gl_ce_s4_rel_err_vs_seq"] = _relative(glce4_out, out)
        row["fused_config"] = str(default_config(m // world, n, k, world))  # what "fused" ran
        row["kernel_w1_rel_err"] = _relative(w1_out, out)
        ag_bytes_in = (world - 1) / world * m * k * 2
        for times in (row, queued):
            times["limit"] = max(times["cublas"], ag_bytes_in / LINK_BYTES_PER_S * 1e3)
            times["speedup_vs_seq"] = times["seq"] / times["fused"]
            times["gl_speedup_vs_seq"] = times["seq"] / times["fused_gl"]
            times["ce_speedup_vs_seq"] = times["seq"] / times["fused_ce"]
            times["ce_speedup_vs_symm"] = (times["symm"] / times["fused_ce"]) if times["symm"] else None
            times["glce_speedup_vs_seq"] = times["seq"] / times["fused_gl_ce"]
            times["glce_speedup_vs_symm"] = (times["symm"] / times["fused_gl_ce"]) if times["symm"] else None
            times["glce_s4_speedup"] = times["fused_gl_ce"] / times["fused_gl_ce_s4"]
            times["speedup_vs_symm"] = (times["symm"] / times["fused"]) if times["symm"] else None
            times["kernel_w1_vs_cublas"] = times["cublas"] / times["kernel_w1"]
            times["auto_vs_best"] = auto_vs_best(times)
        results.append(row)
        if rank == 0:
            print(f"[{index}] {label} M={m} N={n} K={k}: queued cublas {queued['cublas']:.3f} "
                  f"nccl_ag {queued['nccl_ag']:.3f} seq {queued['seq']:.3f} fused {queued['fused']:.3f} "
                  f"kernel_w1 {queued['kernel_w1']:.3f} x{queued['speedup_vs_seq']:.2f} vs seq, "
                  f"err {row['fused_rel_err_vs_seq']:.1e}", flush=True)
        del a, weight, gathered, out, fused_out, gl_out, ce_out, glce_out, glce4_out, w1_out
        del gluon, engine, gluon_engine, gluon_engine_s4
        torch.cuda.empty_cache()
    if rank == 0:
        command = f"torchrun --nproc_per_node={world} benchmarks/bench_ag_gemm.py " + " ".join(sys.argv[1:])
        name = f"ag_gemm_w{world}" + ("_llama8b" if args.shapes == "llama8b" else "")
        name += f"_b{args.batch}" if args.shapes == "llama8b" and args.batch != 8 else ""
        write_outputs(results, name, run_meta(world, command), args.out, multi=True)
    dist.barrier()
    dist.destroy_process_group()


def run_onegpu(args):
    """TP = 1 and the GEMM half on one GPU (device time, one_rank = the whole GPU)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    torch.manual_seed(1234)
    one_rank = VirtualRanks(1, data_bytes=1 << 30)
    results = []
    for index, (label, m, n, k) in enumerate(shapes(args.tp_shapes)):
        if args.only and str(index) not in args.only.split(","):
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)).t()
        out, tp1_out, w1_out, gl_out, sk_out = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                                                for _ in range(5))
        gluon = AllGatherGemmConfig(pipelined=True)
        tail = AllGatherGemmConfig(pipelined=True, stream_k=True)
        columns = {"cublas": lambda: torch.mm(a, b, out=out),
                   "tp1": lambda: ax.all_gather_gemm(a, b, out=tp1_out),
                   "kernel_w1": lambda: one_rank.all_gather_gemm([a], [b], [w1_out]),
                   "kernel_w1_gl": lambda: one_rank.all_gather_gemm([a], [b], [gl_out], config=gluon),
                   "kernel_w1_sk": lambda: one_rank.all_gather_gemm([a], [b], [sk_out], config=tail)}
        times = device_time(columns, calls=args.calls, batches=args.batches)
        for column in (tp1_out, w1_out, gl_out, sk_out):
            column.fill_(float("nan"))
        tail_tiles = 0
        for name, fn in columns.items():
            fn()
            if name == "kernel_w1_sk":
                tail_tiles = max(launch.tail_tiles for call in one_rank.last_plans
                                 for launch in call.launches.values())
        one_rank.check()
        row = dict(label=label, M=m, N=n, K=k, world=1, queued=times, tail_tiles=tail_tiles,
                   plan=str(plan_all_gather_gemm(a, b)),
                   tp1_rel_err=_relative(tp1_out, out), kernel_w1_rel_err=_relative(w1_out, out),
                   kernel_w1_gl_rel_err=_relative(gl_out, out), kernel_w1_sk_rel_err=_relative(sk_out, out),
                   host_us={name: host_time_us(fn, calls=20, repeats=3) for name, fn in columns.items()})
        for name in ("kernel_w1", "kernel_w1_gl", "kernel_w1_sk"):
            times[f"{name}_vs_cublas"] = times["cublas"] / times[name]
        results.append(row)
        print(f"[{index}] {label} {m}x{n}x{k}: cublas {times['cublas']:.3f} tp1 {times['tp1']:.3f} "
              f"kernel_w1 {times['kernel_w1']:.3f} ({times['kernel_w1_vs_cublas']:.2f}x) "
              f"/gl {times['kernel_w1_gl']:.3f} ({times['kernel_w1_gl_vs_cublas']:.2f}x) "
              f"/gl/sk {times['kernel_w1_sk']:.3f} ({times['kernel_w1_sk_vs_cublas']:.2f}x, tail {tail_tiles}) "
              f"err {row['kernel_w1_rel_err']:.1e} {row['kernel_w1_gl_rel_err']:.1e}", flush=True)
        del a, b, out, tp1_out, w1_out, gl_out, sk_out
        torch.cuda.empty_cache()
    command = "python3 benchmarks/bench_ag_gemm.py " + " ".join(sys.argv[1:])
    write_outputs(results, "ag_gemm_onegpu", run_meta(1, command), args.out, multi=False)
    dist.destroy_process_group()


def _table(results, times_of, multi):
    if multi:
        head = ("| shape | M | N | K | cuBLAS | NCCL AG | seq | symm | fused | auto | best / auto | p2p AG | kernel W=1 | "
                "limit | vs seq | vs symm | fused /gl | /gl vs seq | fused /ce | /ce vs seq | /ce vs symm | "
                "fused /gl/ce | /gl/ce vs seq | /gl/ce vs symm |")
    else:
        head = ("| shape | M | N | K | cuBLAS | TP=1 path | kernel W=1 | cuBLAS / kernel W=1 | "
                "kernel W=1 /gl | cuBLAS / kernel W=1 /gl | stream-K tail tiles | /gl/sk | "
                "cuBLAS / /gl/sk |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        t = times_of(r)
        if multi:
            symm = f"{t['symm']:.3f}" if t["symm"] else "n/a"
            vs_symm = f"{t['speedup_vs_symm']:.2f}x" if t["speedup_vs_symm"] else "n/a"
            lines.append(f"| {r['label']} | {r['M']} | {r['N']} | {r['K']} | {t['cublas']:.3f} | "
                         f"{t['nccl_ag']:.3f} | {t['seq']:.3f} | {symm} | {t['fused']:.3f} | {auto_cell(t)} | "
                         f"{t['p2p_ag']:.3f} | {t['kernel_w1']:.3f} | {t['limit']:.3f} | "
                         f"{t['speedup_vs_seq']:.2f}x | {vs_symm} |"
                         + (f" {t['fused_gl']:.3f} | {t['gl_speedup_vs_seq']:.2f}x |" if t.get("fused_gl") else " - | - |")
                         + (f" {t['fused_ce']:.3f} | {t['ce_speedup_vs_seq']:.2f}x | "
                            + (f"{t['ce_speedup_vs_symm']:.2f}x |" if t.get("ce_speedup_vs_symm") else "n/a |")
                            if t.get("fused_ce") else " - | - | - |")
                         + (f" {t['fused_gl_ce']:.3f} | {t['glce_speedup_vs_seq']:.2f}x | "
                            + (f"{t['glce_speedup_vs_symm']:.2f}x |" if t.get("glce_speedup_vs_symm") else "n/a |")
                            if t.get("fused_gl_ce") else " - | - | - |"))
        else:
            lines.append(f"| {r['label']} | {r['M']} | {r['N']} | {r['K']} | {t['cublas']:.3f} | "
                         f"{t['tp1']:.3f} | {t['kernel_w1']:.3f} | {t['kernel_w1_vs_cublas']:.2f} | "
                         + (f"{t['kernel_w1_gl']:.3f} | {t['kernel_w1_gl_vs_cublas']:.2f} |"
                            if "kernel_w1_gl" in t else "- | - |")
                         + (f" {r['tail_tiles']} | {t['kernel_w1_sk']:.3f} | {t['kernel_w1_sk_vs_cublas']:.2f} |"
                            if "kernel_w1_sk" in t else " - | - | - |"))
    return lines


def write_outputs(results, name, meta, out_dir, multi: bool):
    """The run's JSON, history line, markdown table and PNG; multi: a torchrun run (its columns,
    at any world size, 1 too), else --onegpu's."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as handle:
        json.dump(dict(meta=meta, rows=results), handle, indent=1)
    append_history(out_dir, name, meta, dict(rows=results))
    lines = [f"# Fused all-gather + GEMM: {name} ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
             f"command: `{meta['command']}`", "",
             "## Device time (calls queued back to back behind a sleep kernel), ms", ""]
    lines += _table(results, lambda r: r["queued"], multi) + [""]
    if multi:
        lines += ["## Eager (calls issued by the host, columns interleaved in blocks of three calls, the last timed), ms", ""]
        lines += _table(results, lambda r: r, multi) + [""]
    if multi and all("glce_s4_speedup" in r for r in results):
        lines += ["/gl/ce at 4 stages against 3 (time at 3 / time at 4; device, eager): " + "; ".join(
            f"{r['M']}x{r['N']}x{r['K']} {r['queued']['glce_s4_speedup']:.3f}, {r['glce_s4_speedup']:.3f}"
            for r in results), ""]
    lines += ["relative errors vs cuBLAS: " + "; ".join(
        f"{r['M']}x{r['N']}x{r['K']}: " + ", ".join(f"{k} {v:.1e}" for k, v in r.items() if k.endswith("rel_err")
                                                  or k.endswith("rel_err_vs_seq")) for r in results)]
    lines += ["", "host us per call: " + "; ".join(
        f"{r['M']}x{r['N']}x{r['K']}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["host_us"].items()) for r in results)]
    lines += ["", "plans: "] + [f"- {r['plan']}" for r in results]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        labels = [f"{r['M']}x{r['N']}x{r['K']}" for r in results]
        columns = ["seq", "symm", "fused", "fused_ce", "fused_gl_ce", "kernel_w1", "limit"] if multi else ["tp1", "kernel_w1", "kernel_w1_gl", "kernel_w1_sk"]
        base = "seq" if multi else "cublas"
        figure, axis = plt.subplots(figsize=(max(8, len(labels) * 1.1), 4.5))
        width = 0.8 / len(columns)
        for i, column in enumerate(columns):
            values = [r["queued"][base] / r["queued"][column] if r["queued"].get(column) else 0 for r in results]
            axis.bar([x + i * width for x in range(len(labels))], values, width, label=column)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([x + 0.4 for x in range(len(labels))])
        axis.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        axis.set_ylabel(f"speed vs {base}, device time (higher is faster)")
        axis.set_title(f"all-gather + GEMM, bf16 ({meta['machine']})", fontsize=9)
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG")


def as_shipped(row: dict) -> dict:
    """A result row whose "fused" times (eager and queued) are those of the config the fused path
    runs now (``default_config`` where copy engines can move rows, as on the device): where the
    "fused" column ran another config and the "fused /gl/ce" column ran this one, that column's
    times; else as measured. A row says what "fused" ran ("fused_config"); rows written before
    it did ran the default of their commit: /gl/ce at W = 2, the pushes at W = 4 (902a153)."""
    shipped = str(default_config(row["M"] // row["world"], row["N"], row["K"], row["world"], engines=True))
    ran = row.get("fused_config", row.get("fused_gl_ce_config") if row["world"] == 2 else None)
    if ran == shipped or row.get("fused_gl_ce_config") != shipped:
        return row
    return {**row, "fused": row["fused_gl_ce"], "queued": {**row["queued"], "fused": row["queued"]["fused_gl_ce"]}}


def auto_table(results: list[dict]) -> dict:
    """ag_gemm_auto.json from result files: a shape where torch's symmetric-memory op was the
    fastest in device time and eagerly goes to "symm_wins", else one where fused (``as_shipped``)
    was slower than the unfused pair (the faster of NCCL's and our all-gather, then cuBLAS:
    ``unfused_time``) in device time to "fused_loses"."""
    loses, wins, sources = [], [], []
    for result in results:
        meta = result["meta"]
        sources.append(table_source(meta))
        for row in map(as_shipped, result["rows"]):
            shape = [row["M"], row["N"], row["K"], row["world"]]
            if row["world"] > 1 and symm_fastest(row):
                wins.append(shape)
            elif row["world"] > 1 and row["queued"]["fused"] > unfused_time(row["queued"]):
                loses.append(shape)
    from axedist.collectives.fused_tp import AG_AUTO, AG_AUTO_TABLE_PATH
    # shapes these results did not measure keep what earlier runs found
    measured = {(row["M"], row["N"], row["K"], row["world"]) for result in results for row in result["rows"]}
    with open(AG_AUTO_TABLE_PATH) as handle:
        earlier = json.load(handle)
    return merged_with_earlier(earlier, dict(source=sources, fused_loses=loses, symm_wins=wins,
                                             min_rows_per_rank=AG_AUTO["min_rows_per_rank"]), measured)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", default="", help="comma list of shape indices to run")
    parser.add_argument("--shapes", default="design", choices=["design", "llama8b"],
                        help="design: the design and model rows; llama8b: the calls of bench_tp.py --preset "
                             "llama8b at this world size")
    parser.add_argument("--batch", type=int, default=8,
                        help="--shapes llama8b: bench_tp's batch (rows = batch x 4096; its GPU-bound TP=4 size is 16)")
    parser.add_argument("--onegpu", action="store_true", help="one GPU, no torchrun: TP = 1 and the GEMM half")
    parser.add_argument("--tp-shapes", type=int, default=4, help="--onegpu: the TP degree whose N_local to use")
    parser.add_argument("--calls", type=int, default=10, help="--onegpu: calls per timed batch")
    parser.add_argument("--batches", type=int, default=5, help="--onegpu: timed batches (median)")
    parser.add_argument("--tables-from", nargs="+", default=None, metavar="RESULTS_JSON",
                        help="no benchmark: write axedist/kernels/ag_gemm_auto.json from these result files")
    args = parser.parse_args()
    if args.tables_from:
        results = [json.load(open(path)) for path in args.tables_from]
        from axedist.collectives.fused_tp import AG_AUTO_TABLE_PATH
        table = auto_table(results)  # reads the earlier table: before the file is opened for writing
        with open(AG_AUTO_TABLE_PATH, "w") as handle:
            json.dump(table, handle, indent=1)
        return
    require_multicast_off()
    started = time.time()
    (run_onegpu if args.onegpu else run_multi)(args)
    print(f"done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
