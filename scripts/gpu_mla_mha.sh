#!/usr/bin/env bash
# MLA's MHA form on the GPU machine, in one call: the GPU test suite (or TESTS, a gtest filter),
# `attnrt bench --suite mla` on the MHA-form rows beside the d128 prefill rows of the same build,
# and torch's best form of the MHA rows (bench/torch_mla_mha.py) with the ratio per row.
#   usage: OUT=DIR scripts/gpu_mla_mha.sh   (carry .gpubin from scripts/gpu_prebuild.sh and .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/o}; mkdir -p $O
source .devdeps/unpack-debs.sh >/dev/null
source scripts/gpubin.sh
B=/tmp/bin; gpubin_unpack .gpubin $B
s=$(date +%s)
timeout ${TEST_TIMEOUT:-300} $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="${TESTS:-*}" > $O/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-s )) s"; grep -E "FAILED|PASSED|SKIPPED|Failure|tests ran" $O/tests.log | head -30
s=$(date +%s)
timeout 200 $B/attnrt bench --backend cuda --suite mla --workload mla-prefill,mla-extend --no-reference \
  --repeats 10 --warmup 2 --json $O/mla_mha.json > $O/mla_mha.txt 2>&1
echo "bench mla rc=$? $(( $(date +%s)-s )) s"; grep -E "^mla-|^ceil|copy|gemm|notes|check" $O/mla_mha.txt | head -20
s=$(date +%s)
timeout 200 $B/attnrt bench --backend cuda --workload prefill-1x16384,prefill-1x4096 --no-reference \
  --repeats 10 --warmup 2 --json $O/prefill.json > $O/prefill.txt 2>&1
echo "bench prefill rc=$? $(( $(date +%s)-s )) s"; grep -E "^prefill" $O/prefill.txt
s=$(date +%s)
(cd bench && timeout 200 python3 torch_mla_mha.py --attnrt-json $O/mla_mha.json --json $O/torch_mha.json) > $O/torch.txt 2>&1
echo "torch rc=$? $(( $(date +%s)-s )) s"; cat $O/torch.txt | tail -20
