#!/usr/bin/env bash
# One device call before a stop: every multi-GPU test at W=4 and W=2, and the main demo on NCCL.
# Multicast stays off (project policy) for this shell and everything it starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset AXEDIST_ENABLE_MULTICAST
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 AXEDIST_TIMEOUT_S=20 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/axedist_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
run() { local name=$1; shift; local t0=$(date +%s); timeout -k 5 "$LIMIT" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -1)" | tee -a "$OUT/summary.txt"; }
# TESTS narrows the run (default: every multi-GPU test), e.g. TESTS="tests_multigpu/test_dtensor_nccl.py"
TESTS=${TESTS:-tests_multigpu}
LIMIT=${LIMIT_W4:-210} run pytest_w4 python3 -m pytest -q -rfx -x -p no:cacheprovider $TESTS
LIMIT=${LIMIT_W2:-150} CUDA_VISIBLE_DEVICES=0,1 run pytest_w2 python3 -m pytest -q -rfx -x -p no:cacheprovider $TESTS
LIMIT=90 run demo_w4 torchrun --nproc-per-node 4 launch/demo_dtensor.py --cuda --png "$OUT/demo.png"
grep -E "ok:|fused|finished|Error|error" "$OUT/demo_w4.log" | head -12
grep -E "FAILED|Error" "$OUT"/pytest_w*.log | head -20
echo "=== summary ==="; cat "$OUT/summary.txt"
