#!/usr/bin/env bash
# One GPU call (under 480 s) on the final tree of this round:
#   0. the whole GPU suite (attnrt_cuda_tests) on main (.gpubin-main: merge-walk, the fast SiLU and
#      the four-warp TMA producer landed);
#   1. patches/prefill-desc-tree.patch's descriptors alone on top of it (.gpubin-desc: each tile's
#      MMA descriptors as the first one's plus constants) against main, the prefill rows, two rounds;
#   2. main's prefill rows at pages 16, 64 and 128 (what the page size still costs after the
#      four-warp producer).
#   usage: OUT=DIR [CALL_SECONDS=450] scripts/gpu_next4.sh
#          (carry .gpubin-main, .gpubin-desc, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 450
gpubin_unpack .gpubin-main /tmp/bin-main || exit 1
gpu_stage suite 280 /tmp/bin-main/attnrt_cuda_tests --gtest_brief=1
rows=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512
OUT=$OUTDIR/ab AB_DEADLINE=90 ROUNDS=2 AB_RUN_SECONDS=40 scripts/gpu_ab.sh "$rows" \
  .gpubin-main .gpubin-desc | tail -7
for page in 16 64 128; do
  gpu_stage page$page 40 /tmp/bin-main/attnrt bench --backend cuda --no-reference --quiet --repeats 10 \
    --workload prefill-1x16384,prefill-8x2048,extend-8x2048+512 --page-size $page
  grep -E "^(prefill|extend)" "$O/page$page.log" | sed "s/^/page $page: /"
done
