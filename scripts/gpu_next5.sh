#!/usr/bin/env bash
# One short GPU call (under 240 s): the descriptor half of patches/prefill-desc-tree.patch with Q's
# descriptor encoded per tile inside issue_s (.gpubin-desc3; the hoisted form kept it live across the
# loop and lost 2% at d64 in two calls): its prefill tests, then main against it on the rows it
# moved, two rounds.
#   usage: OUT=DIR [CALL_SECONDS=200] scripts/gpu_next5.sh   (carry .gpubin-main, .gpubin-desc3, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 200
gpubin_unpack .gpubin-desc3 /tmp/bin-desc3 || exit 1
gpu_stage desc3_tests 100 /tmp/bin-desc3/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*CudaPrefill*:*Kv8Prefill*:*CudaMlaMha*:*CudaSwa*:*Fp8Prefill*:*PrefillFp8*'
OUT=$OUTDIR/ab AB_DEADLINE=70 ROUNDS=2 AB_RUN_SECONDS=30 scripts/gpu_ab.sh \
  prefill-1x8192-d64,prefill-1x4096,extend-8x2048+512,prefill-1x8192-d256 .gpubin-main .gpubin-desc3 | tail -5
