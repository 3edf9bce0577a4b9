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
B=/tmp/ab-bin/final
F='CudaMlaCta.NativePageSizesWithRaggedLengths'
gpu_stage tests_final 130 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMla*'
gpu_stage race_final 60 compute-sanitizer --tool racecheck --print-limit 3 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter=$F
gpu_stage sync_final 25 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 --print-limit 3 \
  $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$F
gpu_stage tests_slot32 70 /tmp/ab-bin/slot32/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaMlaCta.PairedTile*:CudaMlaCta.NativePage*:CudaMlaCta.Keys*'
echo "== rows"
rows=mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h128-64x4096,mla-decode-h128-128x8192
rows=$rows,mla-decode-h16-1x32768-fp8,mla-decode-h16-64x8192-fp8,mla-decode-h128-64x4096-fp8
rows=$rows,mla-decode-h128-128x8192-fp8,mla-decode-h16-1x32768-p1,mla-decode-h16-64x8192-p1
rows=$rows,mla-decode-h128-64x4096-p1,mla-decode-h128-128x8192-p1,mla-verify-chain-64x4096+4
rows=$rows,mla-verify-tree-64x4096+16-topk4
for r in 1 2; do
  for v in head2 final slot32; do
    [ $(date +%s) -gt $((GPU_END - 30)) ] && { echo "out of time"; break 2; }
    bin=/tmp/ab-bin/$v/attnrt
    timeout 60 $bin bench --backend cuda --suite mla --no-reference --quiet --workload $rows \
      >"$O/bench_${v}_r$r.log" 2>&1
    bench_rates "$v r$r" <"$O/bench_${v}_r$r.log"
    awk -v t="$v r$r ceiling" '$1 ~ /^(memory|bf16)$/ {print t, $0}' "$O/bench_${v}_r$r.log"
    timeout 20 $bin bench --backend cuda --suite mla --no-reference --quiet --page-size 1 \
      --workload mla-decode-h128-64x4096-fp8 2>&1 | bench_rates "$v r$r page1"
    # The paired-tile CTA over fp8 at every page size (its default is page 1 only).
    [ $v = final ] && ATTNRT_MLA_FP8_PAIRS_MAX_PAGE=128 timeout 25 $bin bench --backend cuda \
      --suite mla --no-reference --quiet \
      --workload mla-decode-h128-64x4096-fp8,mla-decode-h128-128x8192-fp8 2>&1 |
      bench_rates "$v r$r fp8pairs"
  done
done
