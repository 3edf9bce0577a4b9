#!/usr/bin/env bash
# The call that measures patches/mla-copy-imm.patch (.gpubin-imm) against main (.gpubin-head2):
# every MLA CTA's tile copies from one source address a row, the column blocks at immediate
# offsets (a row past the keys copies nothing from its in-pool address), instead of a select and
# a 64-bit add a block (paired-tile CTA 9,184 -> 8,448 SASS instructions, keys-on-M 3,912 ->
# 3,504 and 204 -> 168 registers, the 64-row CTA 3,552 -> 3,344).
#  1. the patched binary's MLA and DSA tests (the fp8 paths copy through the same code), then
#     racecheck of the native page sizes test;
#  2. one bench process a binary, alternating twice, over the MLA rows of every CTA: h128 bf16
#     (paired-tile), h16 bf16 and fp8 (keys-on-M), h128 fp8 (the 64-row CTA), page 1 for both
#     head counts.
#   usage: OUT=$OUT scripts/gpu_copy_imm.sh  (carry .gpubin-head2, .gpubin-imm, .devdeps; about
#          5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 320 head2 imm
B=/tmp/ab-bin/imm
gpu_stage tests_imm 120 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMla*:CudaDsa*'
gpu_stage race_imm 60 compute-sanitizer --tool racecheck --print-limit 3 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter='CudaMlaCta.NativePageSizesWithRaggedLengths'
echo "== rows"
for r in 1 2; do
  for v in head2 imm; do
    [ $(date +%s) -gt $((GPU_END - 30)) ] && { echo "out of time"; break 2; }
    timeout 40 /tmp/ab-bin/$v/attnrt bench --backend cuda --suite mla --no-reference --quiet \
      --workload mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-verify-chain-64x4096+4,mla-decode-h128-64x4096-p1,mla-decode-h16-64x8192,mla-decode-h16-64x8192-p1,mla-decode-h16-64x8192-fp8,mla-decode-h128-64x4096-fp8 \
      2>&1 | bench_rates "$v r$r"
  done
done
