#!/usr/bin/env bash
# The next GPU call (under 600 s), on main's binary (.gpubin-main from scripts/gpu_prebuild.sh):
#   1. the whole GPU suite, in two parts each with its own slot (one 210 s slot no longer holds it);
#   2. ncu source counters of the 16-bit prefill CTA on prefill-8x2048 and prefill-1x16384 after
#      the Q stepping and the per-unit trims: what a unit costs outside its loop now (it was ~3
#      loop tiles, 25% of 8x2048: epilogue 10.8%, Q wait 7.3%, run scan and divisions ~4%), and
#      whether the epilogue's 4-byte stores or the wait for the next unit's Q lead it. That
#      decides between 16-byte epilogue stores (quad transpose) and Q by TMA, or the next unit's
#      first S = Q K^T issued before this unit's epilogue (needs Q earlier: one Q buffer today).
#   3. the split size of the one-request MLA decode rows (ATTNRT_KV_CHUNK 256 .. 1024).
#   4. the prefill rows on the landed tree.
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_next.sh   (carry .gpubin-main, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
gpubin_unpack .gpubin-main /tmp/bin || exit 1
B=/tmp/bin/attnrt
part2='*Linear*:*Dsa*:*Dcp*:*Kv8Prefill*:*Fp8Prefill*:*PrefillFp8*'
gpu_stage suite_1 200 /tmp/bin/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="-$part2"
gpu_stage suite_2 200 /tmp/bin/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="$part2"
for row in prefill-8x2048 prefill-1x16384; do
  gpu_stage ncu_src_$row 60 ncu --clock-control none --kernel-name regex:prefill_ws_kernel --launch-skip 2 \
    --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --import-source no -f -o "$O/src_$row" $B bench --backend cuda --workload $row --repeats 2 \
    --warmup 1 --no-reference --quiet
  ncu -i "$O/src_$row.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUTDIR/sass_$row.csv.gz"
  ncu -i "$O/src_$row.ncu-rep" --page details 2>&1 | grep -E "Duration|Warp Cycles" | head -3
done
# 3. The split size of the one-request MLA rows (the wave model picks 128 splits of 256 keys; with
#    the merge 1.3x faster since 64 splits were last compared, eager): bf16, fp8 and page 1.
for chunk in 256 512 1024; do
  gpu_stage mla_chunk_$chunk 40 env ATTNRT_KV_CHUNK=$chunk $B bench --backend cuda --suite mla \
    --workload mla-decode-h16-1x32768,mla-decode-h16-1x32768-fp8,mla-decode-h16-1x32768-p1 \
    --no-reference --repeats 20 --quiet
  grep -E "^mla-decode" "$O/mla_chunk_$chunk.log" | sed "s/^/KV_CHUNK $chunk: /"
done
# 4. The prefill rows once more on the landed tree, against their A/Bs (d64 and d256 keep the code
#    they had before the trims).
gpu_stage prefill_rows 60 $B bench --backend cuda --no-reference --quiet --workload \
  prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512
grep -E "^(prefill|extend)" "$O/prefill_rows.log"
