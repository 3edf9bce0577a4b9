#!/usr/bin/env bash
# One GPU call for the checks that wait on a GPU after a CPU-side round (docs/BENCHMARKS.md "What
# waits for the next calls"), each stage bounded so the call stays under 540 s:
#   dcp      the DCP GPU tests (ranks on the engine's stream and in CUDA graphs, NCCL with one
#            rank, cuda ranks on one GPU, page sizes), the graph and run suites, stream order,
#            `attnrt run --dcp-size 2` with cuda ranks; DCP_TESTS adds a gtest filter
#   python   pytest of the Python package's DSA, DCP and runtime tests with CUDA tensors
#   long     the long-context decode rows (long-decode) and the small decode rows, with torch's
#            flash / cuDNN on the same shapes (bench/torch_sdpa.py --from)
#   ncu      Nsight Compute over dsa-decode-64x32768: time and throughput of every dsa_ kernel
#   usage: OUT=DIR scripts/gpu_followups.sh [STAGES]   (comma-separated; default all four;
#          carry .gpubin from scripts/gpu_prebuild.sh, with py312.tar.xz for python, and .devdeps)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-dcp,python,long,ncu}
want() { [[ ,$what, == *",$1,"* ]]; }
source scripts/gpubin.sh
gpu_call_setup
if [ -z "${ATTNRT_NCCL_LIBRARY:-}" ]; then
  lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))" 2>/dev/null)
  [ -n "$lib" ] && [ -f "$lib" ] && export ATTNRT_NCCL_LIBRARY=$lib
fi
$B/attnrt info 2>&1 | head -6

if want dcp; then
  s=$(date +%s)
  filter='*CudaDcp*:CudaGraph*:CudaRun.*:*CudaStreamOrder.*'
  timeout 150 $B/attnrt_cuda_tests --gtest_brief=1 --gtest_filter="$filter${DCP_TESTS:+:$DCP_TESTS}" \
    > $O/dcp_tests.log 2>&1
  echo "dcp tests rc=$? $(( $(date +%s)-s )) s"
  grep -E "^\[ +(PASSED|FAILED|SKIPPED) +\]|tests ran|Failure" $O/dcp_tests.log | head -30
  # cuda ranks replaying DECODE / TARGET_VERIFY graphs, every layer compared after the replay.
  s=$(date +%s)
  timeout 60 $B/attnrt run --dcp-size 2 --attention-backend cuda --speculative-num-steps 3 \
    --no-progress > $O/dcp_run.txt 2>&1
  echo "dcp run rc=$? $(( $(date +%s)-s )) s"; grep -iE "graph|dcp|error|FAILED" $O/dcp_run.txt | head -8
fi

if want python; then
  mkdir -p python/attnrt/bin
  cp $B/attnrt python/attnrt/bin/attnrt
  tar -C python/attnrt -xJf .gpubin/py312.tar.xz
  s=$(date +%s)
  PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 timeout 170 python3 -m pytest -q -p no:cacheprovider -rs \
    python/tests/test_dsa.py python/tests/test_dcp.py python/tests/test_runtime.py \
    ${PYTESTS:-} > $O/pytest.log 2>&1
  echo "pytest rc=$? $(( $(date +%s)-s )) s: $(tail -n 1 $O/pytest.log)"
  grep -E "^(FAILED|ERROR)" $O/pytest.log | head -20
fi

if want long; then
  s=$(date +%s)
  timeout 150 $B/attnrt bench --backend cuda \
    --workload "${LONG_ROWS:-long-decode,decode-1x32768,decode-16x4096}" \
    --no-reference --repeats 10 --warmup 2 --json $O/long.json > $O/long.txt 2>&1
  echo "bench rc=$? $(( $(date +%s)-s )) s"
  grep -E "^decode|ceiling|copy" $O/long.txt | head -12
  s=$(date +%s)
  timeout 100 python3 bench/torch_sdpa.py --device cuda --kernels flash,cudnn --from $O/long.json \
    > $O/long_torch.txt 2>&1
  echo "torch rc=$? $(( $(date +%s)-s )) s"
  grep -E "^decode" $O/long_torch.txt | head -8
fi

if want ncu; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  s=$(date +%s)
  timeout 120 "$NCU" --clock-control none --kernel-name "regex:dsa_" --launch-skip 4 --launch-count 6 \
    --section SpeedOfLight --metrics gpu__time_duration.sum \
    $B/attnrt bench --backend cuda --suite dsa --workload dsa-decode-64x32768 --repeats 2 --warmup 1 \
    --no-reference --quiet > $O/ncu_dsa.txt 2>&1
  echo "ncu rc=$? $(( $(date +%s)-s )) s"
  grep -E "^  [a-z_].*\(|gpu__time_duration.sum|Memory Throughput|Compute \(SM\) Throughput|DRAM Throughput" \
    $O/ncu_dsa.txt | head -40
fi
