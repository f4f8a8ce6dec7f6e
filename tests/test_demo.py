"""README's main job keeps working: the layout demo, and the DTensor demo under torchrun (gloo)."""

import os
import subprocess
import sys
from pathlib import Path

from axedist.testing import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


def test_layout_demo_runs():
    out = subprocess.run([sys.executable, "launch/demo.py"], cwd=ROOT, check=True, capture_output=True, text=True)
    assert "S[(8,36):(6,1)]" in out.stdout and "S[(2,3):(3,1)]" in out.stdout


def test_dtensor_demo_runs_under_torchrun(tmp_path):
    returncode, stdout, stderr = run_torchrun(["launch/demo_dtensor.py", "--png", str(tmp_path / "layout.png")], 2,
                                              cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert stdout.count("ok:") == 5 and "demo finished" in stdout
    assert (tmp_path / "layout.png").stat().st_size > 0
