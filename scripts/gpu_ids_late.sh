#!/usr/bin/env bash
# The call that measures the MLA copiers' page ids left unconsumed until the copies (.gpubin-ids,
# patches/mla-ids-late.patch) against the landed tree (.gpubin-pl2 = b1a9b29's kernels):
#  1. ids' MLA tests of every CTA at every page size and mode (bf16, e4m3);
#  2. one bench process a binary, alternating twice, over the rows the copiers' page ids reach.
#   usage: OUT=$OUT scripts/gpu_ids_late.sh  (carry .gpubin-pl2, .gpubin-ids, .devdeps; ~3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels "${CALL_SECONDS:-200}" pl2 ids
gpu_stage tests_ids 70 /tmp/ab-bin/ids/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaMlaCta.NativePageSizesWithRaggedLengths:CudaMlaCta.EveryMode*'
tail -n 3 "$O/tests_ids.log"
MLA_AB_ROWS=mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-decode-h16-64x8192
MLA_AB_ROWS=$MLA_AB_ROWS,mla-decode-h16-1x32768,mla-decode-h128-64x4096-p1
MLA_AB_ROWS=$MLA_AB_ROWS,mla-decode-h128-64x4096-fp8,mla-verify-chain-64x4096+4
mla_ab_rounds 20 pl2 ids
ab_table pl2
