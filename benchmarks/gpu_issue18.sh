#!/usr/bin/env bash
# One GPU-machine call for issue 18 on a single GPU: the P2P connector tests on CUDA (tiny
# models; the mp-executor case needs pyzmq, carried as a wheel), then benchmarks/pd_transfer.py
# (producer + consumer engines on one GPU, Llama-3.1-8B shape: transfer GB/s, TTFT with the
# pulled KV vs recomputing, ceilings). The two-GPU goodput comparison needs nvidia-h200-x2.
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue18.sh
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kv_connector/test_p2p.py \
  > "$OUT/p2p_tests.txt" 2>&1
echo "p2p tests rc=$?"; tail -3 "$OUT/p2p_tests.txt"
timeout 300 python3 benchmarks/pd_transfer.py --out "$OUT" > "$OUT/pd_log.txt" 2>&1
echo "pd_transfer rc=$?"; grep '^{' "$OUT/pd_log.txt"; grep -E "Error|error" "$OUT/pd_log.txt" | tail -3
