"""Why is the fused GEMM + reduce-scatter slower eager than queued at the Llama-405B shape?
(issue 28: 12.77 ms eager vs 10.90 ms device at W=2, d9d6530's gemm_rs_w2.md; at 8192x8192x7168
the two agree.) Per rank and per call, the fused call's CUDA-event time in four series, each of
--reps calls back to back after a barrier:

  eager         the calls as a program issues them (bench_gemm_rs's eager column)
  queued        the same behind a sleep kernel long enough for the host to enqueue them all
  eager_synced  each call alone: synchronize and barrier before it (no skew, no queue)
  eager_cublas  torch.mm alone, eager (no coupling between ranks)

and the SM clock and power after each series (read only). Writes probe_gemm_rs_eager.json.

    torchrun --nproc-per-node 2 benchmarks/probe_gemm_rs_eager.py --out <dir>
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from axedist.collectives.fused import gemm_reduce_scatter


def _gpu_state():
    state = {}
    for name in ("clock_rate", "power_draw", "temperature", "utilization"):
        try:
            state[name] = getattr(torch.cuda, name)()
        except Exception as error:  # pynvml missing: say so
            state[name] = f"{type(error).__name__}"
    return state


def _series(fn, reps, mode):
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    if mode == "queued":
        torch.cuda._sleep(int((2 + reps * 0.5) * 2_000_000))
    begin = time.perf_counter()
    for start, end in events:
        if mode == "synced":
            torch.cuda.synchronize()
            dist.barrier()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - begin) * 1e3
    return {"ms": [s.elapsed_time(e) for s, e in events], "wall_ms": wall, "gpu": _gpu_state()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1234 + rank)
    shapes = [("llama3.1-405b", 8192, 16384, 53248 // world), ("design", 16384, 8192, 7168),
              ("design", 8192, 8192, 7168)]
    rows = []
    for label, m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
        partial = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fused = lambda: gemm_reduce_scatter(a, b, None, backend="p2p", out=out)  # noqa: E731
        cublas = lambda: torch.mm(a, b, out=partial)  # noqa: E731
        for _ in range(3):
            fused()
            cublas()
        row = {"label": label, "M": m, "N": n, "K_local": k, "world": world, "gpu_before": _gpu_state()}
        for name, fn, mode in (("eager", fused, "eager"), ("queued", fused, "queued"),
                               ("eager_synced", fused, "synced"), ("eager_cublas", cublas, "eager"),
                               ("eager_again", fused, "eager")):
            row[name] = _series(fn, args.reps, mode)
        rows.append(row)
        if rank == 0:
            print(label, m, n, k, {name: round(statistics.median(row[name]["ms"]), 3)
                                   for name in ("eager", "queued", "eager_synced", "eager_cublas", "eager_again")},
                  flush=True)
        del a, b, out, partial
        torch.cuda.empty_cache()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        meta = {"commit": os.environ.get("AXEDIST_COMMIT", "unknown"), "torch": torch.__version__,
                "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "command": f"torchrun --nproc-per-node {world} benchmarks/probe_gemm_rs_eager.py --reps {args.reps}"}
        with open(os.path.join(args.out, "probe_gemm_rs_eager.json"), "w") as handle:
            json.dump({"meta": meta, "ranks": gathered}, handle, indent=1)
        for r, ranked in enumerate(gathered):
            for row in ranked:
                print(f"rank {r} {row['label']} {row['M']}x{row['N']}x{row['K_local']}")
                for name in ("eager", "queued", "eager_synced", "eager_cublas", "eager_again"):
                    print(f"  {name:13s} " + " ".join(f"{v:.2f}" for v in row[name]["ms"]) + f"  | {row[name]['gpu']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
