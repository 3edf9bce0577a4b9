#!/usr/bin/env bash
# Builds the libFuzzer harnesses of fuzz/ (build-asan/, scripts/asan_env.sh: clang with
# AddressSanitizer + UndefinedBehaviorSanitizer) and runs each for SECONDS (default 60) over its
# seeds (fuzz/corpus/<harness>/, unchanged; what the fuzzer adds goes to build-asan/fuzz-corpus/)
# with its dictionary (fuzz/dict/). Fails on the first crash, sanitizer report, hang (-timeout) or
# uncaught exception; the input that did it is left in build-asan/fuzz-artifacts/.
# `python` is the Python API's harness (fuzz/fuzz_python.py): atheris (PyPI) in the package's venv
# (scripts/python_env.sh, which builds and installs attnrt there), the same corpus and artifact
# folders, and the same rules; an input it stops on replays with `python fuzz/fuzz_python.py FILE`.
# usage: scripts/fuzz.sh [SECONDS] [HARNESS...]   (harnesses: fuzz/CMakeLists.txt and python;
#        default all)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(hf_config trace npy case options batch python)
source scripts/asan_env.sh
targets=()
for h in "${harnesses[@]}"; do [ "$h" = python ] || targets+=("fuzz_$h"); done
[ ${#targets[@]} -eq 0 ] || cmake --build "$asan_build" -j "$(nproc)" --target "${targets[@]}"
if [[ " ${harnesses[*]} " == *" python "* ]]; then
  py=$(bash scripts/python_env.sh | tail -n 1)
  "$py" -c "import atheris" 2>/dev/null || "$py" -m pip install -q "atheris>=2.3"
fi

artifacts=$asan_build/fuzz-artifacts
mkdir -p "$artifacts"
for h in "${harnesses[@]}"; do
  corpus=$asan_build/fuzz-corpus/$h
  mkdir -p "$corpus"
  dict=()
  [ -f "fuzz/dict/$h.dict" ] && dict=(-dict="fuzz/dict/$h.dict")
  log=$asan_build/fuzz-$h.log
  echo "fuzz: $h for ${seconds} s"
  run=("$asan_build/fuzz/fuzz_$h")
  [ "$h" = python ] && run=("$py" fuzz/fuzz_python.py)
  if ! "${run[@]}" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2560 \
      -malloc_limit_mb=2048 -max_len=16384 -print_final_stats=1 "${dict[@]}" \
      -artifact_prefix="$artifacts/$h-" "$corpus" "fuzz/corpus/$h" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz: $h failed; the input is in $artifacts (rerun: ${run[*]} FILE)" >&2
    exit 1
  fi
  grep -E "stat::number_of_executed_units|Done [0-9]+ runs" "$log" | tail -n 1
  echo "fuzz: $h corpus: $(ls "$corpus" | wc -l) inputs added to $(ls "fuzz/corpus/$h" | wc -l) seeds"
done
