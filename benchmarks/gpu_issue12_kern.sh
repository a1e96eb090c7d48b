#!/usr/bin/env bash
# One GPU call (< 150 s) for issue 12's folded-scale kernels: the quantized-KV kernel and
# backend tests on CUDA, the Triton decode kernel at batch 64 x 8k for every dtype beside
# bfloat16 with its config sweep (gpu_issue12.py KERNEL_CONFIGS; each record checked against
# SDPA over the dequantized pages), then the engine decode step (bf16, fp8_e4m3, int4).
# Logs + issue12.json in $OUT; a table last.
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue12_kern.sh
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader
part() {  # part <seconds> <log> <command...>
  local t=$1 log=$2; shift 2
  local s; s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$log" 2>&1
  echo "$(basename "$log" .txt) rc=$? in $(( $(date +%s) - s ))s"
}
part 40 "$OUT/gpu_tests_kvquant.txt" python3 -m pytest -q -p no:cacheprovider tests/attention/test_kv_quant.py \
  tests/attention/test_triton_kv_quant.py
tail -1 "$OUT/gpu_tests_kvquant.txt"
part 60 "$OUT/kernel_log.txt" python3 benchmarks/gpu_issue12.py --out "$OUT" --parts kernel \
  --dtypes bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2
part 40 "$OUT/step_log.txt" python3 benchmarks/gpu_issue12.py --out "$OUT" --parts step --dtypes bfloat16,fp8_e4m3,int4
sed -n '/^part /,$p' "$OUT/kernel_log.txt"
sed -n '/^part /,$p' "$OUT/step_log.txt" | grep -v '^part ' 
