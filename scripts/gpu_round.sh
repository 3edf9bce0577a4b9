#!/usr/bin/env bash
# One GPU call that verifies a round on the H200: the GPU test suite (or TESTS, a gtest filter),
# `--deterministic` against the default (bench decode / verify rows eagerly, and `attnrt run` with
# CUDA graphs: tokens/s of both), the host plan at batch 256 (printed by the first bench), the NCCL
# version the machine loads, and torch's DSA anchors (bench/torch_dsa.py) when present.
#   usage: OUT=DIR scripts/gpu_round.sh   (carry .gpubin from scripts/gpu_prebuild.sh and .devdeps)
#   TEST_TIMEOUT (s, default 170), ROWS (bench rows, default decode-64x4096,decode-1x32768,
#   decode-256x2048,verify-chain-64x4096+8), CHUNKS / CHUNK_ROWS (the split policy), RUNS (more
#   `attnrt run` argument sets, ';'-separated), SUITES (bench suites, e.g. dsa), SUITE_ENVS (run
#   each suite once per VAR=value word, for A/B of a kernel switch, e.g. "ATTNRT_DSA_INDEXER=cuda_core
#   ATTNRT_DSA_INDEXER=mma"), TORCH_DSA=0 (skip), DEFAULT_ROWS=0 (skip the default / deterministic
#   bench rows and runs)
set -uo pipefail
cd "$(dirname "$0")/.."
# The summary (what is printed) is in the call's output; logs come back in $OUT/logs.tar.gz.
source scripts/gpubin.sh
gpu_call_setup
# PyTorch's NCCL where the toolkit has none.
if [ -z "${ATTNRT_NCCL_LIBRARY:-}" ]; then
  lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))" 2>/dev/null)
  [ -n "$lib" ] && [ -f "$lib" ] && export ATTNRT_NCCL_LIBRARY=$lib
fi
$B/attnrt info | head -8 > $O/info.txt; cat $O/info.txt

# The round's own tests first (FIRST, a gtest filter), so that they report even if the whole suite
# runs out of time.
if [ -n "${FIRST:-}" ]; then
  s=$(date +%s)
  timeout 90 $B/attnrt_cuda_tests --gtest_filter="$FIRST" > $O/tests_first.log 2>&1
  echo "first tests rc=$? $(( $(date +%s)-s )) s"
  grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|tests ran" $O/tests_first.log | head -40
  grep -E "Failure" $O/tests_first.log | sort | uniq -c | head -20
fi
s=$(date +%s)
timeout "${TEST_TIMEOUT:-170}" $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="${TESTS:-*}" > $O/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-s )) s"
grep -E "^\[ +(PASSED|FAILED) +\]|tests ran" $O/tests.log | head -40
grep -E "Failure" $O/tests.log | sort | uniq -c | head -20

rows=${ROWS:-decode-64x4096,decode-1x32768,decode-256x2048,verify-chain-64x4096+8}
modes=(default deterministic); [ "${DEFAULT_ROWS:-1}" = 0 ] && modes=()
for mode in "${modes[@]}"; do
  flag=(); [ $mode = deterministic ] && flag=(--deterministic)
  s=$(date +%s)
  timeout 120 $B/attnrt bench --backend cuda --workload "$rows" --no-reference --repeats 10 \
    --warmup 2 "${flag[@]}" --json $O/bench_$mode.json > $O/bench_$mode.txt 2>&1
  echo "bench $mode rc=$? $(( $(date +%s)-s )) s"
  grep -E "^(decode|verify)|plan|graph" $O/bench_$mode.txt | head -14
done
# The split policy measured (CHUNKS: keys per split through ATTNRT_KV_CHUNK, eager steps, on
# CHUNK_ROWS), e.g. what deterministic mode's fixed chunk costs a row.
for c in ${CHUNKS:-}; do
  ATTNRT_KV_CHUNK=$c timeout 60 $B/attnrt bench --backend cuda --workload "${CHUNK_ROWS:-$rows}" \
    --no-reference --repeats 10 --warmup 2 > $O/bench_chunk_$c.txt 2>&1
  echo "bench ATTNRT_KV_CHUNK=$c rc=$?"; grep -E "^(decode|verify)" $O/bench_chunk_$c.txt
done
for mode in "${modes[@]}"; do
  flag=(); [ $mode = deterministic ] && flag=(--deterministic)
  s=$(date +%s)
  timeout 60 $B/attnrt run --attention-backend cuda "${flag[@]}" --json $O/run_$mode.json \
    --no-progress > $O/run_$mode.txt 2>&1
  echo "run $mode rc=$? $(( $(date +%s)-s )) s"
  grep -E -i "DECODE|graph|tokens/s|leak" $O/run_$mode.txt | head -8
done
# RUNS: more `attnrt run` argument sets, separated by ';' (each on cuda, its summary printed).
IFS=';' read -r -a runs <<<"${RUNS:-}"
for i in "${!runs[@]}"; do
  s=$(date +%s)
  # shellcheck disable=SC2086  # each set is split into its arguments
  timeout 120 $B/attnrt run --attention-backend cuda --no-progress ${runs[$i]} > $O/run_extra_$i.txt 2>&1
  echo "run ${runs[$i]} rc=$? $(( $(date +%s)-s )) s"
  grep -E -i "^(EXTEND|DECODE|MIXED|TARGET|DRAFT|total)|graph|dcp|error|fail|leak" $O/run_extra_$i.txt | head -14
done
# SUITES: `attnrt bench --suite S` on cuda for each S (e.g. dsa), rows printed.
for suite in ${SUITES:-}; do
  for e in ${SUITE_ENVS:-plain}; do
    tag=$suite; envs=()
    [ "$e" = plain ] || { tag=${suite}_${e##*=}; envs=("$e"); }
    s=$(date +%s)
    env "${envs[@]}" timeout 240 $B/attnrt bench --backend cuda --suite $suite --no-reference \
      --repeats 10 --warmup 2 --json $O/bench_suite_$tag.json > $O/bench_suite_$tag.txt 2>&1
    echo "bench --suite $suite ${envs[*]} rc=$? $(( $(date +%s)-s )) s"
    grep -v -E "^bench: " $O/bench_suite_$tag.txt | tail -24
  done
done
if [ -f bench/torch_dsa.py ] && [ "${TORCH_DSA:-1}" != 0 ]; then
  s=$(date +%s)
  (cd bench && timeout 90 python3 torch_dsa.py --device cuda --json $O/torch_dsa.json) > $O/torch_dsa.txt 2>&1
  echo "torch_dsa rc=$? $(( $(date +%s)-s )) s"; tail -12 $O/torch_dsa.txt
fi
