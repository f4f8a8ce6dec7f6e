#!/usr/bin/env bash
# Everything a fresh CPU machine needs for the demo and the tests (idempotent).
# torch is pinned exactly: on the project's CPU machines 2.13.0 is a local CPU
# build; a looser pin would pull the multi-GB CUDA build from the registry.
# A machine that already has torch >= 2.11 and the test packages (the GPU machines, which reach
# no registry) installs nothing from a registry: the package is linked in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 11))" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# What is missing of the test extras (and Triton: the CPU tests compile the kernels to sm_90a
# PTX/cubin with its ptxas), as pip requirements; nothing when all of them import.
missing=$("$PY" - <<'PYTHON'
import importlib.util
wanted = {"pytest": "pytest>=8", "xdist": "pytest-xdist>=3", "hypothesis": "hypothesis>=6",
          "matplotlib": "matplotlib>=3.7", "triton": "triton==3.6.0"}
print(" ".join(spec for module, spec in wanted.items() if importlib.util.find_spec(module) is None))
PYTHON
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  "$PY" -m pip install -q $missing
fi
# torch's OpInfo database (tests/test_ops_opinfo.py, benchmarks/sweep_opinfo.py) imports expecttest;
# without a registry the tests that need it are skipped rather than failing the install
if ! "$PY" -c "import expecttest" 2>/dev/null; then
  "$PY" -m pip install -q --retries 1 --timeout 15 "expecttest>=0.2" || echo "install.sh: expecttest not installed: the OpInfo sweep's tests will be skipped"
fi
here=$PWD
if (cd / && "$PY" -c "import axedist, os, sys; sys.exit(os.path.dirname(os.path.dirname(os.path.abspath(axedist.__file__))) != sys.argv[1])" "$here") 2>/dev/null; then
  exit 0  # this checkout is already what Python imports
fi
# The package itself, editable. Without a registry pip cannot build it in isolation: then a .pth
# file in site-packages points Python at this checkout (the same effect, nothing downloaded).
if ! "$PY" -m pip install -q --retries 1 --timeout 15 --no-deps -e . 2>/tmp/axedist_install.log; then
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$PWD" > "$site/axedist_checkout.pth"
  echo "install.sh: pip could not build the package here (no registry?); linked $PWD through $site/axedist_checkout.pth"
fi
