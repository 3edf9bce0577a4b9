#!/usr/bin/env bash
# The warp-specialised prefill CTA over fp8 pages (kernels/prefill_ws.cuh with PrefillWsKv8Config,
# the default for prefill tiles over an e4m3 / e5m2 cache; ATTNRT_PREFILL_KV8=0 takes the mma.sync
# CTA) on the GPU machine, in one call of under 600 s (the stages' timeouts add up to 595 s): its
# GPU tests (`*Kv8Prefill*`, e4m3 and e5m2 pools at every head dim it has), the existing prefill
# suites (`*Fp8Prefill*`, `*CudaPrefill*`), compute-sanitizer memcheck and racecheck on its small
# tests, `info --explain`, `attnrt run` of two llama3-8b layers over an fp8_e4m3 and an fp8_e5m2
# cache and of two gemma3-12b layers (head dim 256, sliding windows) over fp8_e4m3 (checked
# against reference), then `attnrt bench --backend cuda` over the bf16 and -kvfp8 prefill /
# extend rows (head dims 64, 128, 256) with the CTA on, and again with ATTNRT_PREFILL_KV8=0 (the
# mma.sync CTA), so both rates and the bf16 rows come from one call; last, the head-dim-128 rows on
# 128-key tiles (ATTNRT_PREFILL_KV8_WIDE=1, patches/kv8-d64-d256.patch; ignored without it).
#   usage: OUT=DIR scripts/gpu_kv8_prefill.sh   (carry .gpubin from scripts/gpu_prebuild.sh and .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs under $OUT/logs, packed into $OUT/logs.tar.gz at exit; binaries in B=/tmp/bin.
source scripts/gpubin.sh
gpu_call_setup
s=$(date +%s)
timeout 170 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Kv8Prefill*' \
  > $O/tests_kv8.log 2>&1
echo "kv8 tests rc=$? $(( $(date +%s)-s )) s"
grep -E "FAILED|PASSED|SKIPPED|Failure|tests ran|error|Which is|Expected" $O/tests_kv8.log | head -40
s=$(date +%s)
timeout 90 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Fp8Prefill*:*CudaPrefill*' \
  > $O/tests_prefill.log 2>&1
echo "prefill / fp8 prefill tests rc=$? $(( $(date +%s)-s )) s"
grep -E "FAILED|PASSED|SKIPPED|Failure|tests ran|error" $O/tests_prefill.log | head -20
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$CS" ]; then
  for tool in memcheck racecheck; do
    filter='*CudaKv8PrefillTest.SmallStepForTheSanitizers/*:*CudaKv8PrefillTest.RingWrapForTheSanitizers/E4m3*'
    [ $tool = memcheck ] && filter='*CudaKv8PrefillTest.SmallStepForTheSanitizers/*:*CudaKv8PrefillTest.RingWrapForTheSanitizers/*'
    s=$(date +%s)
    t=45
    [ $tool = racecheck ] && t=50
    timeout $t "$CS" --tool $tool --error-exitcode 9 $B/attnrt_cuda_tests --gtest_brief=1 \
      --gtest_filter="$filter" > $O/san_$tool.txt 2>&1
    echo "compute-sanitizer $tool rc=$? $(( $(date +%s)-s )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $O/san_$tool.txt | tail -1)"
    grep -E "FAILED|PASSED|tests ran" $O/san_$tool.txt | head -4
  done
else
  echo "no compute-sanitizer on this machine"
fi
for kv in fp8_e4m3 fp8_e5m2; do
  $B/attnrt info --model llama3-8b --attention-backend cuda --kv-cache-dtype $kv --explain 2>&1 |
    grep -E "^ +extend|error" | head -2
done
ATTNRT_PREFILL_KV8=0 $B/attnrt info --model llama3-8b --attention-backend cuda \
  --kv-cache-dtype fp8_e4m3 --explain 2>&1 | grep -E "^ +extend|error" | head -2
for kv in fp8_e4m3 fp8_e5m2; do
  s=$(date +%s)
  timeout 30 $B/attnrt run --model llama3-8b --layers 2 --attention-backend cuda \
    --kv-cache-dtype $kv --page-size 16 --no-progress > $O/run_$kv.txt 2>&1
  echo "run ($kv) rc=$? $(( $(date +%s)-s )) s"; tail -8 $O/run_$kv.txt
done
s=$(date +%s)
timeout 30 $B/attnrt run --model gemma3-12b --layers 2 --attention-backend cuda \
  --kv-cache-dtype fp8_e4m3 --page-size 16 --no-progress > $O/run_gemma3.txt 2>&1
echo "run (gemma3-12b, fp8_e4m3) rc=$? $(( $(date +%s)-s )) s"; tail -8 $O/run_gemma3.txt
W=prefill-1x16384-kvfp8,extend-8x2048+512-kvfp8,prefill-1x16384,extend-8x2048+512
W=$W,prefill-1x8192-d64-kvfp8,prefill-1x8192-d256-kvfp8,prefill-1x8192-d64,prefill-1x8192-d256
for kv8 in 1 0; do
  s=$(date +%s)
  ATTNRT_PREFILL_KV8=$kv8 timeout 55 $B/attnrt bench --backend cuda --workload "$W" \
    --no-reference --repeats 10 --warmup 2 --json $O/bench_kv8_$kv8.json \
    > $O/bench_kv8_$kv8.txt 2>&1
  echo "bench (ATTNRT_PREFILL_KV8=$kv8) rc=$? $(( $(date +%s)-s )) s"
  grep -E "^(prefill|extend)|check|notes" $O/bench_kv8_$kv8.txt | head -10
done
# Head dim 128 on 128-key tiles in 2 stages against the default 64-key tiles in 4 (above).
s=$(date +%s)
ATTNRT_PREFILL_KV8_WIDE=1 timeout 40 $B/attnrt bench --backend cuda \
  --workload prefill-1x16384-kvfp8,extend-8x2048+512-kvfp8 --no-reference --repeats 10 --warmup 2 \
  --json $O/bench_kv8_wide.json > $O/bench_kv8_wide.txt 2>&1
echo "bench (ATTNRT_PREFILL_KV8_WIDE=1) rc=$? $(( $(date +%s)-s )) s"
grep -E "^(prefill|extend)|check|notes" $O/bench_kv8_wide.txt | head -4
