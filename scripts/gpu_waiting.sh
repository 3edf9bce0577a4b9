#!/usr/bin/env bash
# The call that measures the waiting patch (patches/README.md) on one warm GPU, ~4 minutes.
# Binaries (DIR/bin.tar.xz from scripts/gpu_prebuild.sh), carried with .devdeps:
#   .gpubin-main  main (c0bfbc4's kernels)
#   .gpubin-mlaf  main + patches/mla-two-in-flight.patch
# Stages: the MLA / split tests of the patched binary and an A/B of the h16 MLA rows (two
# rounds); synccheck / racecheck of the keys-on-M MLA tests with the patch; synccheck of the
# prefill RowMaxima tests with main's binary (a deleted variant reported errors there).
#   usage: OUT=$OUT scripts/gpu_waiting.sh   (run: carry .gpubin-main, .gpubin-mlaf, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/out/waiting}
mkdir -p "$out"
source .devdeps/unpack-debs.sh >/dev/null
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== A/B"
AB_TESTS='CudaMla*:*Mla*:*Split*' AB_TEST_SECONDS=80 AB_SUITE=mla ROUNDS=2 OUT=$out/mla AB_DEADLINE=150 \
  scripts/gpu_ab.sh mla-decode-h16-64x8192-p1,mla-decode-h16-64x8192,mla-decode-h16-1x32768,mla-decode-h16-64x8192-fp8,mla-decode-h16-1x32768-fp8,mla-verify-chain-64x4096+4 \
  .gpubin-main .gpubin-mlaf 2>&1 | grep -v ^copy | tail -12
for t in synccheck racecheck; do
  echo "== $t mlaf"
  timeout 40 compute-sanitizer --tool $t --error-exitcode 9 /tmp/ab-bin/mlaf/attnrt_cuda_tests --gtest_brief=1 \
    --gtest_filter='CudaMlaCta.NativePageSizesWithRaggedLengths:CudaMlaCta.KeysOnMItemsOfSeveralTokens' 2>&1 | tail -2
done
echo "== synccheck main prefill RowMaxima"
timeout 60 compute-sanitizer --tool synccheck --error-exitcode 9 /tmp/ab-bin/main/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaPrefillWsTmaTest.RowMaxima*:CudaPrefillWsPingPongTest.RowMaxima*' 2>&1 | tail -2
cd "$out" && tar czf mla.tgz mla && rm -rf mla
