#!/usr/bin/env bash
# Installs what the build needs on a Debian/Ubuntu machine (skips what is present), then configures
# and builds into build/. Used by run.sh, test.sh and CI.
# --deps-only: install and stop. ATTNRT_SETUP_CLANG=1 adds clang with its sanitizer and libFuzzer
# runtimes and its OpenMP (scripts/sanitize.sh and scripts/fuzz.sh build with clang).
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake ninja-build g++ ccache libfmt-dev libcli11-dev nlohmann-json3-dev libhwy-dev
      libgtest-dev libgmock-dev libbenchmark-dev libdlpack-dev)
if [ "${ATTNRT_SETUP_CLANG:-0}" = 1 ]; then
  pkgs+=(clang libclang-rt-dev libomp-dev)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ "${1:-}" = --deps-only ] && exit 0

# nvcc is often installed outside PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${ATTNRT_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$jobs"
