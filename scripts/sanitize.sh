#!/usr/bin/env bash
# The CPU build under AddressSanitizer + UndefinedBehaviorSanitizer (issue 21), in build-asan/
# (scripts/asan_env.sh; shared with scripts/fuzz.sh): builds the tests, the CLI and the example,
# runs the C++ suite (ctest), then `attnrt run` with the defaults and on every model preset with
# speculative decoding on. A sanitizer report stops the failing program with an error, so any
# report fails the script.
# ATTNRT_SANITIZE_QUICK=1 (CI): ctest without the slowest tests and shorter runs (a short trace,
# every 4th step checked).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/asan_env.sh
start=$SECONDS
cmake --build "$asan_build" -j "$(nproc)" --target attnrt_tests attnrt_cli attnrt_example
echo "sanitize: build took $((SECONDS - start)) s"

start=$SECONDS
ctest --test-dir "$asan_build" --output-on-failure -j "$(nproc)" ${ATTNRT_SANITIZE_CTEST_ARGS:-}
echo "sanitize: ctest took $((SECONDS - start)) s"

start=$SECONDS
cli=$asan_build/attnrt
run_args=(--no-progress)
if [ "${ATTNRT_SANITIZE_QUICK:-0}" = 1 ]; then
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
# Every preset `attnrt info` names: hybrid linear (qwen3-next, kimi-linear, nemotron-h), SWA
# (gemma3, mistral, demo), MLA (deepseek-v3) and DSA (deepseek-v3.2) models among them.
presets=$("$cli" info | sed -n 's/.*(presets: \(.*\))\./\1/p' | tr -d ',')
[ -n "$presets" ] || { echo "sanitize: no presets in the output of attnrt info" >&2; exit 1; }
for model in $presets; do
  sanitize_run --model "$model" --speculative-num-steps 2 --speculative-eagle-topk 2 \
    --speculative-num-draft-tokens 4 --page-size 4
done
echo "sanitize: $runs runs of attnrt run took $((SECONDS - start)) s; no sanitizer reports"
