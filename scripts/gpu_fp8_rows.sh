#!/usr/bin/env bash
# The call that measures the fp8 paired-tile CTA's pair rows (a pair of blocks' raw chunks in the
# even block's 128-byte rows, so a quarter warp's LDGSTS write one shared-memory row; .gpubin-pl)
# against the landed tree (.gpubin-land), then verifies the candidate tree whole:
#  1. pl's fp8 MLA tests, racecheck and synccheck of the page-size test (fp8 at 128 heads on
#     pages 1 .. 128 through the paired-tile CTA);
#  2. one bench process a binary, alternating twice: every decode / verify row of --suite mla and
#     the h128 fp8 row at page 1;
#  3. Nsight Compute of pl's fp8 paired-tile CTA (shared-memory wavefronts by opcode: LDGSTS was
#     4.50x its ideal);
#  4. the host plan at batch 256 (decode), and pl's whole GPU suite (bounded by the call's time).
#   usage: OUT=$OUT scripts/gpu_fp8_rows.sh  (carry .gpubin-land, .gpubin-pl, .devdeps; ~9 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels 585 land pl
B=/tmp/ab-bin/pl
mla_checked pl 90 'CudaMlaCta.Fp8*:CudaMlaCta.PairedTile*'
echo "== rows"
mla_ab_rounds 300 land pl
# The host plan at batch 256 on this host (issue 20: decode <= 5 µs), after the rows.
gpu_stage plan 40 $B/attnrt bench --backend cuda --workload decode-64x4096 --no-reference --quiet
grep -A9 "host plan per step" $O/plan.log | head -12
NCU_STALLS_ARGS="--top 4 --context 1" gpu_ncu_profile pl_fp8_pairs 60 $B mla \
  mla-decode-h128-64x4096-fp8 mla_pairs_kernel
left=$((GPU_END - $(date +%s) - 5))
[ $left -gt 60 ] && gpu_stage suite_pl $left $B/attnrt_cuda_tests --gtest_brief=1
