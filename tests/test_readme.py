"""README's first DTensor example runs as printed, under torchrun on 4 gloo ranks."""

import os
import re
from pathlib import Path

from axedist.testing import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A first DTensor"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    returncode, stdout, stderr = run_torchrun([str(script)], 4, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert stdout.count("S[(4,2,6):(1@gpuid,6,1)]") >= 4, stdout[-2000:]
    assert "1. all-gather over gpuid (1 group of 4): each member sends 144 B" in stdout, stdout[-2000:]
    # The ranks' prints interleave, even inside a line ("(Replicate(),)(Replicate(),) True \nTrue"),
    # so count the words, not the lines
    assert stdout.count("(Replicate(),)") == 4, stdout[-2000:]
    # (words can touch too: "TrueTrue")
    assert stdout.count("True") == 4 and "False" not in stdout, stdout[-2000:]
