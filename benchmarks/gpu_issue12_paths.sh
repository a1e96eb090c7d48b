#!/usr/bin/env bash
# Quantized-KV decode code paths on one GPU (issue 12): integer-built float16 codes (no
# conversion instructions) and one dot per bit lane for 4-/2-bit codes, beside the previous
# paths, in two calls:
#   PHASE=sweep  the quantized-KV kernel tests on CUDA, then the decode kernel alone at batch 64
#                x 8k per dtype: each code path and tile config (benchmarks/gpu_issue12.py kernel)
#   PHASE=engine the decode step at batch 64 x 8k and W1 per dtype with the defaults, and the
#                step with the previous code paths (--code-paths fast_cvt=0,lane_split=0)
#   PHASE=rotation int4/int2 with the Hadamard rotation inside the Triton kernels vs around them
#                (--unfused-rotation): CUDA tests (kernels, CUDA graphs), the kernel, the batch-64
#                x 8k step, batch-1 decode (Llama-3.1-8B shape) per dtype, W1 int4
#   PHASE=final  the shipped code: probe, CUDA tests, kernel, step, batch-1 decode, W1 (int4/int2, bf16)
#   PHASE=fold   the value rotation folded into the weights (q rotated by the store kernel) vs rotated
#                in the kernels (--no-value-fold): CUDA tests, batch-1 decode, the batch-64 x 8k step, W1
#   PHASE=table  every dtype beside bf16 on the final code: kernel, step, batch-1 (PHASE=table_w1: W1)
#   PHASE=residual int4/int2 with the filling block exact (kv_residual) vs without (--no-residual): CUDA
#                tests, the batch-64 x 8k step, batch-1 decode (PHASE=residual_w1: W1)
#   PHASE=unpack int4/int2 bit lanes built by inline PTX (--code-paths unpack=asm) vs integer ops: CUDA
#                tests, the decode kernel (default tiles; asm: a tile sweep), the batch-64 x 8k step
#   PHASE=unpack_engine asm as the default: CUDA tests (kernels, residual, CUDA graphs), a tile sweep
#                around the new default, the batch-64 x 8k step, batch-1 decode and W1 (bf16, int4, int2)
#   PHASE=unpack_b1 64-key asm tiles below one program per SM: CUDA tests (residual, CUDA graphs),
#                batch-1 decode (and int4 with unpack=int32), the batch-64 x 8k step
#   PHASE=i8qk   int8 queries and an int8 tensor-core q . K (unpack=asm_i8qk) beside asm: CUDA tests,
#                the kernel, the batch-64 x 8k step
# Usage (repo root): OUT=<dir> PHASE=sweep|engine|rotation|final|fold|table|table_w1|residual|residual_w1|unpack|unpack_engine|unpack_b1|i8qk \
#   bash benchmarks/gpu_issue12_paths.sh
set -u
OUT=${OUT:-/tmp/kvserve-out}
PHASE=${PHASE:-sweep}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
. "$(dirname "$0")/gpu_part.sh"  # part <seconds> <log> <command...>
probe_rotation() {  # each Triton kernel with the rotation, one process each; stop unless all 12 are ok
  for c in store decode prefill prefill64 prefill16 forward; do
    for dt in int4 int2; do
      CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 benchmarks/rotation_probe.py $c --dtype $dt 2>>"$OUT/probe_err.txt" \
        | tee -a "$OUT/probe.txt"
    done
  done
  if grep -q '"ok": false' "$OUT/probe.txt" || [ "$(grep -c '"ok": true' "$OUT/probe.txt")" != 12 ]; then
    echo "probe failed: no engine figures"; exit 1
  fi
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$PHASE" = sweep ]; then
  part 110 "$OUT/tests.txt" python3 -m pytest -q -x tests/attention/test_triton_kv_quant.py
  tail -3 "$OUT/tests.txt"
  part 330 "$OUT/kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts kernel \
    --dtypes bfloat16,fp8_e4m3,int8,int4,int2
  sed -n '/^part /,$p' "$OUT/kernel.txt"
elif [ "$PHASE" = rotation ]; then
  probe_rotation
  part 120 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_quant.py \
    tests/worker/test_cuda_graphs.py -k "fused_rotation or store or code_paths or graph_replay"
  grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
  part 40 "$OUT/kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts kernel --dtypes int4,int2 \
    --no-sweep --rotate
  part 60 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step --dtypes int4,int2
  part 40 "$OUT/step_unfused.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_unfused" --parts step \
    --dtypes int4 --unfused-rotation
  part 150 "$OUT/b1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts b1 \
    --dtypes bfloat16,fp8_e4m3,int4,int2
  part 45 "$OUT/b1_unfused.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_unfused" --parts b1 \
    --dtypes int4 --unfused-rotation
  part 90 "$OUT/w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts w1 --dtypes bfloat16,int4
  for f in kernel step step_unfused b1 b1_unfused w1; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
elif [ "$PHASE" = final ]; then  # the shipped code once more, fewer parts (the comparisons ran in "rotation")
  probe_rotation
  part 150 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_quant.py \
    tests/worker/test_cuda_graphs.py -k "fused_rotation or store_quantizes or graph_replay or decode_and_prefill"
  grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
  part 40 "$OUT/kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts kernel --dtypes int4,int2 \
    --no-sweep --rotate
  part 80 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step --dtypes bfloat16,int4,int2
  part 100 "$OUT/b1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts b1 --dtypes bfloat16,int4,int2
  part 90 "$OUT/w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts w1 --dtypes bfloat16,int4
  for f in kernel step b1 w1; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf final.tgz --remove-files probe.txt probe_err.txt tests.txt kernel.txt step.txt b1.txt w1.txt k)
elif [ "$PHASE" = table ]; then
  all=bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2
  part 70 "$OUT/kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts kernel --dtypes $all --no-sweep
  part 170 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step --dtypes $all
  part 200 "$OUT/b1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts b1 --dtypes $all
  for f in kernel step b1; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf table.tgz --remove-files kernel.txt step.txt b1.txt k)
elif [ "$PHASE" = table_w1 ]; then
  part 400 "$OUT/w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts w1 \
    --dtypes bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2
  sed -n '/^part /,$p' "$OUT/w1.txt"
  (cd "$OUT" && tar czf table_w1.tgz --remove-files w1.txt k)
elif [ "$PHASE" = residual ]; then
  part 120 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_residual.py tests/worker/test_cuda_graphs.py
  grep -hE "^FAILED|passed|failed" "$OUT/tests.txt" | tail -12
  part 90 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step --dtypes bfloat16,int4,int2
  part 60 "$OUT/step_nores.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_nores" --parts step \
    --dtypes int4,int2 --no-residual
  part 100 "$OUT/b1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts b1 --dtypes bfloat16,int4,int2
  part 60 "$OUT/b1_nores.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_nores" --parts b1 \
    --dtypes int4,int2 --no-residual
  for f in step step_nores b1 b1_nores; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf residual.tgz --remove-files tests.txt step.txt step_nores.txt b1.txt b1_nores.txt k k_nores)
elif [ "$PHASE" = residual_w1 ]; then
  part 200 "$OUT/tests_quant.txt" python3 -m pytest -q tests/attention/test_triton_kv_quant.py \
    -k "fused_rotation or store or decode_and_prefill"
  tail -1 "$OUT/tests_quant.txt"
  part 150 "$OUT/w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts w1 --dtypes bfloat16,int4,int2
  part 100 "$OUT/w1_nores.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_nores" --parts w1 \
    --dtypes int4,int2 --no-residual
  for f in w1 w1_nores; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf residual_w1.tgz --remove-files tests_quant.txt w1.txt w1_nores.txt k k_nores)
elif [ "$PHASE" = fold ]; then
  part 150 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_quant.py \
    tests/attention/test_kv_rotation.py tests/worker/test_cuda_graphs.py \
    -k "rotat or store or graph_replay or decode_and_prefill"
  grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
  part 120 "$OUT/b1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts b1 --dtypes bfloat16,int4,int2
  part 45 "$OUT/b1_kernels.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_kernels" --parts b1 \
    --dtypes int4 --no-value-fold
  part 90 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step --dtypes bfloat16,int4,int2
  part 40 "$OUT/step_kernels.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_kernels" --parts step \
    --dtypes int4 --no-value-fold
  part 90 "$OUT/w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts w1 --dtypes bfloat16,int4
  for f in b1 b1_kernels step step_kernels w1; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf fold.tgz --remove-files tests.txt b1.txt b1_kernels.txt step.txt step_kernels.txt w1.txt \
    k k_kernels)
elif [ "$PHASE" = unpack ]; then
  part 200 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_quant.py \
    -k "unpack or lane_asm or code_paths"
  grep -hE "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
  part 60 "$OUT/kernel_int32.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_int32" --parts kernel \
    --dtypes bfloat16,int4,int2 --no-sweep
  part 120 "$OUT/kernel_asm.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_asm" --parts kernel \
    --dtypes int4,int2 --code-paths unpack=asm --configs 64x2x5,64x4x2,128x4x2,32x2x5,128x2x5,64x2x3,32x4x2
  part 130 "$OUT/step_asm.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_asm" --parts step \
    --dtypes bfloat16,int4,int2 --code-paths unpack=asm
  part 90 "$OUT/step_int32.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_int32" --parts step \
    --dtypes int4,int2 --code-paths unpack=int32
  for f in kernel_int32 kernel_asm step_asm step_int32; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf unpack.tgz --remove-files tests.txt kernel_int32.txt kernel_asm.txt step_asm.txt \
    step_int32.txt k_int32 k_asm)
elif [ "$PHASE" = unpack_engine ]; then  # asm is the default now (128 x 2 x 5 tiles)
  part 130 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_quant.py \
    tests/attention/test_triton_kv_residual.py tests/worker/test_cuda_graphs.py \
    -k "unpack or code_paths or decode_and_prefill or residual or multi_token or graph_replay"
  grep -hE "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
  part 40 "$OUT/kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts kernel \
    --dtypes int4,int2 --configs 128x2x4,128x2x6,256x4x3,256x4x2,128x4x5,256x2x3
  part 100 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step --dtypes bfloat16,int4,int2
  part 110 "$OUT/b1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts b1 --dtypes bfloat16,int4,int2
  part 190 "$OUT/w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts w1 --dtypes bfloat16,int4,int2
  for f in kernel step b1 w1; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf unpack_engine.tgz --remove-files tests.txt kernel.txt step.txt b1.txt w1.txt k)
elif [ "$PHASE" = unpack_b1 ]; then  # 64-key asm tiles when programs < SMs (batch-1 decode)
  part 150 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_residual.py \
    tests/worker/test_cuda_graphs.py -k "residual or multi_token or graph_replay"
  grep -hE "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
  part 110 "$OUT/b1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts b1 --dtypes bfloat16,int4,int2
  part 45 "$OUT/b1_int32.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_int32" --parts b1 --dtypes int4 \
    --code-paths unpack=int32
  part 70 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step --dtypes bfloat16,int4
  for f in b1 b1_int32 step; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf unpack_b1.tgz --remove-files tests.txt b1.txt b1_int32.txt step.txt k k_int32)
elif [ "$PHASE" = i8qk ]; then  # int8 q . K (unpack=asm_i8qk) beside the default asm path
  if [ -z "${NO_TESTS:-}" ]; then
    part 200 "$OUT/tests.txt" python3 -m pytest -q tests/attention/test_triton_kv_quant.py \
      -k "unpack or code_paths or decode_and_prefill or scale_tiles"
    grep -hE "^FAILED|passed|failed" "$OUT/tests.txt" | tail -8
  fi
  part 60 "$OUT/kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts kernel \
    --dtypes bfloat16,int4,int2 --no-sweep
  part 60 "$OUT/kernel_i8qk.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_i8qk" --parts kernel \
    --dtypes int4,int2 --code-paths unpack=asm_i8qk --configs 64x2x5,128x4x2,128x4x5
  part 100 "$OUT/step_i8qk.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_i8qk" --parts step \
    --dtypes bfloat16,int4,int2 --code-paths unpack=asm_i8qk
  for f in kernel kernel_i8qk step_i8qk; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
  (cd "$OUT" && tar czf i8qk.tgz --remove-files $(ls tests.txt 2>/dev/null) kernel.txt kernel_i8qk.txt step_i8qk.txt \
    k k_i8qk)
else
  part 70 "$OUT/tests.txt" python3 -m pytest -q -x tests/attention/test_triton_kv_quant.py -k "code_paths or decode_and_prefill"
  tail -2 "$OUT/tests.txt"
  part 60 "$OUT/kernel.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts kernel \
    --dtypes bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2 --no-sweep
  part 50 "$OUT/kernel_fp8.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_fp8" --parts kernel --dtypes fp8_e4m3
  part 130 "$OUT/step.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts step \
    --dtypes bfloat16,fp8_e4m3,int8,int4,int2
  part 40 "$OUT/step_prev.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k_prev" --parts step \
    --dtypes int4 --code-paths fast_cvt=0,lane_split=0
  part 140 "$OUT/w1.txt" python3 benchmarks/gpu_issue12.py --out "$OUT/k" --parts w1 --dtypes bfloat16,fp8_e4m3,int4
  for f in kernel kernel_fp8 step step_prev w1; do sed -n '/^part /,$p' "$OUT/$f.txt"; done
fi
