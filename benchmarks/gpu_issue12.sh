#!/usr/bin/env bash
# One GPU-machine call for issue 12 (quantized KV cache): the quantized-KV kernel and backend
# tests on CUDA, then the Triton decode kernel GB/s, decode step at batch 64 x 8k, batch-1
# decode and W1, each dtype beside bfloat16 (benchmarks/gpu_issue12.py). Logs + JSON in $OUT.
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue12.sh [--quick]   (--quick: bf16, fp8, int4 only)
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
DT=bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2
[ "${1:-}" = "--quick" ] && DT=bfloat16,fp8_e4m3,int4
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/attention/test_kv_quant.py \
  tests/attention/test_triton_kv_quant.py > "$OUT/gpu_tests_kvquant.txt" 2>&1
echo "kv-quant GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_kvquant.txt"
timeout 45 python3 benchmarks/gpu_issue12.py --out "$OUT" --parts kernel --dtypes $DT > "$OUT/kernel_log.txt" 2>&1
echo "kernel rc=$?"
timeout 115 python3 benchmarks/gpu_issue12.py --out "$OUT" --parts step,b1 --dtypes $DT > "$OUT/step_log.txt" 2>&1
echo "step/b1 rc=$?"
timeout 100 python3 benchmarks/gpu_issue12.py --out "$OUT" --parts w1 --dtypes bfloat16,fp8_e4m3,int4 > "$OUT/w1_log.txt" 2>&1
echo "w1 rc=$?"
python3 - "$OUT/issue12.json" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
key = {"kernel": "ms", "step": "ms_per_step", "b1": "ms_per_step", "w1": "output_tok_per_s"}
base = {r["part"]: r.get(key[r["part"]]) for r in recs if r.get("kv_cache_dtype") == "bfloat16"}
print(f"{'part':<8}{'dtype':<10}{'figure':>12}{'vs bf16':>9}{'GB/s':>9}")
for r in recs:
    v, b = r.get(key.get(r["part"], "")), base.get(r["part"])
    print(f"{r['part']:<8}{r['kv_cache_dtype']:<10}{str(v if v is not None else 'ERR'):>12}"
          f"{(f'{v / b:.2f}x' if v and b else '-'):>9}{str(r.get('gb_per_s', '')):>9}")
PY
