#!/usr/bin/env bash
# One call that tests MLA kernel candidates and times them against a base: each candidate's MLA
# tests (TESTS, a gtest filter; default every CudaMlaCta test), racecheck and synccheck of the
# first candidate over the keys-on-M items of several tokens, then ROWS (default the h16 fp8 and
# bf16 decode rows) in ROUNDS alternating rounds (scripts/gpu_ab.sh; the first folder is the base).
#   usage: OUT=DIR bash scripts/gpu_mla_ab.sh BASE CANDIDATE...   (prebuilt folders, each carried
#          with .devdeps; e.g. .gpubin-main .gpubin-x)
export OUT; source .devdeps/unpack-debs.sh >/dev/null
rows=${ROWS:-mla-decode-h16-64x8192-fp8,mla-decode-h16-1x32768-fp8,mla-decode-h16-64x8192,mla-decode-h16-1x32768}
first=${2#.gpubin-}
for dir in "${@:2}"; do
  b=${dir#.gpubin-}
  mkdir -p /tmp/$b && tar -C /tmp/$b -xJf $dir/bin.tar.xz
  timeout ${TEST_SECONDS:-90} /tmp/$b/attnrt_cuda_tests --gtest_brief=1 \
    --gtest_filter="${TESTS:-CudaMlaCta.*}" >$OUT/tests_$b.log 2>&1
  echo "tests $b rc=$?: $(grep -E '^\[  (PASSED|FAILED)|Failure' $OUT/tests_$b.log | head -4 | tr '\n' ' ')"
done
for tool in racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool /tmp/$first/attnrt_cuda_tests --gtest_brief=1 \
    --gtest_filter='CudaMlaCta.KeysOnMItemsOfSeveralTokens' >$OUT/$tool.log 2>&1
  echo "$tool $first rc=$?: $(grep -E 'SUMMARY|PASSED|FAILED' $OUT/$tool.log | tr '\n' ' ')"
done
AB_SUITE=mla ROUNDS=${ROUNDS:-3} OUT=$OUT/ab AB_DEADLINE=${AB_DEADLINE:-200} scripts/gpu_ab.sh $rows "$@" 2>&1 |
  grep -v "^copy" | tail -6
