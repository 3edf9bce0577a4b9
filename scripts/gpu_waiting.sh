#!/usr/bin/env bash
# The call that measures the waiting patches (patches/README.md), on one warm GPU: .gpubin-main
# against .gpubin-both (main + patches/mla-s-chains.patch + patches/prefill-mask-per-unit.patch:
# the two touch different files, so one binary carries both), .gpubin-spec (main +
# patches/prefill-spec-softmax.patch, which conflicts with the mask patch), .gpubin-qtma (main +
# patches/prefill-q-tma.patch) and .gpubin-pairs (main + patches/prefill-store-pairs.patch). Each binary's tests of what it changes first (the whole suites run
# on the tree that lands, in the next call), then the timings, two rounds alternating.
#   build: export PATH=/usr/local/cuda/bin:$PATH ATTNRT_GPU_BUILD=$PWD/build ATTNRT_PY312=/nonexistent
#          scripts/gpu_prebuild.sh .gpubin-main
#          git apply patches/mla-s-chains.patch patches/prefill-mask-per-unit.patch
#          scripts/gpu_prebuild.sh .gpubin-both; git checkout -- backends
#          git apply patches/prefill-spec-softmax.patch; scripts/gpu_prebuild.sh .gpubin-spec
#          git checkout -- backends
#          git apply patches/prefill-q-tma.patch; scripts/gpu_prebuild.sh .gpubin-qtma
#          git checkout -- backends tests
#          git apply patches/prefill-store-pairs.patch; scripts/gpu_prebuild.sh .gpubin-pairs
#          git checkout -- backends
#   usage: OUT=DIR [CALL_SECONDS=590] scripts/gpu_waiting.sh
#          (carry .gpubin-main, .gpubin-both, .gpubin-spec, .gpubin-qtma, .gpubin-pairs,
#          .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 590
rows=mla-decode-h16-1x32768-fp8,mla-decode-h16-64x8192-fp8,mla-decode-h128-64x4096-fp8
rows=$rows,mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h16-64x8192-p1
OUT=$O/ab AB_SUITE=mla AB_DEADLINE=$((GPU_END - $(date +%s) - 430)) AB_RUN_SECONDS=40 AB_TEST_SECONDS=60 \
  AB_TESTS='CudaMla*:CudaBackendTest.*Split*' \
  bash scripts/gpu_ab.sh "$rows" .gpubin-main .gpubin-both 2>&1 | grep -v "^copy" | tail -10
# The prefill tests of what the four prefill patches change: the ping-pong CTA (the mask, the
# speculative softmax, whose three paths RowMaximaJumping drives, and the paired stores), the TMA
# producer (Q by TMA) and its host checks, MLA's MHA form (head dim 192: the paired stores).
prow=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512
OUT=$O/abp AB_DEADLINE=$((GPU_END - $(date +%s) - 5)) AB_RUN_SECONDS=40 AB_TEST_SECONDS=50 \
  AB_TESTS='*CudaPrefillWsPingPong*:*CudaPrefillWsTma*:CudaPrefillTma*:*CudaMlaMha*' \
  bash scripts/gpu_ab.sh "$prow" .gpubin-main .gpubin-both .gpubin-spec .gpubin-qtma .gpubin-pairs \
  2>&1 | grep -v "^copy" | tail -12
