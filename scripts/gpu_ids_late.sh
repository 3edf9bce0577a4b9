#!/usr/bin/env bash
# The call that measures two waiting MLA patches against main (.gpubin-head2 = 5892626):
#  - patches/mla-keys-m-ids.patch (.gpubin-kmids): the keys-on-M CTA (h16 rows) with its page ids
#    through shared memory at pages of up to 16 slots;
#  - patches/mla-pairs-late.patch (.gpubin-late): the paired-tile CTA's registers instance (pages
#    above 16) with its page ids loaded where the compiler cannot fold the rows' arithmetic into
#    the load, so the warps wait for them at the copies a load later, not at the load.
# 1. each patched binary's MLA tests, then racecheck and synccheck of the test over the native page
#    sizes 1 .. 128 (both 64-row CTAs and the keys-on-M CTA, every page-id form);
# 2. one bench process a binary, alternating twice: the h16 rows at pages 64 and 1 (head2, kmids;
#    GB/s), the h128 rows at page 64 and at --page-size 32 (head2, late; TFLOP/s);
# 3. in the time left, Nsight Compute's stall samples of the late binary's paired-tile CTA
#    (bench/ncu_stalls.py: the page-table loads should be gone from "loads used at once").
#   usage: OUT=$OUT scripts/gpu_ids_late.sh  (carry .gpubin-head2, .gpubin-kmids, .gpubin-late,
#          .devdeps; about 8 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 480 head2 kmids late
F='CudaMlaCta.NativePageSizesWithRaggedLengths'
for v in kmids late; do
  B=/tmp/ab-bin/$v
  gpu_stage tests_$v 120 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMla*'
  gpu_stage race_$v 60 compute-sanitizer --tool racecheck --print-limit 3 $B/attnrt_cuda_tests \
    --gtest_brief=1 --gtest_filter=$F
  gpu_stage sync_$v 60 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 --print-limit 3 \
    $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$F
done
echo "== rows"
bench() { timeout 30 /tmp/ab-bin/$1/attnrt bench --backend cuda --suite mla --no-reference --quiet "${@:3}" 2>&1 | bench_rates "$1 $2"; }
for r in 1 2; do
  for v in head2 kmids; do
    [ $(date +%s) -gt $((GPU_END - 20)) ] && { echo "out of time"; break 2; }
    bench $v r$r --workload mla-decode-h16-64x8192,mla-decode-h16-64x8192-p1,mla-decode-h16-1x32768,mla-decode-h16-1x32768-p1
    bench $v "r$r page16" --page-size 16 --workload mla-decode-h16-64x8192
  done
  for v in head2 late; do
    [ $(date +%s) -gt $((GPU_END - 20)) ] && { echo "out of time"; break 2; }
    bench $v r$r --workload mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-verify-chain-64x4096+4,mla-verify-tree-64x4096+16-topk4
    bench $v "r$r page32" --page-size 32 --workload mla-decode-h128-64x4096
  done
done
left=$((GPU_END - $(date +%s)))
if [ $left -gt 60 ]; then
  echo "== ncu: the late binary's paired-tile CTA on mla-decode-h128-64x4096 (page 64)"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout $((left - 10)) $NCU --clock-control none --kernel-name regex:mla_pairs_kernel --launch-skip 2 \
    --launch-count 1 --section WarpStateStats --section SourceCounters -f -o "$O/late_h128" \
    /tmp/ab-bin/late/attnrt bench --backend cuda --suite mla --workload mla-decode-h128-64x4096 \
    --repeats 2 --warmup 1 --no-reference --quiet >/dev/null 2>&1
  $NCU -i "$O/late_h128.ncu-rep" --page source --csv --print-source sass > $O/late_sass.csv 2>/dev/null
  python3 bench/ncu_stalls.py $O/late_sass.csv --top 8 --context 1 | head -40
fi
