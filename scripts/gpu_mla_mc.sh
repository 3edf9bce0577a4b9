#!/usr/bin/env bash
# The call that explains why the paired-tile CTA's two-CTA multicast clusters (ATTNRT_MLA_MC=1) ran
# 0.95x one CTA an item on 05d9239's tree, after 1.01-1.03x when they landed (docs/BENCHMARKS.md):
#  1. the h128 rows with the clusters on and off, one bench process a setting, alternating twice;
#  2. Nsight Compute of both instances on mla-decode-h128-64x4096 (stall reasons, top
#     instructions, shared-memory wavefronts): the clusters' `barrier` and `long_sb` samples (the
#     free barriers both CTAs arrive on, the multicast boxes' arrival) against the one-CTA form.
#   usage: OUT=$OUT scripts/gpu_mla_mc.sh [GPUBIN]  (default .gpubin; carry it and .devdeps; ~3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpubin.sh
gpu_call_begin "${CALL_SECONDS:-240}"
B=/tmp/mc-bin
gpubin_unpack "${1:-.gpubin}" $B >/dev/null || exit 1
rows=mla-decode-h128-64x4096,mla-decode-h128-128x8192,mla-verify-chain-64x4096+4
for r in 1 2; do
  for mc in 0 1; do
    ATTNRT_MLA_MC=$mc timeout 30 $B/attnrt bench --backend cuda --suite mla --no-reference --quiet \
      --workload $rows --json "$O/mc${mc}_r${r}.json" 2>&1 | bench_rates "mc=$mc r$r"
  done
done
ATTNRT_MLA_MC=0 gpu_ncu_profile one_cta 60 $B mla mla-decode-h128-64x4096 mla_pairs_kernel
ATTNRT_MLA_MC=1 gpu_ncu_profile clusters 60 $B mla mla-decode-h128-64x4096 mla_pairs_mc_kernel
ab_table mc0
