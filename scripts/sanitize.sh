#!/usr/bin/env bash
# The CPU build under AddressSanitizer + UndefinedBehaviorSanitizer (issue 21), in build-asan/
# (scripts/asan_env.sh; shared with scripts/fuzz.sh): builds the tests, the CLI and the example,
# runs the C++ suite (ctest) and the example, then `attnrt run` with the defaults and on every
# model preset with speculative decoding on. A sanitizer report stops the failing program with an
# error, so any report fails the script. docs/RELIABILITY.md has the timings.
# ATTNRT_SANITIZE_QUICK=1 (CI): no test suite (its build is a third of the time), the example, and
# shorter runs (the first 8 requests of the built-in trace, every 4th step checked, the first 2
# layers of models without linear layers).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/asan_env.sh
quick=${ATTNRT_SANITIZE_QUICK:-0}
targets=(attnrt_cli attnrt_example)
[ "$quick" = 1 ] || targets+=(attnrt_tests)
start=$SECONDS
cmake --build "$asan_build" -j "$(nproc)" --target "${targets[@]}"
echo "sanitize: build took $((SECONDS - start)) s"

start=$SECONDS
if [ "$quick" = 1 ]; then
  "$asan_build/attnrt_example" >/dev/null
else
  ctest --test-dir "$asan_build" --output-on-failure -j "$(nproc)"
fi
echo "sanitize: $([ "$quick" = 1 ] && echo example || echo ctest) took $((SECONDS - start)) s"

start=$SECONDS
cli=$asan_build/attnrt
run_args=(--no-progress)
if [ "$quick" = 1 ]; then
  trace=$asan_build/sanitize_trace.jsonl
  "$cli" run --print-trace | head -n 8 >"$trace"
  run_args+=(--trace "$trace" --check-every 4)
fi
runs=0
sanitize_run() {
  echo "sanitize: attnrt run $*"
  "$cli" run "${run_args[@]}" "$@" >/dev/null
  runs=$((runs + 1))
}
sanitize_run
sanitize_run --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
sanitize_run --attention-backend reference --page-size 16 --kv-cache-dtype fp8_e4m3
# Every preset `attnrt info` names: dense, SWA (gemma3, mistral, demo), MLA (deepseek-v3), DSA
# (deepseek-v3.2) and the linear hybrids (qwen3-next, kimi-linear, nemotron-h), with a
# speculative tree.
presets=$("$cli" info | sed -n 's/.*(presets: \(.*\))\./\1/p' | tr -d ',')
[ -n "$presets" ] || { echo "sanitize: no presets in the output of attnrt info" >&2; exit 1; }
for model in $presets; do
  layers=()
  # Quick: the first 2 layers of the models without linear layers (the hybrids run one period of
  # their pattern anyway, through the first attention layer).
  if [ "$quick" = 1 ] && ! "$cli" info --model "$model" | grep -qE '[0-9]+ (gdn|kda|mamba2)'; then
    layers=(--layers 2)
  fi
  sanitize_run --model "$model" --speculative-num-steps 2 --speculative-eagle-topk 2 \
    --speculative-num-draft-tokens 4 --page-size 4 "${layers[@]}"
done
echo "sanitize: $runs runs of attnrt run took $((SECONDS - start)) s; no sanitizer reports"
