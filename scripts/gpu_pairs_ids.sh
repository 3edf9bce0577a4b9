#!/usr/bin/env bash
# The call that measures the paired-tile MLA CTA with its page ids by cp.async through shared
# memory below 64 slots a page (patches/mla-pairs-ids.patch; .gpubin-ids2) against main
# (.gpubin-head):
#  1. the patched binary's paired-tile tests, then compute-sanitizer racecheck and synccheck of
#     the test that runs both 64-row CTAs in every mode at pages 1 and 64;
#  2. both binaries, alternating twice, one bench process each on the h128 rows at their own
#     pages (64, and 1 for -p1), then at --page-size 16 and 32 (TFLOP/s).
#   usage: OUT=$OUT scripts/gpu_pairs_ids.sh  (carry .gpubin-head, .gpubin-ids2, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 260 head ids2
B=/tmp/ab-bin/ids2
F='CudaMlaCta.PairedTileCtaAndTheSplitCtaInEveryMode'
gpu_stage tests_ids 60 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMlaCta.*'
gpu_stage race_ids 50 compute-sanitizer --tool racecheck --print-limit 3 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter=$F
gpu_stage sync_ids 50 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 --print-limit 3 \
  $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$F
echo "== rows (TFLOP/s)"
for r in 1 2; do
  for v in head ids2; do
    [ $(date +%s) -gt $((GPU_END - 15)) ] && { echo "out of time"; break 2; }
    bin=/tmp/ab-bin/$v/attnrt
    timeout 25 $bin bench --backend cuda --suite mla --no-reference --quiet \
      --workload mla-decode-h128-64x4096,mla-decode-h128-64x4096-p1,mla-verify-chain-64x4096+4 2>&1 | bench_rates "$v r$r"
    for pg in 16 32; do
      timeout 20 $bin bench --backend cuda --suite mla --no-reference --quiet --page-size $pg \
        --workload mla-decode-h128-64x4096 2>&1 | bench_rates "$v r$r page$pg"
    done
  done
done
