#!/usr/bin/env bash
# The call for the prepared prefill patches (patches/README.md): tests of each patched build, then
# the prefill rows (main against poly-exp at every 4th / 2nd pair and Q by TMA with the producer's
# registers) and the fp8 rows (main against poly-exp with the fp8 CTA), alternating rounds.
#   usage: OUT=DIR bash scripts/gpu_prepared.sh
#          (carry .gpubin-main, .gpubin-pe4, .gpubin-pe2, .gpubin-pe4f, .gpubin-qtmar, .devdeps)
export OUT; source .devdeps/unpack-debs.sh >/dev/null
for b in pe4f pe2 qtmar; do mkdir -p /tmp/$b && tar -C /tmp/$b -xJf .gpubin-$b/bin.tar.xz; done
echo "== pe4f tests"; timeout 130 /tmp/pe4f/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Prefill*:*Mla*:*Swa*:*Kv8*:*Nonfinite*' > $OUT/pe4f_tests.log 2>&1; echo rc=$?; tail -3 $OUT/pe4f_tests.log
echo "== pe2 tests"; timeout 40 /tmp/pe2/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*CudaPrefillWs*' 2>&1 | tail -2
echo "== qtmar tests"; timeout 120 /tmp/qtmar/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Prefill*:*MlaMha*:*Swa*' > $OUT/qtmar_tests.log 2>&1; echo rc=$?; tail -3 $OUT/qtmar_tests.log
echo "== prefill A/B"; ROUNDS=3 OUT=$OUT/pf AB_DEADLINE=200 scripts/gpu_ab.sh prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512 .gpubin-main .gpubin-pe4 .gpubin-pe2 .gpubin-qtmar 2>&1 | grep -v "^copy" | tail -8
echo "== fp8 A/B"; ROUNDS=3 OUT=$OUT/f8 AB_DEADLINE=80 scripts/gpu_ab.sh prefill-1x16384-fp8,prefill-1x4096-fp8,prefill-8x2048-fp8,extend-8x2048+512-fp8 .gpubin-main .gpubin-pe4f 2>&1 | grep -v "^copy" | tail -6
