#!/usr/bin/env bash
# A short two-GPU device call: the multi-GPU tests of the TP kernels and the NCCL training paths,
# one name per line (-v) so a cut-off run still says what passed.   bash benchmarks/device/w2_tests.sh [BUDGET_S]
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 AXEDIST_TIMEOUT_S=20 AXEDIST_COLLECTIVE_TIMEOUT_S=120 OMP_NUM_THREADS=4
BUDGET=${1:-210}
source "$(dirname "$0")/step.sh"
PYTEST="python3 -m pytest -v -rfE -p no:cacheprovider"
step precompile 20 python3 benchmarks/precompile_collectives.py --worlds 2 --jobs 32
step tp_kernels 100 $PYTEST tests_multigpu/test_fused_tp.py tests_multigpu/test_compile_nccl.py
step nccl_paths 90 $PYTEST tests_multigpu/test_train_tp_nccl.py tests_multigpu/test_runtime_executor_nccl.py tests_multigpu/test_ops_pending_nccl.py
echo "total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
for f in "$LOGS"/tp_kernels.log "$LOGS"/nccl_paths.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$f" | sed 's/ *\[ *[0-9]*%\]//' | tail -40; done
