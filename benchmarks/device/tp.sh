#!/usr/bin/env bash
# One device call: issue 27's GPU-bound training steps on every GPU of the machine (W = its GPU
# count), Llama-3-8B layers (--preset llama8b: dim 4096, 32 heads, 8 KV heads, FFN 14336, 4 layers,
# vocab 16384, 8 x 4096 tokens per TP group), progress on stdout as it runs:
#   AXEDIST_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/device/tp.sh [BUDGET_S]   # default 560
# W=2 (nvidia-h100-x2 / nvidia-h200-x2), about 4-5 min:
#   precompile (<= 45 s); bench_tp at TP=2: fp32 loss check of 5 sides, then axedist, torch, axedist
#   compiled, torch compiled, torch compiled + async-TP, 3 warm-up + 20 interleaved steps each, one
#   profiled step each (<= 470 s; expected ~250 s: ~150 s of compiles, ~30 s of timed steps)
# W=4 (nvidia-h100-x4 / nvidia-h200-x4), about 6-8 min:
#   precompile; bench_tp at TP=4 as above (<= 360 s; expected ~230 s); bench_train_2d dp2 x tp2 vs
#   torch FSDP2 + TP, 16 x 4096 tokens, eager (<= 150 s; expected ~70 s)
# Back in $OUT: tp.tgz (logs/, results/ with history/), summary.txt, and each benchmark's .md/.json/.png.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 AXEDIST_TIMEOUT_S=20 AXEDIST_COLLECTIVE_TIMEOUT_S=120 OMP_NUM_THREADS=4
export STEP_TEE=1
BUDGET=${1:-560}
source "$(dirname "$0")/step.sh"
env_log 6
W=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "W=$W, budget ${BUDGET}s, commit $AXEDIST_COMMIT"
step precompile 45 python3 benchmarks/precompile_collectives.py --worlds $W --jobs 32
TP_LIMIT=$(( W >= 4 ? 360 : 470 ))
step bench_tp_w$W $TP_LIMIT torchrun --nproc-per-node $W benchmarks/bench_tp.py --cuda --preset llama8b --compile \
  --profile --out "$RESULTS"
if (( W >= 4 )); then
  step bench_train_2d_w$W 150 torchrun --nproc-per-node $W benchmarks/bench_train_2d.py --cuda --preset llama8b \
    --profile --out "$RESULTS"
fi
echo "total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
for f in "$RESULTS"/*.md; do [[ -f $f ]] && { echo "=== $f"; grep -E "^\| |^- |passed|FAILED|failed" "$f" | head -40; }; done
# at most 8 files come back: the bundle, the summary and each benchmark's table, numbers and chart
cp "$RESULTS"/*.md "$RESULTS"/*.json "$RESULTS"/*.png "$OUT"/ 2>/dev/null
tar czf "$OUT/tp.tgz" -C "$OUT" results logs && rm -rf "$OUT/results" "$OUT/logs"
ls "$OUT"
