# Sourced by the GPU scripts that take prebuilt binaries (scripts/gpu_prebuild.sh DIR/bin.tar.xz).
# gpubin_label DIR: the label of DIR in tables and file names (its name without a leading
# ".gpubin-" or "."). gpubin_unpack DIR DEST: unpacks DIR/bin.tar.xz into DEST; fails when it
# holds no attnrt binary.
gpubin_label() {
  local label
  label=$(basename "$1")
  label=${label#.gpubin-}
  echo "${label#.}"
}

gpubin_unpack() {
  mkdir -p "$2"
  if ! tar -C "$2" -xJf "$1/bin.tar.xz" || [ ! -x "$2/attnrt" ]; then
    echo "$1/bin.tar.xz does not hold an attnrt binary (build it with scripts/gpu_prebuild.sh or scripts/gpu_prebuild_refs.sh)"
    return 1
  fi
}

# gpu_logs_setup: the start of a one-call GPU script run from the repository root. Logs go under
# O=$OUT/logs and are packed into $OUT/logs.tar.gz at exit (at most 8 files come back from a call);
# the .devdeps libraries are unpacked.
gpu_logs_setup() {
  OUTDIR=${OUT:-/tmp/o}
  O=$OUTDIR/logs
  mkdir -p "$O"
  trap 'tar -C "$OUTDIR" -czf "$OUTDIR/logs.tar.gz" logs && rm -rf "$O"' EXIT
  source .devdeps/unpack-debs.sh >/dev/null
}

# gpu_call_begin SECONDS: gpu_logs_setup, the call's end GPU_END (now + CALL_SECONDS, else
# SECONDS; gpu_stage skips what would pass it) and the card's name and clock, first in the output.
gpu_call_begin() {
  gpu_logs_setup
  GPU_END=$(($(date +%s) + ${CALL_SECONDS:-$1}))
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
}

# gpu_call_setup: gpu_logs_setup, and the prebuilt binaries of .gpubin go to B=/tmp/bin.
gpu_call_setup() {
  gpu_logs_setup
  B=/tmp/bin
  gpubin_unpack .gpubin "$B"
}

# gpu_stage NAME SECONDS COMMAND...: runs COMMAND under a timeout of SECONDS into $O/NAME.log, then
# prints its exit code, time, gtest / compute-sanitizer verdicts and first failure lines. A stage
# that would end past GPU_END (seconds since the epoch; unset: no bound) is skipped and says so.
gpu_stage() {
  local name=$1 t=$2 s rc
  shift 2
  s=$(date +%s)
  if [ -n "${GPU_END:-}" ] && [ $((s + t)) -gt "$GPU_END" ]; then
    echo "$name: not run (the call's time is spent)"
    return
  fi
  timeout "$t" "$@" >"$O/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - s)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]|ERROR SUMMARY|RACECHECK SUMMARY' "$O/$name.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \] [A-Z]|Failure|Which is|Expected|error:" "$O/$name.log" | head -12
}

# gpubin_unpack_labels LABEL...: .gpubin-LABEL of each into /tmp/ab-bin/LABEL (exits on a bad one).
gpubin_unpack_labels() {
  local v
  for v in "$@"; do gpubin_unpack ".gpubin-$v" "/tmp/ab-bin/$v" >/dev/null || exit 1; done
}

# bench_rates TAG: `attnrt bench` output on stdin -> "TAG ROW RATE UNIT" a row (GB/s or GFLOP/s),
# for the one-process-a-binary A/B loops of the call scripts.
bench_rates() {
  awk -v t="$1" '{for (i = 1; i <= NF; i++) if (($i == "GB/s" || $i == "GFLOP/s") && $1 !~ /^(memory|bf16|fp32|gather|ordered)$/) printf "%s %s %s %s\n", t, $1, $(i - 1), $i}'
}

# gpu_call_labels SECONDS LABEL...: gpu_call_begin SECONDS, then gpubin_unpack_labels LABEL...
gpu_call_labels() {
  gpu_call_begin "$1"
  shift
  gpubin_unpack_labels "$@"
}

# The decode / verify rows of `attnrt bench --suite mla` that the MLA A/B calls alternate over.
MLA_AB_ROWS=mla-decode-h16-1x32768,mla-decode-h16-64x8192,mla-decode-h128-64x4096
MLA_AB_ROWS=$MLA_AB_ROWS,mla-decode-h128-128x8192,mla-decode-h16-1x32768-fp8
MLA_AB_ROWS=$MLA_AB_ROWS,mla-decode-h16-64x8192-fp8,mla-decode-h128-64x4096-fp8
MLA_AB_ROWS=$MLA_AB_ROWS,mla-decode-h128-128x8192-fp8,mla-decode-h16-1x32768-p1
MLA_AB_ROWS=$MLA_AB_ROWS,mla-decode-h16-64x8192-p1,mla-decode-h128-64x4096-p1
MLA_AB_ROWS=$MLA_AB_ROWS,mla-decode-h128-128x8192-p1,mla-verify-chain-64x4096+4
MLA_AB_ROWS=$MLA_AB_ROWS,mla-verify-tree-64x4096+16-topk4

# mla_ab_round LABEL ROUND: one bench process of /tmp/ab-bin/LABEL over MLA_AB_ROWS (rates and
# ceilings printed as "LABEL rROUND ..."; the log in $O/bench_LABEL_rROUND.log), then the h128 fp8
# row at page 1.
mla_ab_round() {
  local bin=/tmp/ab-bin/$1/attnrt log=$O/bench_$1_r$2.log
  timeout 60 $bin bench --backend cuda --suite mla --no-reference --quiet --workload $MLA_AB_ROWS \
    --json "$O/$1_r$2.json" >"$log" 2>&1
  bench_rates "$1 r$2" <"$log"
  awk -v t="$1 r$2 ceiling" '$1 ~ /^(memory|bf16)$/ {print t, $0}' "$log"
  timeout 20 $bin bench --backend cuda --suite mla --no-reference --quiet --page-size 1 \
    --workload mla-decode-h128-64x4096-fp8 --json "$O/$1-p1_r$2.json" 2>&1 |
    bench_rates "$1 r$2 page1"
}

# mla_ab_rounds RESERVE LABEL...: two rounds of mla_ab_round over the LABELs in turn, stopping
# where fewer than RESERVE seconds are left before GPU_END (the stages after the rows).
mla_ab_rounds() {
  local reserve=$1 r v
  shift
  for r in 1 2; do
    for v in "$@"; do
      [ "$(date +%s)" -gt $((GPU_END - reserve)) ] && { echo "rows: out of time"; return; }
      mla_ab_round "$v" "$r"
    done
  done
}

# ab_table BASE: bench/ab.py's tables of the --json reports under $O (mla_ab_round's), against the
# label BASE: the rows at the suite's page size, then mla_ab_round's page-1 row (labels LABEL-p1,
# so that its row is held against BASE's page-1 run, not BASE's row of the same name at page 64).
# Printed last by the call scripts, so that a `tail` of the call's output keeps them.
ab_table() {
  local main=() p1=() f
  for f in "$O"/*.json; do
    case $f in *-p1_r*.json) p1+=("$f") ;; *) main+=("$f") ;; esac
  done
  [ ${#main[@]} -gt 0 ] && python3 bench/ab.py "${main[@]}" --base "$1" 2>&1 | tail -n 40
  [ ${#p1[@]} -gt 0 ] && python3 bench/ab.py "${p1[@]}" --base "$1-p1" 2>&1 | tail -n 6
  return 0
}

# gpu_ncu_profile NAME SECONDS BIN SUITE ROW KERNEL_REGEX: Nsight Compute's stall samples and source
# counters of one launch of KERNEL_REGEX (the third) on a bench row of BIN/attnrt, as a gpu_stage:
# $O/NAME.ncu-rep and NAME.csv, then bench/ncu_stalls.py's reasons, top instructions and
# shared-memory wavefronts by opcode (NCU_STALLS_ARGS, default "--top 12 --context 2").
gpu_ncu_profile() {
  local name=$1 t=$2 bin=$3 suite=$4 row=$5 kernel=$6 ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  gpu_stage "$name" "$t" "$ncu" --clock-control none --kernel-name "regex:$kernel" --launch-skip 2 \
    --launch-count 1 --section WarpStateStats --section SourceCounters -f -o "$O/$name" \
    "$bin/attnrt" bench --backend cuda --suite "$suite" --workload "$row" --repeats 2 --warmup 1 \
    --no-reference --quiet ${STALLS_BENCH_ARGS:-}
  if [ ! -f "$O/$name.ncu-rep" ]; then
    echo "$name: no profile (no launch of a kernel matching $kernel?)"
    return
  fi
  "$ncu" -i "$O/$name.ncu-rep" --page source --csv --print-source sass >"$O/$name.csv" 2>/dev/null
  # shellcheck disable=SC2086
  python3 bench/ncu_stalls.py "$O/$name.csv" ${NCU_STALLS_ARGS:---top 12 --context 2} | head -90
}

# mla_checked LABEL TEST_SECONDS FILTER: /tmp/ab-bin/LABEL's MLA tests of FILTER, then racecheck and
# synccheck of the page-size test (every MLA CTA on pages 1 .. 128, bf16 and e4m3), as gpu_stages
# tests_LABEL, race_LABEL and sync_LABEL.
mla_checked() {
  local b=/tmp/ab-bin/$1/attnrt_cuda_tests f='CudaMlaCta.NativePageSizesWithRaggedLengths'
  gpu_stage "tests_$1" "$2" "$b" --gtest_brief=1 --gtest_filter="$3"
  gpu_stage "race_$1" 60 compute-sanitizer --tool racecheck --print-limit 3 "$b" --gtest_brief=1 \
    --gtest_filter=$f
  gpu_stage "sync_$1" 25 compute-sanitizer --tool synccheck --num-cuda-barriers 65536 \
    --print-limit 3 "$b" --gtest_brief=1 --gtest_filter=$f
}
