#!/usr/bin/env bash
# One GPU call closing this round's single-GPU figures (issues 12, 18, 21), each part under its
# own time limit: NIXL READ between two processes (UCX's choice, and with UCX_TLS forced to the
# CUDA transports), the quantized decode kernel (new defaults), the decode step at batch 64 x 8k
# and W1 per KV dtype, and W1-style throughput with FP8 weights + FP8 KV.
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_final_round.sh
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
. "$(dirname "$0")/gpu_part.sh"  # part <seconds> <log> <command...>
UCX_PROTO_INFO=y part 40 "$OUT/nixl_probe.txt" python3 benchmarks/nixl_probe.py
grep -E "nixl probe|remote memory read|Error" "$OUT/nixl_probe.txt" | head -5
UCX_TLS=cuda_ipc,cuda_copy,sm,self,tcp UCX_PROTO_INFO=y part 40 "$OUT/nixl_probe_cuda_tls.txt" python3 benchmarks/nixl_probe.py
grep -E "nixl probe|remote memory read|Error" "$OUT/nixl_probe_cuda_tls.txt" | head -5
UCX_LOG_LEVEL=debug part 40 "$OUT/nixl_probe_debug.txt" python3 benchmarks/nixl_probe.py --blocks 64
grep -iE "cuda_ipc|cuda_copy|failed|unreachable" "$OUT/nixl_probe_debug.txt" | sort | uniq -c | sort -rn | head -15
part 60 "$OUT/k12_kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k12" --parts kernel --dtypes bfloat16,fp8_e4m3,int8,int4
part 100 "$OUT/k12_step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k12" --parts step --dtypes bfloat16,fp8_e4m3,int4
part 90 "$OUT/k12_w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k12" --parts w1 --dtypes bfloat16,fp8_e4m3
grep -h '^{' "$OUT/k12_kernel.txt" "$OUT/k12_step.txt" "$OUT/k12_w1.txt" | cut -c1-220
part 150 "$OUT/i21_w1.txt" python3 benchmarks/gpu_issue21.py --out "$OUT/i21" --parts w1 --formats bf16,bf16+fp8kv,fp8,fp8+fp8kv
grep -h '^{' "$OUT/i21_w1.txt"
