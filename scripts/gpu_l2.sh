#!/usr/bin/env bash
# The call that measures patches/l2-read-once.patch (.gpubin-l2) against main (.gpubin-main), and
# puts the landed tree's late MLA page ids through the sanitizers first:
#  1. racecheck and synccheck of CudaMlaCta.NativePageSizesWithRaggedLengths (every MLA CTA at
#     pages 1 .. 128, bf16 and e4m3) on main;
#  2. the l2 binary's decode / MLA tests, then two rounds of the GQA decode rows under the bench's
#     write flush (where the patch should gain) and under the clean flush (where it should not);
#  3. two rounds of the h16 MLA rows, with mla-decode-h128-64x4096 as a control (the paired-tile
#     CTA does not take the policy);
#  4. the linear layers' decode kernel (its state's bulk copies under the same policy): the
#     CudaLinear tests, then two rounds of the gdn / mamba2 decode rows;
#  5. on main's binary, the paired-tile CTA's page ids in shared memory (the default at pages up
#     to 16) against registers (ATTNRT_MLA_PAIRS_IDS_MAX_PAGE=0) on the h128 rows at pages 1 and
#     16, two rounds alternating.
#   usage: OUT=$OUT scripts/gpu_l2.sh  (carry .gpubin-main, .gpubin-l2, .devdeps; ~7 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_labels "${CALL_SECONDS:-480}" main l2
f=CudaMlaCta.NativePageSizesWithRaggedLengths
gpu_stage race_main 60 compute-sanitizer --tool racecheck --print-limit 3 \
  /tmp/ab-bin/main/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$f
gpu_stage sync_main 30 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 \
  --print-limit 3 /tmp/ab-bin/main/attnrt_cuda_tests --gtest_brief=1 --gtest_filter=$f
rows=decode-1x32768,decode-16x4096,decode-64x4096,decode-64x4096-fp8
OUT=$O/ab AB_DEADLINE=240 AB_TESTS='CudaBackendTest.*:CudaMlaCta.*:*Split*:*Graph*:CudaLinear*' \
  AB_TEST_SECONDS=150 scripts/gpu_ab.sh $rows .gpubin-main .gpubin-l2 2>&1 | tail -n 9 | cut -c1-600
OUT=$O/clean AB_ENV=ATTNRT_BENCH_FLUSH=clean AB_DEADLINE=60 scripts/gpu_ab.sh $rows .gpubin-main \
  .gpubin-l2 2>&1 | tail -n 5
mla=mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h16-64x8192-fp8
mla=$mla,mla-decode-h16-64x8192-p1,mla-decode-h128-64x4096
OUT=$O/mla AB_SUITE=mla AB_DEADLINE=60 scripts/gpu_ab.sh $mla .gpubin-main .gpubin-l2 2>&1 | tail -n 6
lin=gdn-decode-64,gdn-decode-256,mamba2-decode-64,mamba2-decode-256
OUT=$O/linear AB_SUITE=linear AB_DEADLINE=60 scripts/gpu_ab.sh $lin .gpubin-main .gpubin-l2 2>&1 |
  tail -n 6
h128=mla-decode-h128-64x4096,mla-decode-h128-64x4096-fp8
for r in 1 2; do
  for ids in 16 0; do
    for page in 1 16; do
      [ "$(date +%s)" -gt $((GPU_END - 20)) ] && break 3
      ATTNRT_MLA_PAIRS_IDS_MAX_PAGE=$ids timeout 60 /tmp/ab-bin/main/attnrt bench --backend cuda \
        --suite mla --no-reference --quiet --page-size $page --workload $h128 2>&1 |
        bench_rates "ids<=$ids page$page r$r"
    done
  done
done
