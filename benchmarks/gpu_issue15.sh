#!/usr/bin/env bash
# One GPU-machine call for issue 15 part B (hybrid KV cache manager): the window tests on
# CUDA (Triton kernels never read blocks below the window; tiny Mistral/Qwen2 window models
# equal transformers, batched + chunked + async, block bound, prefix hits), then
# benchmarks/hybrid_kv.py: max concurrency hybrid vs not at 32K (Gemma 3 270M shape, or its
# KV-shape stand-in when Gemma3ForCausalLM is not registered; and a Mistral-style all-window
# model), long-prompt throughput beside the non-hybrid run, multi-turn chat prefix-cache hit
# rate hybrid vs full-attention cache, decode step at 2K vs 32K, and the Triton decode kernel
# for a window vs a full layer. Each part under its own timeout (~7.5 min in all); PARTS=capacity,prefix
# (comma list of tests,capacity,prefix,decode,kernel) runs a subset.
# Usage (repo root): KVSERVE_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_issue15.sh [--cpu-smoke]
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
smoke=""
T=1
for a in "$@"; do
  case $a in
    --cpu-smoke) smoke="--cpu-smoke"; export TRITON_INTERPRET=1 OMP_NUM_THREADS=1; T=3 ;;
  esac
done
PARTS=${PARTS:-tests,capacity${WITH_PREFIX:+,prefix},decode,kernel}  # the hit-rate part is not GPU-specific
if [[ ",$PARTS," == *,tests,* ]]; then
  timeout $((60 * T)) python3 -m pytest -q -p no:cacheprovider tests/attention/test_window_skip.py \
    tests/core/test_sliding_window_manager.py tests/engine/test_hybrid_kv.py > "$OUT/gpu_tests.txt" 2>&1
  echo "window tests rc=$?"; tail -2 "$OUT/gpu_tests.txt"
fi
: > "$OUT/bench_log.txt"
for part in capacity prefix decode kernel; do
  [[ ",$PARTS," == *,$part,* ]] || continue
  case $part in capacity) t=95;; prefix) t=220;; decode) t=60;; kernel) t=30;; esac
  timeout $((t * T)) python3 benchmarks/hybrid_kv.py $smoke --out "$OUT" --parts $part --tag $part \
    >> "$OUT/bench_log.txt" 2>&1
  echo "$part rc=$?"
done
grep "^|" "$OUT/bench_log.txt"
