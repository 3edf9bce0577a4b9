#!/usr/bin/env bash
# The call that measures patches/prefill-desc-uniform.patch (.gpubin-pdu) against the landed tree
# (.gpubin-final, the kernels of 05d9239): the prefill CTAs' tile addresses through a warp shuffle,
# so that ptxas builds the MMA descriptors in uniform registers instead of moving them there before
# every MMA (R2UR was 9.9% of the d128 CTA's executed instructions).
#  1. the patched binary's prefill / MLA MHA / fp8 prefill tests (bounded), then synccheck of the
#     ping-pong TMA prefill test;
#  2. scripts/gpu_ab.sh, two rounds: the 16-bit prefill and extend rows, d64 / d256, kvfp8 and the
#     fp8 prefill rows (TFLOP/s).
#   usage: OUT=$OUT scripts/gpu_prefill_uniform.sh  (carry .gpubin-final, .gpubin-pdu, .devdeps;
#          about 8 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 500 pdu
gpu_stage sync_pdu 60 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 --print-limit 3 \
  /tmp/ab-bin/pdu/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaPrefillWsTmaTest.*'
rows=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256
rows=$rows,extend-8x2048+512,prefill-1x16384-kvfp8,prefill-1x16384-fp8,prefill-8x2048-fp8
AB_TESTS='CudaPrefill*:CudaFp8Prefill*:CudaKv8Prefill*:*MlaMha*' AB_TEST_SECONDS=150 ROUNDS=2 \
  AB_DEADLINE=$((GPU_END - $(date +%s) - 10)) OUT=$O/ab scripts/gpu_ab.sh "$rows" .gpubin-final \
  .gpubin-pdu
