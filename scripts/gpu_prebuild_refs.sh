#!/usr/bin/env bash
# Builds the GPU binaries of several git refs here for scripts/gpu_ab.sh: each REF is checked out
# in turn in one worktree of its own (${ATTNRT_REFS_WORKTREE:-/tmp/attnrt-refs}, kept between
# runs) and built there by scripts/gpu_prebuild.sh into .gpubin-NAME/ (NAME = REF with every
# character outside [A-Za-z0-9._-] replaced by '-'), all in one build folder
# (${ATTNRT_GPU_BUILD:-/tmp/b-gpu-refs}), so that ninja recompiles only what differs between two
# refs. The ref WORKTREE builds this working tree as it is, uncommitted changes included, into
# .gpubin-worktree (through gpu_prebuild.sh's own build folder).
#   usage: scripts/gpu_prebuild_refs.sh REF [REF...]
#   then:  carry .devdeps and the .gpubin-NAME folders (about 14 MB each; a call carries 64 MiB at
#          most, so four refs), and run scripts/gpu_ab.sh ROWS .gpubin-NAME...
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
if [ $# -lt 1 ]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
wt=${ATTNRT_REFS_WORKTREE:-/tmp/attnrt-refs}
build=${ATTNRT_GPU_BUILD:-/tmp/b-gpu-refs}
for ref in "$@"; do
  if [ "$ref" = WORKTREE ]; then
    bash scripts/gpu_prebuild.sh "$root/.gpubin-worktree"
    continue
  fi
  git rev-parse --verify --quiet "$ref^{commit}" >/dev/null || {
    echo "gpu_prebuild_refs: $ref is not a commit of this repository"
    exit 1
  }
  name=$(printf '%s' "$ref" | tr -c 'A-Za-z0-9._-' '-')
  if git -C "$wt" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$wt" checkout --quiet --detach "$ref"
  else
    git worktree prune
    git worktree add --quiet --detach "$wt" "$ref"
  fi
  echo "== $ref ($(git -C "$wt" rev-parse --short HEAD)) -> .gpubin-$name"
  ATTNRT_GPU_BUILD=$build bash "$wt/scripts/gpu_prebuild.sh" "$root/.gpubin-$name" || {
    echo "gpu_prebuild_refs: the build of $ref failed"
    exit 1
  }
done
