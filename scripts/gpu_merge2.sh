#!/usr/bin/env bash
# patches/merge-slices.patch (.gpubin-merge) against main (.gpubin-main) in one GPU call of under
# 600 s: the split-KV merge in slices of 128 dims where a request has 16 splits or more.
#   1. its tests: the backend, MLA, split, DSA and graph suites and the gather probe;
#   2. the MLA h16 / h128 rows and the GQA decode rows that split (long context, small batch),
#      two rounds each, alternated;
#   3. with the time left, issue 20's rows beside torch's SDPA kernels (see the end).
# What should move: the h16 1x32768 rows (128 splits) ~1.15x as in the first form; the 64x8192
# rows and every row of fewer than 16 splits not at all (one slice: main's merge).
#   usage: OUT=DIR [CALL_SECONDS=540] scripts/gpu_merge2.sh
#          (carry .gpubin-main, .gpubin-merge, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_logs_setup
GPU_END=$(($(date +%s) + ${CALL_SECONDS:-540}))
M=/tmp/bin-merge
gpubin_unpack .gpubin-merge $M || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
gpu_stage tests 120 $M/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaBackendTest.*:*Mla*:*Split*:*Dsa*:CudaGraphRuntime.*:CudaBench.*:*Determin*'
left=$((GPU_END - $(date +%s)))
OUT=$OUTDIR/mla AB_SUITE=mla AB_DEADLINE=120 ROUNDS=2 AB_RUN_SECONDS=60 \
  scripts/gpu_ab.sh mla-decode-h16-1x32768,mla-decode-h16-1x32768-fp8,mla-decode-h16-1x32768-p1,mla-decode-h16-64x8192,mla-decode-h128-64x4096 \
  .gpubin-main .gpubin-merge | tail -7
left=$((GPU_END - $(date +%s)))
OUT=$OUTDIR/gqa AB_DEADLINE=100 ROUNDS=2 AB_RUN_SECONDS=40 scripts/gpu_ab.sh \
  decode-1x32768,decode-1x131072,decode-4x131072,decode-16x4096,decode-64x4096 \
  .gpubin-main .gpubin-merge | tail -7
# With the time left: issue 20's prefill / extend rows and decode-1x32768 / 16x4096 under the
# merge binary with torch's SDPA kernels (flash, cuDNN) on the same shapes, side by side.
left=$((GPU_END - $(date +%s)))
if [ $left -gt 100 ]; then
  gpu_stage round_attnrt 60 $M/attnrt bench --backend cuda \
    --workload prefill,extend,decode-1x32768,decode-16x4096 --no-reference --repeats 10 \
    --quiet --json "$OUTDIR/round_attnrt.json"
  left=$((GPU_END - $(date +%s)))
  gpu_stage round_torch $((left - 15)) python3 bench/torch_sdpa.py --device cuda \
    --kernels flash,cudnn --from "$OUTDIR/round_attnrt.json" --json "$OUTDIR/round_torch.json"
  python3 bench/compare.py "$OUTDIR/round_attnrt.json" "$OUTDIR/round_torch.json" \
    | tee "$OUTDIR/round.txt" | tail -25
else
  echo "round: not run ($left s left)"
fi
