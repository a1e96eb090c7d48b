"""Mixture of experts on two GPUs (``nvidia-h200-x2``): tensor parallel 2 vs expert parallel 2.

Mixtral-8x7B shape (32 layers, hidden 4096, 8 experts of intermediate 14336, top-2, 32 query /
8 KV heads), dummy bf16 weights, mp executor. For ``-tp 2`` (each expert's intermediate
dimension split) and ``-tp 2 --enable-expert-parallel`` (4 whole experts per GPU):
batch-1 ms/token (128-token prompt) next to its floor, and decode ms/step and tok/s at batch 64.
Floor at batch 1: the bytes the busier GPU reads per token (its attention and LM-head share,
the router, and the experts: under TP half of both selected experts, under EP the selected
experts it holds, 1 + 3/7 on average for the busier one) over the measured copy bandwidth. Also the
tokens routed per expert (``moe_expert_tokens``) after the run, and the start-up breakdown.
Each record is a JSON line and goes to ``$OUT/moe_parallel.json``.

Usage (repo root): OUT=<dir> python3 benchmarks/gpu_moe_parallel.py [--enforce-eager]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode import _config_dir, decode_latency  # noqa: E402
from gpu_equality import env  # noqa: E402
from gpu_tensor_parallel import copy_bandwidth  # noqa: E402

MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                    num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    architectures=["MixtralForCausalLM"], bos_token_id=1, eos_token_id=2)


def floor_bytes_per_token(ep: bool) -> float:
    """Bytes one of the two GPUs reads per decoded token at batch 1 (bf16 weights)."""
    c = MIXTRAL_8X7B
    h, i, layers, e, k = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], 8, 2
    hd = h // c["num_attention_heads"]
    attn = h * (c["num_attention_heads"] * hd + 2 * c["num_key_value_heads"] * hd) + c["num_attention_heads"] * hd * h
    expert = 3 * h * i
    # TP: half of each selected expert (k / 2 experts' bytes). EP: the busier GPU holds both selected
    # experts with probability (E/2 - 1) / (E - 1), one otherwise; the all-reduce waits for it.
    experts_read = k / 2 if not ep else 1 + (e / 2 - 1) / (e - 1)
    per_layer = attn / 2 + h * e + experts_read * expert
    return 2 * (layers * per_layer + c["vocab_size"] * h / 2 + h)


def run(path: str, ep: bool, enforce_eager: bool, copy_bw: float) -> dict:
    from kvserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096,
              tensor_parallel_size=2, enable_expert_parallel=ep, gpu_memory_utilization=0.9,
              enforce_eager=enforce_eager, disable_log_stats=True)
    startup = time.perf_counter() - t0
    try:
        decode_latency(llm, 128, 16, 1)
        ms = statistics.median(decode_latency(llm, 128, 128, 1)[8:])
        b64 = statistics.median(decode_latency(llm, 128, 64, 64)[4:])
        counts = llm.llm_engine.stats.moe_expert_tokens
    finally:
        llm.shutdown()
    floor = floor_bytes_per_token(ep) / copy_bw * 1e3
    return dict(layout="ep2" if ep else "tp2", enforce_eager=enforce_eager, b1_ms_per_token=round(ms, 3),
                b1_floor_ms=round(floor, 3), b1_fraction_of_floor=round(floor / ms, 3),
                b64_ms_per_step=round(b64, 3), b64_tok_per_s=round(64 / b64 * 1e3, 1),
                moe_expert_tokens=counts, startup_s=round(startup, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-moe")
    ap.add_argument("--enforce-eager", action="store_true", help="No CUDA graphs (also the automatic fallback "
                                                                  "when capture fails).")
    a = ap.parse_args()
    os.makedirs(a.tmp, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    e, recs = env(), []

    def emit(name: str, r: dict) -> None:
        recs.append({"name": name, **r, **e})
        json.dump(recs, open(os.path.join(a.out, "moe_parallel.json"), "w"), indent=1)
        print(json.dumps({"name": name, **r}), flush=True)

    copy_bw = copy_bandwidth()
    emit("copy_bandwidth", dict(bytes_per_s=round(copy_bw)))
    path = _config_dir(a.tmp, "mixtral-8x7b", MIXTRAL_8X7B, "MixtralConfig")
    for ep in (False, True):
        try:
            emit("mixtral_8x7b", run(path, ep, a.enforce_eager, copy_bw))
        except Exception as exc:  # e.g. a MoE path that CUDA graphs cannot capture: measure it eager
            if a.enforce_eager:
                raise
            print(f"{'ep2' if ep else 'tp2'} with CUDA graphs failed ({exc!r}); eager", flush=True)
            emit("mixtral_8x7b", run(path, ep, True, copy_bw))
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
