#!/usr/bin/env bash
# One GPU call (under 600 s): patches/prefill-desc-tree.patch and patches/prefill-tma-spread.patch
# against main.
#   0. .gpubin-dt (the whole patch: each tile's MMA descriptors as the first one's plus constants,
#      wgmma_desc_add; the row maximum and sum as trees, tree_reduce) and .gpubin-desc (the
#      descriptors alone): the prefill suites, racecheck / synccheck of the persistent cases.
#      .gpubin-spread (prefill-tma-spread: the TMA producer's boxes issued by the four producer
#      warps side by side instead of warp 0 alone; at 16-slot pages a tile is 32 boxes, which
#      warp 0 issued lane after lane): its prefill suites, racecheck / synccheck.
#   1. The prefill / extend rows, main against the three, two rounds (scripts/gpu_ab.sh).
#   2. The 16-bit prefill rows beside torch (bench/torch_sdpa.py, SDPA flash and cuDNN) with the
#      patched binary, as issue 20 counts them.
#   What should move: the ping-pong consumers' per-tile chain (ncu: ~69% of a consumer warp's
#   time executing, "wait" the largest reason; the descriptor chains ~200 instructions between
#   the turn and its hand-over, the row maximum a 32-step fold) on every ping-pong row (d64, d128,
#   the CTA over fp8 pages); d256 and MLA's MHA form free-run, the descriptors only.
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_next3.sh
#          (carry .gpubin-main, .gpubin-dt, .gpubin-desc, .gpubin-spread, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
gpubin_unpack .gpubin-main /tmp/bin-main || exit 1
filter='*CudaPrefill*:*Kv8Prefill*:*CudaMlaMha*:*CudaSwa*:*Fp8Prefill*:*PrefillFp8*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for v in dt spread; do
  gpubin_unpack .gpubin-$v /tmp/bin-$v || exit 1
  gpu_stage ${v}_tests 110 /tmp/bin-$v/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="$filter"
  for tool in racecheck synccheck; do
    gpu_stage ${v}_$tool 60 "$CS" --tool $tool --error-exitcode 9 /tmp/bin-$v/attnrt_cuda_tests \
      --gtest_brief=1 --gtest_filter='CudaPrefillWsPingPongTest.MoreWorkItemsThanSms:CudaPrefillWsTmaTest.MoreWorkItemsThanSms'
  done
done
rows=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512,prefill-1x16384-kvfp8
OUT=$OUTDIR/ab AB_DEADLINE=200 ROUNDS=2 AB_RUN_SECONDS=50 scripts/gpu_ab.sh "$rows" \
  .gpubin-main .gpubin-dt .gpubin-desc .gpubin-spread | tail -9
left=$((GPU_END - $(date +%s)))
if [ $left -gt 100 ]; then
  gpu_stage torch_bench 60 /tmp/bin-dt/attnrt bench --backend cuda --no-reference --quiet \
    --workload prefill,extend --json "$O/torch_from.json"
  grep -E "^(prefill|extend)|bf16 |memory " "$O/torch_bench.log"
  timeout $((left - 75)) python3 bench/torch_sdpa.py --device cuda --kernels flash,cudnn \
    --from "$O/torch_from.json" >"$O/torch.log" 2>&1
  echo "torch rc=$?"; tail -16 "$O/torch.log"
else
  echo "torch rows: not run ($left s left)"
fi
