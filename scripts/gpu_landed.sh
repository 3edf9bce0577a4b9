#!/usr/bin/env bash
# The call that verifies the landed tree (.gpubin, from scripts/gpu_prebuild.sh) and measures it
# against torch in the same call, bounded to CALL_SECONDS (default 590; stages that would pass it
# are skipped and say so), most needed first:
#   1. the tests of the kernels a round changed (TESTS, a gtest filter; default: every prefill CTA,
#      MLA, SWA, kv8 prefill, the backend, splits, graphs), or the whole suite with TESTS='*';
#   2. compute-sanitizer racecheck and synccheck of the persistent prefill cases (ping-pong with
#      the cp.async producer, and the default TMA producer);
#   3. the decode and prefill rows (attnrt bench; the host plan at batch 256 is in its output),
#      torch's flash and cuDNN on the same shapes (bench/torch_sdpa.py --from) and the ratios;
#   4. the MLA rows, torch's forms of them (bench/torch_mla.py --from) and the ratios;
#   5. gdn-decode-64 (linear suite; % of copy).
#   usage: OUT=DIR [CALL_SECONDS=590] [TESTS=filter] [TESTS_SECONDS=170] [SANITIZE=0]
#          scripts/gpu_landed.sh
#          (carry .gpubin, .devdeps; the whole suite, TESTS='*', takes ~215 s on an H100)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 590
gpubin_unpack .gpubin /tmp/bin || exit 1
B=/tmp/bin
$B/attnrt info 2>&1 | sed -n 3p
tests=${TESTS:-'*Prefill*:*Mla*:*Swa*:*Kv8*:CudaBackendTest.*:*Split*:*Graph*'}
gpu_stage tests "${TESTS_SECONDS:-170}" $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="$tests"
pers='CudaPrefillWsPingPongTest.MoreWorkItemsThanSms:CudaPrefillWsTmaTest.MoreWorkItemsThanSms'
for tool in racecheck synccheck; do
  [ "${SANITIZE:-1}" = 1 ] || break
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  gpu_stage $tool 40 compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 9 \
    $B/attnrt_cuda_tests --gtest_filter="$pers"
done
rows=decode-1x32768,decode-16x4096,decode-64x4096,prefill-1x16384,prefill-1x4096,prefill-8x2048
rows=$rows,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512
gpu_stage bench 45 $B/attnrt bench --backend cuda --workload $rows --no-reference --repeats 10 \
  --warmup 2 --json $O/attn.json
grep -E "^(prefill|extend|decode)|plan|ceiling" $O/bench.log | head -16
gpu_stage torch_sdpa 45 python3 bench/torch_sdpa.py --device cuda --kernels flash,cudnn --from \
  $O/attn.json --json $O/attn_torch.json
python3 bench/compare.py $O/attn.json $O/attn_torch.json 2>&1 | tail -11
mla=mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h128-64x4096,mla-decode-h16-64x8192-fp8
mla=$mla,mla-decode-h16-1x32768-fp8,mla-decode-h128-64x4096-fp8
gpu_stage mla 50 $B/attnrt bench --backend cuda --suite mla --workload $mla --no-reference \
  --repeats 10 --warmup 2 --json $O/mla.json
grep -E "^mla" $O/mla.log | head -8
gpu_stage torch_mla 60 python3 bench/torch_mla.py --device cuda --from $O/mla.json \
  --attnrt-json $O/mla.json --json $O/mla_torch.json
tail -10 $O/torch_mla.log
gpu_stage gdn 30 $B/attnrt bench --backend cuda --suite linear --workload gdn-decode-64 --no-reference \
  --repeats 10 --warmup 2
grep -E "^gdn|copy" $O/gdn.log | head -3
