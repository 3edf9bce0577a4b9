#!/usr/bin/env bash
# The call that measures the fp8 paired-tile CTA's sector pairs (a pair of blocks' raw chunks of a
# row in global order in the even block's row, so each 32-byte global sector lands as a 32-byte
# pair; .gpubin-pl2) against the landed tree (.gpubin-pl = the kernels of 660a43f):
#  1. pl2's fp8 MLA tests, racecheck and synccheck of the page-size test;
#  2. one bench process a binary, alternating twice: the fp8 MLA rows and the h128 fp8 row at
#     page 1;
#  3. Nsight Compute of pl2's fp8 paired-tile CTA (LDGSTS was 7.76x its ideal wavefronts).
#   usage: OUT=$OUT scripts/gpu_fp8_sectors.sh  (carry .gpubin-pl, .gpubin-pl2, .devdeps; ~4 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels "${CALL_SECONDS:-250}" pl pl2
B=/tmp/ab-bin/pl2
F='CudaMlaCta.NativePageSizesWithRaggedLengths'
gpu_stage tests_pl2 80 $B/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaMlaCta.Fp8*:CudaMlaCta.PairedTile*'
gpu_stage race_pl2 45 compute-sanitizer --tool racecheck --print-limit 3 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter=$F
gpu_stage sync_pl2 20 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 --print-limit 3 \
  $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$F
rows=mla-decode-h128-64x4096-fp8,mla-decode-h128-128x8192-fp8,mla-decode-h16-64x8192-fp8
for r in 1 2; do
  for v in pl pl2; do
    [ $(date +%s) -gt $((GPU_END - 25)) ] && { echo "rows: out of time"; break 2; }
    bin=/tmp/ab-bin/$v/attnrt
    timeout 30 $bin bench --backend cuda --suite mla --no-reference --quiet --workload $rows 2>&1 |
      bench_rates "$v r$r"
    timeout 15 $bin bench --backend cuda --suite mla --no-reference --quiet --page-size 1 \
      --workload mla-decode-h128-64x4096-fp8 2>&1 | bench_rates "$v r$r page1"
  done
done
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
name=pl2_fp8_pairs
gpu_stage ncu_pl2 25 $NCU --clock-control none --kernel-name regex:mla_pairs_kernel --launch-skip 2 \
  --launch-count 1 --section WarpStateStats --section SourceCounters -f -o "$O/$name" \
  $B/attnrt bench --backend cuda --suite mla --workload mla-decode-h128-64x4096-fp8 --repeats 2 \
  --warmup 1 --no-reference --quiet
if [ -f "$O/$name.ncu-rep" ]; then
  $NCU -i "$O/$name.ncu-rep" --page source --csv --print-source sass >"$O/$name.csv" 2>/dev/null
  python3 bench/ncu_stalls.py "$O/$name.csv" --top 2 --context 0 | grep -A6 "by reason\|wavefronts"
fi
