"""Two real torchrun agents on this machine: ``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on
localhost. Each agent is a node to torchrun, and so to axedist: the layout demo's (dp, tp) mesh
has dp across the two nodes and tp inside, its plans are those of the simulated 2 x 2 topology,
and the tensor-parallel training job runs end to end on the 4 processes of both agents.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

from torch.distributed import TCPStore
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.mesh import init_mesh
from axedist.planning import plan_redistribute
from axedist.spec import spec_from_placements
from axedist.testing import RankError, run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(script_args, nnodes: int = 2, nproc: int = 2, timeout_s: float = 300) -> list[tuple[int, str]]:
    """``nnodes`` torchrun agents of ``nproc`` processes each, meeting through c10d on localhost:
    (returncode, stdout + stderr) per agent. A timeout kills every agent and its ranks, then raises.
    The rendezvous store lives in this process, not in an agent: an agent hosting it would close
    it on finishing while a slower agent still polls it (seen once in CI on a loaded machine:
    ``RendezvousConnectionError`` in ``num_nodes_waiting``)."""
    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false",
           "--rdzv-id", f"nodes-{os.getpid()}-{port}", *script_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(nnodes)]
    try:
        outputs = [agent.communicate(timeout=timeout_s)[0] for agent in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        tails = "\n".join((agent.communicate()[0] or "")[-6000:] for agent in agents)
        raise RankError(f"{' '.join(script_args)} on {nnodes} torchrun agents timed out after {timeout_s} s\n{tails}")
    finally:
        del store  # only once every agent has ended
    return [(agent.returncode, out) for agent, out in zip(agents, outputs)]


def _simulated_plans(rank, world):
    """The plans the demo prints, on a simulated topology of 2 hosts x 2 ranks."""
    mesh = init_mesh((2, 2), ("dp", "tp"), host_size=2)
    shape, pp = (16, 6), [Partial(), Partial()]
    moves = [(pp, [Replicate(), Replicate()]), (pp, [Shard(0), Shard(0)]),
             ([Shard(0), Shard(0)], [Replicate(), Replicate()])]
    return [str(plan_redistribute(spec_from_placements(shape, mesh, a), spec_from_placements(shape, mesh, b), 4))
            for a, b in moves]


def test_two_torchrun_nodes_run_the_demo_and_the_training_job(tmp_path):
    # the layout demo with a 2-D (dp, tp) mesh over the two nodes
    runs = launch_nodes(["launch/demo_dtensor.py", "--mesh", "2x2", "--png", str(tmp_path / "layout.png")])
    text = "\n".join(out for _, out in runs)
    assert [code for code, _ in runs] == [0, 0], text[-4000:]
    assert "demo finished" in text
    assert ("2-D mesh dp=2 (inter-node) x tp=2 (intra-node): DeviceMesh('cpu', [[0, 1], [2, 3]], axes=('dp', 'tp'), "
            "dp=2 (inter-node) x tp=2 (intra-node), 2 hosts of 2 rank(s))") in text  # found, not simulated
    for plan in run_on_ranks(_simulated_plans, 4)[0]:  # a simulated topology plans as the real one
        assert "   " + plan.replace("\n", "\n   ") in text, plan
    assert text.count("ok: full_tensor() on every rank equals the global tensor ([") == 3

    # the training job on the 4 processes of both agents: fully sharded over dp across the two
    # nodes, tensor parallel over tp inside each
    runs = launch_nodes(["launch/train_tp.py", "--steps", "4", "--log-every", "2", "--seq", "8", "--batch", "2",
                         "--dim", "16", "--vocab", "32", "--layers", "1", "--out", str(tmp_path / "train"),
                         "--no-checkpoint"])
    text = "\n".join(out for _, out in runs)
    assert [code for code, _ in runs] == [0, 0], text[-4000:]
    assert ("mesh DeviceMesh('cpu', [[0, 1], [2, 3]], axes=('dp', 'tp'), dp=2 (inter-node) x tp=2 (intra-node), "
            "2 hosts of 2 rank(s))") in text
    assert "step    4" in text and "training finished" in text
    assert (tmp_path / "train" / "losses.json").exists()
