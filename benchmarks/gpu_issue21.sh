#!/usr/bin/env bash
# One GPU-machine call for issue 21 (quantized weights): the quantization GPU tests (Triton GEMV included),
# then per-format linear-layer kernels (PyTorch kernels vs the Triton GEMV, M = 1/4/16/64), W2 (Llama-3.1-8B shape, dummy weights quantized at load) beside each format's
# roofline, and W1-style throughput with 64 requests. Logs + JSON to $OUT (4 files).
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue21.sh [--cpu-smoke]
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
smoke=""
[ "${1:-}" = "--cpu-smoke" ] && smoke="--cpu-smoke"
if [ -z "$smoke" ]; then
  timeout 80 python3 -m pytest -q -p no:cacheprovider tests/layers/test_quantization_gpu.py \
    tests/layers/test_triton_gemv.py > "$OUT/gpu_tests_issue21.txt" 2>&1
  echo "quantization tests rc=$?"; tail -3 "$OUT/gpu_tests_issue21.txt"
fi
timeout 70 python3 benchmarks/gpu_issue21.py --out "$OUT" --parts kernels $smoke > "$OUT/kernels_log.txt" 2>&1
echo "kernels rc=$?"
timeout 150 python3 benchmarks/gpu_issue21.py --out "$OUT/w2" --parts w2 \
  --formats bf16,fp8,int4,int4@triton $smoke > "$OUT/w2_log.txt" 2>&1
echo "w2 rc=$?"
if [ -n "${WITH_W1:-}" ]; then  # W1-style part opt-in (device time)
  timeout 150 python3 benchmarks/gpu_issue21.py --out "$OUT/w1" --parts w1 --formats bf16,fp8,int4 $smoke \
    > "$OUT/w1_log.txt" 2>&1
  echo "w1 rc=$?"
fi
for f in kernels_log w2_log w1_log; do if [ -f "$OUT/$f.txt" ]; then sed -n '/^part /,$p' "$OUT/$f.txt"; fi; done
