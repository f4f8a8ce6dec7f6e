#!/usr/bin/env bash
# Everything a fresh CPU machine needs for the demo and the tests (idempotent).
# torch is pinned exactly: on the project's CPU machines 2.13.0 is a local CPU
# build; a looser pin would pull the multi-GB CUDA build from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 11))" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# Triton (CPU machines too): the CPU tests compile the kernels to sm_90a PTX/cubin with its ptxas.
"$PY" -m pip install -q -e ".[test]" "triton==3.6.0"
