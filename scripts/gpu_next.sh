#!/usr/bin/env bash
# The next GPU call (under 600 s): the whole GPU suite on main + one prepared prefill change, its
# sanitizer runs, and the change against main on the prefill rows.
#   .gpubin-main  main's kernels
#   .gpubin-trim  + three trims of the ping-pong CTA's per-unit and per-tile overhead (ncu source
#                 counters: a unit outside its loop costs ~3 loop tiles, 25% of 8x2048):
#                 the run [it_begin, it_end) found from its two ends instead of testing every tile
#                 (~1,000 instructions a warp a unit at 64 tiles); the ring stage and phase of the
#                 loop stepped instead of divided by the stage count; the epilogue's 1 / l as
#                 MUFU.RCP (no IEEE slow path) and its lse only where one is stored.
# What should move: every ping-pong row by 1-3%, 8x2048 and extend (short units) the most.
#   usage: OUT=DIR [CALL_SECONDS=480] scripts/gpu_next.sh   (carry .gpubin-main, .gpubin-trim,
#          .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 480
gpubin_unpack .gpubin-trim /tmp/bin-trim || exit 1
T=/tmp/bin-trim/attnrt_cuda_tests
gpu_stage trim_suite 210 $T --gtest_brief=1
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in racecheck synccheck; do
  gpu_stage trim_$tool 60 "$CS" --tool $tool --error-exitcode 9 $T --gtest_brief=1 \
    --gtest_filter='CudaPrefillWsPingPongTest.MoreWorkItemsThanSms:CudaPrefillWsTmaTest.MoreWorkItemsThanSms'
done
rows=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,extend-8x2048+512,prefill-1x16384-kvfp8
OUT=$OUTDIR/ab AB_SUITE=all AB_DEADLINE=$((GPU_END - $(date +%s))) ROUNDS=2 AB_RUN_SECONDS=40 \
  scripts/gpu_ab.sh $rows .gpubin-main .gpubin-trim | tail -9
