#!/usr/bin/env bash
# One device call on ONE GPU: the virtual-rank tests of the TP kernels (fused all-gather + GEMM,
# GEMM + all-reduce, CUDA graphs), the earlier virtual-rank tests, then the TP = 1 paths and GEMM
# halves of bench_ag_gemm.py / bench_decode.py and infer_tp.py with CUDA graphs. Logs under $OUT.
#   bash benchmarks/device/onegpu.sh [BUDGET_S] [TRAIN_DIR] [all | tp | kernels]
#   (tp: without the earlier kernels' tests; kernels: the TP kernels' tests and benchmarks only)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 AXEDIST_TIMEOUT_S=${AXEDIST_TIMEOUT_S:-10}
export CUDA_DEVICE_MAX_CONNECTIONS=32
BUDGET=${1:-500}
source "$(dirname "$0")/step.sh"
TRAIN_DIR=${2:-runs/tp1_cpu}
env_log 4
PYTEST="python3 -m pytest -q -rf -p no:cacheprovider -x"
MODE=${3:-all}
step tp_kernels 200 $PYTEST tests_onegpu/test_virtual_tp.py
if [[ $MODE == all ]]; then
  step earlier 150 $PYTEST tests_onegpu/test_virtual_collectives.py tests_onegpu/test_virtual_fused.py tests_onegpu/test_gemm_core.py -k "not every_candidate"
fi
if [[ $MODE != kernels ]]; then
  step infer_graphs 60 torchrun --nproc-per-node 1 launch/infer_tp.py --cuda --cuda-graphs --train-dir "$TRAIN_DIR"
  step infer_eager 40 torchrun --nproc-per-node 1 launch/infer_tp.py --cuda --train-dir "$TRAIN_DIR"
  step train_sp 80 torchrun --nproc-per-node 1 launch/train_tp.py --cuda --steps 20 --seq 256 --no-checkpoint --out /tmp/train_sp
fi
step bench_decode 120 torchrun --nproc-per-node 1 benchmarks/bench_decode.py --out "$RESULTS" --reps 10
step bench_ag_gemm 100 python3 benchmarks/bench_ag_gemm.py --onegpu --out "$RESULTS" --calls 5 --batches 3
echo "total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
tar czf "$OUT/results_logs.tgz" -C "$OUT" results logs && rm -rf "$OUT/results" "$OUT/logs"  # few files back
