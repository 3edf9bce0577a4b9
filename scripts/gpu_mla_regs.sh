#!/usr/bin/env bash
# The call for the fp8 keys-on-M MLA CTA that converts its operands in registers (no producer
# warpgroup): its tests (two stages / two CTAs an SM, and four stages / one CTA an SM), racecheck
# and synccheck over its fp8 cases, then the h16 MLA rows against main, alternating rounds.
#   usage: OUT=DIR bash scripts/gpu_mla_regs.sh   (carry .gpubin-main, .gpubin-mlar,
#          .gpubin-mlar4, .devdeps)
export OUT; source .devdeps/unpack-debs.sh >/dev/null
for b in mlar mlar4; do mkdir -p /tmp/$b && tar -C /tmp/$b -xJf .gpubin-$b/bin.tar.xz; done
echo "== mlar tests"
timeout 200 /tmp/mlar/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Mla*:*Dsa*:*Split*' \
  >$OUT/mlar_tests.log 2>&1
echo rc=$?; grep -E "FAILED|Failure|PASSED|SKIPPED" $OUT/mlar_tests.log | head -12
echo "== mlar4 tests"
timeout 90 /tmp/mlar4/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMlaCta.*' \
  >$OUT/mlar4_tests.log 2>&1
echo rc=$?; grep -E "FAILED|PASSED" $OUT/mlar4_tests.log | head -6
for tool in racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool /tmp/mlar/attnrt_cuda_tests --gtest_brief=1 \
    --gtest_filter='CudaMlaCta.KeysOnMItemsOfSeveralTokens' >$OUT/$tool.log 2>&1
  echo "$tool rc=$?: $(grep -E 'SUMMARY|PASSED|FAILED' $OUT/$tool.log | tr '\n' ' ')"
done
echo "== A/B"
rows=mla-decode-h16-64x8192-fp8,mla-decode-h16-1x32768-fp8,mla-decode-h16-64x8192,mla-decode-h16-1x32768
AB_SUITE=mla ROUNDS=3 OUT=$OUT/ab AB_DEADLINE=200 scripts/gpu_ab.sh $rows .gpubin-main .gpubin-mlar \
  .gpubin-mlar4 2>&1 | grep -v "^copy" | tail -6
echo "== checked fp8 row"
/tmp/mlar/attnrt bench --backend cuda --suite mla --workload mla-decode-h16-64x8192-fp8,mla-decode-h16-1x32768-fp8 \
  --repeats 3 2>&1 | grep -E "^mla" | head -4
