#!/usr/bin/env bash
# One GPU-machine call for issue 5: the engine's GPU tests (CUDA graphs, piecewise graphs,
# async scheduling), greedy equality with transformers, then W2, the decode step times and
# W1 (async scheduling on, and off for comparison). Logs and JSON go to $OUT.
# Usage (repo root): KVSERVE_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_issue5.sh [--w1-profile] [--kernels]
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
extra=""
kernels=0
for a in "$@"; do
  case $a in
    --w1-profile) extra="$extra --w1-profile" ;;
    --kernels) kernels=1 ;;
  esac
done
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/worker/test_cuda_graphs.py \
  tests/engine/test_async_scheduling.py tests/attention/test_fused_layers.py > "$OUT/gpu_tests_engine.txt" 2>&1
echo "engine GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_engine.txt"
if [ $kernels = 1 ]; then
  timeout ${KERNEL_TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_kernels.py \
    > "$OUT/gpu_tests_kernels.txt" 2>&1
  echo "kernel tests rc=$?"; tail -2 "$OUT/gpu_tests_kernels.txt"
fi
timeout 150 python3 benchmarks/gpu_issue2.py --out "$OUT" --skip-w1 > "$OUT/equality_log.txt" 2>&1
echo "equality rc=$?"; tail -3 "$OUT/equality_log.txt"
timeout 330 python3 benchmarks/gpu_decode.py --out "$OUT" --backends triton --w1-backends triton \
  --skip-peer --w1-sync-too $extra > "$OUT/decode_log.txt" 2>&1
echo "decode rc=$?"; tail -9 "$OUT/decode_log.txt"
