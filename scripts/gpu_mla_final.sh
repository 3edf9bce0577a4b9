#!/usr/bin/env bash
# The call that verifies the landed MLA changes together (.gpubin-final) against 5892626's kernels
# (.gpubin-head2): copies at immediate offsets, the keys-on-M CTA's page ids through shared
# memory, the two-CTA multicast clusters, and the paired-tile CTA over fp8 at page 1.
#  1. the MLA CTA tests, then racecheck and synccheck of the page-size test (clusters at pages
#     >= 32, the fp8 paired-tile CTA at page 1, both page-id forms of both 16-bit CTAs);
#  2. one bench process a binary, alternating twice: the decode and verify rows of --suite mla
#     (bf16, fp8, page 1), the h128 fp8 row at page 1, and the h128 fp8 rows at page 64 on the
#     paired-tile CTA (ATTNRT_MLA_FP8_PAIRS_MAX_PAGE=128).
#  3. patches/mla-copy-slot32.patch (.gpubin-slot32, against .gpubin-final): the MLA copiers' pool
#     rows in 32 bits (one wide multiply-add a row address): its MLA tests, and its rows beside
#     the other two binaries' in the same rounds.
#   usage: OUT=$OUT scripts/gpu_mla_final.sh  (carry .gpubin-head2, .gpubin-final, .gpubin-slot32,
#          .devdeps; ~9 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 570 head2 final slot32
mla_checked final 130 'CudaMla*'
gpu_stage tests_slot32 70 /tmp/ab-bin/slot32/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaMlaCta.PairedTile*:CudaMlaCta.NativePage*:CudaMlaCta.Keys*'
echo "== rows"
for r in 1 2; do
  for v in head2 final slot32; do
    [ $(date +%s) -gt $((GPU_END - 30)) ] && { echo "rows: out of time"; break 2; }
    mla_ab_round $v $r
    # The paired-tile CTA over fp8 at every page size (its default was page 1 only).
    [ $v = final ] && ATTNRT_MLA_FP8_PAIRS_MAX_PAGE=128 timeout 25 /tmp/ab-bin/$v/attnrt bench \
      --backend cuda --suite mla --no-reference --quiet \
      --workload mla-decode-h128-64x4096-fp8,mla-decode-h128-128x8192-fp8 2>&1 |
      bench_rates "$v r$r fp8pairs"
  done
done
