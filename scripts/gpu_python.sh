#!/usr/bin/env bash
# The Python package on the GPU machine: its pytest suite with CUDA tensors (runtime, engine
# interface, torch.cuda.graph capture, transformers end to end), the examples, the binding's
# overhead and the bench rows through Python beside torch and the CLI. Logs and JSON to $OUT.
# Built elsewhere: .gpubin/bin.tar.xz (the CLI, scripts/gpu_prebuild.sh) and
# .gpubin/py312.tar.xz (the extension for the machine's python3, scripts/gpu_prebuild.sh --python).
#   usage: scripts/gpu_python.sh [STAGES]   (test,examples,overhead,rows; default all)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-test,examples,overhead,rows}
out=${OUT:-$PWD/out/gpu}
mkdir -p "$out"
want() { [[ ,$what, == *",$1,"* ]]; }
if [ -f .devdeps/unpack-debs.sh ]; then source .devdeps/unpack-debs.sh >/dev/null; fi
mkdir -p python/attnrt/bin /tmp/gpubin
tar -C /tmp/gpubin -xJf .gpubin/bin.tar.xz && cp /tmp/gpubin/attnrt python/attnrt/bin/attnrt
tar -C python/attnrt -xJf .gpubin/py312.tar.xz
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
{
  python3 --version
  python3 -c "import torch, transformers, attnrt; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'attnrt', attnrt.__version__, attnrt.cuda_status())"
} 2>&1 | tee "$out/versions.txt"
summary=()
if want test; then
  t0=$(date +%s)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --durations=15 python/tests \
    >"$out/pytest.log" 2>&1
  rc=$?
  summary+=("test rc=$rc $(($(date +%s) - t0))s: $(tail -n 1 "$out/pytest.log")")
fi
if want examples; then
  t0=$(date +%s)
  { python3 examples/python/engine_step.py && \
    python3 examples/python/serve.py --device cuda --cuda-graphs --no-progress && \
    python3 examples/python/dsa_step.py --check && \
    python3 examples/python/dsa_step.py --preset --lens 3000,2500,700 --chunk 1024 && \
    python3 examples/python/serve.py --device cuda --model-preset llama3-8b --layers 8 \
      --requests 256 --max-running 64 --cuda-graphs --no-progress && \
    python3 -m torch.distributed.run --nproc-per-node "$(nvidia-smi -L | wc -l)" \
      examples/python/dcp_decode.py --nccl --context 8192 --chunk 1024; } >"$out/examples.log" 2>&1
  summary+=("examples rc=$? $(($(date +%s) - t0))s")
fi
if want overhead; then
  timeout 120 python3 bench/python_overhead.py --json "$out/python_overhead.json" \
    >"$out/overhead.log" 2>&1
  summary+=("overhead rc=$?")
fi
if want rows; then
  timeout 240 python3 bench/python_rows.py --device cuda --cli python/attnrt/bin/attnrt \
    --json "$out/python_rows.json" >"$out/rows.log" 2>&1
  summary+=("rows rc=$?")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
