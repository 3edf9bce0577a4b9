#!/usr/bin/env bash
# One GPU call of under 600 s for two changes of main (.gpubin-main) against the binary before them
# (.gpubin-before):
#   1. the tests: the linear-layer suites, the prefill suites and the host plan's (the prefill
#      work list now in L2-sized sections of requests by default);
#   2. racecheck over the three state-pass tests that showed hazards between the consumers' plain
#      reads of a stage and the producer's next bulk copy into it (every consumer thread now
#      arrives on the stage's empty barrier);
#   3. the linear extend rows, before against main, two rounds (what should move: nothing; 256
#      arrivals a chunk instead of 8);
#   4. the attention prefill, extend and verify rows under main with the sections (the default)
#      and without (ATTNRT_PREFILL_SECTION_MB=0), two rounds (what should move: the rows of
#      several requests of several query tiles: prefill-8x2048 and the extend rows ~4-5%; the
#      single-request and verify rows not at all).
#   usage: OUT=DIR [CALL_SECONDS=570] scripts/gpu_sections_linear.sh
#          (carry .gpubin-main, .gpubin-before, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_logs_setup
GPU_END=$(($(date +%s) + ${CALL_SECONDS:-570}))
B=/tmp/bin-main
gpubin_unpack .gpubin-main $B || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
gpu_stage tests 200 $B/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*Linear*:*CudaPrefill*:*Kv8Prefill*:*CudaMlaMha*:*CudaHostPlan*:*Verify*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
gpu_stage racecheck 90 "$CS" --tool racecheck --error-exitcode 9 $B/attnrt_cuda_tests \
  --gtest_brief=1 --gtest_filter='CudaLinearChunked.HeadDim128:CudaLinearChunked.GdnMatchesRecurrenceOnRaggedRequests:CudaLinearChunked.KdaMatchesRecurrenceOnRaggedRequests'
left=$((GPU_END - $(date +%s)))
if [ $left -gt 200 ]; then
  OUT=$OUTDIR/linear AB_SUITE=linear AB_DEADLINE=120 ROUNDS=2 AB_RUN_SECONDS=50 scripts/gpu_ab.sh \
    gdn-extend-8x8192,kda-extend-8x8192,gdn-extend-1x65536-h2v8 .gpubin-before .gpubin-main \
    | tail -6
else
  echo "linear a/b: not run ($left s left)"
fi
# The sections against one section, the same binary, alternated.
S=$OUTDIR/sections
mkdir -p "$S"
for round in 1 2; do
  for mb in 0 default; do
    env_mb=()
    [ $mb = 0 ] && env_mb=(ATTNRT_PREFILL_SECTION_MB=0)
    label=one_section
    [ $mb = default ] && label=sections
    gpu_stage "${label}_r$round" 60 env "${env_mb[@]}" $B/attnrt bench --backend cuda \
      --workload prefill,extend,verify --no-reference --repeats 10 --warmup 2 --quiet \
      --json "$S/${label}_r$round.json"
  done
done
python3 bench/ab.py "$S" --base one_section | tee "$OUTDIR/sections.txt"
