#!/usr/bin/env bash
# Online serving sweep on one GPU: `kvserve serve` (Llama-3.1-8B shape, dummy bf16 weights, no
# tokenizer) driven by `kvserve bench serve` at 1..64 requests/s with ShareGPT-like random
# lengths (uniform 4:400 prompt and 4:354 output tokens, means 202 and 179), each rate for
# about SWEEP_DURATION s of arrivals (--sweep-duration), a fresh random workload per rate.
#
# Usage, from the repo root (on the GPU machine, with the server's wheels in .whl/):
#     OUT=/some/dir KVSERVE_COMMIT=<sha> bash benchmarks/gpu_serve_sweep.sh
# Writes into $OUT: serve_sweep.json (env, client/server commands, model config, one entry per
# rate), serve_sweep.md (the table), plots/{ttft,tpot,throughput}_vs_qps.png, server.log and
# sweep.log; prints a short table last, with the targets at 32 QPS (TTFT p50 <= 80 ms,
# TPOT p50 <= 10 ms).
#
# Wheels: when .whl/ exists (and SWEEP_SKIP_WHEELS is unset) they are installed into
# /tmp/site first (no index, no deps), as the device README says; PYTHONPATH=/tmp/site:$PWD.
#
# Settings (environment):
#   SWEEP_CONFIG        llama31-8b (default) | tiny (2-layer, hidden 64, vocab 1000: a CPU dry run)
#   SWEEP_RATES         request rates, default 1,2,4,8,16,32,64
#   SWEEP_DURATION      seconds of arrivals per rate (default 30)
#   SWEEP_MIN_PROMPTS   fewest requests per rate (default 32)
#   SWEEP_INPUT_LEN     prompt tokens LO:HI, inclusive (default 4:400, mean 202)
#   SWEEP_OUTPUT_LEN    output tokens LO:HI, inclusive (default 4:354, mean 179)
#   SWEEP_WARMUP_PROMPTS  untimed requests sent all at once before the sweep (default 64; 0: none)
#   SWEEP_DEADLINE_S    wall-clock budget of the whole script from its start (default 570): the
#                       sweep is interrupted (SIGINT) in time to stop the server and print
#                       the rates it finished
#   SERVE_READY_TIMEOUT seconds to wait for /health (default 300)
#   SERVE_EXTRA_ARGS    more `kvserve serve` flags (e.g. "--enforce-eager")
#   SWEEP_PORT          server port (default 8000)
#   SWEEP_SKIP_WHEELS   set to skip the wheel install

set -u
T0=$(date +%s)
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/kvserve_serve_sweep}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

CONFIG=${SWEEP_CONFIG:-llama31-8b}
RATES=${SWEEP_RATES:-1,2,4,8,16,32,64}
DURATION=${SWEEP_DURATION:-30}
MIN_PROMPTS=${SWEEP_MIN_PROMPTS:-32}
INPUT_LEN=${SWEEP_INPUT_LEN:-4:400}
OUTPUT_LEN=${SWEEP_OUTPUT_LEN:-4:354}
WARMUP=${SWEEP_WARMUP_PROMPTS:-64}
DEADLINE=${SWEEP_DEADLINE_S:-570}
READY_TIMEOUT=${SERVE_READY_TIMEOUT:-300}
PORT=${SWEEP_PORT:-8000}
URL=http://127.0.0.1:$PORT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

log() { echo "[sweep $(( $(date +%s) - T0 ))s] $*"; }

# ------------------------------------------------------------------ wheels / PYTHONPATH
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ -z "${SWEEP_SKIP_WHEELS:-}" ]; then
    log "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$REPO
else
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
python3 - <<'EOF' || { echo "a package the server or the client needs is missing"; exit 1; }
import importlib, importlib.metadata, platform
mods = {"torch": "torch", "triton": "triton", "transformers": "transformers", "numpy": "numpy",
        "fastapi": "fastapi", "starlette": "starlette", "pydantic": "pydantic", "uvicorn": "uvicorn",
        "zmq": "pyzmq", "msgspec": "msgspec", "httpx": "httpx", "prometheus_client": "prometheus_client",
        "typing_extensions": "typing_extensions", "matplotlib": "matplotlib"}
got = {}
for m, dist in mods.items():
    try:
        mod = importlib.import_module(m)
        try:
            got[m] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            got[m] = getattr(mod, "__version__", "?")
    except ImportError as exc:
        if m == "matplotlib":
            got[m] = "MISSING (no plots; re-plot later with python -m kvserve.bench.plots)"
        else:
            raise SystemExit(f"import {m}: {exc}")
import torch
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print("python", platform.python_version(), "| device", dev, "|", ", ".join(f"{k} {v}" for k, v in got.items()))
EOF
HAVE_MPL=$(python3 -c "import matplotlib" 2>/dev/null && echo 1 || echo 0)

# ------------------------------------------------------------------ model config
MODEL_DIR=$(mktemp -d /tmp/kvserve_sweep_model.XXXXXX)/$CONFIG
python3 - "$CONFIG" "$MODEL_DIR" <<'EOF' || exit 1
import json, sys
import transformers
name, path = sys.argv[1], sys.argv[2]
CONFIGS = {
    # = LLAMA31_8B of benchmarks/gpu_decode.py
    "llama31-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
    ),
    "tiny": dict(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
    ),
}
if name not in CONFIGS:
    raise SystemExit(f"SWEEP_CONFIG must be one of {', '.join(CONFIGS)}, got {name!r}")
transformers.LlamaConfig(**CONFIGS[name]).save_pretrained(path)
EOF
VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL_DIR/config.json")
SERVED_NAME=$CONFIG-dummy

SERVE_ARGS=(serve "$MODEL_DIR" --load-format dummy --dtype bfloat16 --skip-tokenizer-init --max-model-len 4096
            --host 127.0.0.1 --port "$PORT" --served-model-name "$SERVED_NAME" --disable-access-log
            --shutdown-timeout 10)
if [ "$CONFIG" = tiny ]; then SERVE_ARGS+=(--kv-cache-memory 256MiB); fi
# shellcheck disable=SC2206
SERVE_ARGS+=(${SERVE_EXTRA_ARGS:-})

# ------------------------------------------------------------------ server
SERVER_PID=
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        log "stopping the server (SIGTERM to $SERVER_PID)"
        kill -TERM "$SERVER_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            log "server still up after 30 s: SIGKILL"
            kill -KILL "$SERVER_PID" 2>/dev/null
        fi
    fi
    wait "$SERVER_PID" 2>/dev/null
    log "server exited with status $?"
    SERVER_PID=
}
trap stop_server EXIT

log "starting: kvserve ${SERVE_ARGS[*]}"
python3 -m kvserve.entrypoints.cli "${SERVE_ARGS[@]}" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!

python3 - "$URL" "$READY_TIMEOUT" "$SERVER_PID" <<'EOF'
import os, sys, time, urllib.request
url, timeout, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
t0 = time.time()
while time.time() - t0 < timeout:
    try:
        os.kill(pid, 0)
    except OSError:
        raise SystemExit("the server exited before it was ready")
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                print(f"server ready after {time.time() - t0:.0f} s")
                raise SystemExit(0)
    except OSError:
        pass
    time.sleep(1)
raise SystemExit(f"the server was not ready in {timeout:.0f} s")
EOF
if [ $? -ne 0 ]; then
    echo "---- server.log (tail)"; tail -n 40 "$OUT/server.log"
    exit 1
fi
grep -E "KV cache|CUDA graph|captur|weights|attention" "$OUT/server.log" | head -n 8

BENCH=(python3 -m kvserve.entrypoints.cli bench serve --base-url "$URL" --model "$SERVED_NAME" --dataset random
       --vocab-size "$VOCAB" --input-len "$INPUT_LEN" --disable-tqdm)

# ------------------------------------------------------------------ warm-up (untimed, not saved)
if [ "$WARMUP" -gt 0 ]; then
    log "warm-up: $WARMUP requests at once (16 output tokens)"
    "${BENCH[@]}" --num-prompts "$WARMUP" --request-rate inf --output-len 16 --seed 100000 \
        >/tmp/kvserve_sweep_warmup.log 2>&1 || { echo "warm-up failed:"; tail -n 20 /tmp/kvserve_sweep_warmup.log; }
    grep -E "^rate " /tmp/kvserve_sweep_warmup.log
fi

# ------------------------------------------------------------------ sweep
LEFT=$(( DEADLINE - ($(date +%s) - T0) - 30 ))
if [ "$LEFT" -lt 20 ]; then LEFT=20; fi
log "sweep: rates $RATES, ~${DURATION}s each (min $MIN_PROMPTS requests), in $INPUT_LEN, out $OUTPUT_LEN; at most ${LEFT}s"
PLOT_ARGS=()
if [ "$HAVE_MPL" = 1 ]; then PLOT_ARGS=(--plot "$OUT/plots"); fi
set -o pipefail
timeout -s INT -k 15 "$LEFT" "${BENCH[@]}" --output-len "$OUTPUT_LEN" --sweep "$RATES" --sweep-duration "$DURATION" \
    --sweep-min-prompts "$MIN_PROMPTS" --seed 0 --goodput ttft:80 tpot:10 --num-warmups 4 \
    --save-result "$OUT/serve_sweep.json" "${PLOT_ARGS[@]}" 2>&1 | tee "$OUT/sweep.log"
BENCH_RC=$?
set +o pipefail
[ "$BENCH_RC" -eq 0 ] || log "bench serve exited with status $BENCH_RC (124/130: cut at the deadline; finished rates are saved)"

stop_server

# ------------------------------------------------------------------ record the server side, plots, summary
[ -f "$OUT/serve_sweep.json" ] || { echo "no $OUT/serve_sweep.json"; exit 1; }
SERVE_CMD="kvserve ${SERVE_ARGS[*]}" python3 - "$OUT/serve_sweep.json" "$MODEL_DIR/config.json" "$CONFIG" "$BENCH_RC" <<'EOF'
import json, os, sys
path, cfg_path, name, rc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
res = json.load(open(path))
cfg = json.load(open(cfg_path))
res["server"] = {"command": os.environ["SERVE_CMD"], "model_config_name": name, "model_config": cfg,
                 "weights": "dummy (random)", "dtype": "bfloat16", "same_machine_as_client": True}
res["sweep_script"] = {"script": "benchmarks/gpu_serve_sweep.sh", "bench_exit_status": rc,
                       "complete": rc == 0, "kvserve_commit_env": os.environ.get("KVSERVE_COMMIT")}
with open(path, "w") as fh:
    json.dump(res, fh, indent=2)
    fh.write("\n")
EOF
if [ "$HAVE_MPL" = 1 ] && [ ! -f "$OUT/plots/ttft_vs_qps.png" ]; then
    python3 -m kvserve.bench.plots "$OUT/serve_sweep.json" "$OUT/plots"
fi

python3 - "$OUT/serve_sweep.json" <<'EOF'
import json, sys
res = json.load(open(sys.argv[1]))
env, runs = res["env"], res["runs"]
v = env.get("versions", {})
print()
print(f"device: {env.get('device')} | torch {v.get('torch')} | triton {v.get('triton')} | "
      f"transformers {v.get('transformers')} | commit {env.get('git_commit')}")
print(f"model: {res['server']['model_config_name']} dummy bf16 | in {res['config']['input_len']} out "
      f"{res['config']['output_len']} tokens (uniform) | complete sweep: {res['sweep_script']['complete']}")
f = lambda x: "-" if x in (None, "nan") else (x if isinstance(x, str) else f"{x:.1f}")
hdr = ("rate", "reqs", "ok", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99", "out tok/s")
print(" ".join(f"{h:>9}" for h in hdr))
for r in runs:
    row = (r["request_rate"], r["num_requests"], r["completed"], r["request_throughput"], r["median_ttft_ms"],
           r["p99_ttft_ms"], r["median_tpot_ms"], r["p99_tpot_ms"], r["p99_itl_ms"], r["output_throughput"])
    print(" ".join(f"{(str(x) if isinstance(x, int) else f(x)):>9}" for x in row))
at32 = [r for r in runs if r["request_rate"] == 32.0]
if at32 and all(isinstance(at32[0][k], (int, float)) for k in ("median_ttft_ms", "median_tpot_ms")):
    r = at32[0]
    ok_t, ok_p = r["median_ttft_ms"] <= 80.0, r["median_tpot_ms"] <= 10.0
    print(f"targets at 32 QPS: TTFT p50 {r['median_ttft_ms']:.1f} ms (<= 80: {'PASS' if ok_t else 'FAIL'}), "
          f"TPOT p50 {r['median_tpot_ms']:.2f} ms (<= 10: {'PASS' if ok_p else 'FAIL'}), "
          f"failed requests {r['failed']}")
else:
    print("targets at 32 QPS: no (successful) run at 32 QPS")
EOF
log "done; files in $OUT: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
exit "$BENCH_RC"  # 0: every rate ran; 124: cut at SWEEP_DEADLINE_S; 1: a rate completed no request
