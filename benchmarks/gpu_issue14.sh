#!/usr/bin/env bash
# GPU call for issue 14 (speculative decoding), from the repo root:
#   OUT=<dir> bash benchmarks/gpu_issue14.sh
# 1. spec-decode tests that need no GGUF model (rejection sampler, n-gram, dynamic policy,
#    the chi-square distribution test on a tiny model, metrics) + the CUDA graph tests;
# 2. benchmarks/gpu_spec.py, one part per process (each under its own timeout):
#    verify-step cost k=0..8 at batch 1 and 64 (Llama-3.1-8B shape), batch-1 speedups
#    (oracle drafts at set acceptance, n-gram), W1-like load with dynamic speculation off/on.
# Writes $OUT/spec_tests.txt, $OUT/spec_{verify,batch1,load}.log and $OUT/{verify,batch1,load}/spec_bench.json;
# prints a short table last. About 8 minutes.
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
root=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=$root timeout 60 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/spec_decode \
  tests/worker/test_cuda_graphs.py > "$OUT/spec_tests.txt" 2>&1
echo "spec/graph GPU tests rc=$?"; tail -2 "$OUT/spec_tests.txt"
for part in verify batch1 load; do
  case $part in verify) t=120;; batch1) t=200;; load) t=120;; esac
  PYTHONPATH=$root timeout $t python3 benchmarks/gpu_spec.py --out "$OUT/$part" --parts $part > "$OUT/spec_$part.log" 2>&1
  echo "$part rc=$?"
done
for part in verify batch1 load; do grep '^|' "$OUT/spec_$part.log" | grep -v '^| part\|^|---' ; done
