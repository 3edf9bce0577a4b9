#!/usr/bin/env bash
# The d64 / d128 prefill CTA's S one tile ahead (ATTNRT_PREFILL_AHEAD, prefill_ws.cuh's
# PrefillWsAheadConfig) against its ping-pong loop, in one binary (.gpubin-ahead):
#  1. the prefill suites at K / V stages 3 / 2 and 2 / 2 and off (CudaPrefillWsAhead*, the TMA
#     default's);
#  2. one bench process a mode (off, 32, 22), alternating, two rounds, over the prefill rows; then
#     bench/ab.py's table against off;
#  3. compute-sanitizer's racecheck / synccheck on one long-run case (SANITIZE=0: not run).
#   usage: OUT=$OUT scripts/gpu_ahead.sh  (carry .gpubin-ahead, .devdeps; ~4 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels "${CALL_SECONDS:-280}" ahead
T=/tmp/ab-bin/ahead/attnrt_cuda_tests
gpu_stage tests 100 $T --gtest_brief=1 \
  --gtest_filter='CudaPrefillWsAhead*:CudaPrefillWsTmaTest.*'
if ! grep -q '^\[  PASSED' "$O/tests.log" || grep -q '^\[  FAILED' "$O/tests.log"; then
  echo "tests did not pass: no rows"
  exit 0
fi
ROWS=${AHEAD_ROWS:-prefill-1x16384,prefill-1x4096,prefill-8x2048,extend-8x2048+512,prefill-1x8192-d64}
for r in 1 2; do
  modes="0 32 22"
  [ $r = 2 ] && modes=${AHEAD_R2_MODES:-0 32}
  for mode in $modes; do
    [ "$(date +%s)" -gt $((GPU_END - 40)) ] && { echo "rows: out of time"; break 2; }
    log=$O/bench_m${mode}_r$r.log
    ATTNRT_PREFILL_AHEAD=$mode timeout 45 /tmp/ab-bin/ahead/attnrt bench --backend cuda \
      --workload "$ROWS" --no-reference --quiet --no-step-costs --json "$O/m${mode}_r$r.json" \
      >"$log" 2>&1
    bench_rates "m$mode r$r" <"$log"
  done
done
python3 bench/ab.py "$O"/m*_r*.json --base m0 2>&1 | tail -n 20
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in racecheck synccheck; do
    gpu_stage "$tool" 60 compute-sanitizer --tool "$tool" $T --gtest_brief=1 \
      --gtest_filter='CudaPrefillWsAheadTest.PageSizesAndLongRuns'
  done
fi

