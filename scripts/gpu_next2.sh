#!/usr/bin/env bash
# The GPU call after scripts/gpu_next.sh (under 600 s), five parts:
#   1. patches/merge-walk.patch (.gpubin-walk) against main: the split-KV merge sliced so that no
#      thread walks more than 8 splits (128 splits: 16 threads a 4-dim vector, slices of 32 dims;
#      d128 now in 4 slices where it had one), the walk's loads unrolled by 8, the weights' sum
#      reduced across the block instead of by one thread. Its tests (backend, MLA, split, DSA,
#      graphs), then the decode rows that split (decode-1x32768: 68 µs against cuDNN's 63; the
#      merge's per-thread walk of 32 splits in rounds of 4 loads is ~5 µs of it by estimate) and
#      the MLA h16 rows, two rounds. What should move: decode-1x32768 / 1x131072 and
#      mla-decode-h16-1x32768 by a few µs; rows of few splits (64x4096, h16-64x8192) not at all.
#   2. the conv's fast SiLU, now common/math.cuh's silu for every conv path (.gpubin-silu; the
#      first form changed only the extend conv, and verify + commit then differed from sequential
#      decode beyond the tight tolerance): the linear tests, then the linear rows, two rounds.
#   3. ncu kernel times of kda-extend-8x8192 and mamba2-extend-8x8192 under main: which kernel
#      holds KDA's 20.5 ms (4.4x GDN's row) and Mamba2's 4.4 ms.
#   4. ncu of the 16-bit prefill CTA on prefill-1x16384 (SpeedOfLight, WarpStateStats,
#      SourceCounters): where the consumers stall (issue 20: 63% of the GEMM rate, cuDNN 82%).
#   5. the prefill rows at pages 16, 64 and 128 (attnrt bench --page-size).
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_next2.sh
#          (carry .gpubin-main, .gpubin-walk, .gpubin-silu, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
gpubin_unpack .gpubin-walk /tmp/bin-walk || exit 1
gpubin_unpack .gpubin-main /tmp/bin-main || exit 1
gpubin_unpack .gpubin-silu /tmp/bin-silu || exit 1
gpu_stage walk_tests 120 /tmp/bin-walk/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaBackendTest.*:CudaMla*:*Split*:CudaBench.GatherProbe*:CudaDsa.*:CudaGraphRuntime.*'
OUT=$OUTDIR/walk AB_SUITE=all AB_DEADLINE=150 ROUNDS=2 AB_RUN_SECONDS=40 scripts/gpu_ab.sh \
  decode-1x32768,decode-1x131072,decode-16x4096,decode-64x4096,mla-decode-h16-1x32768,mla-decode-h16-64x8192 \
  .gpubin-main .gpubin-walk | tail -8
gpu_stage silu_tests 90 /tmp/bin-silu/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Linear*'
OUT=$OUTDIR/silu AB_SUITE=linear AB_DEADLINE=100 ROUNDS=2 AB_RUN_SECONDS=50 scripts/gpu_ab.sh \
  gdn-extend-8x8192,mamba2-extend-8x8192,gdn-extend-1x65536-h2v8,gdn-decode-64,mamba2-decode-64 \
  .gpubin-main .gpubin-silu | tail -7
# The 16-bit prefill CTA's stalls per SASS instruction (source page of the report, as CSV).
gpu_stage ncu_prefill 150 ncu --clock-control none --kernel-name regex:prefill_ws_kernel --launch-skip 2 \
  --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
  --import-source no -f -o "$O/prefill" /tmp/bin-main/attnrt bench --backend cuda \
  --workload prefill-1x16384 --repeats 2 --warmup 1 --no-reference --quiet
ncu -i "$O/prefill.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUTDIR/prefill_sass.csv.gz"
ncu -i "$O/prefill.ncu-rep" --page details 2>&1 | grep -E "Duration|Stall|Warp Cycles|Issued|Eligible|Throughput" | head -30
# Page size against the prefill rate (cuDNN reads contiguous K / V; the rows page by 16).
for page in 16 64 128; do
  gpu_stage page$page 60 /tmp/bin-main/attnrt bench --backend cuda --no-reference --quiet --repeats 10 \
    --workload prefill-1x16384,prefill-8x2048,extend-8x2048+512 --page-size $page
  grep -E "^(prefill|extend)" "$O/page$page.log" | sed "s/^/page $page: /"
done
for row in kda-extend-8x8192 mamba2-extend-8x8192; do
  gpu_stage ncu_$row 45 ncu --clock-control none --metrics gpu__time_duration.sum -c 16 \
    /tmp/bin-main/attnrt bench --backend cuda --suite linear --workload $row --no-reference \
    --repeats 1 --warmup 1 --quiet
  echo "ncu $row:"; grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$O/ncu_$row.log" | head -24
done
