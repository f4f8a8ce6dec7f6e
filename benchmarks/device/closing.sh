#!/usr/bin/env bash
# Device calls before a stop (nvidia-h200-x4), logs and results under $OUT:
#   bash benchmarks/device/closing.sh tests    # tests_onegpu (in halves, side by side, where there are 2+ GPUs),
#                                       # tests_multigpu at W=4 (4 GPUs) and W=2
#                                       # (TESTS narrows them; ONEGPU=0 skips the one-GPU suite, W2=0 the W=2 run:
#                                       # on a fresh 2-GPU machine the two do not fit one call, 2026-11-30:
#                                       # halves > 240 s each compiling every kernel, W=2 321 s; so
#                                       # W2=0 LIMIT_ONEGPU=420 in one call, ONEGPU=0 in the next;
#                                       # that was before the halves ran xdist workers, ONEGPU_JOBS)
#   bash benchmarks/device/closing.sh benches  # fused GEMM+RS W=4/W=2, collectives tile sweep, redistribute,
#                                       # model_tables (the fused kernels at bench_tp's llama8b calls -> 'auto'),
#                                       # ag_gemm (design + llama8b shapes -> 'auto'),
#                                       # TP and FSDP x TP training steps (GPU-bound size), main job on NCCL, decode (BENCHES narrows them;
#                                       # CONFIGS / ONLY pick gemm_rs candidates / shape indices;
#                                       # BENCHES=w8 on an 8-GPU machine: the issue 8 runs;
#                                       # BENCHES=ce_graphs: AXEDIST_CE_GRAPHS's probe and TP step, off and on;
#                                       # BENCHES=auto_host: the host cost of auto's cuBLAS + NCCL path;
#                                       # BENCHES=gemm_rs_held: GEMM + RS held at the power cap;
#                                       # BENCHES=context_parallel: bench_context_parallel.py at W)
# Everything comes back as $OUT/bundle.tgz (logs/, results/) and $OUT/summary.txt.
# Step times on 4x H200 (2026-11-28, warm Triton cache after precompile): tests_multigpu W=4 317 s
# (+120 s for test_every_candidate_config_and_gemm_only_mode), W=2 ~280 s, tests_onegpu halves
# 128 / 141 s side by side; tp 114 s, train_2d 254 s, gemm_rs_w4 43 s, redistribute 71 s,
# main_sh 93 s, ag_gemm 50 s, decode 37 s. So the whole 4-GPU table takes three calls, e.g.
#   OUT=$OUT/t ... closing.sh tests (W=4 only); OUT=$OUT/b BENCHES="ag_gemm decode" ... closing.sh benches
#   BENCHES="tp train_2d" ... closing.sh benches
#   BENCHES="gemm_rs_w4 redistribute main_sh collectives" ... closing.sh benches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 AXEDIST_TIMEOUT_S=20 OMP_NUM_THREADS=4
MODE=${1:-tests}
BUDGET=${BUDGET:-560}
source "$(dirname "$0")/step.sh"
env_log 8

PYTEST="python3 -m pytest -q -rfx -x -p no:cacheprovider"
if [[ $MODE == tests ]]; then
  # the one-GPU suite on GPU 0, then tests_multigpu on every GPU (W=4 where there are 4) and on two;
  # -v names every test (a cut-off run still says what passed), --durations times them, and a
  # test that hangs fails alone after TEST_TIMEOUT seconds where pytest-timeout is installed
  TESTS=${TESTS:-tests_multigpu}
  PYTEST="python3 -m pytest -v -rfEx -p no:cacheprovider --durations=${DURATIONS:-40}"
  python3 -c "import pytest_timeout" 2>/dev/null && PYTEST="$PYTEST --timeout ${TEST_TIMEOUT:-240}"
  GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
  # xdist workers per GPU for the one-GPU suite's halves (their kernels compile side by side; six on
  # one GPU ran the whole suite in 188-259 s, 2026-12-01; both halves at three each side by side on
  # one fresh GPU 264 s; not yet run on 2+ GPUs)
  WORKERS="-n ${ONEGPU_JOBS:-3} --dist load"
  # the halves: every file of tests_onegpu once (until 2026-12-01 the halves left out four files)
  ONEGPU_A="tests_onegpu/test_virtual_tp.py tests_onegpu/test_compile_onegpu.py tests_onegpu/test_cached_routes_cuda.py tests_onegpu/test_fused_out_cuda.py"
  ONEGPU_B="tests_onegpu --ignore=tests_onegpu/test_virtual_tp.py --ignore=tests_onegpu/test_compile_onegpu.py --ignore=tests_onegpu/test_cached_routes_cuda.py --ignore=tests_onegpu/test_fused_out_cuda.py"
  [[ -f benchmarks/precompile_collectives.py ]] && step precompile 60 python3 benchmarks/precompile_collectives.py --worlds 2 4 --jobs 48
  if (( GPUS >= 4 )); then
    # W=4 on all four; then W=2 on GPUs 0,1 while the one-GPU suite runs in two halves on GPUs 2 and 3
    CUDA_VISIBLE_DEVICES=0,1,2,3 step pytest_w4 ${LIMIT_W4:-300} $PYTEST $TESTS
    CUDA_VISIBLE_DEVICES=0,1 step pytest_w2 ${LIMIT_W2:-300} $PYTEST $TESTS &
    if [[ ${ONEGPU:-1} == 1 ]]; then
      CUDA_VISIBLE_DEVICES=2 step pytest_onegpu_a ${LIMIT_ONEGPU:-300} $PYTEST $WORKERS $ONEGPU_A &
      CUDA_VISIBLE_DEVICES=3 step pytest_onegpu_b ${LIMIT_ONEGPU:-300} $PYTEST $WORKERS $ONEGPU_B &
    fi
    wait
  elif (( GPUS >= 2 )); then
    # the one-GPU suite in two halves on GPUs 0 and 1 side by side, then W=2 on both
    if [[ ${ONEGPU:-1} == 1 ]]; then
      CUDA_VISIBLE_DEVICES=0 step pytest_onegpu_a ${LIMIT_ONEGPU:-240} $PYTEST $WORKERS $ONEGPU_A &
      CUDA_VISIBLE_DEVICES=1 step pytest_onegpu_b ${LIMIT_ONEGPU:-240} $PYTEST $WORKERS $ONEGPU_B &
      wait
    fi
    [[ ${W2:-1} == 1 ]] && CUDA_VISIBLE_DEVICES=0,1 step pytest_w2 ${LIMIT_W2:-330} $PYTEST $TESTS
  else
    # one GPU: the whole suite in one step, six xdist workers sharing the GPU (their kernels
    # compile side by side: 119 tests in 259 s on a fresh 1x H200, 2026-12-01, against 860 s in
    # two calls run serially)
    [[ ${ONEGPU:-1} == 1 ]] && CUDA_VISIBLE_DEVICES=0 step pytest_onegpu ${LIMIT_ONEGPU:-420} $PYTEST -n ${ONEGPU_JOBS:-6} --dist load tests_onegpu
  fi
  for f in "$LOGS"/pytest_*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -12; done
elif [[ $MODE == benches ]]; then  # BENCHES narrows the list (names below)
  BENCHES=${BENCHES:-"gemm_rs_w4 gemm_rs_w2 rows redistribute tp train_2d main_job demo"}
  export AXEDIST_COMMIT=${AXEDIST_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  CONFIGS=${CONFIGS:-0,1,3,5,6,7,8,14,15,16}
  W=$(python3 -c "import torch; print(min(4, torch.cuda.device_count()))")
  train_2d() {  # FSDP x TP (dp2 x tp2) at the GPU-bound size, eager and compiled (traced FSDP), profiled, its memory at the peak by site (~4.5 min)
    step bench_train_2d ${TRAIN_2D_LIMIT:-330} torchrun --nproc-per-node 4 benchmarks/bench_train_2d.py --cuda --preset llama8b --compile --profile --memory ${TRAIN_2D_ARGS:-} --out "$RESULTS"
  }
  for name in $BENCHES; do case $name in
    model_tables) # the fused kernels vs cuBLAS + collective at bench_tp's llama8b calls, W = up to 4 GPUs
      # (MODEL_ARGS="--batch 16": the GPU-bound TP=4 size's calls);
      # 'auto' then reads the measured winners (the tables are rewritten here and come back in the bundle)
      # (MODEL_TUNE=all MODEL_CONFIGS="0,128x256x64/g8/s3/w8/r64/gl": the shipped pull config against
      # the Gluon kernel, so that the table takes whichever wins)
      step gemm_rs_llama8b 150 torchrun --nproc-per-node $W benchmarks/bench_gemm_rs.py --shapes llama8b ${MODEL_ARGS:-} --tune ${MODEL_TUNE:-default} ${MODEL_CONFIGS:+--configs $MODEL_CONFIGS} --reps 10 --out "$RESULTS"
      step ag_gemm_llama8b 100 torchrun --nproc-per-node $W benchmarks/bench_ag_gemm.py --shapes llama8b ${MODEL_ARGS:-} --reps 10 --out "$RESULTS"
      for f in "$RESULTS"/gemm_rs_w${W}_llama8b*.json; do [[ -f $f ]] && python3 benchmarks/bench_gemm_rs.py --tables-from "$f" >> "$LOGS/tables.log" 2>&1; done
      for f in "$RESULTS"/ag_gemm_w${W}_llama8b*.json; do [[ -f $f ]] && python3 benchmarks/bench_ag_gemm.py --tables-from "$f" >> "$LOGS/tables.log" 2>&1; done
      mkdir -p "$RESULTS/tables" && cp axedist/kernels/*_auto.json axedist/kernels/gemm_rs_tuned.json "$RESULTS/tables/" ;;
    ag_gemm) # the all-gather + GEMM at W = up to 4 GPUs: the design shapes and bench_tp's llama8b calls, then 'auto' reads both
      step ag_gemm_w$W 100 torchrun --nproc-per-node $W benchmarks/bench_ag_gemm.py --reps 10 --out "$RESULTS"
      step ag_gemm_llama8b 100 torchrun --nproc-per-node $W benchmarks/bench_ag_gemm.py --shapes llama8b --reps 10 --out "$RESULTS"
      python3 benchmarks/bench_ag_gemm.py --tables-from "$RESULTS"/ag_gemm_w${W}*.json >> "$LOGS/tables.log" 2>&1
      mkdir -p "$RESULTS/tables" && cp axedist/kernels/ag_gemm_auto.json "$RESULTS/tables/" ;;
    gemm_rs_w4) step bench_gemm_rs_w4 170 torchrun --nproc-per-node 4 benchmarks/bench_gemm_rs.py --reps 15 --configs $CONFIGS ${ONLY:+--only $ONLY} --out "$RESULTS" ;;
    gemm_rs_held) # held back to back at the power cap (a training step's clocks): 16384 x 8192 x 7168,
      # Qwen, 405B and M = 128 (~150 s at W = 4; results/probe_gemm_power.md says why)
      step bench_gemm_rs_held 200 torchrun --nproc-per-node $W benchmarks/bench_gemm_rs.py --reps 10 --tune default --only 4,6,7,8 --held 0.5 --out "$RESULTS" ;;
    gemm_rs_w2) CUDA_VISIBLE_DEVICES=0,1 step bench_gemm_rs_w2 150 torchrun --nproc-per-node 2 benchmarks/bench_gemm_rs.py --reps 15 --configs $CONFIGS ${ONLY:+--only $ONLY} --out "$RESULTS" ;;
    rows) for rows in 4 16; do AXEDIST_P2P_ROWS=$rows step rows_$rows 60 torchrun --nproc-per-node 4 benchmarks/bench_collectives.py --sizes 67108864 268435456 --reps 20 --out "$RESULTS/rows$rows"; done ;;
    rounds) step rounds 200 torchrun --nproc-per-node 4 benchmarks/bench_collectives.py --rounds ${ROUNDS:-1 2 4 8} --sizes 16777216 67108864 268435456 --reps 20 --out "$RESULTS" ;;
    collectives) step bench_collectives 240 torchrun --nproc-per-node 4 benchmarks/bench_collectives.py --reps 30 --out "$RESULTS" ;;
    redistribute) step bench_redistribute 120 torchrun --nproc-per-node $W benchmarks/bench_redistribute.py --cuda --rows ${REDIST_ROWS:-4096} --out "$RESULTS" ;;
    tp) # the GPU-bound size, eager + compiled + torch's async-TP, profiled (~2 min on 4x H200); TP_ARGS adds
      # bench_tp arguments (--memory, --first-step, --trace, --eager-backends p2p torch). At W = 4 the
      # GPU-bound size is batch 16 (at the preset's 8 both eager sides wait on their host; the 2026-11-30
      # call ran batch 8 by mistake): TP_BATCH overrides, 0 keeps the preset's
      batch=${TP_BATCH:-$(( W >= 4 ? 16 : 0 ))}; batch_args=""
      (( batch > 0 )) && batch_args="--batch $batch"
      step bench_tp 380 torchrun --nproc-per-node $W benchmarks/bench_tp.py --cuda --preset llama8b --compile --profile $batch_args ${TP_ARGS:-} --out "$RESULTS" ;;
    tp_backends) # eager only: axedist (auto) against its collectives pinned (PINS: p2p / torch fused calls, nccl planned), and torch
      step bench_tp_backends 200 torchrun --nproc-per-node $W benchmarks/bench_tp.py --cuda --preset llama8b --profile ${PINS_ARGS:-} --eager-backends ${PINS:-p2p torch nccl} --out "$RESULTS/backends" ;;
    train_2d_backends) # eager only, dp2 x tp2: axedist (auto) against its collectives pinned (PINS), and torch
      step bench_train_2d_backends 240 torchrun --nproc-per-node 4 benchmarks/bench_train_2d.py --cuda --preset llama8b --profile ${PINS_ARGS:-} --eager-backends ${PINS:-nccl} --out "$RESULTS/backends" ;;
    tp_eager) # eager only, where the eager step's time goes: axedist (auto), cuBLAS + NCCL pinned, torch;
      # one profiled step per side with every rank's Chrome trace (results/eager/traces/), one with the allocator history
      step bench_tp_eager 200 torchrun --nproc-per-node $W benchmarks/bench_tp.py --cuda --preset llama8b --profile --trace --memory --eager-backends torch --out "$RESULTS/eager" ;;
    train_2d) if (( W >= 4 )); then train_2d; else echo "bench_train_2d SKIPPED (needs 4 GPUs)" | tee -a "$SUMMARY"; fi ;;
    main_sh) step main_sh 200 bash launch/main.sh ;;
    main_job) step main_job 150 bash -c "torchrun --nproc-per-node $W launch/train_tp.py --cuda --out $OUT/train_tp && torchrun --nproc-per-node 2 launch/infer_tp.py --cuda --train-dir $OUT/train_tp" ;;
    demo) step demo 60 torchrun --nproc-per-node 4 launch/demo_dtensor.py --cuda ;;
    context_parallel) # context-parallel causal attention vs one GPU's whole sequence and torch's context_parallel
      step bench_context_parallel 120 torchrun --nproc-per-node $W benchmarks/bench_context_parallel.py --reps 20 --out "$RESULTS" ;;
    decode) # the decode stack (eager, CUDA graphs) vs torch, the row-parallel GEMMs and the fused layer tail (DECODE_ARGS=--profile: kernels per graph step)
      step bench_decode 200 torchrun --nproc-per-node $W benchmarks/bench_decode.py --reps 20 --batches 1,8,64 ${DECODE_ARGS:-} --out "$RESULTS" ;;
    ce_graphs) # AXEDIST_CE_GRAPHS (opt-in until this runs on 2+ GPUs): the probe on real ranks (host and device
      # time of both modes; whether the GPU runs a graph's peer copies as copy-engine memcpys or as kernels),
      # then the TP step eager at batch 8, where both sides wait on their host (902a153 at W = 4: host
      # 121.8 vs torch 113.9 ms), without and with the graphs; torch's side in both runs is the anchor
      mkdir -p "$RESULTS/ce_graphs"
      step ce_graph_probe 90 env OUT="$RESULTS/ce_graphs" torchrun --nproc-per-node $W benchmarks/device/probe_ce_graph.py
      for mode in 0 1; do
        step bench_tp_ce_graphs_$mode 150 env AXEDIST_CE_GRAPHS=$mode torchrun --nproc-per-node $W benchmarks/bench_tp.py \
          --cuda --preset llama8b --batch 8 --steps 10 --check-steps 0 --out "$RESULTS/ce_graphs/$mode"
      done ;;
    auto_host) # gemm_reduce_scatter's auto at the inference shapes (cuBLAS + NCCL) against the pair called
      # directly, by pieces: host and eager time, CUDA runtime calls (results/probe_auto_host.md)
      step probe_auto_host 120 torchrun --nproc-per-node $W benchmarks/device/probe_auto_host.py --out "$RESULTS" ;;
    w8) # issue 8, on nvidia-h200-x8 (the tests mode runs at W=8 there by itself)
      step bench_gemm_rs_w8 300 torchrun --nproc-per-node 8 benchmarks/bench_gemm_rs.py --reps 15 --configs $CONFIGS ${ONLY:+--only $ONLY} --out "$RESULTS"
      step bench_collectives_w8 240 torchrun --nproc-per-node 8 benchmarks/bench_collectives.py --reps 30 --out "$RESULTS"
      step bench_tp_w8 200 torchrun --nproc-per-node 8 benchmarks/bench_tp.py --cuda --preset llama8b --steps 10 --out "$RESULTS" ;;
  esac; done
  for f in "$LOGS"/*.log; do echo "== $f"; grep -E "^\[|geomean|min_|rc=|Error|ms/token|loss|x faster|slower" "$f" | tail -12; done
fi
# at most ~8 files come back from a device call: one bundle of logs and results, plus the tables
tar -czf "$OUT/bundle.tgz" -C "$OUT" logs results 2>/dev/null && rm -rf "$LOGS" "$RESULTS"
rm -rf "$OUT/train_tp"
echo "=== summary ==="; cat "$SUMMARY"
