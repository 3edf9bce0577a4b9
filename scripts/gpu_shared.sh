#!/usr/bin/env bash
# Several attnrt processes on one GPU at once, as serving engines share one: PROCS copies of
# `attnrt run` (the trace tests/data/shared_gpu_trace.jsonl, one layer of qwen2.5-7b, CUDA graphs
# on, no per-step checks) start together and each writes one DECODE step as a replay case; then
# each case is replayed eagerly on the GPU, alone. A recorded output that differs from its replay
# by more than MAXERR (graph and eager steps split the keys differently, so they agree to rounding
# only) is wrong. Configurations: the first graph step at pages 64, 128, 16, 1 (bf16 and fp8 KV),
# and a later one. This is the experiment of the defect of wrong first graph steps on a shared GPU
# (docs/cuda_graphs.md).
#   usage: scripts/gpu_shared.sh CLI OUTDIR [PROCS]   (MAXERR=0.02)
# Prints one line per configuration and exits 1 when any dump was wrong or a process failed.
set -uo pipefail
cli=$1
out=$2
procs=${3:-8}
maxerr=${MAXERR:-0.02}
trace=$(cd "$(dirname "$0")/.." && pwd)/tests/data/shared_gpu_trace.jsonl
mkdir -p "$out"
status=0
# page, kv dtype, step (17 is the first DECODE step at pages 64 and 128, 15 at pages 16 and 1).
for cfg in "64 fp8_e5m2 17" "64 bf16 17" "64 fp8_e4m3 17" "128 bf16 17" "16 fp8_e5m2 15" \
  "1 bf16 15" "64 fp8_e5m2 19"; do
  read -r page kv step <<<"$cfg"
  dir=$out/p${page}_${kv}_s$step
  rm -rf "$dir" && mkdir -p "$dir"
  pids=()
  for i in $(seq 1 "$procs"); do
    "$cli" run --model qwen2.5-7b --trace "$trace" --no-progress --attention-backend cuda \
      --seed 456 --layers 1 --chunked-prefill-size 48 --check-every 0 --page-size "$page" \
      --kv-cache-dtype "$kv" --dump-step "$step" "$dir/case$i" >"$dir/run$i.log" 2>&1 &
    pids+=($!)
  done
  failed_runs=0
  for p in "${pids[@]}"; do wait "$p" || failed_runs=$((failed_runs + 1)); done
  wrong=0
  worst=0
  for i in $(seq 1 "$procs"); do
    line=$("$cli" replay "$dir/case$i" --backend cuda 2>&1 | grep 'vs recorded output')
    echo "p$page $kv step $step case$i: ${line#*: }" >>"$out/replays.log"
    err=$(sed -nE 's/.*largest error ([0-9.eE+-]+).*/\1/p' <<<"$line")
    [ -z "$err" ] && { grep -q 'bit-exact' <<<"$line" && err=0 || err=inf; }
    if awk -v e="$err" -v m="$maxerr" 'BEGIN { exit !(e == "inf" || e + 0 > m + 0) }'; then
      wrong=$((wrong + 1))
    fi
    worst=$(awk -v a="$worst" -v b="$err" 'BEGIN { print (b == "inf" || b + 0 > a + 0) ? b : a }')
  done
  printf 'shared  page %-3s %-9s step %-2s  %d processes: %d wrong, %d failed runs, largest error %s\n' \
    "$page" "$kv" "$step" "$procs" "$wrong" "$failed_runs" "$worst"
  [ "$wrong" -gt 0 ] || [ "$failed_runs" -gt 0 ] && status=1
done
exit $status
