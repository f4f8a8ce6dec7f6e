"""Host cost of a /gl/ce GEMM + reduce-scatter call with its copies replayed as one CUDA graph per
epoch parity (AXEDIST_CE_GRAPHS=1) against the same copies issued one by one (three CUDA calls
per comm chunk: the default), on one GPU with virtual ranks, both modes in ONE run (each on its
own virtual ranks, its mode set when its calls were prepared).

    OUT=<dir> python3 benchmarks/device/probe_ce_graph.py

Per world size (2, 4) and shape: host us per call of all W virtual ranks (timing.host_time_us:
calls issued behind a sleep kernel, median of 5 runs of 50 calls), so per rank = that / W; the
device time of both modes (timing.device_time, virtual ranks share one GPU: a sanity check,
not a multi-GPU number); every output checked against the sum of the ranks' products (fp32
reference, relative error < 1e-2) after calls in both modes, alternating halves. Writes
$OUT/probe_ce_graph.json and prints one line per case.
"""
import json
import os

import torch

from axedist.collectives.timing import device_time, host_time_us
from axedist.kernels import gemm_rs
from axedist.kernels.launch import multiprocessors
from axedist.testing import VirtualRanks

# (M, N, K local): GEMM + RS shapes small enough for W virtual ranks on one GPU
SHAPES = ((2048, 8192, 2048), (4096, 8192, 1024))
CONFIG = gemm_rs.GemmConfig(stages=4, push=True, defer_release=True, pipelined=True, engine=True)


def error(as_, bs, outs) -> float:
    """Largest relative error of any rank's rows against the fp32 sum of every rank's product."""
    total = sum(a.float() @ b.float() for a, b in zip(as_, bs))
    rows = total.shape[0] // len(outs)
    return max(((out.float() - total[r * rows:(r + 1) * rows]).abs().max()
                / total[r * rows:(r + 1) * rows].abs().max()).item() for r, out in enumerate(outs))


def gpu_ops(fn) -> dict:
    """What the GPU ran in one call, by name (kernels and copies), from the profiler: whether a
    graph's copies are copy-engine memcpys as the issued ones are."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            counts[name] = counts.get(name, 0) + 1
    return counts


def main():
    torch.manual_seed(3)
    results = []
    assert "AXEDIST_CE_GRAPHS" not in os.environ, "the probe sets AXEDIST_CE_GRAPHS itself"
    for world in (2, 4):
        for m, n, k in SHAPES:
            as_ = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
            bs = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                  for _ in range(world)]
            modes, engines = {}, {}
            for name, flag in (("graph", "1"), ("issued", "0")):  # AXEDIST_CE_GRAPHS at prepare
                os.environ["AXEDIST_CE_GRAPHS"] = flag
                ranks = VirtualRanks(world, 64 << 20, processors=multiprocessors(0) // (2 * world))
                outs = ranks.gemm_reduce_scatter(as_, bs, config=CONFIG)
                ranks.check()
                engines[name] = [call.replay for call in ranks.last_plans]
                assert all(isinstance(e, gemm_rs.EngineReduceScatter) for e in engines[name])
                modes[name] = (lambda r=ranks, o=outs: r.gemm_reduce_scatter(as_, bs, o, config=CONFIG),
                               ranks, outs)
            os.environ.pop("AXEDIST_CE_GRAPHS")
            row = dict(world=world, m=m, n=n, k=k, chunks=len(engines["graph"][0].copies[0]),
                       graph_errors=[e.graph_error for e in engines["graph"]],
                       graphs=all(len(e.graphs) == 2 for e in engines["graph"]),
                       issued_graphs=any(e.graphs for e in engines["issued"]))
            call, issued = modes["graph"][0], modes["issued"][0]
            errors = []
            for name in ("graph", "issued", "graph", "issued", "issued", "graph"):  # both halves
                fn, ranks, outs = modes[name]
                for out in outs:
                    out.fill_(float("nan"))
                fn()
                ranks.check()
                errors.append(error(as_, bs, outs))
            row["max_rel_error"] = max(errors)
            row["host_us_graph"] = host_time_us(call, calls=50)
            row["host_us_issued"] = host_time_us(issued, calls=50)
            row.update({f"device_ms_{name}": value for name, value in
                        device_time({"graph": call, "issued": issued}, calls=10).items()})
            row["max_rel_error_after"] = 0.0
            for fn, ranks, outs in modes.values():
                ranks.check()
                row["max_rel_error_after"] = max(row["max_rel_error_after"], error(as_, bs, outs))
            row.update({f"gpu_ops_{name}": gpu_ops(fn) for name, fn in
                        (("graph", call), ("issued", issued))})
            results.append(row)
            print(f"W={world} {m}x{n}x{k} chunks/peer-set {row['chunks']} graphs {row['graphs']} "
                  f"host us/call (W ranks) graph {row['host_us_graph']:.1f} issued "
                  f"{row['host_us_issued']:.1f} (per rank {row['host_us_graph'] / world:.1f} vs "
                  f"{row['host_us_issued'] / world:.1f}); device ms graph "
                  f"{row['device_ms_graph']:.3f} issued {row['device_ms_issued']:.3f}; "
                  f"max rel err {max(row['max_rel_error'], row['max_rel_error_after']):.2e} "
                  f"errors {set(row['graph_errors'])}", flush=True)
            print(f"  GPU ops graph {row['gpu_ops_graph']}\n  GPU ops issued {row['gpu_ops_issued']}",
                  flush=True)
            assert row["max_rel_error"] < 1e-2 and row["max_rel_error_after"] < 1e-2, row
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "probe_ce_graph.json"), "w") as f:
        json.dump(dict(commit=os.environ.get("AXEDIST_COMMIT", ""),
                       device=torch.cuda.get_device_name(0), torch=torch.__version__,
                       config=str(CONFIG), results=results), f, indent=1)


if __name__ == "__main__":
    main()
