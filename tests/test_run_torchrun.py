"""axedist.testing.run_torchrun tries again only where the failure was not the script's."""

from pathlib import Path

from axedist.testing import run_torchrun

SCRIPT = '''
import os, sys
runs = os.path.join(sys.argv[1], "runs")
n = len(open(runs).read()) if os.path.exists(runs) else 0
open(runs, "a").write("x")
if sys.argv[2] == "teardown" and n < {aborts}:
    print("done")
    sys.stderr.write("terminate called without an active exception\\n")
    os.abort()
if sys.argv[2] == "broken":
    raise SystemExit("the script's own failure")
print("done")
'''


def _run(tmp_path: Path, mode: str, aborts: int = 1):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(aborts=aborts))
    code, out, err = run_torchrun([str(script), str(tmp_path), mode], 1, cwd=str(tmp_path))
    return code, out, len((tmp_path / "runs").read_text())


def test_an_abort_in_teardown_is_run_again(tmp_path):
    code, out, runs = _run(tmp_path, "teardown")
    assert code == 0 and "done" in out and runs == 2


def test_at_most_three_runs_then_the_failure_is_returned(tmp_path):
    code, _, runs = _run(tmp_path, "teardown", aborts=5)
    assert code != 0 and runs == 3


def test_a_failing_script_runs_once(tmp_path):
    code, _, runs = _run(tmp_path, "broken")
    assert code != 0 and runs == 1
