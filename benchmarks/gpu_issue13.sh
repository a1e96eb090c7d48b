#!/usr/bin/env bash
# GPU-machine call for issue 13 (tiered KV cache). Each part runs under its own timeout; a
# failing part does not stop the next. Writes under $OUT (5 files) and prints a table last.
#   1. tests/kv_connector on CUDA (CPU tier through the transfer stream, swap, disk tier,
#      random arrivals; tiny random Llama, triton backend, async scheduling, CUDA graphs)
#   2. benchmarks/kv_tiers.py --gpu8b: Llama-3.1-8B shape, dummy bf16 weights:
#      multi-turn 64 conversations x 6 turns (working set ~10x the device pool), zero reuse,
#      swap vs recompute, disk persistence of a 2k prompt, device<->pinned host GB/s
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue13.sh [--cpu-smoke]
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
root=$PWD
if [ "${1:-}" = "--cpu-smoke" ]; then
  export OMP_NUM_THREADS=1
  PYTHONPATH=$root timeout 300 python3 benchmarks/kv_tiers.py --tiny --tier-gib 0.05 --kv-cache-memory 16MiB \
    --persist-len 512 --bw-blocks 64 --out "$OUT/tiers_smoke.json" > "$OUT/tiers_smoke_log.txt" 2>&1
  echo "smoke rc=$?"; tail -12 "$OUT/tiers_smoke_log.txt"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=$root timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kv_connector > "$OUT/gpu_tests.txt" 2>&1
echo "kv_connector GPU tests rc=$?"; tail -3 "$OUT/gpu_tests.txt"
common="--gpu8b --tier-gib 24 --kv-cache-memory 16GiB"
PYTHONPATH=$root timeout 40 python3 benchmarks/kv_tiers.py $common --parts bandwidth --bw-blocks 1024 \
  --out "$OUT/tiers_bw.json" > "$OUT/tiers_log.txt" 2>&1
echo "bandwidth rc=$?"
PYTHONPATH=$root timeout 130 python3 benchmarks/kv_tiers.py $common --parts multiturn --convs 64 --turns 6 \
  --first-tokens 512 --turn-tokens 256 --output-len 32 --out "$OUT/tiers_multiturn.json" >> "$OUT/tiers_log.txt" 2>&1
echo "multiturn rc=$?"
PYTHONPATH=$root timeout 100 python3 benchmarks/kv_tiers.py $common --parts zero,swap,persist --zero-n 64 \
  --zero-len 1024 --output-len 64 --decode-len 128 --swap-n 64 --swap-prompt 512 --swap-out 512 --persist-len 2048 \
  --out "$OUT/tiers_rest.json" >> "$OUT/tiers_log.txt" 2>&1
echo "zero/swap/persist rc=$?"
grep -E "^(part|multiturn|zero_reuse|swap|persist|bandwidth) " "$OUT/tiers_log.txt"
