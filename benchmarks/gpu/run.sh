#!/usr/bin/env bash
# The one entry point for GPU measurements: runs the named parts one after the other, each under
# its own time limit (a part that fails or runs out of time does not stop the next), each writing
# into $OUT/<part>/ (console.txt + its JSON), then prints a short table last and packs the part
# folders into $OUT/results.tgz (the device tool brings back at most 8 files; KEEP_DIRS=1 keeps
# the folders as they are).
#
# Usage (repo root, on the GPU machine):
#   OUT=<dir> bash benchmarks/gpu/run.sh PART[:SECONDS] ...     e.g.  w1 w2 w3 kv-quant-kernel:90
#   bash benchmarks/gpu/run.sh --list                             the parts and their time limits
#
# The canonical workloads (parts w1, w2, w3: benchmarks/workloads.py, one engine per process):
#   KVSERVE_SRC=<dir>       measure the kvserve tree in <dir> instead of this one (PYTHONPATH)
#   KVSERVE_BASELINE=<dir>  also measure the tree in <dir> right after each workload, in the same
#                           call (side by side: $OUT/<part>/current.json and baseline.json); e.g.
#                           `git archive <commit> kvserve | tar -x -C .prev` here, carried as .prev;
#                           KVSERVE_BASELINE_COMMIT=<sha> names it in the JSON
#   WORKLOAD_ARGS="..."     extra workloads.py arguments (e.g. "--kv-cache-dtype fp8_e4m3")
# Other settings: KVSERVE_COMMIT (recorded in the JSON when git metadata is absent or stale),
# GPU_TESTS (the test paths of part tests-cuda), INT4_W2_FORMATS (part int4-w2's Triton-GEMM formats). Wheels in .whl/ and NIXL in .whl_nixl/ (as
# the device README says) are installed into /tmp/site first when present.
# Part ray-tp unpacks Ray from .whl_ray/ (bash benchmarks/gpu/ray_bundle.sh: ~31 MiB, carried as .whl_ray).
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Multicast stays off on multi-GPU hosts (it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=${SITE:-/tmp/site}
SRC=${KVSERVE_SRC:-$ROOT}
B=benchmarks

# name:default seconds:what it measures
PARTS="
tests-cuda:300:the GPU-relevant tests on CUDA (GPU_TESTS; default attention, worker, layers, kv_connector)
equality:150:greedy equality with transformers, float32, Qwen3-0.6B shape (gpu_equality.py)
w1:240:W1 offline throughput, Qwen3-0.6B shape (workloads.py)
w1-steps:150:W1 step by step: wall time by step kind and decode batch size, the tail's cost (w1_steps.py)
w2:200:W2 batch-1 decode ms/token, Llama-3.1-8B shape (workloads.py)
w3:300:W3 prefix reuse, caching on vs off (workloads.py)
w2-peer:240:W2 of transformers' static-cache generate beside ours, decode step times (gpu_decode.py)
w1-peer:300:W1 of transformers' continuous batching (w1_peer.py)
w3-ttft:300:W3 per-request TTFT of a prefix hit vs cold, and the 0%-hit cost (w3_prefix.py)
kv-quant-kernel:120:quantized-KV decode kernel alone per dtype vs bf16, GB/s (gpu_kv_quant.py kernel)
kv-quant-engine:300:quantized-KV decode step b64 x 8k, batch-1 decode and W1 per dtype (gpu_kv_quant.py)
weight-quant:240:quantized weights: linear kernels and W2 per format vs roofline (gpu_weight_quant.py)
int4-gemm:150:W4A16 GEMM alone at the 8B projections, M 1..256, tuned per shape, vs bf16 and tinygemm, GB/s vs copy (gpu_w4a16.py)
int4-w2:200:W2 batch-1 decode, 8B shape: int4, awq, gptq on the Triton W4A16 GEMM, int4 on tinygemm, bf16 (workloads.py)
int4-offline:340:offline ISL/OSL 1000/1000, 8B shape, 256 requests: int4 vs bf16 vs fp8 (gpu_w4a16.py)
int4-moe:140:GPTQ INT4 experts vs bf16, Qwen3-30B-A3B shape: fused MoE kernel T=1..256, batch-1 ms/token, batch-64 tok/s (gpu_int4_moe.py)
spec:510:speculative decoding: verify-step cost, batch-1 speedups, W1-like load, EAGLE-3 draft steps eager vs CUDA graphs, tree verify cost (gpu_spec.py; SPEC_PARTS picks)
tiers:300:KV tiers at the 8B shape: bandwidth, multi-turn, zero reuse, swap, persistence (kv_tiers.py)
hybrid:240:hybrid KV (sliding window): capacity, decode 2K vs 32K, window kernel (hybrid_kv.py)
gemma3:400:Gemma 3 270M shape: equality with transformers, throughput (gpu_gemma3.py)
bounded:360:bounded KV: decode cost none/streaming/h2o, endless StreamingLLM (gpu_bounded.py)
structured:360:structured outputs: bitmask on CUDA, constrained requests in a batch (gpu_structured_outputs.py)
pd-transfer:200:P/D KV transfer on one GPU, tcp and NIXL: GB/s and TTFT vs recompute (pd_transfer.py)
serve-sweep:580:online serving sweep 1..64 QPS, 8B shape (gpu_serve_sweep.sh)
tp:560:two GPUs: tensor parallelism TP=1 vs 2, 8B and 70B shapes (gpu_tensor_parallel.py)
pp:120:two GPUs: pipeline parallel 2 vs tensor parallel 2 vs one GPU, 8B shape, batch 1 and 64 (gpu_tensor_parallel.py --pp)
pp-70b:330:two GPUs: 70B shape, pipeline parallel 2 vs tensor parallel 2, batch 1 and 64, vs the weight-read floor (gpu_tensor_parallel.py --pp)
allreduce:60:two GPUs: custom all-reduce one-shot/two-shot vs NCCL vs torch symm_mem, 8 KB..4 MB, eager and graph; fused AR+add+RMSNorm (gpu_all_reduce.py)
tp-ar:150:two GPUs: 8B batch-1 ms/token TP=1 vs TP=2 custom all-reduce vs TP=2 NCCL, each in its own process (gpu_all_reduce.py)
pd:580:two GPUs: 1 prefill + 1 decode worker vs 2 colocated replicas (pd_goodput.py)
pd4:590:four GPUs (nvidia-h200-x4): P/D 1+3 and 2+2 vs 4 colocated replicas (pd_goodput.py)
moe-kernel:120:fused MoE kernel alone, Qwen3-30B-A3B / gpt-oss-20b layers, T=1..4096 vs weight-read roofline (gpu_moe.py)
moe:420:MoE models, dummy weights: Qwen3-30B-A3B batch-1 decode + ISL/OSL 1000/1000, gpt-oss-20b (gpu_moe.py)
moe-ep:580:two GPUs: Mixtral-8x7B shape, tensor parallel 2 vs expert parallel 2, batch 1 and 64 (gpu_moe_parallel.py)
mla:480:MLA: decode kernel GB/s vs copy (b64 x 8K, 128/16 heads); DeepSeek-V2-Lite shape engine (gpu_mla.py)
mla-mtp:130:DeepSeek MTP speculation (deepseek_mtp), V3-shaped small config, dummy weights: batch-1 ms/token, k 0/1/2; draft steps eager vs CUDA graphs (gpu_mla.py mtp, mtp-graphs)
mla-kernel:60:MLA decode kernel alone, b64 x 8K, 16/128 heads, bf16/FP8 latent: tile sweep, best GB/s vs copy (gpu_mla.py kernel)
mla-tp2:150:two GPUs: DeepSeek-V2-Lite shape TP=2 vs TP=1, batch-1 ms/token and batch-64 tok/s, each in its own process (gpu_mla.py tp)
soak:600:10-minute-class soak, 8B shape: fixed rate, aborts, hang-ups; lost requests, leaked blocks, drift (load/soak_gpu.py)
memory-stress:330:GPU memory under a feature matrix (max batch + prefixes, 32K FP8 KV, n-gram speculation, MoE): OOMs, peak vs --gpu-memory-utilization (gpu_memory_stress.py)
engine-release:420:three engines in one process after a W1-like load: free GPU memory after shutdown (gpu_engine_release.py)
fp8:180:FP8 W8A8 GEMMs at the 8B projections (cut-over M), W4 with FP8 weights + FP8 KV vs TensorRT-LLM (gpu_fp8_gemm.py)
cascade:100:cascade attention: kernel alone at the W3 shape vs per-request decode; W3 cascade on vs off, caching off (gpu_cascade.py)
step-profile:70:batch-512 (and 1024) x ~2K decode step, 8B shape, FP8 KV: host ms per seam, kernel table vs roofline (step_profile.py)
dp:150:two GPUs: data parallel 2 vs 1 behind one server, 8B serving at 64 and 96 QPS (gpu_data_parallel.py)
ray-tp:150:two GPUs: TP=2 through a one-node Ray cluster vs mp: equal outputs, start-up (gpu_ray_tp.py; Ray from .whl_ray/)
eagle3-train:300:EAGLE-3 head for the default model trained on the GPU (real weights): held-out acceptance k=2..5, batch-1 ms/token k=3/4 vs none, batch 16/64 dynamic (gpu_eagle3_train.py)
spec-policy:200:the shipped EAGLE head on the default model (real weights): batch 16/64 dynamic speculation vs none, batch-1 k=4 vs none (gpu_eagle3_train.py --head)
spec-off-rounds:300:speculation configured but off, batch 64: none vs EAGLE k=4 vs n-gram dynamic, 4 alternating rounds of fresh processes, 3 timed runs each (spec_off_cost.py --rounds)
spec-off-interleaved:200:speculation configured but off, batch 64: none, EAGLE k=4 and n-gram dynamic engines in one process, timed runs alternating, then one run each under cProfile (spec_off_cost.py --interleave --host-calls)
spec-off:240:speculation configured but off (dynamic, batch 64 above its band): none vs EAGLE k=4 / k=1 / n-gram tok/s, graph replay device ms, kernel table (spec_off_cost.py --profile; KVSERVE_BASELINE's tree after: none, EAGLE k=4)
spec-edit:150:default model (real weights), batch 1: n-gram and suffix decoding on code edits, repeated edits and chat vs none (spec_decode_cpu.py --device cuda)
prefill:150:long prompts, 8B shape: prefill kernel alone 4K/32K/128K vs matmul peak, W5 TTFT bf16 vs fp8 KV (gpu_prefill.py)
decode-kernel:90:paged decode kernel alone, 8B layer, b512x2K b64x8K b1x32K, bf16 and fp8 KV: config sweep, GB/s vs copy, old kernel beside, fp8 KV FP8-dot path rows (gpu_decode_kernel.py)
"

if [ "${1:-}" = "--list" ] || [ $# = 0 ]; then
  echo "parts (name, default seconds, what):"
  echo "$PARTS" | sed '/^$/d' | sed 's/^\([^:]*\):\([^:]*\):/\1|\2|/' | awk -F'|' '{printf "  %-16s %4ss  %s\n", $1, $2, $3}'
  [ $# = 0 ] && exit 2
  exit 0
fi

install_wheels() {  # the server's wheels (.whl/) and NIXL (.whl_nixl/) into $SITE
  mkdir -p "$SITE"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl > "$OUT/wheels.txt" 2>&1
    echo "wheels rc=$?"
  fi
  if [ -f .whl_nixl/nixl_trim.tar.xz ]; then  # nixl-cu13 unpacked and trimmed to fit one call
    tar -C "$SITE" -xJf .whl_nixl/nixl_trim.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl_nixl/nixl-*-py3-none-any.whl \
      >> "$OUT/wheels.txt" 2>&1
    echo "nixl rc=$?"
  elif ls .whl_nixl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl_nixl/*.whl >> "$OUT/wheels.txt" 2>&1
    echo "nixl rc=$?"
  fi
}

py() { PYTHONPATH=$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH} python3 "$@"; }

reap_gpu_leftovers() {  # after a part: kill processes still computing on this run's GPUs
  # A server started in its own session (setsid) outlives its part's process group when the part
  # is cut at its limit, and its memory would fail the next part. Parts run one at a time per
  # run.sh, and each lanes.sh lane owns its GPU, so whatever still runs on these GPUs is stale.
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  local uuids pid uuid
  uuids=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null | awk -F', ' -v vis="${CUDA_VISIBLE_DEVICES:-}" \
    'BEGIN { n = split(vis, a, ",") } { if (n == 0) print $2; else for (i = 1; i <= n; i++) if (a[i] == $1) print $2 }')
  [ -n "$uuids" ] || return 0
  local killed
  killed=$(nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader 2>/dev/null | while IFS=', ' read -r pid uuid; do
    if [ -n "$pid" ] && echo "$uuids" | grep -qF "$uuid"; then
      echo "killing a leftover GPU process: $pid $(ps -o cmd= -p "$pid" 2>/dev/null | cut -c1-100)"
      kill -9 "$pid" 2>/dev/null
    fi
  done)
  [ -n "$killed" ] && { echo "$killed"; sleep 3; }  # the driver frees their memory
  return 0
}

workload() {  # workload <w1|w2|w3> <dir>: this tree (or KVSERVE_SRC), then KVSERVE_BASELINE if set
  local w=$1 d=$2
  # shellcheck disable=SC2086
  py "$B/workloads.py" --workload "$w" ${WORKLOAD_ARGS:-} --out "$d/current.json"
  if [ -n "${KVSERVE_BASELINE:-}" ]; then
    local base
    base=$(cd "$KVSERVE_BASELINE" && pwd)
    # shellcheck disable=SC2086
    (cd "$base" && KVSERVE_COMMIT=${KVSERVE_BASELINE_COMMIT:-} PYTHONPATH=$base:$SITE \
      python3 "$ROOT/$B/workloads.py" --workload "$w" ${WORKLOAD_ARGS:-} --out "$d/baseline.json")
  fi
}

run_part() {  # run_part <name> <dir>: the commands of one part
  local p=$1 d=$2
  case $p in
    tests-cuda)
      # shellcheck disable=SC2086
      py -m pytest -q -p no:cacheprovider -m "not slow" ${GPU_TESTS:-tests/attention tests/worker tests/layers tests/kv_connector} ;;
    equality) py $B/gpu_equality.py --out "$d" --skip-w1 ;;
    w1|w2|w3) workload "$p" "$d" ;;
    w1-steps) py $B/w1_steps.py --out "$d" ;;
    w2-peer) py $B/gpu_decode.py --out "$d" --backends triton --w1-backends "" ;;
    w1-peer) py $B/w1_peer.py --out "$d" ;;
    w3-ttft) py $B/w3_prefix.py --out "$d" ;;
    kv-quant-kernel) py $B/gpu_kv_quant.py --out "$d" --parts kernel --dtypes bfloat16,fp8_e4m3,fp8_e5m2,int8,int4,int2 ;;
    kv-quant-engine)
      py $B/gpu_kv_quant.py --out "$d" --parts step,b1 --dtypes bfloat16,fp8_e4m3,int8,int4,int2
      py $B/gpu_kv_quant.py --out "$d" --parts w1 --dtypes bfloat16,fp8_e4m3,int4 ;;
    weight-quant) py $B/gpu_weight_quant.py --out "$d" --parts kernels,w2 --formats bf16,fp8,int4,int4@triton ;;
    int4-gemm) py $B/gpu_w4a16.py --out "$d" --parts gemm --sweep --sweep-s 50 ;;
    int4-w2)  # batch 1: max_num_seqs=4 captures 3 graphs, not 35 (the batch-1 step is the same)
      local w2a="--workload w2 --engine-arg max_num_seqs=4"
      for q in ${INT4_W2_FORMATS:-int4 awq gptq}; do
        # shellcheck disable=SC2086
        KVSERVE_INT4_KERNEL=w4a16 py $B/workloads.py $w2a --engine-arg quantization=$q --out "$d/w2_$q.json"
      done
      # shellcheck disable=SC2086
      KVSERVE_INT4_KERNEL=tinygemm py $B/workloads.py $w2a --engine-arg quantization=int4 \
        --out "$d/w2_int4_tinygemm.json"
      # shellcheck disable=SC2086
      py $B/workloads.py $w2a --out "$d/w2_none.json" ;;
    int4-offline) py $B/gpu_w4a16.py --out "$d" --parts offline --formats int4,bf16,fp8 --offline-deadline $(( ${LIMIT:-340} - 110 )) ;;
    int4-moe) py $B/gpu_int4_moe.py --out "$d" --deadline $(( ${LIMIT:-90} - 5 )) ;;
    spec) for s in ${SPEC_PARTS:-verify batch1 load draft tree}; do py $B/gpu_spec.py --out "$d/$s" --parts $s; done ;;
    tiers)
      local c="--gpu8b --tier-gib 24 --kv-cache-memory 16GiB"
      # shellcheck disable=SC2086
      py $B/kv_tiers.py $c --parts bandwidth --bw-blocks 1024 --out "$d/tiers_bw.json"
      # shellcheck disable=SC2086
      py $B/kv_tiers.py $c --parts multiturn --convs 64 --turns 6 --first-tokens 512 --turn-tokens 256 \
        --output-len 32 --out "$d/tiers_multiturn.json"
      # shellcheck disable=SC2086
      py $B/kv_tiers.py $c --parts zero,swap,persist --zero-n 64 --zero-len 1024 --output-len 64 --decode-len 128 \
        --swap-n 64 --swap-prompt 512 --swap-out 512 --persist-len 2048 --out "$d/tiers_rest.json" ;;
    hybrid) for s in capacity decode kernel; do py $B/hybrid_kv.py --out "$d" --parts $s --tag $s; done ;;
    gemma3) py $B/gpu_gemma3.py --out "$d" ;;
    bounded)
      py $B/gpu_bounded.py --out "$d" --parts cost
      py $B/gpu_bounded.py --out "$d/endless" --parts endless --endless-seconds 150 ;;
    structured) py $B/gpu_structured_outputs.py --out "$d" ;;
    pd-transfer)
      for t in tcp nixl; do UCX_PROTO_INFO=y py $B/pd_transfer.py --transport $t --out "$d"; done ;;
    serve-sweep) OUT=$d SWEEP_SKIP_WHEELS=1 PYTHONPATH=$SITE:$SRC bash $B/gpu_serve_sweep.sh ;;
    tp) py $B/gpu_tensor_parallel.py --out "$d" ;;
    pp) py $B/gpu_tensor_parallel.py --pp --out "$d" --point-timeout 38 ;;
    pp-70b) py $B/gpu_tensor_parallel.py --pp --model 70b --out "$d" --point-timeout $(( (${LIMIT:-330} - 10) / 2 )) ;;
    allreduce) py $B/gpu_all_reduce.py --part allreduce --out "$d" ;;
    tp-ar) py $B/gpu_all_reduce.py --part tp --out "$d" --deadline $(( ${LIMIT:-150} - 8 )) ;;
    pd4)
      # shellcheck disable=SC2086
      UCX_PROTO_INFO=y py $B/pd_goodput.py --out "$d" --deadline $(( ${LIMIT:-590} - 30 )) --modes pd-1x3,pd-2x2,colocated-4 \
        --rates 16,32,48 --duration 15 ${PDG_ARGS:-} ;;
    moe-ep) py $B/gpu_moe_parallel.py --out "$d" ;;
    pd)
      # shellcheck disable=SC2086
      UCX_PROTO_INFO=y py $B/pd_goodput.py --out "$d" --deadline $(( ${LIMIT:-580} - 30 )) ${PDG_ARGS:-} ;;
    moe-kernel)
      py $B/gpu_moe.py --out "$d" --parts kernel
      py $B/gpu_moe.py --out "$d/sweep" --parts sweep --deadline $(( ${LIMIT:-120} / 4 )) ;;
    moe) py $B/gpu_moe.py --out "$d" --parts models --deadline $(( ${LIMIT:-420} - 20 )) ;;
    mla) py $B/gpu_mla.py --out "$d" --num-requests 64 --engine-timeout $(( ${LIMIT:-480} - 120 )) ;;
    mla-mtp)
      py $B/gpu_mla.py --out "$d" --parts mtp --mtp-ks 1,2 --mtp-deadline $(( ${LIMIT:-130} - 95 ))
      py $B/gpu_mla.py --out "$d/graphs" --parts mtp-graphs ;;
    mla-kernel) py $B/gpu_mla.py --out "$d" --parts kernel --kernel-budget $(( ${LIMIT:-60} - 15 )) ;;
    mla-tp2) py $B/gpu_mla.py --out "$d" --parts tp --tp-deadline $(( ${LIMIT:-150} - 12 )) ;;
    soak)  # 8 GiB of KV (~65K tokens at the 8B shape): long prompts at 80% load preempt
      py $B/load/soak_gpu.py --duration ${SOAK_S:-400} --calib-s 40 --serve-args "--kv-cache-memory 8GiB" --out "$d" ;;
    engine-release) py $B/gpu_engine_release.py --out "$d" ;;
    memory-stress)  # MEMSTRESS_CONFIGS: a subset, NAME+expandable for PyTorch's expandable segments
      py $B/gpu_memory_stress.py --out "$d" --seconds 25 --configs "${MEMSTRESS_CONFIGS:-max-batch,long-fp8,spec,moe}" \
        --timeout "${MEMSTRESS_TIMEOUT:-$(( (${LIMIT:-330} - 10) / 4 ))}" ;;
    fp8) py $B/gpu_fp8_gemm.py --out "$d" --parts w4,gemm --deadline $(( ${LIMIT:-180} - 25 )) ;;
    cascade) py $B/gpu_cascade.py --out "$d" --deadline $(( ${LIMIT:-100} - 5 )) ;;
    step-profile)  # FP8 KV: 512 x 2K does not fit a bf16 KV cache beside the weights (128 GiB)
      py $B/step_profile.py --device cuda --batch 512 1024 --context 2048 --steps 20 --profile-steps 4 \
        --kv-cache-dtype fp8_e4m3 --out "$d" ;;
    dp) py $B/gpu_data_parallel.py --out "$d" --deadline $(( ${LIMIT:-150} - 12 )) ;;
    ray-tp) py $B/gpu_ray_tp.py --out "$d" --site "$SITE" --wheels "$ROOT/.whl_ray" ;;
    prefill)  # the quick tile/path sweep (~30 s, best per KV dtype), W5 (the TTFT targets), the kernel figures
      local old=/tmp/prefill_old.py  # the kernel before the config table: KVSERVE_BASELINE's, or from git
      if [ -n "${KVSERVE_BASELINE:-}" ]; then cp "$KVSERVE_BASELINE/kvserve/attention/triton/prefill.py" $old
      else git show "${PREFILL_BASELINE_COMMIT:-0fa5af9}:kvserve/attention/triton/prefill.py" > $old 2>/dev/null || old=""; fi
      py $B/gpu_prefill.py --out "$d" --parts peak,sweep,w5,chunk,kernel --reps 2 --sweep-set quick --budget 35 \
        --chunk-budget 20 ${old:+--old-kernel $old} ;;
    eagle3-train)  # the head (~20 MB, two files) lies outside results.tgz: the tool brings back <= 16 MiB a file
      # the default GGUF from the pieces carried by earlier calls (benchmarks/gpu/gguf_parts.sh), if not given
      [ -z "${KVSERVE_DEFAULT_GGUF:-}" ] && [ -d "$ROOT/.gguf_part2" ] && \
        KVSERVE_DEFAULT_GGUF=$(bash "$ROOT/benchmarks/gpu/gguf_parts.sh" join) && export KVSERVE_DEFAULT_GGUF
      py $B/gpu_eagle3_train.py --out "$d" --head-out "$OUT/eagle3-head" --deadline $(( ${LIMIT:-300} - 15 )) ;;
    spec-policy)  # the default GGUF from the carried pieces, as eagle3-train
      [ -z "${KVSERVE_DEFAULT_GGUF:-}" ] && [ -d "$ROOT/.gguf_part2" ] && \
        KVSERVE_DEFAULT_GGUF=$(bash "$ROOT/benchmarks/gpu/gguf_parts.sh" join) && export KVSERVE_DEFAULT_GGUF
      py $B/gpu_eagle3_train.py --out "$d" --head kvserve/spec_decode/data/eagle-smollm2-135m --method eagle \
        --plan batch,none,k4 --deadline $(( ${LIMIT:-200} - 10 )) ;;
    spec-off)  # ~30 s per configuration; KVSERVE_BASELINE's tree (the same script) into $d/baseline
      py $B/spec_off_cost.py --out "$d" --batches 64 --configs none,eagle_dynamic,ngram_dynamic,eagle1_dynamic --profile
      if [ -n "${KVSERVE_BASELINE:-}" ]; then
        local base
        base=$(cd "$KVSERVE_BASELINE" && pwd)
        (cd "$base" && PYTHONPATH=$base:$SITE python3 "$ROOT/$B/spec_off_cost.py" --out "$d/baseline" \
          --tmp /tmp/kvserve-spec-off-base --batches 64 --configs none,eagle_dynamic --profile)
      fi ;;
    spec-off-rounds) py $B/spec_off_cost.py --out "$d" --batches 64 --rounds "${SPEC_OFF_ROUNDS:-4}" --repeats 3 \
      --configs "${SPEC_OFF_CONFIGS:-none,eagle_dynamic,ngram_dynamic}" ;;
    spec-off-interleaved) py $B/spec_off_cost.py --out "$d" --batches 64 --interleave --rounds 5 --repeats 2 --host-calls \
      --configs "${SPEC_OFF_CONFIGS:-none,eagle_dynamic,ngram_dynamic}" ;;
    spec-edit)  # the default GGUF from the carried pieces, as eagle3-train
      [ -z "${KVSERVE_DEFAULT_GGUF:-}" ] && [ -d "$ROOT/.gguf_part2" ] && \
        KVSERVE_DEFAULT_GGUF=$(bash "$ROOT/benchmarks/gpu/gguf_parts.sh" join) && export KVSERVE_DEFAULT_GGUF
      py $B/spec_decode_cpu.py --device cuda --model "${KVSERVE_DEFAULT_GGUF:?the default GGUF}" \
        --workloads edit,repeat,chat --ks 4 --suffix-ks 4,8 --edit-prompts 6 --chat-prompts 6 --max-tokens 256 \
        --out "$d/spec_decode_cuda.json" ;;
    decode-kernel)  # the kernel of 0fa5af9 (before the config table) beside: KVSERVE_BASELINE's, or from git
      local old=/tmp/decode_old.py
      if [ -n "${KVSERVE_BASELINE:-}" ]; then cp "$KVSERVE_BASELINE/kvserve/attention/triton/decode.py" $old
      else git show "${DECODE_BASELINE_COMMIT:-0fa5af9}:kvserve/attention/triton/decode.py" > $old 2>/dev/null || old=""; fi
      py $B/gpu_decode_kernel.py --out "$d" --budget $(( ${LIMIT:-90} - 12 )) ${old:+--old-kernel $old} ;;
    *) echo "unknown part: $p (bash benchmarks/gpu/run.sh --list)"; return 2 ;;
  esac
}

headline() {  # the figures of one part, one line each
  local p=$1 d=$2
  case $p in
    w1|w2|w3)
      for f in "$d"/current.json "$d"/baseline.json; do
        [ -f "$f" ] && python3 - "$f" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).readline())
w = r["workload"]
if w.startswith("W1"):
    fig = f"{r['output_tok_per_s']} out tok/s"
elif w.startswith("W2"):
    fig = f"{r['ms_per_token']} ms/token"
else:
    fig = (f"off {r['caching_off']['wall_s']} s, on {r['caching_on']['wall_s']} s ({r['speedup']}x), "
           f"TTFT ratio {r['ttft_ratio']}")
print(f"  {w} {r.get('kv_cache_dtype') or ''} {fig}  [{str(r['commit'])[:10]}]")
PY
      done ;;
    pd|pd4) grep -h '^|' "$d/console.txt" 2>/dev/null | grep -v '^|--' | tail -n 16 | cut -c1-160 | sed 's/^/  /' ;;
    *) grep -h '^|' "$d/console.txt" 2>/dev/null | grep -v '^|--' | tail -n 8 | cut -c1-160 | sed 's/^/  /' ;;
  esac
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>/dev/null
git log -1 --format='commit %h %s' 2>/dev/null || echo "commit ${KVSERVE_COMMIT:-unknown}"

# msgspec travels as a wheel too (`import kvserve` needs it; the GPU image lacks it)
install_wheels

SUMMARY=()
for spec in "$@"; do
  name=${spec%%:*}
  line=$(echo "$PARTS" | grep "^$name:" || true)
  limit=${line#*:}; limit=${limit%%:*}
  [ "$spec" != "$name" ] && limit=${spec#*:}
  [ -z "$line" ] && { echo "== $name: unknown part"; SUMMARY+=("$name|2|0"); continue; }
  d=$OUT/$name
  mkdir -p "$d"
  echo "== $name (limit ${limit}s)"
  s=$(date +%s)
  # The part's commands in a subshell, killed as a group at its limit.
  LIMIT=$limit timeout -k 10 "$limit" bash -c "$(declare -f py workload run_part); \
    ROOT='$ROOT' OUT='$OUT' SITE='$SITE' SRC='$SRC' B='$B' LIMIT='$limit'; run_part '$name' '$d'" \
    > "$d/console.txt" 2>&1
  rc=$?
  reap_gpu_leftovers
  echo "rc=$rc in $(( $(date +%s) - s ))s"; tail -n 6 "$d/console.txt"
  SUMMARY+=("$name|$rc|$(( $(date +%s) - s ))")
done

{
  echo
  printf '%-16s %4s %6s\n' part rc seconds
  for row in "${SUMMARY[@]}"; do
    IFS='|' read -r n rc t <<< "$row"
    printf '%-16s %4s %6s\n' "$n" "$rc" "$t"
    headline "$n" "$OUT/$n"
  done
} | tee "$OUT/summary.txt"

if [ -z "${KEEP_DIRS:-}" ]; then
  dirs=()
  for spec in "$@"; do [ -d "$OUT/${spec%%:*}" ] && dirs+=("${spec%%:*}"); done
  # Server and launch logs can run to hundreds of MB; keep the last 512 KB of each so the
  # archive stays under the device tool's 16 MiB per file and the JSON always comes back.
  for d in "${dirs[@]}"; do
    find "$OUT/$d" -type f \( -name '*.txt' -o -name '*.log' \) -size +512k | while read -r f; do
      tail -c 524288 "$f" > "$f.tail" && mv "$f.tail" "$f"
    done
  done
  [ ${#dirs[@]} -gt 0 ] && tar czf "$OUT/results.tgz" -C "$OUT" "${dirs[@]}" && (cd "$OUT" && rm -rf "${dirs[@]}")
fi
