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
mla_checked pl2 80 'CudaMlaCta.Fp8*:CudaMlaCta.PairedTile*'
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
NCU_STALLS_ARGS="--top 4 --context 1" gpu_ncu_profile pl2_fp8_pairs 25 $B mla \
  mla-decode-h128-64x4096-fp8 mla_pairs_kernel
