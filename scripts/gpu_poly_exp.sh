#!/usr/bin/env bash
# The poly-exp call (patches/README.md): tests of the patched build, then the prefill and fp8 rows,
# main against the builds with every 4th / 2nd pair of exp2 on the FMA pipe (see the README row).
#   usage: OUT=DIR bash scripts/gpu_poly_exp.sh   (carry .gpubin-main, -pe4, -pe2, -pe4f, .devdeps)
export OUT; source .devdeps/unpack-debs.sh >/dev/null; mkdir -p /tmp/pe4f && tar -C /tmp/pe4f -xJf .gpubin-pe4f/bin.tar.xz
echo "== pe4f tests"; timeout 100 /tmp/pe4f/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*CudaPrefillWs*:*CudaMlaMha*:*Fp8Prefill*:*Kv8*:*Nonfinite*:*Swa*' > $OUT/pe4f_tests.log 2>&1; echo rc=$?; tail -3 $OUT/pe4f_tests.log
echo "== prefill A/B"; ROUNDS=2 OUT=$OUT/pf AB_DEADLINE=100 scripts/gpu_ab.sh prefill-1x16384,prefill-8x2048,prefill-1x8192-d64,extend-8x2048+512 .gpubin-main .gpubin-pe4 .gpubin-pe2 2>&1 | grep -v "^copy" | tail -6
echo "== fp8 A/B"; ROUNDS=2 OUT=$OUT/f8 AB_DEADLINE=60 scripts/gpu_ab.sh prefill-1x16384-fp8,prefill-8x2048-fp8,extend-8x2048+512-fp8 .gpubin-main .gpubin-pe4f 2>&1 | grep -v "^copy" | tail -5
