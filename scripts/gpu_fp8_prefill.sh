#!/usr/bin/env bash
# The fp8 prefill CTA (kernels/prefill_fp8.cuh, --fp8-prefill-attention) on the GPU machine, in one
# call of under 500 s: the prefill GPU tests (fp8 and 16-bit CTAs), compute-sanitizer memcheck and
# racecheck on one small fp8 prefill test, `info --explain` and an `attnrt run` of two llama3-8b
# layers with the option (checked against reference), then one `attnrt bench --backend cuda` over
# the bf16 prefill / extend rows and their -fp8 variants, so both rates come from the same run.
#   usage: OUT=DIR scripts/gpu_fp8_prefill.sh   (carry .gpubin from scripts/gpu_prebuild.sh and .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs under $OUT/logs, packed into $OUT/logs.tar.gz at exit; binaries in B=/tmp/bin.
source scripts/gpubin.sh
gpu_call_setup
s=$(date +%s)
timeout 150 $B/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter="${TESTS:-*Fp8Prefill*:*CudaPrefill*}" > $O/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-s )) s"; grep -E "FAILED|PASSED|SKIPPED|Failure|tests ran|error" $O/tests.log | head -30
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$CS" ]; then
  for tool in memcheck racecheck; do
    s=$(date +%s)
    timeout 45 "$CS" --tool $tool --error-exitcode 9 $B/attnrt_cuda_tests --gtest_brief=1 \
      --gtest_filter='CudaFp8PrefillTest.SmallStepForTheSanitizers' > $O/san_$tool.txt 2>&1
    echo "compute-sanitizer $tool rc=$? $(( $(date +%s)-s )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $O/san_$tool.txt | tail -1)"
  done
else
  echo "no compute-sanitizer on this machine"
fi
F=(--attention-backend cuda --kv-cache-dtype fp8_e4m3 --fp8-prefill-attention)
$B/attnrt info --model llama3-8b "${F[@]}" --explain 2>&1 | grep -E "^ +extend|error" | head -3
s=$(date +%s)
timeout 45 $B/attnrt run --model llama3-8b --layers 2 "${F[@]}" --page-size 16 --no-progress \
  > $O/run.txt 2>&1
echo "run rc=$? $(( $(date +%s)-s )) s"; tail -15 $O/run.txt
s=$(date +%s)
timeout 170 $B/attnrt bench --backend cuda \
  --workload prefill-1x4096,prefill-1x16384,prefill-8x2048,extend-8x2048+512,fp8-prefill \
  --no-reference --repeats 10 --warmup 2 --json $O/fp8_prefill.json > $O/fp8_prefill.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-s )) s"; grep -E "^(prefill|extend)|check|notes" $O/fp8_prefill.txt | head -20
