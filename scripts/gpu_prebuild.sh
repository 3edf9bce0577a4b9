#!/usr/bin/env bash
# Builds the GPU check's binaries here (Release, sm_90a) into .gpubin/ (git-ignored), so that a
# GPU call can skip its build: carry .gpubin and .devdeps, and run
#   ATTNRT_GPU_PREBUILT=.gpubin OUT=$OUT scripts/gpu_check.sh all
# The binaries link the CUDA runtime statically and need only libfmt / libhwy from .devdeps there.
#   usage: scripts/gpu_prebuild.sh [OUTDIR]   (default .gpubin; a relative OUTDIR is taken from
#          the project root; ATTNRT_GPU_BUILD = build folder, JOBS = parallel jobs)
set -euo pipefail
cd "$(dirname "$0")/.."
outdir=${1:-.gpubin}
build=${ATTNRT_GPU_BUILD:-/tmp/b-gpu}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
ninja -C "$build" -j"${JOBS:-$(nproc)}" attnrt_cuda_tests attnrt_cli
# Carried compressed (the tree that travels is limited to 64 MiB). xz -9: its 64 MiB dictionary
# finds the kernels the two binaries share (21 MB at -6, 11 MB at -9), so three builds travel.
rm -rf "$outdir" && mkdir -p "$outdir/tmp"
cp "$build/attnrt" "$build/attnrt_cuda_tests" "$outdir/tmp/"
strip "$outdir/tmp/attnrt"
# ATTNRT_KEEP_SYMBOLS=1 keeps the test binary's symbols, for a crash report to symbolise.
[ "${ATTNRT_KEEP_SYMBOLS:-0}" = 1 ] || strip "$outdir/tmp/attnrt_cuda_tests"
tar -C "$outdir/tmp" -cf - attnrt attnrt_cuda_tests | xz -T0 -9 >"$outdir/bin.tar.xz"
rm -rf "$outdir/tmp"
# The Python extension for the GPU machine's python3 (3.12 there): built with a Python 3.12 that
# has nanobind and scikit-build-core (ATTNRT_PY312, default ~/.cache/attnrt-py/venv312/bin/python),
# when there is one; scripts/gpu_python.sh unpacks it into python/attnrt.
py312=${ATTNRT_PY312:-$HOME/.cache/attnrt-py/venv312/bin/python}
if [ -x "$py312" ]; then
  PATH=$(dirname "$nvcc"):$PATH "$py312" -m pip wheel -q --no-build-isolation --no-deps . \
    -w /tmp/attnrt-wheel312 >/dev/null
  so=$(ls build/python/cp312-*/_native*.so)
  mkdir -p "$outdir/tmp" && cp "$so" "$outdir/tmp/" && strip "$outdir/tmp/$(basename "$so")"
  tar -C "$outdir/tmp" -cf - "$(basename "$so")" | xz -T0 -6 >"$outdir/py312.tar.xz"
  rm -rf "$outdir/tmp"
fi
ls -la "$outdir"
