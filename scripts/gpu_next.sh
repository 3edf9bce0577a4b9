#!/usr/bin/env bash
# The next GPU call (under 600 s): two prepared decode patches against main, with their tests and
# cuDNN / torch beside the decode rows in the same call.
#   .gpubin-main    main's kernels
#   .gpubin-prewait + patches/decode-prewait.patch: the split decode CTAs (keys-on-M and both MLA
#                   CTAs) copy the keys below the step's prefix before the PDL wait on the step's
#                   KV-store kernels (StoredKeysWait), so a split's key loop runs under the stores
#                   and their boundary instead of after them.
#   .gpubin-pm      + patches/merge-ahead.patch: the merge kernel reads the request before its
#                   wait, and each thread's partial rows together with the lse (one memory round
#                   trip, not two).
# What should move: the split rows by the boundaries taken off their critical path (decode-1x32768:
# split kernel 48 us of the forward's 58 under the clean flush), the MLA h16 rows likewise; rows
# of one split (64x4096, 256x2048) not at all. Outputs must stay bitwise those of main (the
# merge sums in the same order), which the determinism tests check.
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_next.sh   (carry .gpubin-main, .gpubin-prewait,
#          .gpubin-pm, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
gpubin_unpack .gpubin-pm /tmp/bin-pm || exit 1
T=/tmp/bin-pm/attnrt_cuda_tests
gpu_stage pm_tests 150 $T --gtest_brief=1 \
  --gtest_filter='CudaBackendTest.*:CudaMla*:Ranks/*:Pages/*:*Split*:*Determin*:CudaGeneric.*'
gpu_stage pm_tests2 90 $T --gtest_brief=1 \
  --gtest_filter='CudaGraph*:CudaStreamOrder*:CudaSwa*:CudaRun.*:CudaNonFinite*:CudaKVCacheRows*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in racecheck synccheck; do
  gpu_stage pm_$tool 60 "$CS" --tool $tool --error-exitcode 9 $T --gtest_brief=1 \
    --gtest_filter='CudaBackendTest.*Split*:CudaMlaCta.*'
done
rows=decode-1x32768,decode-16x4096,decode-64x4096,decode-256x2048,decode-4x131072,mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h128-64x4096,verify-chain-64x4096+4
OUT=$OUTDIR/ab AB_SUITE=all AB_DEADLINE=$((GPU_END - $(date +%s) - 100)) ROUNDS=2 AB_RUN_SECONDS=40 \
  scripts/gpu_ab.sh $rows .gpubin-main .gpubin-prewait .gpubin-pm | tail -14
left=$((GPU_END - $(date +%s)))
if [ $left -gt 70 ]; then
  gpu_stage torch_bench 40 /tmp/bin-pm/attnrt bench --backend cuda --no-reference --quiet \
    --workload decode-1x32768,decode-16x4096,decode-64x4096,decode-4x131072 --json "$O/torch_from.json"
  timeout $((left - 45)) python3 bench/torch_sdpa.py --device cuda --kernels flash,cudnn \
    --from "$O/torch_from.json" --json "$O/torch.json" >"$O/torch.log" 2>&1
  echo "torch rc=$?"; tail -8 "$O/torch.log"
  python3 bench/compare.py "$O/torch_from.json" "$O/torch.json" 2>&1 | tail -10
else
  echo "torch rows: not run ($left s left)"
fi
