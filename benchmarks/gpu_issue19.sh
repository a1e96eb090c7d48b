#!/usr/bin/env bash
# One GPU-machine call for issue 19: structured-output bitmask on CUDA (correctness + time),
# constrained requests in a W1-like batch (graphs + async scheduling), the bitmask unit test.
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue19.sh
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 360 python3 benchmarks/gpu_issue19.py --out "$OUT" > "$OUT/issue19_log.txt" 2>&1
echo "issue19 rc=$?"
tail -8 "$OUT/issue19_log.txt"
