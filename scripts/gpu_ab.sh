#!/usr/bin/env bash
# A/B timing of prebuilt binaries on the GPU machine, in one call: `attnrt bench` over the same rows
# with each binary in turn, ROUNDS rounds in the same order (a b c a b c), then bench/ab.py's table.
# The binaries come from scripts/gpu_prebuild_refs.sh (or gpu_prebuild.sh): DIR/bin.tar.xz each,
# carried with .devdeps. The first DIR is the base of the ratios.
#   usage: scripts/gpu_ab.sh ROWS DIR [DIR...]
#          ROWS: attnrt bench --workload value (e.g. decode-64x4096,decode-64x4096-fp8)
# Environment: ROUNDS (default 2); AB_SUITE (attention|linear, default attention); AB_ENV
# ("VAR=value ..." set for every bench run, e.g. ATTNRT_BENCH_FLUSH=clean); AB_DEADLINE seconds
# (default 540: a run that would start with less than 45 s left is skipped and says so);
# AB_TESTS, a gtest filter run with the attnrt_cuda_tests of every binary but the base (the first)
# before the timing (default none); AB_TEST_SECONDS / AB_RUN_SECONDS bound each test run (200) and
# each bench run (150), so a kernel that hangs costs one slot, not the call. Files in $OUT (default
# ./out/ab): LABEL_rN.json per run (LABEL = the DIR's name without a leading ".gpubin-"),
# tests_LABEL.log, ab.txt (the table, also printed last).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
rows=$1
shift
out=${OUT:-$PWD/out/ab}
mkdir -p "$out"
deadline=$(($(date +%s) + ${AB_DEADLINE:-540}))
if [ -f .devdeps/unpack-debs.sh ]; then source .devdeps/unpack-debs.sh >/dev/null; fi
source scripts/gpubin.sh
labels=()
for dir in "$@"; do
  label=$(gpubin_label "$dir")
  bin=/tmp/ab-bin/$label
  gpubin_unpack "$dir" "$bin" || exit 1
  echo "$label: $("$bin/attnrt" info 2>&1 | head -1)"
  labels+=("$label")
done
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null
if [ -n "${AB_TESTS:-}" ]; then
  for label in "${labels[@]:1}"; do
    s=$(date +%s)
    timeout "${AB_TEST_SECONDS:-200}" /tmp/ab-bin/$label/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="$AB_TESTS" >"$out/tests_$label.log" 2>&1
    rc=$?
    echo "tests $label rc=$rc $(($(date +%s) - s)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$out/tests_$label.log" | tr '\n' ' ')"
  done
fi
read -r -a extra_env <<<"${AB_ENV:-}"
for ((r = 1; r <= ${ROUNDS:-2}; ++r)); do
  for label in "${labels[@]}"; do
    if (($(date +%s) + 45 > deadline)); then
      echo "skip $label round $r: too little time left"
      continue
    fi
    s=$(date +%s)
    # The step costs after the rows (plan at batch 256, graph replay) are not what an A/B times;
    # binaries built before --no-step-costs measure them anyway.
    quick=()
    /tmp/ab-bin/$label/attnrt bench --help 2>/dev/null | grep -q -- --no-step-costs && quick=(--no-step-costs)
    timeout "${AB_RUN_SECONDS:-150}" env "${extra_env[@]}" /tmp/ab-bin/$label/attnrt bench --backend cuda --suite "${AB_SUITE:-attention}" \
      --workload "$rows" --no-reference --quiet "${quick[@]}" --json "$out/${label}_r$r.json" >"$out/${label}_r$r.txt" 2>&1
    echo "$label round $r: rc=$? $(($(date +%s) - s)) s"
  done
done
python3 bench/ab.py --base "${labels[0]}" "$out" | tee "$out/ab.txt"
