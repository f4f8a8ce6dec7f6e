"""README's main job keeps working: the layout demo, and the DTensor demo under torchrun (gloo)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layout_demo_runs():
    out = subprocess.run([sys.executable, "launch/demo.py"], cwd=ROOT, check=True, capture_output=True, text=True)
    assert "S[(8,36):(6,1)]" in out.stdout and "S[(2,3):(3,1)]" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dtensor_demo_runs_under_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "launch/demo_dtensor.py", "--png", str(tmp_path / "layout.png")]
    # Own session, so a timeout kills torchrun and every rank it started (no orphans).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"demo timed out\n{stdout[-3000:]}{stderr[-3000:]}") from None
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert stdout.count("ok:") == 5 and "demo finished" in stdout
    assert (tmp_path / "layout.png").stat().st_size > 0
