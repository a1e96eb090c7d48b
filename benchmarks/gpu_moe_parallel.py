"""Mixture-of-experts on two GPUs (``nvidia-h200-x2``): tensor parallel 2 vs expert parallel 2.

Mixtral-8x7B shape (32 layers, hidden 4096, 8 experts top-2, expert intermediate 14336, 32 query /
8 KV heads), dummy bf16 weights, each configuration in its own process:
- batch-1 decode ms/token (128-token prompt) next to its floor: the bytes one GPU reads per token
  (its share of attention, embeddings' row, LM head and the routed experts: with TP each GPU reads
  half of both selected experts; with EP a GPU reads the selected experts it holds, 2 whole ones
  when both land on it (probability 3/7), and the step waits for the busier GPU) over the measured
  copy bandwidth;
- decode at batch 64 (ms/step, tok/s).
Ceilings measured in the same call: device copy bandwidth (GPU 0).

Usage (repo root, two GPUs): OUT=<dir> python3 benchmarks/gpu_moe_parallel.py [--batches 1,64]
Writes ``$OUT/moe_parallel.json`` (one record per figure) and prints each as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

MIXTRAL_8X7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
    rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
    architectures=["MixtralForCausalLM"], bos_token_id=1, eos_token_id=2,
)


def floor_bytes_per_token(cfg: dict, mode: str) -> float:
    """Bytes GPU 0 reads per decode token (bf16), expected over the routing for EP."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = h // cfg["num_attention_heads"]
    attn = h * (cfg["num_attention_heads"] * hd * 2 + 2 * cfg["num_key_value_heads"] * hd)
    expert = 3 * h * i
    k, e = cfg["num_experts_per_tok"], cfg["num_local_experts"]
    if mode == "tp":
        experts = k * expert / 2
    else:  # EP=2, top-2 of 8: both on the busier GPU with probability 3/7, else one each
        p_same = (e // 2 - 1) / (e - 1)
        experts = p_same * 2 * expert + (1 - p_same) * expert
    head = cfg["vocab_size"] * h / 2  # vocabulary-parallel LM head
    return 2.0 * (layers * (attn / 2 + experts) + head)


def one(mode: str, batches: list[int], tmp: str) -> list[dict]:
    import torch  # noqa: F401

    from gpu_decode import _config_dir, decode_latency
    from kvserve import LLM

    path = _config_dir(tmp, "mixtral-8x7b", MIXTRAL_8X7B, "MixtralConfig")
    t0 = time.perf_counter()
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096,
              tensor_parallel_size=2, enable_expert_parallel=(mode == "ep"), gpu_memory_utilization=0.9,
              disable_log_stats=True)
    startup = time.perf_counter() - t0
    decode_latency(llm, 128, 16, 1)
    recs = []
    for b in batches:
        steps = decode_latency(llm, 128, 128 if b == 1 else 48, b)
        ms = statistics.median(steps[8 if b == 1 else 4:])
        recs.append(dict(mode=mode, batch=b, ms_per_step=round(ms, 3), tok_per_s=round(b / ms * 1e3, 1),
                         startup_s=round(startup, 1)))
    llm.shutdown()
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-moe-parallel")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--one", choices=["tp", "ep"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    os.makedirs(a.tmp, exist_ok=True)
    if a.one:
        print("RESULT " + json.dumps(one(a.one, batches, a.tmp)), flush=True)
        return
    from gpu_equality import env
    from gpu_tensor_parallel import copy_bandwidth

    os.makedirs(a.out, exist_ok=True)
    recs, e = [], env()

    def emit(name: str, r: dict) -> None:
        recs.append({"name": name, **r, **e})
        json.dump(recs, open(os.path.join(a.out, "moe_parallel.json"), "w"), indent=1)
        print(json.dumps({"name": name, **r}), flush=True)

    bw = copy_bandwidth()
    emit("copy_bandwidth", dict(bytes_per_s=round(bw)))
    for mode in ("tp", "ep"):
        p = subprocess.run([sys.executable, __file__, "--one", mode, "--batches", a.batches, "--tmp", a.tmp],
                           capture_output=True, text=True)
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode or not lines:
            emit(f"mixtral_{mode}2_failed", dict(rc=p.returncode, tail=(p.stdout + p.stderr)[-2000:]))
            continue
        floor_ms = floor_bytes_per_token(MIXTRAL_8X7B, mode) / bw * 1e3
        for r in json.loads(lines[-1][7:]):
            if r["batch"] == 1:
                r["floor_ms"] = round(floor_ms, 3)
                r["fraction_of_floor"] = round(floor_ms / r["ms_per_step"], 3)
            emit(f"mixtral_{mode}2", r)


if __name__ == "__main__":
    main()
