"""Where does the /ce GEMM + reduce-scatter lose its time against its own GEMM? (issue 28: fused
over GEMM-only stayed 1.07-1.25x with the partials off the SMs; about 4.5 us per tile wave on
every design shape, history/gemm_rs_w2_ce_d68b355.md.) The first run (f0315e6) found the own tiles' epilogue
8.4 us against a peer tile's 3.4 and waits of 0.4 us: the kernel spilled registers there
(fixed in 13f4d59: own epilogue 4.3-5.7 us; a relaxed task claim, tried there, was no faster).

Per shape, in one interleaved device-time loop (axedist/collectives/timing.py, queued):
  cublas      torch.mm alone
  gemm_only   the fused kernel's GEMM alone, same tiles (collectives.fused.gemm_only)
  ce          the /ce kernel (--config: candidate 16, /gl/ce, by default; candidate 14 is the
              Triton kernel's; --triton times the same tiles on the Triton kernel too)
Then one traced call: per task its start and end (globaltimer), SM, cycles in the main loop, in
waits and in all; summarised per phase (peer tiles, own tiles) per rank. --copies runs that call
under the CUDA profiler too (CUPTI), so that each comm chunk reads as one line: when its last
peer tile ended (the out flag), when its copy started and ended on the side stream, and when the
peer's own tiles of it started and how long they waited (was a late chunk late to start, or slow
to copy?). Writes probe_gemm_rs_ce.json (+ .md; --render draws the PNG of
the traces on a machine with matplotlib).

    torchrun --nproc-per-node 2 benchmarks/probe_gemm_rs_ce.py --out <dir> [--copies] [--chunks 4,8]
    python benchmarks/probe_gemm_rs_ce.py --render <dir>/probe_gemm_rs_ce.json --out <dir>
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist
import triton

SHAPES = [(8192, 8192, 2048), (16384, 8192, 2048), (2048, 8192, 2048), (8192, 8192, 7168),
          (2048, 8192, 7168)]


def summarise(trace: torch.Tensor, world: int) -> dict:
    """Per phase (the peer tiles, then the own tiles, in claim order): tasks, span (ns), mean
    main-loop / wait / rest-of-task cycles, and the SM clock the trace implies (cycles per ns)."""
    rows = trace.tolist()
    per_slot = len(rows) // world
    first = min(r[0] for r in rows)
    ghz = statistics.median(r[5] / max(1, r[1] - r[0]) for r in rows if r[1] > r[0])
    phases = {}
    for name, chunk in (("peer", rows[:per_slot * (world - 1)]), ("own", rows[per_slot * (world - 1):])):
        phases[name] = dict(
            tasks=len(chunk), begin_us=(min(r[0] for r in chunk) - first) / 1e3,
            end_us=(max(r[1] for r in chunk) - first) / 1e3,
            main_us=statistics.mean(r[3] for r in chunk) / ghz / 1e3,
            wait_us=statistics.mean(r[4] for r in chunk) / ghz / 1e3,
            rest_us=statistics.mean(r[5] - r[3] - r[4] for r in chunk) / ghz / 1e3,
            waiting_tasks=sum(1 for r in chunk if r[4] / ghz > 500))
    # gaps on one SM between a task's end and the next task's start (claim, loop overhead)
    by_sm = {}
    for r in rows:
        by_sm.setdefault(r[2], []).append(r)
    gaps = [b[0] - a[1] for tasks in by_sm.values() for a, b in zip(sorted(tasks), sorted(tasks)[1:])]
    return dict(span_us=(max(r[1] for r in rows) - first) / 1e3, cycles_per_ns=ghz,
                mean_gap_us=statistics.mean(gaps) / 1e3 if gaps else 0.0, phases=phases)


def profiled_copies(call, calls: int) -> dict:
    """Runs call() `calls` times under the CUDA profiler; of the last call, the kernel's start and
    its side-stream copies: {"kernel_us": start, "copies": [(start, end, bytes)]} (CUPTI clock, us)."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        prof.export_chrome_trace(handle.name)
        with open(handle.name) as trace_file:
            events = json.load(trace_file)["traceEvents"]
    kernels = sorted(e["ts"] for e in events
                     if e.get("cat") == "kernel" and "engine_gemm_reduce_scatter" in e.get("name", ""))
    if not kernels:
        raise RuntimeError("probe --copies: the profiler saw no /ce kernel")
    copies = sorted((e["ts"], e["ts"] + e["dur"], int(e.get("args", {}).get("bytes", 0)))
                    for e in events if e.get("cat") == "gpu_memcpy" and e["ts"] >= kernels[-1])
    return {"kernel_us": kernels[-1], "copies": copies}


def chunk_timeline(traces: list, spans: list, m: int, n: int, config, target: int) -> list:
    """Per rank and comm chunk (W = 2: one peer), in us since that rank's kernel started:
    ready (its last peer tile of the chunk ended), copy start / end (its data copy to the peer),
    and on the receiving peer: its own tiles of the chunk, first start, and their longest wait.
    The two ranks' times meet through CUPTI's kernel starts (one host clock); a trace counts
    from its first task, which starts about when the profiler says the kernel did."""
    from axedist.kernels import gemm_rs, schedule
    world = len(traces)
    if world != 2:
        return []
    tiles_m, tiles_n = triton.cdiv(m // world, config.block_m), triton.cdiv(n, config.block_n)
    band_tiles, rectangles = gemm_rs.engine_chunks(m // world, n, config, target)
    bands = triton.cdiv(tiles_n, band_tiles)
    per_slot = tiles_m * tiles_n

    def chunk_of(index):
        tile_m, tile_n = schedule.grouped_tile(index, tiles_m, tiles_n, config.group_m)
        return (tile_m // config.group_m) * bands + tile_n // band_tiles

    ids = [chunk_of(i) for i in range(per_slot)]
    members = [[i for i, c in enumerate(ids) if c == chunk] for chunk in range(len(rectangles))]

    out = []
    for rank in range(world):
        rows, peer_rows = traces[rank], traces[1 - rank]
        first, peer_first = min(r[0] for r in rows), min(r[0] for r in peer_rows)
        ghz = statistics.median(r[5] / max(1, r[1] - r[0]) for r in peer_rows if r[1] > r[0])
        data = [c for c in spans[rank]["copies"] if c[2] > 4]
        kernel = spans[rank]["kernel_us"]
        shift = spans[1 - rank]["kernel_us"] - kernel  # the peer's kernel start in this frame
        for chunk, tasks in enumerate(members):  # a slot's tasks of the chunk, in claim order
            ready = max(rows[i][1] for i in tasks)
            own = [peer_rows[per_slot + i] for i in tasks]
            copy = data[chunk] if chunk < len(data) else (float("nan"),) * 3
            out.append(dict(rank=rank, chunk=chunk, ready_us=(ready - first) / 1e3,
                            copy_start_us=copy[0] - kernel, copy_end_us=copy[1] - kernel,
                            megabytes=copy[2] / 2**20,
                            peer_own_start_us=shift + (min(r[0] for r in own) - peer_first) / 1e3,
                            peer_own_wait_max_us=max(r[4] for r in own) / ghz / 1e3))
    return out


def copy_rate(chunk: dict) -> float:
    """GB/s of a chunk's copy (chunk_timeline's row)."""
    return chunk["megabytes"] * 2**20 / max(1e-9, chunk["copy_end_us"] - chunk["copy_start_us"]) / 1e3


def chunk_lines(chunks) -> list:
    return [f"rank {c['rank']} chunk {c['chunk']}: ready {c['ready_us']:.0f}, copy "
            f"{c['copy_start_us']:.0f}-{c['copy_end_us']:.0f} us ({c['megabytes']:.1f} MiB, "
            f"{copy_rate(c):.0f} GB/s); "
            f"peer's own tiles from {c['peer_own_start_us']:.0f} us, wait <= {c['peer_own_wait_max_us']:.1f} us"
            for c in chunks or []]


def run(args):
    from axedist.collectives.fused import gemm_only
    from axedist.collectives.symmetric import get_workspace
    from axedist.collectives.timing import time_interleaved
    from axedist.kernels import gemm_rs, schedule
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from history import require_multicast_off, run_meta

    require_multicast_off()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    base = (gemm_rs.CANDIDATES[int(args.config)] if args.config.isdigit()
            else gemm_rs.GemmConfig.parse(args.config))
    results = []
    for m, n, k in SHAPES:
        torch.manual_seed(7 + rank)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
        product = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ops = gemm_rs.prepare_operands(a, b)
        workspace = get_workspace(dist.group.WORLD, m * n * 2, a.device)
        # "ce": the shipped chunking and streams; "ce/c<n>": aiming at n comm chunks per peer;
        # "ce/s<n>": the copies on n side streams; "ce/k<n>" (a /gl config): a peer tile counted
        # after K step n of the next tile; "ce/p<n>" (a /gl config): an own tile's first partial
        # loaded n K steps before its last (p-1: after its main loop); "ce/triton": the same
        # config on the Triton kernel. Each: (config, EngineReduceScatter's probe arguments)
        targets = {("ce" if c == gemm_rs.ENGINE_TARGET_CHUNKS else f"ce/c{c}"):
                   (base, dict(target_chunks=c)) for c in args.chunks}
        targets.update({f"ce/s{s}": (base, dict(streams=s)) for s in args.streams
                        if s != schedule.COPY_STREAMS})
        targets.update({f"ce/k{k}": (base, dict(count_step=k)) for k in args.count_steps if k})
        targets.update({f"ce/p{p}": (base, dict(partial_ahead=p)) for p in args.partial_aheads
                        if p != gemm_rs.ENGINE_PARTIAL_AHEAD})
        if args.triton and base.pipelined:
            targets["ce/triton"] = (dataclasses.replace(base, pipelined=False), {})
        # GEMM-only: the config's tile loop alone (a push config would run the Triton one)
        tiles_only = dataclasses.replace(base, push=False, defer_release=False, engine=False)
        engines = {name: gemm_rs.EngineReduceScatter(ops, out, config, world, rank, workspace,
                                                     **probe)
                   for name, (config, probe) in targets.items()}

        def call(launch):
            workspace.begin_call("probe_gemm_rs_ce")
            launch(ops, out)

        # the output against cuBLAS + a sum over ranks (the reduce-scatter's value)
        torch.mm(a, b, out=product)
        dist.all_reduce(product)
        reference = product[rank * (m // world):(rank + 1) * (m // world)].float()
        errors = {}
        for name, engine in engines.items():
            out.fill_(float("nan"))
            call(engine)
            torch.cuda.synchronize()
            errors[name] = ((out.float() - reference).norm() / reference.norm()).item()
        times = time_interleaved({"cublas": lambda: torch.mm(a, b, out=product),
                                  "gemm_only": lambda: gemm_only(a, b, world, tiles_only, out=product),
                                  **{name: (lambda e=e: call(e)) for name, e in engines.items()}},
                                 args.reps, queued=True, align=True)
        tiles = world * triton.cdiv(m // world, base.block_m) * triton.cdiv(n, base.block_n)
        traces, chunks, step = {}, {}, torch.zeros(1, device="cuda")
        for name, (config, probe) in targets.items():
            trace = torch.zeros(tiles, 6, dtype=torch.int64, device="cuda")
            traced = gemm_rs.EngineReduceScatter(ops, out, config, world, rank, workspace,
                                                 trace=trace, **probe)
            # the last call's trace (each call rewrites every task's row), its copies by CUPTI
            # each profiled call starts with the ranks' GPUs in step (a one-float all-reduce)
            spans = profiled_copies(lambda: (dist.all_reduce(step), call(traced)), 3) if args.copies else None
            if spans is None:
                for _ in range(3):
                    call(traced)
                torch.cuda.synchronize()
            gathered = [torch.empty_like(trace) for _ in range(world)]
            dist.all_gather(gathered, trace)
            traces[name] = [dict(summarise(t.cpu(), world), raw=t.cpu().tolist() if args.raw else None)
                            for t in gathered]
            if spans is not None:
                all_spans = [None] * world
                dist.all_gather_object(all_spans, spans)
                chunks[name] = chunk_timeline([t.cpu().tolist() for t in gathered], all_spans,
                                              m, n, base, probe.get("target_chunks",
                                                                    gemm_rs.ENGINE_TARGET_CHUNKS))
        row = dict(M=m, N=n, K_local=k, world=world, config=str(base), times=times,
                   rel_err=errors, traces=traces, chunks=chunks)
        results.append(row)
        if rank == 0:
            print(f"{m}x{n}x{k}: " + " ".join(f"{name} {t:.3f}" for name, t in times.items())
                  + f" | err {max(errors.values()):.1e}", flush=True)
            for name, per_rank in traces.items():
                for line in chunk_lines(chunks.get(name)):
                    print(f"   {name} {line}", flush=True)
                for r, summary in enumerate(per_rank):
                    p = summary["phases"]
                    print(f"   trace {name} rank {r}: span {summary['span_us']:.0f} us, "
                          f"{summary['cycles_per_ns']:.2f} GHz, gap {summary['mean_gap_us']:.2f} us | "
                          + " | ".join(f"{ph} {v['begin_us']:.0f}-{v['end_us']:.0f} us main {v['main_us']:.1f}"
                                       f" wait {v['wait_us']:.2f} rest {v['rest_us']:.2f} ({v['waiting_tasks']} waited)"
                                       for ph, v in p.items()), flush=True)
        del engines, traced, a, b, out, product
        torch.cuda.empty_cache()
    if rank == 0:
        meta = run_meta(world, " ".join([f"torchrun --nproc-per-node {world} benchmarks/probe_gemm_rs_ce.py",
                                         *sys.argv[1:]]))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_gemm_rs_ce.json"), "w") as handle:
            json.dump(dict(meta=meta, rows=results), handle)
        write_markdown(dict(meta=meta, rows=results), args.out)
    dist.barrier()
    dist.destroy_process_group()


def write_markdown(saved, out_dir):
    meta, rows = saved["meta"], saved["rows"]
    lines = [f"# /ce GEMM + reduce-scatter: where its time goes ({meta['date']}, {meta['commit']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; multicast off",
             f"command: `{meta['command']}`", "",
             "Device time (ms, median, max over ranks; queued, columns interleaved):", "",
             "| M | N | K | cuBLAS | GEMM-only | variant | time | / GEMM-only |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["times"]
        for name in (v for v in t if v.startswith("ce")):
            lines.append(f"| {r['M']} | {r['N']} | {r['K_local']} | {t['cublas']:.3f} | {t['gemm_only']:.3f} | "
                         f"{name} | {t[name]:.3f} | {t[name] / t['gemm_only']:.2f} |")
    lines += ["", "Traces (one call, per rank; us; main / wait / rest: mean per task of the phase):", "",
              "| M | N | K | variant | rank | span | peer tiles | own tiles | peer main / rest | own main / wait / rest | own tiles that waited | SM GHz |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, per_rank in r["traces"].items():
            for rank, s in enumerate(per_rank):
                peer, own = s["phases"]["peer"], s["phases"]["own"]
                lines.append(f"| {r['M']} | {r['N']} | {r['K_local']} | {name} | {rank} | {s['span_us']:.0f} | "
                             f"{peer['begin_us']:.0f}-{peer['end_us']:.0f} | {own['begin_us']:.0f}-{own['end_us']:.0f} | "
                             f"{peer['main_us']:.1f} / {peer['rest_us']:.2f} | {own['main_us']:.1f} / {own['wait_us']:.2f} / "
                             f"{own['rest_us']:.2f} | {own['waiting_tasks']} of {own['tasks']} | {s['cycles_per_ns']:.2f} |")
    timelines = [(r, name, c) for r in rows for name, c in r.get("chunks", {}).items() if c]
    if timelines:
        lines += ["", "Comm chunks of the traced call (CUPTI + the kernel trace; us since the sender's kernel "
                  "started; the peer's own tiles of the chunk in the same frame):", "",
                  "| M | N | K | variant | rank | chunk | ready | copy | MiB | GB/s | peer's own tiles from | their longest wait |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, name, chunks in timelines:
            for c in chunks:
                rate = copy_rate(c)
                lines.append(f"| {r['M']} | {r['N']} | {r['K_local']} | {name} | {c['rank']} | {c['chunk']} | "
                             f"{c['ready_us']:.0f} | {c['copy_start_us']:.0f}-{c['copy_end_us']:.0f} | "
                             f"{c['megabytes']:.1f} | {rate:.0f} | {c['peer_own_start_us']:.0f} | "
                             f"{c['peer_own_wait_max_us']:.1f} |")
    with open(os.path.join(out_dir, "probe_gemm_rs_ce.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")


def render(path, out_dir):
    """The raw traces (--raw runs) as one timeline per shape: a row per SM, peer tiles blue,
    own tiles green, their waits red."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as handle:
        saved = json.load(handle)
    write_markdown(saved, out_dir)
    rows = [r for r in saved["rows"] if r["traces"]["ce"][0].get("raw")]
    if not rows:
        return
    figure, axes = plt.subplots(len(rows), 1, figsize=(12, 3.2 * len(rows)), squeeze=False)
    for axis, r in zip(axes[:, 0], rows):
        summary = r["traces"]["ce"][0]
        raw, ghz = summary["raw"], summary["cycles_per_ns"]
        per_slot = len(raw) // r["world"]
        first = min(t[0] for t in raw)
        for index, (start, end, sm, main, wait, total) in enumerate(raw):
            own = index >= per_slot * (r["world"] - 1)
            axis.plot([(start - first) / 1e3, (end - first) / 1e3], [sm, sm], lw=1.2,
                      color="tab:green" if own else "tab:blue")
            if wait / ghz > 200:
                begin = (start - first) / 1e3 + main / ghz / 1e3
                axis.plot([begin, begin + wait / ghz / 1e3], [sm, sm], lw=1.6, color="tab:red")
        axis.set_title(f"{r['M']}x{r['N']}x{r['K_local']} /ce, rank 0: peer tiles (blue), own tiles (green), waits (red)")
        axis.set_xlabel("us since the first task")
        axis.set_ylabel("SM")
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "probe_gemm_rs_ce.png"), dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--raw", action="store_true", help="keep every task's trace row in the JSON")
    parser.add_argument("--chunks", type=lambda text: [int(c) for c in text.split(",")], default=[4],
                        help="comm chunks per peer to aim at, one /ce variant each (4: shipped)")
    parser.add_argument("--streams", type=lambda text: [int(c) for c in text.split(",")], default=[],
                        help="side-stream counts to time /ce variants with (the shipped count: 'ce')")
    parser.add_argument("--config", default="16",
                        help="the /ce config: an index into gemm_rs.CANDIDATES or a config string")
    parser.add_argument("--count-steps", type=lambda text: [int(c) for c in text.split(",")],
                        default=[], help="(a /gl config) also time a peer tile counted after these "
                                         "K steps of the next tile (ce/k<n>)")
    parser.add_argument("--partial-aheads", type=lambda text: [int(c) for c in text.split(",")],
                        default=[], help="(a /gl config) also time an own tile's first partial "
                                         "loaded this many K steps before its last (ce/p<n>; "
                                         "-1: after its main loop)")
    parser.add_argument("--triton", action="store_true",
                        help="(a /gl config) also time the same config on the Triton kernel")
    parser.add_argument("--copies", action="store_true",
                        help="profile the traced call's side-stream copies (CUPTI) per comm chunk")
    parser.add_argument("--render", default=None, metavar="JSON")
    parsed = parser.parse_args()
    if parsed.render:
        render(parsed.render, parsed.out)
    else:
        run(parsed)
