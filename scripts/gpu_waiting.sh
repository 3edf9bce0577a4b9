#!/usr/bin/env bash
# The call that measures the waiting patches (patches/README.md) and tests what would land, on one
# warm GPU, within CALL_SECONDS (default 590). As run on 2026-12-06 (its patches have since been
# landed or deleted: patches/README.md; the form serves the next waiting call). Binaries (each
# DIR/bin.tar.xz from scripts/gpu_prebuild.sh):
#   .gpubin-main  main
#   .gpubin-both  main + mla-s-chains + prefill-mask-per-unit
#   .gpubin-spec  main + prefill-spec-softmax (conflicts with the mask patch)
#   .gpubin-qtma  main + prefill-q-tma
#   .gpubin-all   main + mla-s-chains + prefill-mask-per-unit + prefill-q-tma + prefill-store-pairs
# (the carried tree holds at most 64 MiB: five binaries; store-pairs' own effect is all's over
# both's and qtma's). Stages:
#   1. all's tests of what the patches touch, and spec's prefill tests (RowMaximaJumping drives
#      its three paths);
#   2. the MLA decode rows, main against all (only mla-s-chains touches them), two rounds;
#   3. torch's flash and cuDNN on the prefill rows (bench/torch_sdpa.py), then the prefill rows
#      with all five binaries, two rounds alternating, and main's and all's ratios to torch.
#   build: export PATH=/usr/local/cuda/bin:$PATH ATTNRT_GPU_BUILD=$PWD/build ATTNRT_PY312=/nonexistent
#          scripts/gpu_prebuild.sh .gpubin-main
#          git apply patches/mla-s-chains.patch patches/prefill-mask-per-unit.patch
#          scripts/gpu_prebuild.sh .gpubin-both; git checkout -- backends
#          git apply patches/prefill-spec-softmax.patch; scripts/gpu_prebuild.sh .gpubin-spec
#          git checkout -- backends
#          git apply patches/prefill-q-tma.patch; scripts/gpu_prebuild.sh .gpubin-qtma
#          git checkout -- backends tests
#          git apply patches/mla-s-chains.patch patches/prefill-mask-per-unit.patch \
#            patches/prefill-q-tma.patch patches/prefill-store-pairs.patch
#          scripts/gpu_prebuild.sh .gpubin-all; git checkout -- backends tests
#   usage: OUT=DIR [CALL_SECONDS=590] scripts/gpu_waiting.sh
#          (carry .gpubin-main, .gpubin-both, .gpubin-spec, .gpubin-qtma, .gpubin-all, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 590
gpubin_unpack .gpubin-all /tmp/all || exit 1
gpubin_unpack .gpubin-spec /tmp/spec || exit 1
/tmp/all/attnrt info 2>&1 | head -3
# The tests of what the patches touch: every prefill CTA and its host checks, MLA (decode, MHA form,
# splits), SWA, the kv8 prefill (the 16-bit CTA over fp8 pages), the backend, graphs.
tests='*Prefill*:*Mla*:*Swa*:*Kv8*:CudaBackendTest.*:*Split*:*Graph*'
gpu_stage tests_all 150 /tmp/all/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="$tests"
gpu_stage spec_tests 50 /tmp/spec/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*CudaPrefillWsPingPong*:*CudaPrefillWsTma*:*Kv8Prefill*'
rows=mla-decode-h16-1x32768-fp8,mla-decode-h16-64x8192-fp8,mla-decode-h128-64x4096-fp8
rows=$rows,mla-decode-h16-64x8192
OUT=$O/ab AB_SUITE=mla AB_DEADLINE=$((GPU_END - $(date +%s) - 260)) AB_RUN_SECONDS=40 \
  bash scripts/gpu_ab.sh "$rows" .gpubin-main .gpubin-all 2>&1 | grep -v "^copy" | tail -8
# cuDNN and flash on the prefill rows, in the same call.
prow=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512
gpu_stage torch_sdpa 60 python3 bench/torch_sdpa.py --device cuda --kernels flash,cudnn \
  --workload "$prow" --json $O/torch_prefill.json
grep -E "^(prefill|extend)" $O/torch_sdpa.log | head -14
OUT=$O/abp AB_DEADLINE=$((GPU_END - $(date +%s) - 3)) AB_RUN_SECONDS=40 \
  bash scripts/gpu_ab.sh "$prow" .gpubin-main .gpubin-both .gpubin-spec .gpubin-qtma .gpubin-all \
  2>&1 | grep -v "^copy" | tail -12
for b in main all; do
  [ -f $O/abp/${b}_r1.json ] && python3 bench/compare.py $O/abp/${b}_r1.json $O/torch_prefill.json | tail -9
done
