"""What the one-GPU probes share: a one-rank NCCL group, every column's output checked against a
reference before anything is timed, the run written under $OUT with what made it, and the runs
read back for a report.

    group = one_rank_group(29521)
    errors = checked_outputs(columns, outs, torch.mm(a, b))      # raises past 1e-2
    write_run("probe_x", rows, "python3 benchmarks/device/probe_x.py")
    runs, plt = read_runs(paths), pyplot()
"""
import json, os, time
import torch, torch.distributed as dist


def one_rank_group(port: int):
    """A one-rank NCCL group on GPU 0 (the fused calls' planning asks a group for its size)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return dist.group.WORLD


def checked_outputs(columns: dict, outs: dict, ref: torch.Tensor, tolerance: float = 1e-2) -> dict:
    """Run every column once into its output (filled with NaN first, so a column that writes
    nothing fails) and return its relative error to ref; AssertionError past tolerance."""
    errors = {}
    for name, fn in columns.items():
        outs[name].fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        errors[name] = float((outs[name].float() - ref.float()).norm() / ref.float().norm())
    assert all(e < tolerance for e in errors.values()), errors
    return errors


def write_run(name: str, rows: list, command: str) -> str:
    """$OUT/<name>.json: the rows with the commit (AXEDIST_COMMIT), GPU, torch, date and command."""
    os.makedirs(os.environ["OUT"], exist_ok=True)
    meta = dict(commit=os.environ.get("AXEDIST_COMMIT", "?"), device=torch.cuda.get_device_name(),
                torch=torch.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command=command)
    path = os.path.join(os.environ["OUT"], f"{name}.json")
    with open(path, "w") as handle:
        json.dump(dict(meta, rows=rows), handle, indent=1)
    return path


def read_runs(paths) -> list:
    return [json.load(open(path)) for path in paths]


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display on the machines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
