#!/usr/bin/env bash
# The next GPU call (under 600 s): two prepared prefill changes against main, their tests, and
# cuDNN / FlashAttention (torch SDPA) beside the prefill rows in the same call.
#   .gpubin-main  main's kernels
#   .gpubin-pvw   the ping-pong consumers' wait for their own P V written in both branches of the
#                 rescale (ptxas hoisted the single wait above the softmax: ncu's source counters
#                 put 11% of the loop's samples there), and the mask as one key range a row (419 ->
#                 209 instructions a masked tile)
#   .gpubin-pvwq  + the producer's Q copies with the (token, head) of a row stepped, not divided
#                 (one division a unit instead of 16 a thread; consumers waited for Q at 87% of
#                 8x2048's unit starts)
# What should move: pvw every ping-pong row, the long rows most (the loop is 93% of 1x16384's
# consumer samples, 66% of 8x2048's); pvwq 8x2048 and extend (short units).
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_next.sh   (carry .gpubin-main, .gpubin-pvw,
#          .gpubin-pvwq, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
gpubin_unpack .gpubin-pvwq /tmp/bin-pvwq || exit 1
T=/tmp/bin-pvwq/attnrt_cuda_tests
gpu_stage pvwq_tests 140 $T --gtest_brief=1 \
  --gtest_filter='*CudaPrefill*:*Kv8Prefill*:*CudaMla*:*CudaSwa*:*Fp8Prefill*:*PrefillFp8*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in racecheck synccheck; do
  gpu_stage pvwq_$tool 60 "$CS" --tool $tool --error-exitcode 9 $T --gtest_brief=1 \
    --gtest_filter='CudaPrefillWsPingPongTest.MoreWorkItemsThanSms:CudaPrefillWsTmaTest.MoreWorkItemsThanSms'
done
rows=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512,prefill-1x16384-kvfp8,mla-prefill-1x16384
OUT=$OUTDIR/ab AB_SUITE=all AB_DEADLINE=$((GPU_END - $(date +%s) - 110)) ROUNDS=2 AB_RUN_SECONDS=45 \
  scripts/gpu_ab.sh $rows .gpubin-main .gpubin-pvw .gpubin-pvwq | tail -12
left=$((GPU_END - $(date +%s)))
if [ $left -gt 80 ]; then
  gpu_stage torch_bench 40 /tmp/bin-pvwq/attnrt bench --backend cuda --no-reference --quiet \
    --workload prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512 \
    --json "$O/torch_from.json"
  timeout $((left - 45)) python3 bench/torch_sdpa.py --device cuda --kernels flash,cudnn \
    --from "$O/torch_from.json" --json "$O/torch.json" >"$O/torch.log" 2>&1
  echo "torch rc=$?"; tail -9 "$O/torch.log"
  python3 bench/compare.py "$O/torch_from.json" "$O/torch.json" 2>&1 | tail -9
else
  echo "torch rows: not run ($left s left)"
fi
