#!/usr/bin/env bash
# The call that measures the paired-tile MLA CTA over an fp8 latent (.gpubin-fp8: raw chunks in
# place in the bf16 stages, converted by the warpgroup that scores the tile) against main
# (.gpubin-head2, whose fp8 rows run mla_decode.cu's CTA):
#  1. the fp8 binary's MLA CTA tests (both CTAs over bf16, e4m3 and e5m2 at 64 / 128 heads, page
#     sizes 1 .. 128 at 128 heads in e4m3), then racecheck and synccheck of the page-size test;
#  2. one bench process a binary, alternating twice: the h128 rows in fp8 and bf16 at page 64 and
#     the fp8 row at page 1 (TFLOP/s; the fp8 / bf16 ratio is issue 18's >= 1.0x).
#   usage: OUT=$OUT scripts/gpu_fp8_pairs.sh  (carry .gpubin-head2, .gpubin-fp8, .devdeps; ~5 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 330 head2 fp8
B=/tmp/ab-bin/fp8
F='CudaMlaCta.NativePageSizesWithRaggedLengths'
gpu_stage tests_fp8 150 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMlaCta.*'
gpu_stage race_fp8 60 compute-sanitizer --tool racecheck --print-limit 3 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter=$F
gpu_stage sync_fp8 40 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 --print-limit 3 \
  $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$F
echo "== rows"
rows=mla-decode-h128-64x4096-fp8,mla-decode-h128-128x8192-fp8,mla-decode-h128-64x4096,mla-decode-h128-128x8192
for r in 1 2; do
  for v in head2 fp8; do
    [ $(date +%s) -gt $((GPU_END - 25)) ] && { echo "out of time"; break 2; }
    bin=/tmp/ab-bin/$v/attnrt
    timeout 40 $bin bench --backend cuda --suite mla --no-reference --quiet --workload $rows 2>&1 |
      bench_rates "$v r$r"
    timeout 25 $bin bench --backend cuda --suite mla --no-reference --quiet --page-size 1 \
      --workload mla-decode-h128-64x4096-fp8 2>&1 | bench_rates "$v r$r page1"
  done
done
