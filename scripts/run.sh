#!/usr/bin/env bash
# Set up, build and run the main job: `attnrt run` on its built-in model and trace, on the best
# device present. Extra arguments go to `attnrt run` (see `build/attnrt run --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec build/attnrt run "$@"
