#!/usr/bin/env bash
# One GPU-machine call for issue 15 part B (hybrid KV cache manager): the window tests on
# CUDA (Triton kernels never read blocks below the window; tiny Mistral/Qwen2 window models
# equal transformers, batched + chunked + async, block bound, prefix hits), then
# benchmarks/hybrid_kv.py: max concurrency hybrid vs not at 32K (Gemma 3 270M shape, or its
# KV-shape stand-in when Gemma3ForCausalLM is not registered; and a Mistral-style all-window
# model), long-prompt throughput beside the non-hybrid run, multi-turn chat prefix-cache hit
# rate hybrid vs full-attention cache, decode step at 2K vs 32K, and the Triton decode kernel
# for a window vs a full layer. Each part under its own timeout (~7.5 min in all).
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
timeout $((60 * T)) python3 -m pytest -q -p no:cacheprovider tests/attention/test_window_skip.py \
  tests/core/test_sliding_window_manager.py tests/engine/test_hybrid_kv.py > "$OUT/gpu_tests.txt" 2>&1
echo "window tests rc=$?"; tail -2 "$OUT/gpu_tests.txt"
: > "$OUT/bench_log.txt"
timeout $((95 * T)) python3 benchmarks/hybrid_kv.py $smoke --out "$OUT" --parts capacity --tag capacity \
  >> "$OUT/bench_log.txt" 2>&1
echo "capacity rc=$?"
if [ -n "${WITH_PREFIX:-}" ]; then  # the hit-rate part is not GPU-specific: CPU figures stand
  timeout $((80 * T)) python3 benchmarks/hybrid_kv.py $smoke --out "$OUT" --parts prefix --tag prefix \
    >> "$OUT/bench_log.txt" 2>&1
  echo "prefix rc=$?"
fi
timeout $((60 * T)) python3 benchmarks/hybrid_kv.py $smoke --out "$OUT" --parts decode --tag decode \
  >> "$OUT/bench_log.txt" 2>&1
echo "decode rc=$?"
timeout $((30 * T)) python3 benchmarks/hybrid_kv.py $smoke --out "$OUT" --parts kernel --tag kernel \
  >> "$OUT/bench_log.txt" 2>&1
echo "kernel rc=$?"
grep "^|" "$OUT/bench_log.txt"
