#!/usr/bin/env bash
# Set up, build and run every test (GPU tests skip with a message where no GPU is usable): the C++
# suite (ctest), then the Python package built into a cached venv and its pytest suite
# (scripts/python_env.sh; ATTNRT_SKIP_PYTHON=1 leaves the Python part out).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
if [ "${ATTNRT_SKIP_PYTHON:-0}" != 1 ]; then
  py=$(bash scripts/python_env.sh | tail -n 1)
  # From outside the checkout, so that the installed package (with its extension) is imported.
  (cd /tmp && "$py" -m pytest -q -p no:cacheprovider "$OLDPWD/python/tests")
fi
