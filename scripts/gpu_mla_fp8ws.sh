#!/usr/bin/env bash
# One call: the keys-on-M MLA CTA with its fp8 producer warpgroup (.gpubin-mlaws) against main
# (.gpubin-main): the MLA / DSA tests on the new binary, racecheck and synccheck of its fp8 case,
# then the MLA rows A/B (fp8 at 16 and 128 heads, the bf16 rows beside them for the fp8 / bf16
# ratio), two rounds each.
#   usage: OUT=DIR scripts/gpu_mla_fp8ws.sh   (carry .gpubin-main, .gpubin-mlaws, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 570
gpubin_unpack .gpubin-mlaws /tmp/ws || exit 1
gpu_stage tests 150 /tmp/ws/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMla*:*Dsa*:CudaBackendTest.*Split*'
for tool in racecheck synccheck; do
  extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  gpu_stage $tool 100 compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 9 \
    /tmp/ws/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMlaCta.KeysOnMItemsOfSeveralTokens'
done
rows=mla-decode-h16-1x32768-fp8,mla-decode-h16-64x8192-fp8,mla-decode-h128-64x4096-fp8,mla-decode-h128-128x8192-fp8
rows=$rows,mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h128-64x4096,mla-decode-h16-64x8192-p1
OUT=$O/ab AB_SUITE=mla AB_DEADLINE=$((GPU_END - $(date +%s) - 90)) AB_RUN_SECONDS=60 \
  bash scripts/gpu_ab.sh "$rows" .gpubin-main .gpubin-mlaws 2>&1 | tail -30
# The host plan at batch 256 and gdn-decode-64 on this card (issue 20 asks for both on the H200),
# main's binary, twice.
for r in 1 2; do
  gpu_stage plan_$r 40 /tmp/ab-bin/main/attnrt bench --backend cuda --workload decode-256x2048 \
    --repeats 10 --no-reference --quiet
  grep -E "^plan-" "$O/plan_$r.log"
  gpu_stage gdn_$r 40 /tmp/ab-bin/main/attnrt bench --backend cuda --suite linear \
    --workload gdn-decode-64 --repeats 20 --no-reference --quiet
  grep -E "^gdn-decode" "$O/gdn_$r.log"
done
