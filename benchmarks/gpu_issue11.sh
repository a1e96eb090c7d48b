#!/usr/bin/env bash
# GPU-machine calls for issue 11 (core seams).
#   stage "new":  the engine's GPU tests (CUDA graphs incl. multi-token verification graphs,
#                 async scheduling, fused layers, Triton decode kernels), greedy equality with
#                 transformers, then W2 / decode steps / host time per step / W1 of this tree;
#   stage "prev": the same benchmarks on the previous commit's tree, carried as .prev/
#                 (`git archive 756139e kvserve | tar -x -C .prev`), right after on the same machine.
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue11.sh new|prev
set -u
OUT=${OUT:-/tmp/kvserve-out}
stage=${1:-new}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
root=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$stage" = new ]; then
  PYTHONPATH=$root timeout 200 python3 -m pytest -q -p no:cacheprovider tests/worker/test_cuda_graphs.py \
    tests/engine/test_async_scheduling.py tests/attention/test_fused_layers.py > "$OUT/gpu_tests.txt" 2>&1
  echo "engine GPU tests rc=$?"; tail -2 "$OUT/gpu_tests.txt"
  PYTHONPATH=$root timeout 90 python3 -m pytest -q -p no:cacheprovider -x tests/attention/test_triton_kernels.py \
    -k "decode" >> "$OUT/gpu_tests.txt" 2>&1
  echo "triton decode kernel tests rc=$?"; tail -1 "$OUT/gpu_tests.txt"
  PYTHONPATH=$root timeout 100 python3 benchmarks/gpu_issue2.py --out "$OUT" --skip-w1 > "$OUT/equality_log.txt" 2>&1
  echo "equality rc=$?"; tail -3 "$OUT/equality_log.txt"
  dir=$root; commit=${KVSERVE_COMMIT:-working-tree}
else
  dir=$root/.prev; commit=756139e
fi
(cd "$dir" && KVSERVE_COMMIT=$commit PYTHONPATH=$dir timeout 330 python3 "$root/benchmarks/gpu_decode.py" --out "$OUT" \
   --backends triton --w1-backends triton --skip-peer --step-profile > "$OUT/decode_log.txt" 2>&1)
echo "decode $stage rc=$?"; tail -12 "$OUT/decode_log.txt"
