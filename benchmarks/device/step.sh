# Sourced first by every benchmarks/device/*.sh device call: multicast off (project policy) for the
# shell and everything it starts, the commit and output folders every call records, and `step`.
# The caller sets BUDGET (seconds) and may set OUT before sourcing.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset AXEDIST_ENABLE_MULTICAST
# The device copy's git can be stale (on 2026-11-25 it named the session's first commit in every
# call): give the commit in the call, `AXEDIST_COMMIT=<hash> bash benchmarks/device/w2.sh ...`.
export AXEDIST_COMMIT=${AXEDIST_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/axedist_out}
LOGS=$OUT/logs RESULTS=$OUT/results
mkdir -p "$LOGS" "$RESULTS"
START=$(date +%s)
SUMMARY=$OUT/summary.txt

# One timed, logged step of the device call (STEP_TEE=1: its output also on stdout, as progress).
step() {  # step NAME LIMIT_S COMMAND...: run with min(LIMIT, time left), log, record rc
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "$name SKIPPED (no time left)" | tee -a "$SUMMARY"; return; fi
  local t0=$(date +%s) rc
  if [[ ${STEP_TEE:-0} == 1 ]]; then  # progress on stdout as it happens (warnings only in the log)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | grep --line-buffered -vE "USDT|Warning|warnings.warn|^ *$"
    rc=${PIPESTATUS[0]}
  else
    timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
  fi
  echo "$name rc=$rc ${limit}s-limit took $(( $(date +%s) - t0 ))s: $*" | tee -a "$SUMMARY"
  grep -E "[0-9]+ (passed|failed)|error" "$LOGS/$name.log" | tail -3 | sed 's/^/    /' | tee -a "$SUMMARY"
}

# The machine, versions and multicast settings of the call, into $LOGS/env.log (the first N lines shown).
env_log() {  # env_log [N]
  { date -u; nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv; nvidia-smi topo -m;
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())";
    env | grep -E "NCCL_NVLS|MULTICAST|NVLS|AXEDIST" ; } > "$LOGS/env.log" 2>&1
  head -"${1:-6}" "$LOGS/env.log"
}
