#!/usr/bin/env bash
# Create .venv and install tkcc into it (with the server's libraries). `--dev` adds the test tools.
# With no NVIDIA GPU, the CPU build of torch goes in first (an unpinned torch
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# --dev: the report test renders `tkcc report` in a headless browser (Debian's chromium package), installed
# beside pip's work (both wait on the network) and waited for at the end.
browser=""
if [ "${1:-}" = "--dev" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    ( (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null 2>&1 \
      || echo "setup.sh: could not install chromium; the headless report test will be skipped" >&2 ) &
    browser=$!
  else
    echo "setup.sh: chromium not found (install Debian's chromium package); the headless report test will be skipped" >&2
  fi
fi
extras="hf,cuda,serve"
[ "${1:-}" = "--dev" ] && extras="hf,cuda,serve,science,dev,ray"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
pin=()
# numpy goes in before torch: torch imported without numpy prints "Failed to initialize NumPy".
.venv/bin/python -m pip install -q "numpy<2.4"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0" \
    || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  pin=("torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')")
fi
# transformers and triton pinned to the versions the GPU image carries, so the
# captured graphs match there; numpy<2.4 for Triton 3.6's interpreter.
# the torch pin keeps a dependency from swapping the CPU build for a CUDA one.
.venv/bin/python -m pip install -q -e ".[$extras]" "transformers==5.17.0" "triton==3.6.0" "numpy<2.4" "${pin[@]}"
[ -z "$browser" ] || wait "$browser"
