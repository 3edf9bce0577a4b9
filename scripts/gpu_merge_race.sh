#!/usr/bin/env bash
# GPU calls of under 600 s each for the waiting items, PART = ab or race:
#  ab:   the A/B of patches/merge-slices.patch against main (the patch's tests first, including
#        the page-1 gather probe's; the MLA h16 / h128 rows, two rounds; the long GQA decode rows,
#        one round), ncu's kernel times of mla-decode-h16-1x32768 under each binary (ncu writes
#        the L2 back before each kernel, so these leave out the dirty lines the bench's default
#        flush leaves), and the h16 rows once more under ATTNRT_BENCH_FLUSH=clean (a read flush:
#        no write-back inside the timed call), which splits the row's time into the kernels'
#        and the flush's. The MLA runs also print the page-1 gather ceilings.
#  race: the linear suite's GDN / KDA extend rows and FlashInfer's comparison row
#        (gdn-extend-1x65536-h2v8, its counting in the notes), ncu's kernel times of
#        gdn-extend-8x8192 (conv, gates, prep, state pass), then racecheck over the
#        linear-layer and DCP tests that did not finish whole suites in earlier calls, one test a
#        slot.
#   usage: scripts/gpu_merge_race.sh ab|race   (carry .gpubin-main; .gpubin-merge for ab; for race
#          .gpubin (a copy of .gpubin-main), and .devdeps; results in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/out/merge_race}
mkdir -p "$out"
source .devdeps/unpack-debs.sh >/dev/null
part=${1:?usage: scripts/gpu_merge_race.sh ab|race}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ "$part" = ab ]; then
ROUNDS=2 AB_SUITE=mla AB_DEADLINE=230 OUT=$out/mla \
  AB_TESTS='CudaBackendTest.*:CudaMla*:Ranks/*:Pages/*:*Split*:*Determin*:CudaBench.GatherProbe*' \
  bash scripts/gpu_ab.sh mla-decode-h16-1x32768,mla-decode-h16-1x32768-fp8,mla-decode-h16-1x32768-p1,mla-decode-h16-64x8192,mla-decode-h128-64x4096 \
  .gpubin-main .gpubin-merge > "$out/ab_mla.txt" 2>&1
tail -22 "$out/ab_mla.txt"
ROUNDS=1 AB_DEADLINE=110 OUT=$out/gqa bash scripts/gpu_ab.sh \
  decode-1x32768,decode-1x131072,decode-4x131072,decode-64x4096 .gpubin-main .gpubin-merge \
  > "$out/ab_gqa.txt" 2>&1
tail -12 "$out/ab_gqa.txt"
for l in main merge; do
  timeout 45 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'mla|merge' -c 12 \
    /tmp/ab-bin/$l/attnrt bench --backend cuda --suite mla --workload mla-decode-h16-1x32768 \
    --no-reference --repeats 2 --warmup 1 --quiet > "$out/ncu_$l.txt" 2>&1
  echo "ncu $l:"; grep -E "^  [a-z_]+.*\(|gpu__time_duration" "$out/ncu_$l.txt" | head -16
done
ATTNRT_BENCH_FLUSH=clean timeout 45 /tmp/ab-bin/main/attnrt bench --backend cuda --suite mla \
  --workload mla-decode-h16-1x32768,mla-decode-h16-1x32768-fp8,mla-decode-h16-1x32768-p1 \
  --no-reference --repeats 20 --quiet > "$out/mla_clean_flush.txt" 2>&1
echo "main, ATTNRT_BENCH_FLUSH=clean:"; grep -E "^mla|gather|ordered|memory" "$out/mla_clean_flush.txt" | head -8
tar -C "$out" -czf "$out/ab_runs.tgz" mla gqa && rm -rf "$out/mla" "$out/gqa"
fi
if [ "$part" = race ]; then
source scripts/gpubin.sh
gpubin_unpack .gpubin-main /tmp/ab-bin/main || exit 1
# The GDN extend rows against FlashInfer's published figure (the comparison row and its notes).
timeout 45 /tmp/ab-bin/main/attnrt bench --backend cuda --suite linear \
  --workload flashinfer-gdn,gdn-extend-8x8192,kda-extend-8x8192 --no-reference --repeats 10 \
  --quiet > "$out/linear.txt" 2>&1
grep -E "^(gdn|kda)|FlashInfer" "$out/linear.txt" | head -8
# Where gdn-extend-8x8192's time goes, kernel by kernel (conv, gates, chunk table, prep, state pass).
timeout 40 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'conv|gate|chunk_table|prep|delta|commit' -c 12 \
  /tmp/ab-bin/main/attnrt bench --backend cuda --suite linear --workload gdn-extend-8x8192 \
  --no-reference --repeats 1 --warmup 1 --quiet > "$out/ncu_gdn.txt" 2>&1
echo "ncu gdn-extend-8x8192:"; grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$out/ncu_gdn.txt" | head -24
# racecheck, one test a slot, the timing tests left out.
TOOLS=racecheck UNIT=test SUITE_SECONDS=70 TOTAL_SECONDS=${RACE_SECONDS:-420} OUT=$out \
  bash scripts/gpu_sanitize_suites.sh 'CudaLinearChunked.GdnMatches*:CudaLinearChunked.KdaMatches*:CudaLinearChunked.HeadDim128:CudaLinearSsd.SmallDimsChunk64*:CudaLinearSsd.NemotronShapeBf16StateChunk64:Kinds/CudaLinear.DecodeAndMixedStepsMatchReference/gdn_bf16_small:Kinds/CudaLinear.DecodeAndMixedStepsMatchReference/mamba2_bf16_small:Kinds/CudaLinear.DecodeAndMixedStepsMatchReference/kda_bf16_small:Ranks/CudaDcp.ExtendOverAPrefixThenDecode/n2_gpu_tensors:Ranks/CudaDcp.TreeVerifyThenDecodeAfterCommit/n2_gpu_tensors:Pages/CudaDcpPaged.ChainVerifyThenDecodeAfterAcceptance/n2_gpu_tensors_page16'
fi
