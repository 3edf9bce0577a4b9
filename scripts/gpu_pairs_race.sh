#!/usr/bin/env bash
# The call that measures the three waiting patches of patches/README.md:
#  - mla-pairs-arrive-all.patch (every thread of the paired-tile MLA CTA arrives on the row
#    hand-over mbarriers): its MLA CTA tests and compute-sanitizer racecheck of its every-mode test;
#  - plan-request-major.patch (the items of MLA's multi-tile requests request by request): its MLA
#    and plan tests;
#  - mla-pairs-tma.patch (the paired-tile CTA's whole tiles by TMA boxes at pages >= 16): its MLA
#    tests;
# then the h128 MLA rows of the landed binary and the patched ones (two rounds), the
# 128-request row with the paired-tile CTA on and off (ATTNRT_MLA_PAIRS=1 / 0, one binary), and
# Nsight Compute over the paired-tile CTA on mla-decode-h128-64x4096 (speed of light, warp states,
# memory: what holds it at 2.83 us a tile against 1.1 us of MMAs). About 7 minutes.
#   usage: OUT=$OUT scripts/gpu_pairs_race.sh   (run: carry .gpubin-landed = the landed tree,
#          .gpubin-pairs-all = landed + arrive-all, .gpubin-order = landed + request-major,
#          .gpubin-pairs-tma = landed + TMA, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source .devdeps/unpack-debs.sh >/dev/null
source scripts/gpubin.sh
B=/tmp/ab-bin/pairs-all
gpubin_unpack .gpubin-pairs-all $B >/dev/null || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 40 compute-sanitizer --tool racecheck --print-limit 3 --error-exitcode 9 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter='CudaMlaCta.EveryModeAtEveryTensorParallelHeadCount' 2>&1 | grep -v "Host Frame" | tail -6
for v in 1 0 1; do
  echo "ATTNRT_MLA_PAIRS=$v"
  ATTNRT_MLA_PAIRS=$v timeout 30 $B/attnrt bench --backend cuda --suite mla --no-reference --quiet \
    --workload mla-decode-h128-64x4096,mla-decode-h128-128x8192 2>&1 | grep -E "^mla-" | cut -c1-110
done
AB_TESTS='CudaMlaCta.*:CudaHostPlan*' AB_TEST_SECONDS=80 ROUNDS=2 AB_SUITE=mla \
  OUT=${OUT:-$PWD/out/pairs_race}/ab AB_DEADLINE=320 scripts/gpu_ab.sh \
  mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-verify-chain-64x4096+4,mla-verify-tree-64x4096+16-topk4 \
  .gpubin-landed .gpubin-pairs-all .gpubin-order .gpubin-pairs-tma 2>&1 | grep -v ^copy | tail -10
out=${OUT:-$PWD/out/pairs_race}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 90 $NCU --clock-control none --kernel-name regex:mla_pairs_kernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
  -f -o "$out/pairs_h128" /tmp/ab-bin/landed/attnrt bench --backend cuda --suite mla \
  --workload mla-decode-h128-64x4096 --repeats 2 --warmup 1 --no-reference --quiet >/dev/null 2>&1
$NCU -i "$out/pairs_h128.ncu-rep" --page details 2>&1 | grep -E "Duration|Throughput|Pipe|Stall|Warp Cycles|Hit Rate|Issued" | head -30
