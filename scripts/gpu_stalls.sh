#!/usr/bin/env bash
# Nsight Compute's stall samples, instruction by instruction, of one launch of a kernel on a bench
# row, read with bench/ncu_stalls.py (reasons, top instructions with context, loads used at once).
#   usage: OUT=$OUT scripts/gpu_stalls.sh GPUBIN SUITE:ROW:KERNEL_REGEX [...]
#          e.g. scripts/gpu_stalls.sh .gpubin-head2 attention:prefill-1x16384:prefill_ws \
#                 attention:prefill-1x16384-fp8:prefill_fp8_ws
#          (carry GPUBIN and .devdeps; about 40 s a profile). Extra bench options for every row:
#          STALLS_BENCH_ARGS (e.g. "--fp8-prefill-attention"). Files in $OUT/logs: NAME.ncu-rep and
#          NAME.csv a profile (NAME: the row and the kernel regex), packed into logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
source scripts/gpubin.sh
gpu_call_begin "${CALL_SECONDS:-500}"
bin=/tmp/stalls-bin
gpubin_unpack "$1" $bin >/dev/null || exit 1
shift
for spec in "$@"; do
  IFS=: read -r suite row kernel <<<"$spec"
  name=$(echo "${row}_${kernel}" | tr -c 'A-Za-z0-9_.+-' '_')
  left=$((GPU_END - $(date +%s)))
  [ $left -lt 45 ] && { echo "$spec: not run (the call's time is spent)"; continue; }
  echo "== $spec"
  gpu_ncu_profile "$name" $((left - 5)) $bin "$suite" "$row" "$kernel"
done
