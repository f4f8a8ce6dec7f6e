# Sourced by benchmarks/gpu_check.sh and benchmarks/gpu_closing.sh: one timed, logged step of a device call.
# Needs BUDGET, START, LOGS, SUMMARY set by the caller.
step() {  # step NAME LIMIT_S COMMAND...: run with min(LIMIT, time left), log, record rc
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "$name SKIPPED (no time left)" | tee -a "$SUMMARY"; return; fi
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${limit}s-limit took $(( $(date +%s) - t0 ))s: $*" | tee -a "$SUMMARY"
  grep -E "[0-9]+ (passed|failed)|error" "$LOGS/$name.log" | tail -3 | sed 's/^/    /' | tee -a "$SUMMARY"
}
