#!/usr/bin/env bash
# One GPU call of under 600 s for two waiting patches against main (.gpubin-main):
#   1. patches/conv-ahead.patch (.gpubin-conv): the linear layers' conv keeps 4 tokens of x in
#      flight a thread (raw loads, converted at use) instead of one that stalled at once. Its
#      linear tests, racecheck of one GDN extend test, then the extend rows (conv_vec_kernel) and
#      one decode row (conv_token_kernel: unchanged) against main, two rounds, and ncu's kernel
#      times of gdn-extend-8x8192 under both binaries. What should move: the conv of
#      gdn-extend-8x8192 (1.32 ms, ~54% of copy for its 2.1 GB) toward ~0.8 ms, so the row by
#      ~0.4-0.5 ms; mamba2 and kda extend rows by their conv's share; decode rows not at all.
#   2. patches/merge-slices.patch (.gpubin-merge), with the time left: the MLA part of
#      `scripts/gpu_merge_race.sh ab` (the patch's tests, then the MLA h16 / h128 rows, two
#      rounds).
#   usage: OUT=DIR [CALL_SECONDS=570] scripts/gpu_conv_merge.sh
#          (carry .gpubin-main, .gpubin-conv, .gpubin-merge, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_logs_setup
GPU_END=$(($(date +%s) + ${CALL_SECONDS:-570}))
C=/tmp/bin-conv
gpubin_unpack .gpubin-conv $C || exit 1
gpubin_unpack .gpubin-main /tmp/bin-main || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
gpu_stage conv_tests 90 $C/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Linear*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
gpu_stage conv_racecheck 40 "$CS" --tool racecheck --error-exitcode 9 $C/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter='CudaLinearChunked.GdnMatchesRecurrenceOnRaggedRequests'
OUT=$OUTDIR/conv AB_SUITE=linear AB_DEADLINE=150 ROUNDS=2 AB_RUN_SECONDS=60 scripts/gpu_ab.sh \
  gdn-extend-8x8192,kda-extend-8x8192,mamba2-extend-8x8192,mamba2-extend-1x8192,gdn-extend-1x65536-h2v8,gdn-decode-64 \
  .gpubin-main .gpubin-conv | tail -8
for l in main conv; do
  gpu_stage ncu_$l 40 ncu --clock-control none --metrics gpu__time_duration.sum \
    -k regex:'conv|prep|delta' -c 8 /tmp/bin-$l/attnrt bench --backend cuda --suite linear \
    --workload gdn-extend-8x8192 --no-reference --repeats 1 --warmup 1 --quiet
  echo "ncu $l:"; grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$O/ncu_$l.log" | head -8
done
left=$((GPU_END - $(date +%s)))
if [ $left -gt 120 ]; then
  ROUNDS=2 AB_SUITE=mla AB_DEADLINE=$((left - 10)) OUT=$OUTDIR/mla \
    AB_TESTS='CudaBackendTest.*:CudaMla*:*Split*:CudaBench.GatherProbe*' \
    bash scripts/gpu_ab.sh mla-decode-h16-1x32768,mla-decode-h16-1x32768-fp8,mla-decode-h16-1x32768-p1,mla-decode-h16-64x8192,mla-decode-h128-64x4096 \
    .gpubin-main .gpubin-merge > "$O/ab_mla.txt" 2>&1
  tail -12 "$O/ab_mla.txt"
else
  echo "merge a/b: not run ($left s left)"
fi
