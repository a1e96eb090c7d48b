#!/usr/bin/env bash
# One GPU call for what the first two calls of a round left: quantized-KV speed per dtype beside
# bf16 (issue 12), the tier tests in float32 and the device<->host bandwidth (13), the hybrid
# decode step at 2K vs 32K and the multi-turn prefix hit rate (15), the verification-step cost
# (14, with WITH_SPEC_VERIFY=1). Each part under its own timeout; everything lands in $OUT/results.tgz, a table last.
# Usage (repo root): OUT=<dir> KVSERVE_COMMIT=<sha> bash benchmarks/gpu_followup.sh
set -u
OUT=${OUT:-/tmp/kvserve-out}
R=$OUT/r
mkdir -p "$R"/{12,13,14,15}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
. "$(dirname "$0")/gpu_part.sh"  # part <seconds> <log> <command...>
part 55 "$R/12/gpu_tests_kvquant.txt" python3 -m pytest -q -p no:cacheprovider tests/attention/test_kv_quant.py \
  tests/attention/test_triton_kv_quant.py
tail -1 "$R/12/gpu_tests_kvquant.txt"
part 90 "$R/12/kernel_log.txt" python3 benchmarks/gpu_issue12.py --out "$R/12" --parts kernel \
  --dtypes bfloat16,fp8_e4m3,int8,int4,int2
part 110 "$R/12/step_log.txt" python3 benchmarks/gpu_issue12.py --out "$R/12" --parts step,b1 \
  --dtypes bfloat16,fp8_e4m3,int4
part 100 "$R/12/w1_log.txt" python3 benchmarks/gpu_issue12.py --out "$R/12" --parts w1 --dtypes bfloat16,fp8_e4m3,int4
part 50 "$R/13/gpu_tests.txt" python3 -m pytest -q -p no:cacheprovider tests/kv_connector
tail -1 "$R/13/gpu_tests.txt"
part 55 "$R/15/decode_log.txt" python3 benchmarks/hybrid_kv.py --out "$R/15" --parts decode --tag decode
part 75 "$R/15/prefix_log.txt" python3 benchmarks/hybrid_kv.py --out "$R/15" --parts prefix --tag prefix
part 45 "$R/13/tiers_bw_log.txt" python3 benchmarks/kv_tiers.py --gpu8b --tier-gib 4 --kv-cache-memory 16GiB \
  --parts bandwidth --bw-blocks 1024 --out "$R/13/tiers_bw.json"
if [ -n "${WITH_SPEC_VERIFY:-}" ]; then
  part 90 "$R/14/spec_verify.txt" python3 benchmarks/gpu_spec.py --out "$R/14" --parts verify
fi
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
tar xzf "$OUT/results.tgz" -O ./12/kernel_log.txt ./12/step_log.txt ./12/w1_log.txt 2>/dev/null | grep -E '^(kernel|step|b1|w1) '
tar xzf "$OUT/results.tgz" -O ./15/decode_log.txt ./15/prefix_log.txt 2>/dev/null | grep '^|' \
  | grep -v '^|---\|^| part'
tar xzf "$OUT/results.tgz" -O ./13/tiers_bw_log.txt 2>/dev/null | grep -E '^bandwidth '
