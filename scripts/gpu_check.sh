#!/usr/bin/env bash
# The GPU check of the cuda backend: on the GPU machine, from the project root, in one call that
# keeps within a deadline (ATTNRT_GPU_DEADLINE seconds, default 560, so that a 600 s limit on the
# command still gets every file back):
#   build     Release, sm_90a: attnrt_cuda_tests and the attnrt CLI (always; ninja is incremental)
#   test      every GPU test: backend, prefill, CUDA graphs through AttentionRuntime, the row
#             copies, attnrt run's driver, bench on the GPU
#   check     attnrt check --backend cuda (the conformance suite, one line per feature)
#   run       attnrt run with the defaults (must auto-select cuda; DECODE steps as CUDA graphs,
#             sampled steps of every mode against reference), then a speculative tree run on pages
#             of 16 (verify graphs, accepted rows moved inside the GPU pools), then the hybrid
#             presets (qwen3-next-80b, nemotron-h-8b, kimi-linear-48b, each also with
#             speculative chain verify) and the SWA-hybrid gemma3-12b
#   bench     attnrt bench --backend cuda --json: ceilings, every standard row, host plan at batch
#             256, graph replay of a 32-layer decode step
#   linear    attnrt bench --backend cuda --suite linear (GDN / KDA / Mamba2 layers), then
#             bench/torch_linear.py --device cuda on those rows (the torch forms that ship with
#             transformers) and bench/compare.py, when torch with CUDA and transformers are installed
#   shared    scripts/gpu_shared.sh: 8 attnrt processes on the GPU at once, each dumping a DECODE
#             graph step, every dump replayed eagerly (the recorded outputs must agree)
#   sanitize  compute-sanitizer racecheck and synccheck over the CUDA-graph tests and attnrt run
#             (graphs on, every step checked)
#   memcheck  compute-sanitizer --tool memcheck over attnrt run, the conformance suite (attnrt
#             check --backend cuda), then over the GPU tests
#   torch     bench/torch_sdpa.py --device cuda on the bench rows (SDPA flash, cuDNN,
#             FlexAttention) and bench/compare.py, when torch with CUDA is installed
# Stages run in that order; one that would start with too little time left is skipped and says
# so (run it alone in a second call). Files in $OUT (default ./out/gpu), at most 8: summary.txt,
# tests.log (the GPU tests, then the logs of check, run and memcheck, each under a ### header),
# run.json, bench.log (bench, linear and both torch comparisons), bench.json, torch.json,
# bench_linear.json, torch_linear.json; build.log only when the build fails. The summary table is
# printed last.
#   usage: scripts/gpu_check.sh [all|STAGE[,STAGE...]] [gtest filter]
#          (stages: test, check, run, shared, bench, linear, sanitize, memcheck, torch; they run in
#          the order above)
# ATTNRT_GPU_BENCH_WORKLOAD limits the bench stage's rows (default all; the host plan at batch 256
# and the graph replay are measured whatever rows run); ATTNRT_MEMCHECK_TESTS replaces the gtest
# filter the memcheck stage runs.
# With ATTNRT_GPU_PREBUILT=DIR the build stage is skipped and the attnrt and attnrt_cuda_tests
# binaries in DIR/bin.tar.xz are used: built elsewhere for sm_90a (scripts/gpu_prebuild.sh) and
# carried to the GPU machine, which saves its build minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
filter=${2:-*}
out=${OUT:-$PWD/out/gpu}
mkdir -p "$out"
build=${ATTNRT_GPU_BUILD:-/tmp/b}
deadline=$(($(date +%s) + ${ATTNRT_GPU_DEADLINE:-560}))
if [ -f .devdeps/unpack-debs.sh ]; then source .devdeps/unpack-debs.sh >/dev/null; fi
cli="$build/attnrt"
tests="$build/attnrt_cuda_tests"
memcheck_tests=${ATTNRT_MEMCHECK_TESTS:-'CudaBackendTest.*:CudaPrefill*:CudaGraphRuntime.*:CudaKVCacheRows.*:*CudaSwa*:*CudaLinear*:*Generic*:*Mla*'}

# check, run and memcheck log to files of their own here (each stage's figures are read from its
# log alone); summary() appends them to tests.log, as $OUT may hold 8 files.
tmp=$(mktemp -d)
runlog=$tmp/run.log
mclog=$tmp/memcheck.log
rows=()
left() { echo $((deadline - $(date +%s))); }
want() { [[ $what == all || ,$what, == *",$1,"* ]]; }
note() { rows+=("$1|$2|$3|$4"); }
# finish STAGE DETAIL: the row of a stage that started at $t0 and ended with status $rc: ok, or
# FAILED, which fails the whole check; the detail follows "rc=$rc; ".
finish() {
  note "$1" "$([ $rc -eq 0 ] && echo ok || echo FAILED)" $(($(date +%s) - t0)) "rc=$rc; $2"
  if [ $rc -ne 0 ]; then status=1; fi
}
# budget CAP MIN: seconds a stage may take (CAP at most, what is left minus a margin); empty when
# fewer than MIN seconds are left.
budget() {
  local b=$(($(left) - 10))
  ((b > $1)) && b=$1
  ((b >= $2)) && echo "$b"
}
# begin STAGE CAP MIN: starts a stage: sets t0 (its start) and b (its seconds, see budget); with
# fewer than MIN seconds left, notes the stage as skipped and fails instead.
begin() {
  t0=$(date +%s)
  b=$(budget "$2" "$3") && return 0
  note "$1" skipped 0 "no time left"
  return 1
}
summary() {
  for f in "$runlog" "$mclog"; do
    if [ -s "$f" ]; then cat "$f" >>"$out/tests.log"; fi
  done
  {
    printf '%-10s %-8s %6s  %s\n' stage status seconds detail
    for r in "${rows[@]}"; do
      IFS='|' read -r s st sec d <<<"$r"
      printf '%-10s %-8s %6s  %s\n' "$s" "$st" "$sec" "$d"
    done
  } >"$out/summary.txt"
  echo
  cat "$out/summary.txt"
}
gtest_counts() {
  local p f s
  p=$(grep -oE '^\[  PASSED  \] [0-9]+' "$1" | grep -oE '[0-9]+$' | tail -1)
  f=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | tail -1)
  s=$(grep -oE '^\[  SKIPPED \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | tail -1)
  echo "passed ${p:-0}, failed ${f:-0}, skipped ${s:-0}"
}

# build
t0=$(date +%s)
if [ -n "${ATTNRT_GPU_PREBUILT:-}" ]; then
  mkdir -p "$build" && tar -C "$build" -xJf "$ATTNRT_GPU_PREBUILT/bin.tar.xz"
  if [ ! -x "$cli" ] || [ ! -x "$tests" ]; then
    note build FAILED 0 "ATTNRT_GPU_PREBUILT=$ATTNRT_GPU_PREBUILT lacks attnrt or attnrt_cuda_tests"
    summary
    exit 1
  fi
  note build prebuilt $(($(date +%s) - t0)) "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
else
b=$(budget 400 60)
{ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    && timeout "${b:-60}" ninja -C "$build" -j"$(nproc)" attnrt_cuda_tests attnrt_cli; } \
  >"$out/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  grep -E "error|Error" "$out/build.log" | head -40
  note build FAILED $(($(date +%s) - t0)) "rc=$rc, see build.log"
  summary
  exit 1
fi
note build ok $(($(date +%s) - t0)) "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
rm -f "$out/build.log"
fi
status=0

if want test && begin test 240 30; then
  timeout -k 5 "$b" "$tests" --gtest_filter="$filter" >"$out/tests.log" 2>&1
  rc=$?
  grep -E '^\[  FAILED  \]|Failure$' "$out/tests.log" | head -20
  finish test "$(gtest_counts "$out/tests.log")"
fi

if want check && begin check 90 20; then
  echo "### attnrt check --backend cuda" >>"$runlog"
  timeout -k 5 "$b" "$cli" check --backend cuda --no-progress >>"$runlog" 2>&1
  rc=$?
  finish check "$(grep -m1 -E 'features passed' "$runlog")"
fi

if want run && begin run 120 30; then
  echo "### attnrt run (defaults)" >>"$runlog"
  timeout -k 5 "$b" "$cli" run --no-progress --json "$out/run.json" >>"$runlog" 2>&1
  rc=$?
  backends=$(grep -m1 '^backends:' "$runlog" | cut -c1-60)
  total=$(grep -E '^total ' "$runlog" | tail -1 | tr -s ' ' | cut -d' ' -f2-8)
  finish run "$backends; total: $total"
  t0=$(date +%s)
  if b=$(budget 90 20); then
    echo "### attnrt run, speculative tree on pages of 16" >>"$runlog"
    timeout -k 5 "$b" "$cli" run --no-progress --page-size 16 --speculative-num-steps 3 \
      --speculative-eagle-topk 2 --speculative-num-draft-tokens 6 >>"$runlog" 2>&1
    rc=$?
    verify=$(grep -E '^TARGET_VERIFY ' "$runlog" | tail -1 | tr -s ' ' | cut -d' ' -f2-8)
    finish run-tree "TARGET_VERIFY: $verify"
  fi
  # Graphs on with every step checked against reference, and with no checks (host and GPU
  # never wait for a check between steps).
  for every in 1 0; do
    begin "run-check-$every" 90 20 || continue
    echo "### attnrt run --check-every $every --page-size 64 --kv-cache-dtype fp8_e5m2" >>"$runlog"
    timeout -k 5 "$b" "$cli" run --no-progress --check-every "$every" --page-size 64 \
      --kv-cache-dtype fp8_e5m2 >>"$runlog" 2>&1
    rc=$?
    graphs=$(grep -m1 -E '^CUDA graphs' "$runlog" | cut -c1-70)
    finish "run-check-$every" "$graphs"
  done
  # Hybrid models: linear-attention layers on the GPU state pool (Kimi's MLA layers on the
  # latent pool), checked against reference, with and without speculative chain verify; then an
  # SWA-hybrid model (its sliding-window layers on the GPU SWA pool).
  for m in qwen3-next-80b nemotron-h-8b kimi-linear-48b "qwen3-next-80b spec" \
    "nemotron-h-8b spec" "kimi-linear-48b spec" gemma3-12b; do
    begin "run-${m// /-}" 90 20 || continue
    extra=()
    [[ $m == *spec ]] && extra=(--speculative-num-steps 3 --speculative-eagle-topk 1
      --speculative-num-draft-tokens 4)
    echo "### attnrt run --model ${m%% *} ${extra[*]}" >>"$runlog"
    timeout -k 5 "$b" "$cli" run --no-progress --model "${m%% *}" "${extra[@]}" >>"$runlog" 2>&1
    rc=$?
    backends=$(grep '^backends:' "$runlog" | tail -1 | cut -c1-70)
    total=$(grep -E '^total ' "$runlog" | tail -1 | tr -s ' ' | cut -d' ' -f2-8)
    finish "run-${m// /-}" "$backends; total: $total"
  done
fi

if want shared && begin shared 150 40; then
  echo "### scripts/gpu_shared.sh (8 processes at once)" >>"$runlog"
  timeout -k 5 "$b" bash scripts/gpu_shared.sh "$cli" "$tmp/shared" 8 >"$tmp/shared.log" 2>&1
  rc=$?
  cat "$tmp/shared.log" | tee -a "$runlog"
  [ -f "$tmp/shared/replays.log" ] && cat "$tmp/shared/replays.log" >>"$runlog"
  finish shared "$(grep -c ' 0 wrong, 0 failed' "$tmp/shared.log") of $(grep -c '^shared' "$tmp/shared.log") configurations right"
fi

if want bench && begin bench 300 60; then
  timeout -k 5 "$b" "$cli" bench --backend cuda --workload "${ATTNRT_GPU_BENCH_WORKLOAD:-all}" \
    --json "$out/bench.json" >"$out/bench.log" 2>&1
  rc=$?
  sed -n '/^ceilings/,$p' "$out/bench.log" | grep -vE '^bench: ' | head -45
  finish bench "$(grep -m1 -E '^  memory' "$out/bench.log" | tr -s ' ' | cut -c1-40)"
fi

if want linear && begin linear 240 45; then
  timeout -k 5 "$b" "$cli" bench --backend cuda --suite linear \
    --json "$out/bench_linear.json" >"$tmp/linear.log" 2>&1
  rc=$?
  { echo "### attnrt bench --backend cuda --suite linear"; cat "$tmp/linear.log"; } >>"$out/bench.log"
  sed -n '/^linear row/,$p' "$tmp/linear.log" | grep -vE '^bench: ' | head -30
  finish linear "$(grep -c '"suite": "linear"' "$out/bench_linear.json" 2>/dev/null || echo 0) rows in bench_linear.json"
  t0=$(date +%s)
  if ! python3 -c 'import sys, torch, transformers; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    note linear-torch skipped 0 "torch with CUDA or transformers is not installed"
  elif [ ! -f "$out/bench_linear.json" ]; then
    note linear-torch skipped 0 "no bench_linear.json to take the rows from"
  elif b=$(budget 300 30); then
    # 5 repeats: the torch forms take up to a second per call at these shapes.
    timeout -k 5 "$b" python3 bench/torch_linear.py --device cuda --from "$out/bench_linear.json" \
      --repeats 5 --warmup 1 --json "$out/torch_linear.json" >"$tmp/torch_linear.log" 2>&1
    rc=$?
    python3 bench/compare.py "$out/bench_linear.json" "$out/torch_linear.json" \
      >>"$tmp/torch_linear.log" 2>&1
    { echo "### bench/torch_linear.py --device cuda, then bench/compare.py"; cat "$tmp/torch_linear.log"; } >>"$out/bench.log"
    tail -22 "$tmp/torch_linear.log"
    note linear-torch "$([ $rc -eq 0 ] && echo ok || { [ $rc -eq 124 ] && echo PARTIAL || echo FAILED; })" \
      $(($(date +%s) - t0)) "rc=$rc; $(grep -c '"name"' "$out/torch_linear.json" 2>/dev/null || echo 0) rows in torch_linear.json"
  else
    note linear-torch skipped 0 "no time left"
  fi
fi

# memcheck_one STAGE CAP PARTIAL_OK LABEL CMD...: CMD under compute-sanitizer memcheck (at most CAP
# seconds), appended to the memcheck log; PARTIAL_OK=yes: running out of time is PARTIAL (the
# tests that finished ran clean), not a failure.
memcheck_one() {
  local stage=$1 cap=$2 partial_ok=$3 label=$4 t0 b rc verdict detail
  shift 4
  begin "$stage" "$cap" 30 || return
  echo "### memcheck: $label" >>"$mclog"
  timeout -k 5 "$b" compute-sanitizer --tool memcheck --error-exitcode 9 "$@" >>"$mclog" 2>&1
  rc=$?
  verdict=$([ $rc -eq 0 ] && echo ok || echo FAILED)
  [ $rc -eq 124 ] && [ "$partial_ok" = yes ] && verdict=PARTIAL
  detail="rc=$rc; $(grep -E 'ERROR SUMMARY' "$mclog" | tail -1)"
  [ "$partial_ok" = yes ] && detail="rc=$rc; $(grep -cE '^\[       OK \]' "$mclog") tests ran clean; $(grep -E 'ERROR SUMMARY' "$mclog" | tail -1)"
  note "$stage" "$verdict" $(($(date +%s) - t0)) "$detail"
  [ "$verdict" = FAILED ] && status=1
}

# sanitize_one STAGE TOOL CAP LABEL CMD...: CMD under compute-sanitizer TOOL (racecheck reports
# hazards), at most CAP seconds, appended to the memcheck log.
sanitize_one() {
  local stage=$1 tool=$2 cap=$3 label=$4 t0 b rc extra=()
  shift 4
  begin "$stage" "$cap" 30 || return
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  echo "### $tool: $label" >>"$mclog"
  timeout -k 5 "$b" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 9 "$@" \
    >>"$mclog" 2>&1
  rc=$?
  note "$stage" "$([ $rc -eq 0 ] && echo ok || { [ $rc -eq 124 ] && echo PARTIAL || echo FAILED; })" \
    $(($(date +%s) - t0)) "rc=$rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$mclog" | tail -1)"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status=1
}

if want sanitize; then
  if ! command -v compute-sanitizer >/dev/null; then
    note sanitize skipped 0 "compute-sanitizer not found"
  else
    # The stream-order stress holds one stream until another runs a kernel, which a sanitizer
    # that serialises launches never lets happen: its GPU test runs outside the sanitizers.
    graph_tests=${ATTNRT_SANITIZE_TESTS:-'CudaGraphRuntime.*'}
    for tool in racecheck synccheck; do
      sanitize_one "$tool-tests" "$tool" 150 "$graph_tests" "$tests" --gtest_filter="$graph_tests"
      sanitize_one "$tool-run" "$tool" 120 "attnrt run --check-every 1 --page-size 64 (graphs)" \
        "$cli" run --no-progress --check-every 1 --page-size 64 --kv-cache-dtype fp8_e5m2
    done
  fi
fi

if want memcheck; then
  if ! command -v compute-sanitizer >/dev/null; then
    note memcheck skipped 0 "compute-sanitizer not found"
  else
    memcheck_one memcheck-run 150 no "attnrt run (defaults)" "$cli" run --no-progress
    memcheck_one memcheck-check 120 no "attnrt check --backend cuda" \
      "$cli" check --backend cuda --no-progress
    memcheck_one memcheck-tests 300 yes "$memcheck_tests" "$tests" --gtest_filter="$memcheck_tests"
  fi
fi

if want torch; then
  t0=$(date +%s)
  if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    note torch skipped 0 "torch with CUDA is not installed"
  elif [ ! -f "$out/bench.json" ]; then
    note torch skipped 0 "no bench.json to take the rows from"
  elif b=$(budget 600 30); then
    echo "### bench/torch_sdpa.py --device cuda" >>"$out/bench.log"
    timeout -k 5 "$b" python3 bench/torch_sdpa.py --device cuda --from "$out/bench.json" \
      --json "$out/torch.json" >>"$out/bench.log" 2>&1
    rc=$?
    python3 bench/compare.py "$out/bench.json" "$out/torch.json" >>"$out/bench.log" 2>&1
    note torch "$([ $rc -eq 0 ] && echo ok || { [ $rc -eq 124 ] && echo PARTIAL || echo FAILED; })" \
      $(($(date +%s) - t0)) "rc=$rc; $(grep -c '"name"' "$out/torch.json" 2>/dev/null || echo 0) rows in torch.json"
  else
    note torch skipped 0 "no time left"
  fi
fi

summary
exit $status
