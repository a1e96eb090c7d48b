#!/usr/bin/env bash
# One GPU-machine call for issue 16 (bounded KV): the bounded-KV tests on CUDA, then
# benchmarks/gpu_bounded.py: decode step at batch 64 for none / streaming / h2o (the cost of
# H2O's attention-mass accumulation) and an endless StreamingLLM generation (tok/s and blocks
# held over time); PARTS=tests,cost,endless (a comma list) runs a subset. Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue16.sh [--cpu-smoke]
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
smoke=""
for a in "$@"; do [ "$a" = --cpu-smoke ] && smoke=--cpu-smoke; done
PARTS=${PARTS:-tests,cost,endless}
if [[ ",$PARTS," == *,tests,* ]]; then
timeout 90 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/attention/test_bounded_attention.py \
  tests/engine/test_bounded_kv.py tests/core/test_bounded_kv_manager.py > "$OUT/bounded_tests.txt" 2>&1
echo "bounded tests rc=$?"; tail -2 "$OUT/bounded_tests.txt"
fi
[[ ",$PARTS," == *,cost,* ]] && {
timeout 150 python3 benchmarks/gpu_bounded.py $smoke --out "$OUT" --parts cost > "$OUT/cost_log.txt" 2>&1
echo "cost rc=$?"; grep '^{' "$OUT/cost_log.txt"; }
[[ ",$PARTS," == *,endless,* ]] && {
timeout 200 python3 benchmarks/gpu_bounded.py $smoke --out "$OUT/endless" --parts endless --endless-seconds 150 \
  > "$OUT/endless_log.txt" 2>&1
echo "endless rc=$?"; grep '^{' "$OUT/endless_log.txt" | cut -c1-600; }
true
