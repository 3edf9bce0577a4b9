#!/usr/bin/env bash
# The final GPU call of the trims (under 300 s): the GPU tests of the tree that lands, whose
# prefill_ws instances equal, instruction for instruction, either main's (head dim 64) or the
# measured trim build's (head dims >= 128; cuobjdump -sass per instance).
#   usage: OUT=DIR [CALL_SECONDS=250] scripts/gpu_next.sh   (carry .gpubin-final, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 250
gpubin_unpack .gpubin-final /tmp/bin-final || exit 1
T=/tmp/bin-final/attnrt_cuda_tests
gpu_stage final_prefill 130 $T --gtest_brief=1 \
  --gtest_filter='*CudaPrefill*:*Kv8Prefill*:*CudaMla*:*CudaSwa*:*Fp8Prefill*:*PrefillFp8*'
gpu_stage final_decode 100 $T --gtest_brief=1 \
  --gtest_filter='CudaBackendTest.*:Ranks/*:Pages/*:*Split*:*Determin*:CudaGeneric.*:CudaGraph*:CudaRun.*'
