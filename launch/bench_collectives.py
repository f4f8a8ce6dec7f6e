"""axedist p2p collectives vs NCCL vs PyTorch's symmetric-memory ops, 64 KB to 256 MB.

    torchrun --nproc_per_node=4 launch/bench_collectives.py --out benchmarks/results

Size = bytes of each rank's full input (reduce-scatter, all-reduce) or of the gathered output
(all-gather), bf16. Latency in us (median of calls, CUDA events, max over ranks); bus bandwidth
as nccl-tests defines it: size / time * (W-1)/W (RS, AG) or * 2(W-1)/W (AR).
  axedist       the public call (copies the input into the symmetric workspace first)
  axedist_zc    input already in the workspace (p2p.symmetric_input): the kernel alone
  nccl          torch.distributed (NCCL, NVLS off)
  torch_symm    torch.ops.symm_mem one_shot_all_reduce / two_shot_all_reduce_ (input in symm mem)
Writes collectives_w{W}.json / .md / .png. Multicast stays off (refuses AXEDIST_ENABLE_MULTICAST=1).
"""
import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from axedist.collectives import p2p  # noqa: E402
from axedist.collectives.timing import time_collective  # noqa: E402

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def bus_factor(op, world):
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--profile", action="store_true",
                        help="only measure host (CPU) time per call at 64 KB and print a cProfile")
    args = parser.parse_args()
    if os.environ.get("AXEDIST_ENABLE_MULTICAST") == "1":
        raise SystemExit("refusing to benchmark with AXEDIST_ENABLE_MULTICAST=1 (policy)")
    if os.environ.get("NCCL_NVLS_ENABLE") != "0" or os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        raise SystemExit("set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    group_name = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem
    if args.profile:
        profile_host_overhead(world, rank)
        dist.destroy_process_group()
        return
    rows = []
    for size in SIZES:
        numel = size // 2
        numel -= numel % (world * 16)
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        row = dict(bytes=size, world=world)
        # reduce-scatter
        out = torch.empty(numel // world, device="cuda", dtype=torch.bfloat16)
        row["rs_nccl"] = time_collective(lambda: dist.reduce_scatter_tensor(out, x), args.reps)
        row["rs_axedist"] = time_collective(lambda: p2p.reduce_scatter(x, out=out), args.reps)

        def rs_zero_copy():
            staged = p2p.symmetric_input(x.shape, x.dtype, None, "reduce_scatter")
            p2p.reduce_scatter(staged, out=out)
        row["rs_axedist_zc"] = time_collective(rs_zero_copy, args.reps)
        # all-gather (size = gathered output)
        piece = x[:numel // world]
        gathered = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        row["ag_nccl"] = time_collective(lambda: dist.all_gather_into_tensor(gathered, piece), args.reps)
        row["ag_axedist"] = time_collective(lambda: p2p.all_gather(piece, out=gathered), args.reps)
        # all-reduce
        y = torch.empty_like(x)
        row["ar_nccl"] = time_collective(lambda: (y.copy_(x), dist.all_reduce(y)), args.reps)
        row["ar_axedist_one_shot"] = (time_collective(lambda: p2p.all_reduce(x, out=y, algorithm="one_shot"), args.reps)
                                      if size <= (16 << 20) else None)
        row["ar_axedist_two_shot"] = time_collective(lambda: p2p.all_reduce(x, out=y, algorithm="two_shot"), args.reps)
        try:
            symm = symm_mem.empty(numel, device="cuda", dtype=torch.bfloat16)
            symm_mem.rendezvous(symm, group_name)
            symm.copy_(x)
            row["ar_torch_symm_one_shot"] = (time_collective(
                lambda: torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", group_name), args.reps)
                if size <= (16 << 20) else None)
            row["ar_torch_symm_two_shot"] = time_collective(
                lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name), args.reps)
        except Exception as error:
            row["torch_symm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        # correctness of the timed calls against NCCL
        check = p2p.reduce_scatter(x)
        dist.reduce_scatter_tensor(out, x)
        row["rs_rel_err_vs_nccl"] = ((check.float() - out.float()).norm() / out.float().norm()).item()
        for key in list(row):
            if key.startswith(("rs_", "ag_", "ar_")) and isinstance(row[key], float) and "err" not in key:
                op = {"rs": "reduce_scatter", "ag": "all_gather", "ar": "all_reduce"}[key[:2]]
                row[key.replace("_", "_busbw_", 1)] = size / (row[key] * 1e-3) * bus_factor(op, world) / 1e9
        rows.append(row)
        if rank == 0:
            print(f"{size >> 10:>8} KB  RS us: nccl {row['rs_nccl']*1e3:8.1f} axedist {row['rs_axedist']*1e3:8.1f} "
                  f"zero-copy {row['rs_axedist_zc']*1e3:8.1f} | AG nccl {row['ag_nccl']*1e3:8.1f} axedist {row['ag_axedist']*1e3:8.1f} "
                  f"| AR nccl {row['ar_nccl']*1e3:8.1f} axedist 2-shot {row['ar_axedist_two_shot']*1e3:8.1f}", flush=True)
        del x, y, out, gathered
        torch.cuda.empty_cache()
    if rank == 0:
        write_outputs(rows, world, args.out)
    dist.barrier()
    dist.destroy_process_group()


def profile_host_overhead(world, rank, calls=300):
    """CPU time per call (no synchronization inside the loop) of small collectives, and where
    axedist's goes: tells launch/host overhead apart from device time."""
    import cProfile
    import pstats
    import time
    x = torch.randn(32768, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(32768 // world, device="cuda", dtype=torch.bfloat16)
    cases = {
        "nccl_rs": lambda: dist.reduce_scatter_tensor(out, x),
        "axedist_rs": lambda: p2p.reduce_scatter(x, out=out),
        "axedist_ag": lambda: p2p.all_gather(out, out=x),
        "copy_only": lambda: out.copy_(x[:out.numel()]),
    }
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls
        torch.cuda.synchronize()
        total = (time.perf_counter() - start) / calls
        if rank == 0:
            print(f"profile {name}: host {host * 1e6:.1f} us/call, host+device {total * 1e6:.1f} us/call", flush=True)
    profiler = cProfile.Profile()
    dist.barrier()
    profiler.enable()
    for _ in range(calls):
        p2p.reduce_scatter(x, out=out)
    profiler.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def _fmt(value, scale=1e3):
    return "n/a" if value is None else f"{value * scale:.1f}"


def write_outputs(rows, world, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=f"{socket.gethostname()}: {world}x {torch.cuda.get_device_name()}",
                commit=os.environ.get("AXEDIST_COMMIT", commit or "unknown"), torch=torch.__version__,
                command=f"torchrun --nproc_per_node={world} launch/bench_collectives.py " + " ".join(sys.argv[1:]))
    with open(os.path.join(out_dir, f"collectives_w{world}.json"), "w") as handle:
        json.dump(dict(meta=meta, rows=rows), handle, indent=1)
    lines = [f"# Collectives, W={world}, bf16 ({meta['date']})", "",
             f"machine: {meta['machine']}; commit {meta['commit']}; torch {meta['torch']}; NVLS/multicast off",
             f"command: `{meta['command']}`", "",
             "latency in us (median, max over ranks) / bus bandwidth GB/s; zc = input already in the symmetric workspace", "",
             "| size | RS NCCL | RS axedist | RS axedist zc | RS busbw NCCL / axedist / zc | AG NCCL | AG axedist | AR NCCL | AR ax 1-shot | AR ax 2-shot | AR torch-symm 1-shot | AR torch-symm 2-shot |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['bytes'] >> 10} KB | {_fmt(r['rs_nccl'])} | {_fmt(r['rs_axedist'])} | {_fmt(r['rs_axedist_zc'])} | "
            f"{r['rs_busbw_nccl']:.0f} / {r['rs_busbw_axedist']:.0f} / {r['rs_busbw_axedist_zc']:.0f} | "
            f"{_fmt(r['ag_nccl'])} | {_fmt(r['ag_axedist'])} | {_fmt(r['ar_nccl'])} | {_fmt(r.get('ar_axedist_one_shot'))} | "
            f"{_fmt(r['ar_axedist_two_shot'])} | {_fmt(r.get('ar_torch_symm_one_shot'))} | {_fmt(r.get('ar_torch_symm_two_shot'))} |")
    with open(os.path.join(out_dir, f"collectives_w{world}.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        sizes = [r["bytes"] for r in rows]
        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for key, label in [("rs_nccl", "RS NCCL"), ("rs_axedist", "RS axedist"), ("rs_axedist_zc", "RS axedist zero-copy"),
                           ("ag_nccl", "AG NCCL"), ("ag_axedist", "AG axedist"), ("ar_nccl", "AR NCCL"),
                           ("ar_axedist_two_shot", "AR axedist 2-shot")]:
            left.plot(sizes, [r[key] * 1e3 for r in rows], marker="o", label=label)
            busbw = key.replace("_", "_busbw_", 1)
            right.plot(sizes, [r[busbw] for r in rows], marker="o", label=label)
        for axis, name in ((left, "latency (us)"), (right, "bus bandwidth (GB/s)")):
            axis.set_xscale("log", base=2)
            axis.set_xlabel("bytes")
            axis.set_ylabel(name)
            axis.legend(fontsize=7)
        left.set_yscale("log")
        figure.suptitle(f"bf16 collectives, W={world}, {meta['machine']}", fontsize=9)
        figure.tight_layout()
        figure.savefig(os.path.join(out_dir, f"collectives_w{world}.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
