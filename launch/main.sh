#!/usr/bin/env bash
# README's main command: set up a fresh machine, run the demo, then the main job.
#   1. the layout algebra (one process);
#   2. DTensors on layouts under torchrun: 4 CPU processes on gloo by default,
#      or one process per GPU on NCCL when GPUs are present (AXEDIST_DEMO_CPU=1 forces CPU);
#   3. the main job: a small Llama trained with fully sharded data parallel x tensor + sequence
#      parallelism (dp=2 x tp=2 on 4 processes; launch/train_tp.py: each parameter's layout on the
#      2-D mesh, the collectives of one step, progress, loss curve, checkpoint in runs/train_tp/),
#      then greedy decoding from that checkpoint at TP=2 (launch/infer_tp.py: resharded on load).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=1
python3 launch/demo.py
echo
gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "${AXEDIST_DEMO_CPU:-0}" != 1 ] && [ "$gpus" -ge 2 ]; then
  torchrun --nproc-per-node "$gpus" launch/demo_dtensor.py --cuda "$@"
  echo
  torchrun --nproc-per-node "$gpus" launch/train_tp.py --cuda
  echo
  torchrun --nproc-per-node 2 launch/infer_tp.py --cuda
else
  torchrun --nproc-per-node "${NPROC:-4}" launch/demo_dtensor.py "$@"
  echo
  torchrun --nproc-per-node "${NPROC:-4}" launch/train_tp.py
  echo
  torchrun --nproc-per-node 2 launch/infer_tp.py
fi
