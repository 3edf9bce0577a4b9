#!/usr/bin/env bash
# The waiting patches in ONE GPU call of under 600 s, for a session with device time for one call
# only (the stages' timeouts add up to 560 s; each stage is bounded, so a kernel that hangs costs
# its slot, not the call):
#   1. patches/kv8-d64-d256.patch (.gpubin = main + that patch): the kv8 GPU suite at head dims 64,
#      128, 256, memcheck / racecheck of its small cases, two gemma3-12b layers over fp8_e4m3
#      checked against reference, and the d64 / d256 / d128 -kvfp8 rows with the CTA on and off
#      (ATTNRT_PREFILL_KV8=0), beside the bf16 rows;
#   2. patches/linear-y16.patch (.gpubin-y16) and delta-pass-wgmma.patch on top of it
#      (.gpubin-pass): the linear GPU suites under each, the linear extend rows under the three
#      binaries (.gpubin's linear code is main's), and ncu's kernel times of gdn-extend-8x8192
#      under each.
# The full per-patch calls (scripts/gpu_kv8_prefill.sh, scripts/gpu_merge_race.sh linear) do more
# rounds and rows; this one gives each patch's pass / fail and first numbers.
#   usage: OUT=DIR [WAIT_SECONDS=575] scripts/gpu_waiting.sh   (carry .gpubin, .gpubin-y16,
#          .gpubin-pass, .devdeps); a stage that would end past WAIT_SECONDS is skipped and says so
#          (so with less device time left, pass less and the first stages still run whole)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_setup
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for l in y16 pass; do gpubin_unpack .gpubin-$l /tmp/bin-$l || exit 1; done
ln -sfn $B /tmp/bin-main  # .gpubin's linear code is main's
GPU_END=$(( $(date +%s) + ${WAIT_SECONDS:-575} ))
stage() { gpu_stage "$@"; }
# Stages in the order of what each result decides, so that a short WAIT_SECONDS still lands them:
# the suites (pass / fail of each patch), the rows (what each moves), then sanitizers, the gemma3
# run and ncu's split.
stage kv8_tests 150 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Kv8Prefill*'
for l in y16 pass; do
  stage linear_tests_$l 55 /tmp/bin-$l/attnrt_cuda_tests --gtest_brief=1 \
    --gtest_filter='*CudaLinear*:-*CudaLinearTiming*'
done
W=prefill-1x8192-d64-kvfp8,prefill-1x8192-d256-kvfp8,prefill-1x16384-kvfp8,prefill-1x8192-d64,prefill-1x8192-d256,prefill-1x16384
for kv8 in 1 0; do
  stage bench_kv8_$kv8 35 env ATTNRT_PREFILL_KV8=$kv8 $B/attnrt bench --backend cuda --workload "$W" \
    --no-reference --repeats 10 --warmup 2 --json $O/bench_kv8_$kv8.json
  grep -E "^prefill|gemm|copy" "$O/bench_kv8_$kv8.log" | head -9
done
L=gdn-extend-8x8192,kda-extend-8x8192,mamba2-extend-8x8192,gdn-extend-1x65536-h2v8,gdn-decode-64
for l in main y16 pass; do
  stage linear_bench_$l 30 /tmp/bin-$l/attnrt bench --backend cuda --suite linear --workload "$L" \
    --no-reference --repeats 5 --warmup 1 --json $O/linear_$l.json
  grep -E "^(gdn|kda|mamba2)" "$O/linear_bench_$l.log" | head -6
done
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
stage kv8_memcheck 30 "$CS" --tool memcheck --error-exitcode 9 $B/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*CudaKv8PrefillTest.SmallStepForTheSanitizers/*'
stage kv8_racecheck 30 "$CS" --tool racecheck --error-exitcode 9 $B/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*CudaKv8PrefillTest.SmallStepForTheSanitizers/*'
stage run_gemma3 20 $B/attnrt run --model gemma3-12b --layers 2 --attention-backend cuda \
  --kv-cache-dtype fp8_e4m3 --page-size 16 --no-progress
tail -4 "$O/run_gemma3.log"
for l in main y16 pass; do
  stage ncu_gdn_$l 20 ncu --clock-control none --metrics gpu__time_duration.sum -c 12 \
    /tmp/bin-$l/attnrt bench --backend cuda --suite linear --workload gdn-extend-8x8192 --no-reference \
    --repeats 1 --warmup 1 --quiet
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$O/ncu_gdn_$l.log" | head -16
done
