#!/usr/bin/env bash
# One GPU-machine call for issue 15 part A: Gemma 3 (270M shape, dummy weights) greedy
# equality with transformers in float32 (and bf16 agreement), then bf16 throughput and
# batch-1 decode time; the Gemma 3 / rope unit tests on CUDA too. Logs and JSON go to $OUT.
# Usage (repo root): KVSERVE_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_issue15a.sh [--cpu-smoke]
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
smoke=""
for a in "$@"; do [ "$a" = --cpu-smoke ] && smoke="--cpu-smoke"; done
if [ -z "$smoke" ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/models/test_gemma3.py tests/layers/test_rope_scaling.py \
    > "$OUT/issue15a_tests.txt" 2>&1
  echo "gemma3 + rope tests rc=$?"; tail -2 "$OUT/issue15a_tests.txt"
fi
timeout 200 python3 benchmarks/gpu_issue15a.py --out "$OUT" --parts equality $smoke > "$OUT/issue15a_equality_log.txt" 2>&1
echo "equality rc=$?"; tail -3 "$OUT/issue15a_equality_log.txt"
timeout 200 python3 benchmarks/gpu_issue15a.py --out "$OUT" --parts throughput $smoke > "$OUT/issue15a_throughput_log.txt" 2>&1
echo "throughput rc=$?"; tail -3 "$OUT/issue15a_throughput_log.txt"
