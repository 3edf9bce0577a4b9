#!/usr/bin/env bash
# The call that measures patches/mla-pairs-mc.patch (.gpubin-mc) against main (.gpubin-head2):
# the paired-tile MLA CTA at 128 heads in clusters of two CTAs (a token's two 64-row items), each
# copying half of every whole tile by TMA and multicasting it to both, so the L2 sends a latent
# tile to the two SMs once (pages of 32 slots or more; ATTNRT_MLA_MC=0 keeps one CTA an item).
#  1. the patched binary's MLA CTA tests (128 heads at pages 32 .. 128 take the clusters: every
#     mode, random lengths, partial tiles by cp.async), each bounded (a cluster hang costs one
#     slot), then synccheck and racecheck of the paired-tile test;
#  2. one bench process a binary and setting, alternating twice: head2, mc, mc with
#     ATTNRT_MLA_MC=0 (the one-CTA-an-item instance of the same binary) over the h128 rows at
#     page 64, at --page-size 32, and at page 1 (no clusters: unchanged) (TFLOP/s).
#   usage: OUT=$OUT scripts/gpu_mc.sh  (carry .gpubin-head2, .gpubin-mc, .devdeps; about 5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 330 head2 mc
B=/tmp/ab-bin/mc
F='CudaMlaCta.PairedTileCtaAndTheSplitCtaInEveryMode'
gpu_stage tests_mc 100 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMlaCta.*'
gpu_stage sync_mc 50 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 --print-limit 3 \
  $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$F
gpu_stage race_mc 50 compute-sanitizer --tool racecheck --print-limit 3 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter=$F
echo "== rows"
rows=mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-verify-chain-64x4096+4,mla-verify-tree-64x4096+16-topk4,mla-decode-h128-64x4096-p1
for r in 1 2; do
  for v in head2 mc mc0; do
    [ $(date +%s) -gt $((GPU_END - 25)) ] && { echo "out of time"; break 2; }
    bin=/tmp/ab-bin/${v%0}/attnrt
    mc=1; [ $v = mc0 ] && mc=0
    ATTNRT_MLA_MC=$mc timeout 40 $bin bench --backend cuda --suite mla --no-reference --quiet \
      --workload $rows 2>&1 | bench_rates "$v r$r"
    ATTNRT_MLA_MC=$mc timeout 25 $bin bench --backend cuda --suite mla --no-reference --quiet \
      --page-size 32 --workload mla-decode-h128-64x4096 2>&1 | bench_rates "$v r$r page32"
  done
done
