"""Host cost of a /gl/ce GEMM + reduce-scatter (and, on virtual ranks, all-gather + GEMM) call with
its copies replayed as one CUDA graph per epoch parity (AXEDIST_CE_GRAPHS=1) against the same copies issued one by one (three CUDA calls
per comm chunk: the default), both modes in ONE run, each on its own prepared calls (the mode is
read when a call is prepared).

    OUT=<dir> python3 benchmarks/device/probe_ce_graph.py               # one GPU, virtual ranks
    OUT=<dir> torchrun --nproc-per-node 2 benchmarks/device/probe_ce_graph.py   # real ranks

One GPU: W = 2 and 4 virtual ranks (host time of a call of all W ranks, so per rank = that / W;
device time is a sanity check only, the ranks share one GPU). Real ranks (torchrun): the group's
symmetric workspace, both modes' calls on it (max over ranks). Per shape: host us per call
(timing.host_time_us, behind a sleep kernel, median of 5 runs of 50 calls), device ms
(timing.device_time), what the GPU ran in one call by name (profiler: whether a graph's copies
stay copy-engine memcpys or became kernels, which a full persistent grid would starve), and
every output against an fp32 reference (relative error < 1e-2) after calls in both modes,
alternating halves. Writes $OUT/probe_ce_graph.json and prints one line per case.
"""
import json
import os

import torch
import torch.distributed as dist

from axedist.collectives.fused import FusedCall, GemmReduceScatterPlan
from axedist.collectives.symmetric import get_workspace
from axedist.collectives.timing import device_time, host_time_us, profiled_counts
from axedist.kernels import gemm_rs
from axedist.kernels.ag_gemm import AllGatherGemmConfig
from axedist.kernels.launch import multiprocessors
from axedist.testing import VirtualRanks

CONFIG = gemm_rs.GemmConfig(stages=4, push=True, defer_release=True, pipelined=True, engine=True)
AG_CONFIG = AllGatherGemmConfig(engine=True, pipelined=True)
MODES = (("graph", "1"), ("issued", "0"))  # name, AXEDIST_CE_GRAPHS when the calls are prepared


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).abs().max() / reference.abs().max()).item()


def virtual_modes(op: str, world: int, m: int, n: int, k: int) -> dict:
    """Per mode (call, error after the last call, /ce launches) on W virtual ranks of one GPU:
    op "gemm_rs" (each rank's A [M, K_local]) or "ag_gemm" (each rank's A [M / W, K], its own B)."""
    rows = m if op == "gemm_rs" else m // world
    as_ = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    bs = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(world)]
    if op == "gemm_rs":
        total = sum(a.float() @ b.float() for a, b in zip(as_, bs))
        expected = [total[r * (m // world):(r + 1) * (m // world)] for r in range(world)]
    else:
        gathered = torch.cat([a.float() for a in as_])
        expected = [gathered @ b.float() for b in bs]
    config = CONFIG if op == "gemm_rs" else AG_CONFIG
    modes = {}
    for name, flag in MODES:
        os.environ["AXEDIST_CE_GRAPHS"] = flag
        ranks = VirtualRanks(world, 64 << 20, processors=multiprocessors(0) // (2 * world))
        call = getattr(ranks, "gemm_reduce_scatter" if op == "gemm_rs" else "all_gather_gemm")
        outs = call(as_, bs, config=config)
        ranks.check()
        launches = [plan.replay for plan in ranks.last_plans] if op == "gemm_rs" else [
            launch for plan in ranks.last_plans for launch in plan.launches.values()]

        def error(ranks=ranks, outs=outs):
            ranks.check()
            return max(relative_error(out, ref) for out, ref in zip(outs, expected))
        modes[name] = (lambda c=call, o=outs: c(as_, bs, o, config=config), error, launches)
    os.environ.pop("AXEDIST_CE_GRAPHS")
    return modes


def real_modes(m: int, n: int, k: int) -> dict:
    """Per mode (call, error after the last call, [engine]) on this rank of the default group."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cuda")
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16) / k ** 0.5
    total = a.float() @ b.float()
    dist.all_reduce(total)
    rows = m // world
    reference = total[rank * rows:(rank + 1) * rows]
    plan = GemmReduceScatterPlan("p2p", m, n, k, world, str(CONFIG), "probe")
    modes = {}
    for name, flag in MODES:
        os.environ["AXEDIST_CE_GRAPHS"] = flag
        call = FusedCall(plan, world, rank, lambda nbytes: get_workspace(None, nbytes, device),
                         pinned_config=CONFIG)
        out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
        call.run(a, b, out)

        def error(call=call, out=out):
            call.workspace.check(synchronize=True)
            return relative_error(out, reference)
        modes[name] = (lambda c=call, o=out: c.run(a, b, o), error, [call.replay])
    os.environ.pop("AXEDIST_CE_GRAPHS")
    return modes


def measure(modes: dict, world: int, real: bool) -> dict:
    engines = {name: engines for name, (_, _, engines) in modes.items()}
    assert all(hasattr(e, "graphs") for es in engines.values() for e in es)  # /ce launches
    row = dict(world=world, chunks=len(engines["graph"][0].copies[0]),
               graph_errors=sorted({str(e.graph_error) for e in engines["graph"]}),
               graphs=all(len(e.graphs) == 2 for e in engines["graph"]),
               issued_graphs=any(e.graphs for e in engines["issued"]))
    errors = []
    for name in ("graph", "issued", "graph", "issued", "issued", "graph"):  # both halves
        modes[name][0]()
        errors.append(modes[name][1]())
    calls = {name: fn for name, (fn, _, _) in modes.items()}
    for name, fn in calls.items():
        row[f"host_us_{name}"] = host_time_us(fn, calls=50)
    row.update({f"device_ms_{name}": value for name, value in device_time(calls, calls=10).items()})
    errors += [check() for _, check, _ in modes.values()]
    row["max_rel_error"] = max(errors)
    if real:  # the slowest rank's numbers
        keys = [key for key in row if key.startswith(("host_us", "device_ms", "max_rel"))]
        values = torch.tensor([row[key] for key in keys], dtype=torch.float64, device="cuda")
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        row.update(zip(keys, values.tolist()))
    row.update({f"gpu_ops_{name}": profiled_counts(fn) for name, fn in calls.items()})
    return row


def main():
    assert "AXEDIST_CE_GRAPHS" not in os.environ, "the probe sets AXEDIST_CE_GRAPHS itself"
    real = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if real:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
        torch.manual_seed(3 + dist.get_rank())
        cases = [(dist.get_world_size(), shape) for shape in (  # 2048 x 8192 x 2048: where one GPU's
            (2048, 8192, 2048), (2048, 8192, 7168), (8192, 8192, 2048),  # graph copies ran as kernels
            (16384, 8192, 2048), (8192, 8192, 7168))]
    else:
        torch.manual_seed(3)
        cases = [(op, world, shape) for op in ("gemm_rs", "ag_gemm") for world in (2, 4)
                 for shape in ((2048, 8192, 2048), (4096, 8192, 1024))]
    if real:
        cases = [("gemm_rs", world, shape) for world, shape in cases]
    results = []
    for op, world, (m, n, k) in cases:
        modes = real_modes(m, n, k) if real else virtual_modes(op, world, m, n, k)
        row = dict(measure(modes, world, real), op=op, m=m, n=n, k=k)
        results.append(row)
        per_rank = 1 if real else world
        if not real or dist.get_rank() == 0:
            print(f"{op} W={world} {'real' if real else 'virtual'} {m}x{n}x{k} chunks/call {row['chunks']} "
                  f"graphs {row['graphs']} host us per rank-call graph "
                  f"{row['host_us_graph'] / per_rank:.1f} issued {row['host_us_issued'] / per_rank:.1f}; "
                  f"device ms graph {row['device_ms_graph']:.3f} issued {row['device_ms_issued']:.3f}; "
                  f"max rel err {row['max_rel_error']:.2e}; graph errors {row['graph_errors']}\n"
                  f"  GPU ops graph {row['gpu_ops_graph']}\n  GPU ops issued {row['gpu_ops_issued']}",
                  flush=True)
        assert row["max_rel_error"] < 1e-2, row
    if not real or dist.get_rank() == 0:
        with open(os.path.join(os.environ.get("OUT", "."), "probe_ce_graph.json"), "w") as f:
            json.dump(dict(commit=os.environ.get("AXEDIST_COMMIT", ""),
                           device=torch.cuda.get_device_name(0), torch=torch.__version__,
                           real_ranks=real, config=str(CONFIG), ag_config=str(AG_CONFIG),
                           results=results), f, indent=1)
    if real:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
