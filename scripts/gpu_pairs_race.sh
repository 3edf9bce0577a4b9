#!/usr/bin/env bash
# The call that measures patches/mla-pairs-arrive-all.patch (every thread of the paired-tile MLA
# CTA arrives on the row hand-over mbarriers): its MLA CTA tests and compute-sanitizer racecheck of
# its every-mode test, the h128 rows against the landed binary (two rounds), and the 128-request
# row with the CTA on and off (ATTNRT_MLA_PAIRS=1 / 0, one binary). About 3 minutes.
#   usage: OUT=$OUT scripts/gpu_pairs_race.sh
#   (run: carry .gpubin-pairs-all = landed + patch, .gpubin-landed = the landed tree, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source .devdeps/unpack-debs.sh >/dev/null
source scripts/gpubin.sh
B=/tmp/ab-bin/pairs-all
gpubin_unpack .gpubin-pairs-all $B >/dev/null || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 60 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMlaCta.*' 2>&1 | grep -E "^\[  (PASSED|FAILED)|Failure|threw" | head -5
timeout 40 compute-sanitizer --tool racecheck --print-limit 3 --error-exitcode 9 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter='CudaMlaCta.EveryModeAtEveryTensorParallelHeadCount' 2>&1 | grep -v "Host Frame" | tail -6
for v in 1 0 1; do
  echo "ATTNRT_MLA_PAIRS=$v"
  ATTNRT_MLA_PAIRS=$v timeout 30 $B/attnrt bench --backend cuda --suite mla --no-reference --quiet \
    --workload mla-decode-h128-64x4096,mla-decode-h128-128x8192 2>&1 | grep -E "^mla-" | cut -c1-110
done
ROUNDS=2 AB_SUITE=mla OUT=${OUT:-$PWD/out/pairs_race}/ab AB_DEADLINE=120 scripts/gpu_ab.sh \
  mla-decode-h128-64x4096,mla-verify-chain-64x4096+4,mla-decode-h128-64x4096-p1 .gpubin-landed .gpubin-pairs-all \
  2>&1 | grep -v ^copy | tail -4
