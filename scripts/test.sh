#!/usr/bin/env bash
# Set up, build and run every test (GPU tests skip with a message where no GPU is usable).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
