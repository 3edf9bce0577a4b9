#!/usr/bin/env bash
# The next GPU call (under 600 s): one prepared patch, then measurements that decide the next
# kernel changes of issues 18 and 20, on main's binary (.gpubin-main, scripts/gpu_prebuild.sh):
#   0. patches/prefill-rescale-slack.patch (.gpubin-slack): the 16-bit prefill consumers move a
#      row's softmax reference only when the tile's maximum passes it by more than 8 (log2 units),
#      so O and l are rescaled on a few tiles of a row instead of on most of its first ones (a
#      warp's 16 rows: P(some row's maximum moves at tile i) = 1 - (1 - 1/i)^16 for random logits;
#      summed, 31 of a 64-tile row's tiles and 7.7 of an 8-tile row's rescale today, 64 FMULs a
#      thread each). Its prefill tests, racecheck / synccheck, then the prefill rows against main,
#      two rounds. What should move: every ping-pong row; 8x2048 (8-tile rows: 96% of its tiles
#      rescale today, one a row with the slack) more than 1x16384 (48%). The rule is
#      MLA decode's (kLazy), now one helper for the three kernels; MLA decode's SASS was
#      rescheduled by it, so its tests and two MLA decode rows run too.
#   1. Kernel times (ncu gpu__time_duration) of the split decode rows that miss their targets:
#      mla-decode-h16-1x32768 (39% of copy; target 90%), decode-1x32768 (0.93x cuDNN; target 1.1x)
#      and decode-16x4096: how much of each row is the split kernel, the merge and the gaps.
#   2. The same rows under ATTNRT_BENCH_FLUSH=clean against the default write flush (the memset's
#      ~50 MB of dirty L2 lines are written back during the timed call: ~17 µs at the copy rate,
#      against the 12.4 µs the h16 row's 37.7 MB take).
#   3. decode-1x32768's and decode-16x4096's split size swept (ATTNRT_KV_CHUNK 512 .. 4096,
#      eager): whether other splits beat the wave model's choice there.
#   4. Per-instruction stalls (ncu source counters) of the 16-bit prefill CTA on prefill-1x16384
#      and prefill-8x2048 after the four-warp TMA producer and the base + constant descriptors:
#      whether the consumers still wait on copies (8% before), and what the short causal rows of
#      8x2048 (50% of the GEMM rate against 1x16384's 68%) spend beyond the long row's per tile.
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_next.sh   (carry .gpubin-main, .gpubin-slack, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
gpubin_unpack .gpubin-main /tmp/bin || exit 1
B=/tmp/bin/attnrt
gpubin_unpack .gpubin-slack /tmp/bin-slack || exit 1
gpu_stage slack_tests 130 /tmp/bin-slack/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*CudaPrefill*:*Kv8Prefill*:*CudaMla*:*CudaSwa*:*Fp8Prefill*:*PrefillFp8*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in racecheck synccheck; do
  gpu_stage slack_$tool 60 "$CS" --tool $tool --error-exitcode 9 /tmp/bin-slack/attnrt_cuda_tests \
    --gtest_brief=1 --gtest_filter='CudaPrefillWsPingPongTest.MoreWorkItemsThanSms:CudaPrefillWsTmaTest.MoreWorkItemsThanSms'
done
OUT=$OUTDIR/slack AB_SUITE=all AB_DEADLINE=110 ROUNDS=2 AB_RUN_SECONDS=45 scripts/gpu_ab.sh \
  prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512,prefill-1x16384-kvfp8,mla-decode-h128-64x4096,mla-decode-h16-64x8192 \
  .gpubin-main .gpubin-slack | tail -10
decode_rows=mla-decode-h16-1x32768,decode-1x32768,decode-16x4096
kernels='regex:attention_kernel|decode_keys_m_kernel|mla_attention_kernel|mla_keys_m_kernel|merge_kernel|decode_kernel'
for row in ${decode_rows//,/ }; do
  gpu_stage ncu_$row 60 ncu --clock-control none --kernel-name "$kernels" --launch-skip 4 --launch-count 6 \
    --metrics gpu__time_duration.sum $B bench --backend cuda --suite all --workload $row \
    --no-reference --repeats 2 --warmup 2 --quiet
  echo "ncu $row (kernel, µs):"
  awk '/^  [a-zA-Z_].*\(/ {n=$1} /gpu__time_duration/ {print "  " n, $NF}' "$O/ncu_$row.log" | head -12
done
for flush in write clean; do
  gpu_stage flush_$flush 60 env ATTNRT_BENCH_FLUSH=$flush $B bench --backend cuda --suite all \
    --workload $decode_rows --no-reference --repeats 20 --quiet
  grep -E "^(mla-decode|decode)" "$O/flush_$flush.log" | sed "s/^/flush $flush: /"
done
for chunk in 512 1024 2048 4096; do
  gpu_stage chunk_$chunk 40 env ATTNRT_KV_CHUNK=$chunk $B bench --backend cuda --workload decode-1x32768,decode-16x4096 \
    --no-reference --repeats 20 --quiet
  grep -E "^decode" "$O/chunk_$chunk.log" | sed "s/^/KV_CHUNK $chunk: /"
done
for row in prefill-1x16384 prefill-8x2048; do
  gpu_stage ncu_src_$row 120 ncu --clock-control none --kernel-name regex:prefill_ws_kernel --launch-skip 2 \
    --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --import-source no -f -o "$O/src_$row" $B bench --backend cuda --workload $row --repeats 2 \
    --warmup 1 --no-reference --quiet
  ncu -i "$O/src_$row.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUTDIR/sass_$row.csv.gz"
  ncu -i "$O/src_$row.ncu-rep" --page details 2>&1 | grep -E "Duration|Throughput|Warp Cycles" | head -8
done
