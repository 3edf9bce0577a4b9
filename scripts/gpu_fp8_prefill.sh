#!/usr/bin/env bash
# The fp8 prefill CTAs (kernels/prefill_fp8.cuh, one warpgroup; kernels/prefill_fp8_ws.cuh,
# warp-specialised with ATTNRT_PREFILL_FP8_WS=1; --fp8-prefill-attention) on the GPU machine, in
# one call of under 550 s: the prefill GPU tests (both fp8 CTAs and the 16-bit CTAs),
# compute-sanitizer memcheck and racecheck on the small fp8 prefill tests of both CTAs,
# `info --explain` and an `attnrt run` of two llama3-8b layers with the option on each CTA
# (checked against reference), then `attnrt bench --backend cuda` over the bf16 prefill / extend
# rows and their -fp8 variants (the one-warpgroup CTA), and a second pass of the -fp8 rows with
# ATTNRT_PREFILL_FP8_WS=1, so bf16, fp8 one-warpgroup and fp8 warp-specialised rates come from one
# call.
#   usage: OUT=DIR scripts/gpu_fp8_prefill.sh   (carry .gpubin from scripts/gpu_prebuild.sh and .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs under $OUT/logs, packed into $OUT/logs.tar.gz at exit; binaries in B=/tmp/bin.
source scripts/gpubin.sh
gpu_call_setup
s=$(date +%s)
timeout 170 $B/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter="${TESTS:-*Fp8Prefill*:*CudaPrefill*}" > $O/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-s )) s"; grep -E "FAILED|PASSED|SKIPPED|Failure|tests ran|error" $O/tests.log | head -30
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$CS" ]; then
  for tool in memcheck racecheck; do
    s=$(date +%s)
    timeout 50 "$CS" --tool $tool --error-exitcode 9 $B/attnrt_cuda_tests --gtest_brief=1 \
      --gtest_filter='*CudaFp8PrefillTest.SmallStepForTheSanitizers/*:*CudaFp8PrefillTest.RingWrapForTheSanitizers/WarpSpecialised' \
      > $O/san_$tool.txt 2>&1
    echo "compute-sanitizer $tool rc=$? $(( $(date +%s)-s )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $O/san_$tool.txt | tail -1)"
  done
else
  echo "no compute-sanitizer on this machine"
fi
F=(--attention-backend cuda --kv-cache-dtype fp8_e4m3 --fp8-prefill-attention)
$B/attnrt info --model llama3-8b "${F[@]}" --explain 2>&1 | grep -E "^ +extend|error" | head -3
ATTNRT_PREFILL_FP8_WS=1 $B/attnrt info --model llama3-8b "${F[@]}" --explain 2>&1 |
  grep -E "^ +extend|error" | head -3
for ws in 0 1; do
  s=$(date +%s)
  ATTNRT_PREFILL_FP8_WS=$ws timeout 35 $B/attnrt run --model llama3-8b --layers 2 "${F[@]}" \
    --page-size 16 --no-progress > $O/run_ws$ws.txt 2>&1
  echo "run (ATTNRT_PREFILL_FP8_WS=$ws) rc=$? $(( $(date +%s)-s )) s"; tail -8 $O/run_ws$ws.txt
done
s=$(date +%s)
timeout 150 $B/attnrt bench --backend cuda \
  --workload prefill-1x4096,prefill-1x16384,prefill-8x2048,extend-8x2048+512,fp8-prefill \
  --no-reference --repeats 10 --warmup 2 --json $O/fp8_prefill.json > $O/fp8_prefill.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-s )) s"; grep -E "^(prefill|extend)|check|notes" $O/fp8_prefill.txt | head -20
s=$(date +%s)
ATTNRT_PREFILL_FP8_WS=1 timeout 90 $B/attnrt bench --backend cuda --workload fp8-prefill \
  --no-reference --repeats 10 --warmup 2 --json $O/fp8_prefill_ws.json > $O/fp8_prefill_ws.txt 2>&1
echo "bench (ATTNRT_PREFILL_FP8_WS=1) rc=$? $(( $(date +%s)-s )) s"
grep -E "^(prefill|extend)|check|notes" $O/fp8_prefill_ws.txt | head -10
