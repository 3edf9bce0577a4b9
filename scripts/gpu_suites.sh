#!/usr/bin/env bash
# The GPU tests of a gtest filter run suite by suite, so that a crash (a signal, not a failed
# expectation) in one suite neither hides the others' results nor loses its own log: per suite
# the result line, and for a crash the last test started, its output and, where gdb is installed,
# the backtrace of a rerun of that one test.
#   usage: OUT=DIR scripts/gpu_suites.sh FILTER   (carry .gpubin and .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
filter=${1:?usage: scripts/gpu_suites.sh GTEST_FILTER}
source scripts/gpubin.sh
gpu_call_setup
if [ -z "${ATTNRT_NCCL_LIBRARY:-}" ]; then
  lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))" 2>/dev/null)
  [ -n "$lib" ] && [ -f "$lib" ] && export ATTNRT_NCCL_LIBRARY=$lib
fi
# Suite names: gtest's list has the suites flush left, ending in '.' (not its "Running main()").
suites=$($B/attnrt_cuda_tests --gtest_list_tests --gtest_filter="$filter" |
  grep -E '^[A-Za-z][A-Za-z0-9_/]*\.' | sed 's/\..*$//')
for suite in $suites; do
  log=$O/suite_${suite//\//_}.log
  s=$(date +%s)
  timeout "${SUITE_TIMEOUT:-90}" $B/attnrt_cuda_tests --gtest_filter="$suite.*" > "$log" 2>&1
  rc=$?
  echo "$suite rc=$rc $(( $(date +%s) - s )) s: $(grep -E '^\[  (PASSED|FAILED) ' "$log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | head -5
  if [ $rc -ge 128 ] || [ $rc = 124 ]; then
    last=$(grep -E '^\[ RUN      \]' "$log" | tail -1 | awk '{print $NF}')
    echo "  crashed or hung in $last; its output:"
    sed -n "/RUN      \] ${last//\//\\/}/,\$p" "$log" | tail -15 | sed 's/^/    /'
    if command -v gdb > /dev/null; then
      timeout 90 gdb -batch -ex run -ex bt -ex "info threads" --args $B/attnrt_cuda_tests \
        --gtest_filter="$last" > $O/gdb_${suite//\//_}.txt 2>&1
      grep -E '^#[0-9]+ ' $O/gdb_${suite//\//_}.txt | head -20 | sed 's/^/    /'
    else
      echo "  (no gdb on this machine)"
    fi
  fi
done
