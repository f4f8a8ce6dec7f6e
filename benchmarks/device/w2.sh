#!/usr/bin/env bash
# One device call on TWO GPUs (nvidia-h100-x2 / nvidia-h200-x2): the W=2 half of the multi-GPU runs.
# In priority order, each step bounded by what is left of BUDGET seconds (a step that no longer
# fits is skipped and says so):
#   1. torch.compile: the one-GPU compile test (GPU 0), then its NCCL test at W=2
#   2. the TP training step at the GPU-bound size (--preset llama8b), eager, vs torch's (compiled: benchmarks/device/tp.sh)
#   3. fused all-gather + GEMM, the decode stack, context-parallel attention, the /ce copies as a CUDA graph (probe_ce_graph.py)
#      and the README's train + decode job at TP=2
#   4. the rest of tests_multigpu at W=2, and the fused GEMM + reduce-scatter at W=2 (burst, then held)
#   bash benchmarks/device/w2.sh [BUDGET_S]          # logs and results come back as $OUT/w2.tgz
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 AXEDIST_TIMEOUT_S=20 AXEDIST_COLLECTIVE_TIMEOUT_S=120 OMP_NUM_THREADS=4
BUDGET=${1:-490}
source "$(dirname "$0")/step.sh"
env_log 12
PYTEST="python3 -m pytest -v -rfE -p no:cacheprovider"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
step precompile 45 python3 benchmarks/precompile_collectives.py --worlds 2 --jobs 32
CUDA_VISIBLE_DEVICES=0 step onegpu_compile 90 $PYTEST tests_onegpu/test_compile_onegpu.py
if (( GPUS >= 2 )); then
  export CUDA_VISIBLE_DEVICES=0,1
  step compile_w2 90 $PYTEST tests_multigpu/test_compile_nccl.py
  # eager sides of the GPU-bound size (~45 s); the compiled sides and the profile: benchmarks/device/tp.sh
  step bench_tp_w2 150 torchrun --nproc-per-node 2 benchmarks/bench_tp.py --cuda --preset llama8b --steps 10 --out "$RESULTS"
  step bench_ag_gemm_w2 50 torchrun --nproc-per-node 2 benchmarks/bench_ag_gemm.py --reps 10 --only 0,1,2,3,6,8 --out "$RESULTS"
  step bench_decode_w2 50 torchrun --nproc-per-node 2 benchmarks/bench_decode.py --reps 10 --batches 1,8,64 --out "$RESULTS"
  # context-parallel causal attention vs the whole sequence on one GPU and vs torch's context_parallel (~40 s)
  step bench_cp_w2 90 torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --reps 20 --out "$RESULTS"
  # the /ce copies as one CUDA graph (AXEDIST_CE_GRAPHS, opt-in): host and device time of both
  # modes, and whether the driver runs a graph's peer copies on the copy engines or as kernels
  step ce_graph_w2 60 env OUT="$RESULTS" torchrun --nproc-per-node 2 benchmarks/device/probe_ce_graph.py
  # and the eager TP step with them on (against bench_tp_w2 above, torch's side the anchor of both)
  step bench_tp_w2_ce_graphs 100 env AXEDIST_CE_GRAPHS=1 torchrun --nproc-per-node 2 benchmarks/bench_tp.py --cuda \
    --preset llama8b --steps 10 --check-steps 0 --out "$RESULTS/ce_graphs"
  # auto's cuBLAS + NCCL path at the inference shapes, by pieces (host and eager time; ~20 s)
  step auto_host_w2 60 torchrun --nproc-per-node 2 benchmarks/device/probe_auto_host.py --out "$RESULTS"
  # the README's GPU job at TP=2: train, then decode from its checkpoint eagerly and in CUDA graphs
  # (the checkpoint stays on the machine: /tmp, not $OUT)
  step main_w2 150 bash -c "torchrun --nproc-per-node 2 launch/train_tp.py --cuda --out /tmp/axedist_train_tp \
    && torchrun --nproc-per-node 2 launch/infer_tp.py --cuda --train-dir /tmp/axedist_train_tp \
    && torchrun --nproc-per-node 2 launch/infer_tp.py --cuda --cuda-graphs --train-dir /tmp/axedist_train_tp"
  step pytest_w2 300 $PYTEST tests_multigpu --ignore tests_multigpu/test_compile_nccl.py
  step bench_gemm_rs_w2 60 torchrun --nproc-per-node 2 benchmarks/bench_gemm_rs.py --reps 10 --tune default --out "$RESULTS"
  # the same calls held back to back at the power cap, as a training step runs them (issue 28's 405B
  # eager question: results/probe_gemm_power.md): 16384 x 8192 x 7168, Qwen, 405B, M = 128
  step bench_gemm_rs_held_w2 150 torchrun --nproc-per-node 2 benchmarks/bench_gemm_rs.py --reps 10 --tune default \
    --only 4,6,7,8 --held 0.5 --out "$RESULTS"
fi
echo "total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
for f in "$LOGS"/*.log; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR|geomean|ms/token|per token|tokens follow|x faster|slower|step time|rc=" "$f" | tail -8; done
tar czf "$OUT/w2.tgz" -C "$OUT" results logs && rm -rf "$OUT/results" "$OUT/logs"  # few files back
