#!/usr/bin/env bash
# A/B of the MHA-form CTA variants (ATTNRT_MLA_MHA_CTA) on the GPU machine: each variant's MHA
# tests and its mla-prefill / mla-extend rows; with TMA=0 also the cp.async producer.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p $O
source .devdeps/unpack-debs.sh >/dev/null; source scripts/gpubin.sh; B=/tmp/bin; gpubin_unpack .gpubin $B
for v in ${VARIANTS:-0 1 2 3}; do
  for tma in ${TMAS:-1}; do
    tag=v${v}_tma$tma
    ATTNRT_PREFILL_TMA=$tma ATTNRT_MLA_MHA_CTA=$v timeout 100 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter='CudaMlaMha*' > $O/t_$tag.log 2>&1
    echo "$tag tests rc=$? $(grep -E 'PASSED|FAILED' $O/t_$tag.log | head -2 | tr '\n' ' ')"
    ATTNRT_PREFILL_TMA=$tma ATTNRT_MLA_MHA_CTA=$v timeout 100 $B/attnrt bench --backend cuda --suite mla --workload mla-prefill,mla-extend --no-reference --repeats 10 --warmup 2 --json $O/$tag.json > $O/$tag.txt 2>&1
    grep -E "^mla-" $O/$tag.txt | sed "s/^/$tag /" | cut -c1-150
  done
done
