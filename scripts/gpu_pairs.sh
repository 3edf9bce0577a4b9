#!/usr/bin/env bash
# The call that tests and measures the paired-tile MLA CTA (mla_pairs.cu) and the waiting
# keys-on-M patch (patches/README.md) on one warm GPU, under 10 minutes.
# Binaries (DIR/bin.tar.xz from scripts/gpu_prebuild.sh), carried with .devdeps:
#   .gpubin-main   the base (c0bfbc4's kernels)
#   .gpubin-mlaf   main + patches/mla-two-in-flight.patch
#   .gpubin-pairs  the paired-tile CTA (its binary also runs mla_decode.cu's CTA: ATTNRT_MLA_PAIRS=0)
# Stages: the MLA / split tests of both candidates, then an A/B of the MLA rows (two rounds);
# synccheck / racecheck of the pairs CTA's tests and of the patched keys-on-M CTA's; synccheck of
# the prefill RowMaxima tests with main's binary.
#   usage: OUT=$OUT scripts/gpu_pairs.sh   (run: carry .gpubin-main, .gpubin-mlaf, .gpubin-pairs,
#          .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/out/pairs}
mkdir -p "$out"
source .devdeps/unpack-debs.sh >/dev/null
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
rows=mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-decode-h128-64x4096-p1,mla-verify-chain-64x4096+4
rows+=,mla-decode-h16-64x8192-p1,mla-decode-h16-1x32768,mla-decode-h16-64x8192-fp8
echo "== tests and A/B"
AB_TESTS='CudaMla*:*Mla*:*Split*' AB_TEST_SECONDS=100 AB_SUITE=mla ROUNDS=2 OUT=$out/mla AB_DEADLINE=300 \
  scripts/gpu_ab.sh "$rows" .gpubin-main .gpubin-mlaf .gpubin-pairs 2>&1 | grep -v ^copy | tail -16
grep -E "FAILED|Failure|mismatch|max_abs|worst" "$out"/mla/tests_pairs.log | head -20
echo "== the old 64-row CTA in the pairs binary (ATTNRT_MLA_PAIRS=0), h128-64x4096"
ATTNRT_MLA_PAIRS=0 timeout 40 /tmp/ab-bin/pairs/attnrt bench --suite mla --backend cuda \
  --workload mla-decode-h128-64x4096 2>&1 | grep -E "mla-decode" | head -3
for t in synccheck racecheck; do
  echo "== $t pairs"
  timeout 45 compute-sanitizer --tool $t --error-exitcode 9 /tmp/ab-bin/pairs/attnrt_cuda_tests --gtest_brief=1 \
    --gtest_filter='CudaMlaCta.EveryModeAtEveryTensorParallelHeadCount' 2>&1 | tail -3
done
echo "== synccheck mlaf"
timeout 30 compute-sanitizer --tool synccheck --error-exitcode 9 /tmp/ab-bin/mlaf/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaMlaCta.KeysOnMItemsOfSeveralTokens' 2>&1 | tail -2
echo "== synccheck main prefill RowMaxima"
timeout 40 compute-sanitizer --tool synccheck --error-exitcode 9 /tmp/ab-bin/main/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaPrefillWsTmaTest.RowMaxima*:CudaPrefillWsPingPongTest.RowMaxima*' 2>&1 | tail -2
cd "$out" && tar czf mla.tgz mla && rm -rf mla
