#!/usr/bin/env bash
# The next GPU call (under 600 s), two parts (scripts/gpu_next2.sh is the call after it):
#   0. patches/prefill-defer-wait.patch (.gpubin-defer) against main: the ping-pong prefill loop
#      waits for the previous P V MMA at the top of the next iteration instead of after the
#      softmax, where ptxas had hoisted that wait ahead of the softmax (SASS) and so serialised
#      the softmax behind the P V MMA it was meant to overlap. The prefill suites, racecheck and
#      synccheck of the persistent case, then the prefill / extend rows, two rounds. What should
#      move: every default ping-pong instance (d64, d128, the CTA over fp8 pages, the fp8 CTA of
#      --fp8-prefill-attention through ws_consume_tiles, the same loop): up to ~1/4 of a
#      tile's time where the consumers' softmax is the bound (1x16384, 1x4096, 8x2048, d64,
#      extend); d256 and MLA's MHA form (free-running by default) not at all.
#   1. patches/conv-silu.patch (.gpubin-silu) against main (.gpubin-main): the conv's SiLU through
#      the approximate exp and division (static SASS of conv_vec_kernel<float, bf16, 4>: 3720 ->
#      2864 instructions). Its linear tests, then the linear extend and decode rows, two rounds.
#      What should move: the conv of the extend rows (ncu 1.06 ms at gdn-extend-8x8192, 67% of
#      copy) toward the copy rate; the decode rows' conv_token_kernel a little.
#   usage: OUT=DIR [CALL_SECONDS=560] scripts/gpu_next.sh
#          (carry .gpubin-main, .gpubin-defer, .gpubin-silu, .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin 560
gpubin_unpack .gpubin-silu /tmp/bin-silu || exit 1
gpubin_unpack .gpubin-main /tmp/bin-main || exit 1
gpubin_unpack .gpubin-defer /tmp/bin-defer || exit 1
gpu_stage defer_tests 120 /tmp/bin-defer/attnrt_cuda_tests --gtest_brief=1 \
  --gtest_filter='*CudaPrefill*:*Kv8Prefill*:*CudaMlaMha*:*CudaSwa*:*Fp8Prefill*:*PrefillFp8*'
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in racecheck synccheck; do
  gpu_stage defer_$tool 60 "$CS" --tool $tool --error-exitcode 9 /tmp/bin-defer/attnrt_cuda_tests \
    --gtest_brief=1 --gtest_filter='CudaPrefillWsPingPongTest.MoreWorkItemsThanSms:CudaPrefillWsTmaTest.MoreWorkItemsThanSms:*CudaFp8PrefillTest.RingWrapForTheSanitizers*'
done
OUT=$OUTDIR/defer AB_DEADLINE=130 ROUNDS=2 AB_RUN_SECONDS=60 scripts/gpu_ab.sh \
  prefill-1x16384,prefill-1x4096,prefill-8x2048,prefill-1x8192-d64,prefill-1x8192-d256,extend-8x2048+512,prefill-1x16384-kvfp8,prefill-1x16384-fp8 \
  .gpubin-main .gpubin-defer | tail -9
gpu_stage silu_tests 90 /tmp/bin-silu/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='*Linear*'
OUT=$OUTDIR/silu AB_SUITE=linear AB_DEADLINE=100 ROUNDS=2 AB_RUN_SECONDS=60 scripts/gpu_ab.sh \
  gdn-extend-8x8192,kda-extend-8x8192,mamba2-extend-8x8192,gdn-extend-1x65536-h2v8,gdn-decode-64,mamba2-decode-64 \
  .gpubin-main .gpubin-silu | tail -8
