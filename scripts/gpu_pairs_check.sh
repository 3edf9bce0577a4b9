#!/usr/bin/env bash
# The second call for the paired-tile MLA CTA (its row handshakes moved to mbarriers) and for the
# prefill consumers' single P V wait (prefill_ws.cuh), in under 5 minutes: the MLA CTA and prefill
# RowMaxima / TMA tests, compute-sanitizer racecheck and synccheck of the pairs CTA's every-mode
# test, synccheck of the prefill RowMaxima tests, then one bench round of each binary (MLA h128
# rows, two prefill rows). Stages are skipped once DEADLINE seconds (default 270) have passed.
#   usage: OUT=$OUT scripts/gpu_pairs_check.sh   (run: carry .gpubin-main, .gpubin-pairs, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/out/pairs_check}
mkdir -p "$out"
end=$(($(date +%s) + ${DEADLINE:-270}))
left() { echo $((end - $(date +%s))); }
source .devdeps/unpack-debs.sh >/dev/null
source scripts/gpubin.sh
gpubin_unpack .gpubin-main /tmp/ab-bin/main >/dev/null || exit 1
gpubin_unpack .gpubin-pairs /tmp/ab-bin/pairs >/dev/null || exit 1
B=/tmp/ab-bin/pairs
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== tests (pairs binary)"
timeout 100 $B/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaMlaCta.*:CudaPrefillWsTmaTest.*:CudaPrefillWsPingPongTest.*' >"$out/tests.log" 2>&1
echo "rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$out/tests.log" | tr '\n' ' ')"
grep -E "Failure|threw|FAILED" "$out/tests.log" | head -6
san() {
  local tool=$1 filter=$2 t=$3
  shift 3
  (($(left) < t)) && { echo "skip $tool $filter"; return; }
  echo "== $tool $filter"
  timeout "$t" compute-sanitizer --tool "$tool" --print-limit 3 --error-exitcode 9 "$@" $B/attnrt_cuda_tests \
    --gtest_brief=1 --gtest_filter="$filter" 2>&1 | grep -v "Host Frame" | tail -8
}
san racecheck CudaMlaCta.EveryModeAtEveryTensorParallelHeadCount 35
san synccheck CudaMlaCta.EveryModeAtEveryTensorParallelHeadCount 35 --num-cuda-barriers 65536
san synccheck 'CudaPrefillWsTmaTest.RowMaxima*:CudaPrefillWsPingPongTest.RowMaxima*' 30
for label in main pairs main pairs; do
  (($(left) < 25)) && { echo "skip bench $label"; continue; }
  echo "== bench $label"
  timeout 40 /tmp/ab-bin/$label/attnrt bench --backend cuda --suite mla --no-reference --quiet \
    --workload mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-verify-chain-64x4096+4 \
    2>&1 | grep -E "^mla-" | cut -c1-110
  (($(left) < 25)) && continue
  timeout 40 /tmp/ab-bin/$label/attnrt bench --backend cuda --no-reference --quiet \
    --workload prefill-1x16384,prefill-8x2048 2>&1 | grep -E "^prefill-" | cut -c1-110
done
