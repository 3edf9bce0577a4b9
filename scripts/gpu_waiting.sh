#!/usr/bin/env bash
# The call that measures the waiting patches (patches/README.md), on one warm GPU: .gpubin-main
# against .gpubin-both (main + patches/mla-s-chains.patch + patches/prefill-mask-per-unit.patch:
# the two touch different files, so one binary carries both) and .gpubin-spec (main +
# patches/prefill-spec-softmax.patch, which conflicts with the mask patch), each binary's tests
# first, then the keys-on-M MLA CTA's fp8 profile (what bounds its consumer chain now that the
# producer warpgroup converts).
#   build: export PATH=/usr/local/cuda/bin:$PATH ATTNRT_GPU_BUILD=$PWD/build ATTNRT_PY312=/nonexistent
#          git apply patches/mla-s-chains.patch patches/prefill-mask-per-unit.patch
#          scripts/gpu_prebuild.sh .gpubin-both; git checkout -- backends
#          git apply patches/prefill-spec-softmax.patch; scripts/gpu_prebuild.sh .gpubin-spec
#          git checkout -- backends; scripts/gpu_prebuild.sh .gpubin-main
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_waiting.sh
#          (carry .gpubin-main, .gpubin-both, .gpubin-spec, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
rows=mla-decode-h16-1x32768-fp8,mla-decode-h16-64x8192-fp8,mla-decode-h128-64x4096-fp8
rows=$rows,mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h16-64x8192-p1
OUT=$O/ab AB_SUITE=mla AB_DEADLINE=$((GPU_END - $(date +%s) - 330)) AB_RUN_SECONDS=40 AB_TEST_SECONDS=100 \
  AB_TESTS='CudaMla*:CudaBackendTest.*Split*' \
  bash scripts/gpu_ab.sh "$rows" .gpubin-main .gpubin-both 2>&1 | grep -v "^copy" | tail -10
prow=prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512
OUT=$O/abp AB_DEADLINE=$((GPU_END - $(date +%s) - 60)) AB_RUN_SECONDS=40 AB_TEST_SECONDS=110 \
  AB_TESTS='*CudaPrefill*:*Kv8Prefill*:*CudaMlaMha*:*CudaSwa*' \
  bash scripts/gpu_ab.sh "$prow" .gpubin-main .gpubin-both .gpubin-spec 2>&1 | grep -v "^copy" | tail -9
B=/tmp/ab-bin/main/attnrt
row=mla-decode-h16-64x8192-fp8
gpu_stage ncu_$row 50 ncu --clock-control none --kernel-name regex:mla_keys_m --launch-skip 2 \
  --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
  --import-source no -f -o "$O/$row" $B bench --backend cuda --suite mla --workload $row --repeats 2 \
  --warmup 1 --no-reference --quiet
ncu -i "$O/$row.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUTDIR/sass_$row.csv.gz"
ncu -i "$O/$row.ncu-rep" --page details 2>&1 | grep -E "Duration|Warp Cycles" | head -4
