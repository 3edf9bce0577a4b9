#!/usr/bin/env bash
# The Python package's environment: a venv cached outside the clone (torch, transformers, pytest,
# nanobind and scikit-build-core from PyPI), with attnrt built and installed into it from this
# checkout. Prints the venv's python on its last line. Used by test.sh (and so by CI).
#   ATTNRT_PY_CACHE  where the venv lives (default ~/.cache/attnrt-py); a second run reuses it and
#                    downloads nothing (a cold one fetches ~5 GB: PyPI's Linux torch brings its
#                    CUDA libraries; about 2-3 minutes here)
#   ATTNRT_PY_TORCH  the torch requirement (default torch>=2.4)
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${ATTNRT_PY_CACHE:-$HOME/.cache/attnrt-py}
venv=$cache/venv
py=${ATTNRT_PYTHON:-python3}
reqs=("${ATTNRT_PY_TORCH:-torch>=2.4}" "transformers>=4.56" "pytest>=7" "numpy" "nanobind>=2.4"
      "scikit-build-core>=0.10")
stamp=$venv/.attnrt-requirements
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${reqs[*]}" ]; then
  if ! "$py" -m venv --help >/dev/null 2>&1 || ! "$py" -c "import sysconfig, os; \
      assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" 2>/dev/null; then
    echo "python_env: installing python3-venv python3-dev" >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv python3-dev >/dev/null
  fi
  echo "python_env: creating $venv (${reqs[*]})" >&2
  t0=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q "${reqs[@]}" >&2
  echo "${reqs[*]}" >"$stamp"
  echo "python_env: venv ready in $(($(date +%s) - t0)) s" >&2
fi
# nvcc is often installed outside PATH (as in setup.sh).
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
t0=$(date +%s)
# The package's own build folder (build/python/<wheel tag>) is kept between runs; ccache serves
# the objects the C++ build compiled with the same flags.
"$venv/bin/python" -m pip install -q --no-build-isolation . >&2
echo "python_env: attnrt built and installed in $(($(date +%s) - t0)) s" >&2
echo "$venv/bin/python"
