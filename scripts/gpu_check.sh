#!/usr/bin/env bash
# On the GPU machine, from the project root: build (Release, sm_90a), run the CUDA tests (and
# compute-sanitizer memcheck over a subset), then the GPU benchmarks. Logs and JSON go to $OUT
# (default ./out/gpu); a short table is printed last.
#   usage: scripts/gpu_check.sh [build|test|bench|all|prefill] [extra gtest filter]
# `prefill`: build, the prefill/extend tests (with memcheck over two of them), then only the
# prefill and extend benchmark rows.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
filter=${2:-CudaBackend*:CudaPrefill*}
memcheck_filter='CudaBackendTest.DecodeWindowSoftcapSinks:CudaBackendTest.ExtendWithCachedPrefix:CudaBackendTest.TargetVerifyChainAndTree:CudaBackendTest.DecodeSplitsLongRequests'
bench_args=${ATTNRT_BENCH_ARGS:-}
if [[ $what == prefill ]]; then
  filter=${2:-CudaPrefill*:CudaBackendTest.Extend*:CudaBackendTest.Mixed*:CudaBackendTest.HostTensors*:CudaBackendTest.EagerStep*}
  memcheck_filter='CudaPrefillTest.RaggedCausalExtendAcrossHeadDims:CudaPrefillTest.SplitKeysMergeWithLse'
  bench_args="--only prefill,extend $bench_args"
fi
out=${OUT:-$PWD/out/gpu}
mkdir -p "$out"
build=${ATTNRT_GPU_BUILD:-/tmp/b}
if [ -f .devdeps/unpack-debs.sh ]; then source .devdeps/unpack-debs.sh >/dev/null; fi

status=0
if [[ $what == all || $what == build || $what == test || $what == bench || $what == prefill ]]; then
  t0=$(date +%s)
  { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
      && ninja -C "$build" -j16 attnrt_cuda_tests attnrt_gpu_bench; } >"$out/build.log" 2>&1
  rc=$?
  echo "build: rc=$rc in $(( $(date +%s) - t0 )) s (log: build.log)"
  if [ $rc -ne 0 ]; then grep -E "error|Error" "$out/build.log" | head -40; exit 1; fi
fi
if [[ $what == all || $what == test || $what == prefill ]]; then
  t0=$(date +%s)
  "$build/attnrt_cuda_tests" --gtest_filter="$filter" --gtest_output=xml:"$out/tests.xml" \
      >"$out/tests.log" 2>&1
  rc=$?
  echo "tests ($filter): rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|Failure|error|Expected|Which is" "$out/tests.log" | head -60
  [ $rc -ne 0 ] && status=1
  if command -v compute-sanitizer >/dev/null && [[ ${ATTNRT_MEMCHECK:-1} == 1 ]]; then
    t0=$(date +%s)
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$build/attnrt_cuda_tests" \
      --gtest_filter="$memcheck_filter" >"$out/memcheck.log" 2>&1
    echo "memcheck: rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 "$out/memcheck.log"
  fi
fi
if [[ $what == all || $what == bench || $what == prefill ]]; then
  t0=$(date +%s)
  "$build/attnrt_gpu_bench" --json "$out/bench.json" $bench_args >"$out/bench.log" 2>&1
  echo "bench: rc=$? in $(( $(date +%s) - t0 )) s"
  cat "$out/bench.log" | tail -45
fi
exit $status
