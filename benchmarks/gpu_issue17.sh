#!/usr/bin/env bash
# Issue 17 on `nvidia-h200-x2`: NCCL tensor-parallel tests would go here; the figures come from
# benchmarks/gpu_issue17.py. Ray is not on the GPU machine: carry its wheels in .whl/ (see the
# device README) for the ray row. Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue17.sh
set -u
OUT=${OUT:-/tmp/kvserve-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 560 python3 benchmarks/gpu_issue17.py --out "$OUT" 2>&1 | tee "$OUT/tp_log.txt" | grep '^{'
