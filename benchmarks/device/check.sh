#!/usr/bin/env bash
# One device call: multi-GPU tests and benchmarks of the communication layer, logs under $OUT.
#   bash benchmarks/device/check.sh first   # smoke tests at W=4, benchmarks at W=4, remaining tests
#   bash benchmarks/device/check.sh final   # whole tests_multigpu at W=2 and W=4, W=2 + W=4 benchmarks
#   bash benchmarks/device/check.sh collectives   # collectives only: precompile, tests + bench W=4, W=2
#   bash benchmarks/device/check.sh perf    # fused GEMM+RS smoke tests, both benchmarks at W=4
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 AXEDIST_TIMEOUT_S=${AXEDIST_TIMEOUT_S:-20}
MODE=${1:-first}
BUDGET=${2:-560}
source "$(dirname "$0")/step.sh"

if [[ -f .triton_cache/cache.tgz ]]; then mkdir -p ~/.triton && tar -xzf .triton_cache/cache.tgz -C ~/.triton; fi
env_log 8

PYTEST="python3 -m pytest -q -rf -p no:cacheprovider"
if [[ $MODE == collectives ]]; then  # issue 6 speed work: tests + benchmarks, W=4 then W=2
  step precompile 60 python3 benchmarks/precompile_collectives.py --worlds 2 4 --jobs 48
  step pytest_w4 200 $PYTEST -x tests_multigpu/test_collectives.py
  step bench_collectives_w4 120 torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --out "$RESULTS"
  CUDA_VISIBLE_DEVICES=0,1 step pytest_w2 150 $PYTEST -x tests_multigpu/test_collectives.py
  CUDA_VISIBLE_DEVICES=0,1 step bench_collectives_w2 90 torchrun --nproc_per_node=2 benchmarks/bench_collectives.py --reps 20 --out "$RESULTS"
elif [[ $MODE == collectives_w4 ]]; then  # the W=4 half alone
  step precompile 150 python3 benchmarks/precompile_collectives.py --worlds 4 --jobs 48
  step pytest_w4 200 $PYTEST -x tests_multigpu/test_collectives.py
  step bench_collectives_w4 150 torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --out "$RESULTS"
elif [[ $MODE == first ]]; then
  step smoke_w4 200 $PYTEST tests_multigpu/test_gemm_rs.py tests_multigpu/test_collectives.py \
    -k "reduce_scatter_matches or fp32_reference_bf16 or never_signals or back_to_back"
  step bench_gemm_rs_w4 220 torchrun --nproc_per_node=4 benchmarks/bench_gemm_rs.py --out "$RESULTS"
  step bench_collectives_w4 120 torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --out "$RESULTS"
  step rest_w4 200 $PYTEST tests_multigpu/test_gemm_rs.py tests_multigpu/test_collectives.py \
    -k "not (reduce_scatter_matches or fp32_reference_bf16 or never_signals or back_to_back)"
elif [[ $MODE == perf ]]; then  # fused GEMM+RS host path / push+defer, queued timing; collectives
  step smoke_w4 200 $PYTEST -x tests_multigpu/test_gemm_rs.py \
    -k "fp32_reference_bf16 or back_to_back or compiled_launcher or never_signals or every_candidate"
  step bench_gemm_rs_w4 260 torchrun --nproc_per_node=4 benchmarks/bench_gemm_rs.py --reps 20 --configs ${CONFIGS:-0,1,3,5,6} --out "$RESULTS"
  step bench_collectives_w4 130 torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --reps 30 --out "$RESULTS"
else
  step pytest_w4 200 $PYTEST -x tests_multigpu
  CUDA_VISIBLE_DEVICES=0,1 step pytest_w2 180 $PYTEST -x tests_multigpu
  step bench_gemm_rs_w4 110 torchrun --nproc_per_node=4 benchmarks/bench_gemm_rs.py --reps 15 --out "$RESULTS"
  CUDA_VISIBLE_DEVICES=0,1 step bench_gemm_rs_w2 100 torchrun --nproc_per_node=2 benchmarks/bench_gemm_rs.py --reps 15 --out "$RESULTS"
fi

grep -h "^profile\|tottime\|{built-in\|\.py:" "$LOGS"/profile_w4.log 2>/dev/null | head -30
cat "$RESULTS"/*.md 2>/dev/null | grep -v "^$" | head -80
tar -czf "$OUT/bundle.tgz" -C "$OUT" logs results 2>/dev/null
if [[ $MODE == collectives* || $MODE == perf ]]; then  # at most 8 files come back: bundle, summary, results
  cp "$RESULTS"/collectives_w4.* "$RESULTS"/collectives_w2.json "$RESULTS"/collectives_w2.md "$OUT"/ 2>/dev/null
  [[ $MODE == perf ]] && cp "$RESULTS"/gemm_rs_w4.md "$RESULTS"/gemm_rs_w4.json "$OUT"/ 2>/dev/null && rm -f "$OUT"/collectives_w4.png
  rm -rf "$LOGS" "$RESULTS"
else
  [[ $MODE == final ]] || tar -czf "$OUT/triton_cache.tgz" -C ~/.triton cache 2>/dev/null
fi
ls -la "$OUT"
echo "=== summary ==="; cat "$SUMMARY"
