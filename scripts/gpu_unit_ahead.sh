#!/usr/bin/env bash
# patches/prefill-unit-ahead.patch in ONE GPU call of under 600 s: the 16-bit warp-specialised
# prefill CTA whose producer publishes the next unit while the consumers finish the current one
# and loads the next unit's first K / V tile before its Q. Stages, each bounded:
#   1. the prefill suites under the patched binary (.gpubin-unitahead): the four 16-bit CTA
#      schedules, the CTA over fp8 pages, MLA's MHA form, the SWA cache;
#   2. compute-sanitizer racecheck and synccheck (the new named barrier) over the persistent case
#      (MoreWorkItemsThanSms: ~900 units, several per CTA) of the ping-pong and TMA schedules;
#   3. the prefill / extend rows, main (.gpubin-main) against the patch in two alternating rounds
#      (scripts/gpu_ab.sh, bench/ab.py's table);
#   4. with what time is left, the patched binary's prefill-8x2048 and extend rows with the work
#      list in 24 MiB sections of requests (ATTNRT_PREFILL_SECTION_MB) and without, twice.
# What should move: prefill-8x2048 and extend-8x2048+512 most (units of ~8 tiles, where a unit's
# start and Q load sat on the consumers' path), 1x4096 less, 1x16384 about nothing.
#   usage: OUT=DIR [CALL_SECONDS=570] scripts/gpu_unit_ahead.sh
#          (carry .gpubin-main, .gpubin-unitahead, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_logs_setup
GPU_END=$(($(date +%s) + ${CALL_SECONDS:-570}))
P=/tmp/bin-unitahead
gpubin_unpack .gpubin-unitahead $P || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
gpu_stage tests 170 $P/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*CudaPrefill*:*Kv8Prefill*:*CudaMlaMha*:*CudaSwa*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in racecheck synccheck; do
  gpu_stage $tool 60 "$CS" --tool $tool --error-exitcode 9 $P/attnrt_cuda_tests --gtest_brief=1 \
    --gtest_filter='CudaPrefillWsPingPongTest.MoreWorkItemsThanSms:CudaPrefillWsTmaTest.MoreWorkItemsThanSms'
done
left=$((GPU_END - $(date +%s)))
if [ $left -gt 90 ]; then
  OUT=$OUTDIR/ab AB_SUITE=all AB_DEADLINE=$((left - 10)) ROUNDS=2 AB_RUN_SECONDS=70 scripts/gpu_ab.sh \
    prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512,mla-prefill-1x16384 \
    .gpubin-main .gpubin-unitahead
else
  echo "ab: not run ($left s left)"
fi
# The prefill work list in L2-sized sections of requests (ATTNRT_PREFILL_SECTION_MB, main's planner
# switch) against the default order, on the rows whose units spread over many requests.
for run in 0_r1 24_r1 0_r2 24_r2; do
  gpu_stage sections_$run 30 env ATTNRT_PREFILL_SECTION_MB=${run%_r*} $P/attnrt bench \
    --backend cuda --workload prefill-8x2048,extend-8x2048+512 --no-reference --repeats 10 \
    --warmup 2 --quiet
  grep -E "^(prefill|extend)-8x2048" "$O/sections_$run.log" | head -2
done
