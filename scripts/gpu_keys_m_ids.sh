#!/usr/bin/env bash
# The call that measures the keys-on-M MLA CTA (the h16 rows) with its page ids by cp.async
# through shared memory at pages of up to 16 slots (patches/mla-keys-m-ids.patch; .gpubin-kmids)
# against main (.gpubin-head2):
#  1. the patched binary's MLA tests, then compute-sanitizer racecheck and synccheck of the test
#     over the native page sizes 1 .. 128 (both CTAs, both page-id forms);
#  2. both binaries, alternating twice, one bench process each on the h16 rows at their own pages
#     (64, and 1 for -p1), then h16-64x8192 at --page-size 16 and 32 (GB/s).
#   usage: OUT=$OUT scripts/gpu_keys_m_ids.sh  (carry .gpubin-head2, .gpubin-kmids, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 330
for v in head2 kmids; do gpubin_unpack .gpubin-$v /tmp/ab-bin/$v >/dev/null || exit 1; done
B=/tmp/ab-bin/kmids
echo "== tests"
timeout 120 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMla*' > $O/tests_kmids.log 2>&1
echo "rc=$?"; grep -E "FAILED|tests? from .* ran|PASSED" $O/tests_kmids.log | tail -6
for tool in racecheck synccheck; do
  extra=""; [ $tool = synccheck ] && extra="--num-cuda-barriers 65536"
  timeout 70 compute-sanitizer --tool $tool $extra --print-limit 3 --error-exitcode 9 $B/attnrt_cuda_tests \
    --gtest_brief=1 --gtest_filter='CudaMlaCta.NativePageSizesWithRaggedLengths' 2>&1 \
    | grep -E "SUMMARY|PASSED|FAILED|ERROR" | head -4
done
echo "== rows (GB/s)"
rate() { awk -v t="$1" '{for (i = 1; i <= NF; i++) if ($i == "GB/s" && $1 ~ /^mla/) printf "%s %s %s\n", t, $1, $(i - 1)}'; }
for r in 1 2; do
  for v in head2 kmids; do
    [ $(date +%s) -gt $((GPU_END - 15)) ] && { echo "out of time"; break 2; }
    bin=/tmp/ab-bin/$v/attnrt
    timeout 30 $bin bench --backend cuda --suite mla --no-reference --quiet \
      --workload mla-decode-h16-64x8192,mla-decode-h16-64x8192-p1,mla-decode-h16-1x32768,mla-decode-h16-1x32768-p1 \
      2>&1 | rate "$v r$r"
    for pg in 16 32; do
      timeout 20 $bin bench --backend cuda --suite mla --no-reference --quiet --page-size $pg \
        --workload mla-decode-h16-64x8192 2>&1 | rate "$v r$r page$pg"
    done
  done
done
