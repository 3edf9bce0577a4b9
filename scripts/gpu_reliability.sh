#!/usr/bin/env bash
# One GPU call of the long reliability runs on the H200 (docs/RELIABILITY.md): conformance of
# `cuda` against `reference` at volume (pieces of CHECK_PIECE cases of one seed, as many as fit
# CHECK_SECONDS), compute-sanitizer's four tools over parts of the GPU suite and over `attnrt run`
# (graphs on, speculative decoding), and a soak with CUDA graphs.
#   usage: OUT=DIR scripts/gpu_reliability.sh   (carry .gpubin from scripts/gpu_prebuild.sh and
#   .devdeps). SEED (20261204), CHECK_PIECE (5000), CHECK_SECONDS (240), SAN_SECONDS (per run,
#   100), MEMCHECK_TESTS / RACECHECK_TESTS (gtest filters), SOAK_STEPS (30000), SOAK_SECONDS
#   (150), PARTS (check,sanitize,soak), FIRST_CASE (0: where the pieces start).
set -uo pipefail
cd "$(dirname "$0")/.."
# The summary (what is printed) is in the call's output; logs come back in $OUT/logs.tar.gz.
source scripts/gpubin.sh
gpu_call_setup
parts=${PARTS:-check,sanitize,soak}
has() { [[ ",$parts," == *",$1,"* ]]; }
$B/attnrt info | sed -n 3p

if has check; then
  seed=${SEED:-20261204} piece=${CHECK_PIECE:-5000}
  end=$(( $(date +%s) + ${CHECK_SECONDS:-240} )); first=${FIRST_CASE:-0}; s=$(date +%s)
  while [ $(( $(date +%s) + 60 )) -lt $end ]; do
    timeout $(( end - $(date +%s) )) $B/attnrt check --backend cuda --seed $seed \
      --first-case $first --cases $piece --jobs 8 --no-progress > $O/check_$first.txt 2>&1
    rc=$?
    echo "check cases $first..$(( first + piece - 1 )) rc=$rc $(( $(date +%s) - s )) s"
    [ $rc -eq 0 ] || { tail -40 $O/check_$first.txt; break; }
    first=$(( first + piece ))
  done
  # The last complete piece's table (each piece prints its own; docs sum them).
  last=$(( first - piece )); [ $last -ge 0 ] && tail -30 $O/check_$last.txt
fi

if has sanitize; then
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [ -x "$CS" ] || { echo "no compute-sanitizer on this machine"; CS=; }
  if [ -n "$CS" ]; then
    "$CS" --version | tail -1
    san() {  # tool, label, command...
      local tool=$1 label=$2; shift 2
      local s=$(date +%s)
      timeout ${SAN_SECONDS:-100} "$CS" --tool $tool --error-exitcode 9 "$@" > $O/san_${tool}_$label.txt 2>&1
      echo "compute-sanitizer $tool $label rc=$? $(( $(date +%s) - s )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $O/san_${tool}_$label.txt | tail -1)"
      grep -E "^\[ +(PASSED|FAILED) +\]|tests ran" $O/san_${tool}_$label.txt | head -3
    }
    run=($B/attnrt run --attention-backend cuda --no-progress --speculative-num-steps 3)
    # The runs: full attention (demo), MLA (deepseek-v3, one layer), hybrid linear + full
    # (qwen3-next, two layers), each with graphs and chain verify; then parts of the GPU suite.
    san memcheck run "${run[@]}"
    san memcheck run_mla "${run[@]}" --model deepseek-v3 --layers 1
    san memcheck run_hybrid "${run[@]}" --model qwen3-next-80b --layers 4
    san initcheck run "${run[@]}"
    san initcheck run_mla "${run[@]}" --model deepseek-v3 --layers 1
    san synccheck tests $B/attnrt_cuda_tests --gtest_brief=1 \
      --gtest_filter='CudaBackendTest.*:CudaMlaCta.*:CudaPrefillWsTest.*'
    san memcheck tests $B/attnrt_cuda_tests --gtest_brief=1 \
      --gtest_filter="${MEMCHECK_TESTS:-CudaBackendTest.*:CudaMlaCta.*}"
    san racecheck tests $B/attnrt_cuda_tests --gtest_brief=1 \
      --gtest_filter="${RACECHECK_TESTS:-CudaBackendTest.Decode*:CudaBackendTest.TargetVerify*}"
  fi
fi

if has soak; then
  s=$(date +%s)
  timeout ${SOAK_SECONDS:-150} $B/attnrt run --attention-backend cuda --no-progress \
    --soak-steps ${SOAK_STEPS:-30000} --max-running-requests 8 --chunked-prefill-size 32 \
    --max-total-tokens 640 --page-size 8 --check-every 64 --json $O/soak.json > $O/soak.txt 2>&1
  echo "soak rc=$? $(( $(date +%s) - s )) s"
  grep -E "iterations|^(EXTEND|DECODE|MIXED|IDLE|total)|wall time|pool check|aborts|invariants|tokens/s \(wall|graph" $O/soak.txt
fi
