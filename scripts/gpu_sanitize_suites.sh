#!/usr/bin/env bash
# compute-sanitizer over the GPU suite, suite by suite (issue 21): for each tool of TOOLS and
# each test suite of FILTER, one sanitizer run of that suite alone, bounded by SUITE_SECONDS, so
# a slow suite neither hides the others' results nor loses its own; the whole call stops starting
# runs once TOTAL_SECONDS have passed. One line per run: tool, suite, exit code (9: the tool
# reported errors; 124: the suite did not finish in its slot), seconds, the tool's summary and
# gtest's result line. UNIT=test runs each test of FILTER alone instead (a slot each), for tools
# too slow to get through a whole suite (racecheck instruments every shared-memory access).
#   usage: OUT=DIR scripts/gpu_sanitize_suites.sh FILTER
#   env:   TOOLS (default "memcheck synccheck initcheck racecheck"), SUITE_SECONDS (90),
#          TOTAL_SECONDS (420), UNIT (suite | test). Carry .gpubin (scripts/gpu_prebuild.sh) and
#          .devdeps.
set -uo pipefail
cd "$(dirname "$0")/.."
filter=${1:?usage: scripts/gpu_sanitize_suites.sh GTEST_FILTER}
source scripts/gpubin.sh
gpu_call_setup
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$CS" ] || { echo "no compute-sanitizer on this machine"; exit 1; }
"$CS" --version | tail -1
# Suite names: gtest's list has the suites flush left, ending in '.'; the tests under each
# indented, with a '# GetParam() = ...' comment after parameterised ones.
if [ "${UNIT:-suite}" = test ]; then
  suites=$($B/attnrt_cuda_tests --gtest_list_tests --gtest_filter="$filter" |
    awk '/^[A-Za-z]/ { s = $1; next } { print s $1 }')
else
  suites=$($B/attnrt_cuda_tests --gtest_list_tests --gtest_filter="$filter" |
    grep -E '^[A-Za-z][A-Za-z0-9_/]*\.' | sed 's/\..*$//' | sed 's/$/.*/')
fi
end=$(( $(date +%s) + ${TOTAL_SECONDS:-420} ))
for tool in ${TOOLS:-memcheck synccheck initcheck racecheck}; do
  for suite in $suites; do
    if [ "$(date +%s)" -ge $end ]; then echo "$tool ${suite%.\*}: not run (TOTAL_SECONDS spent)"; continue; fi
    name=${suite%.\*}
    log=$O/san_${tool}_${name//[\/.]/_}.log
    s=$(date +%s)
    timeout "${SUITE_SECONDS:-90}" "$CS" --tool "$tool" --error-exitcode 9 \
      $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="$suite" > "$log" 2>&1
    rc=$?
    # A suite without CUDA work (host-only tests): the tool exits 255 before instrumenting.
    grep -q "terminated before first instrumented API call" "$log" && rc="none (no CUDA calls)"
    echo "$tool $name rc=$rc $(( $(date +%s) - s )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) $(grep -E '^\[  (PASSED|FAILED) ' "$log" | tr '\n' ' ')"
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || [ "${rc:0:4}" = none ] || grep -E "^=========  |FAILED  \] [A-Z]" "$log" | head -8
  done
done
