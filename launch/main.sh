#!/usr/bin/env bash
# README's main command: set up a fresh machine, then run the demo.
#   1. the layout algebra (one process);
#   2. DTensors on layouts under torchrun: 4 CPU processes on gloo by default,
#      or one process per GPU on NCCL when GPUs are present (AXEDIST_DEMO_CPU=1 forces CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=1
python3 launch/demo.py
echo
gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "${AXEDIST_DEMO_CPU:-0}" != 1 ] && [ "$gpus" -ge 2 ]; then
  exec torchrun --nproc-per-node "$gpus" launch/demo_dtensor.py --cuda "$@"
else
  exec torchrun --nproc-per-node "${NPROC:-4}" launch/demo_dtensor.py "$@"
fi
