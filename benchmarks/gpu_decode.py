"""GPU decode benchmarks: W2 (batch-1 decode latency, Llama-3.1-8B shape) beside transformers'
static-cache `generate`, W1 with a chosen attention backend, and the decode step time at
batch 1, 8, 64, 256 with 1k context (Qwen3-0.6B shape), each next to its roofline.

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 benchmarks/gpu_decode.py --out $OUT --backends torch_ref,triton [--w1-backends triton] [--skip-peer]
Writes one JSON record per figure to --out/decode_bench.json and prints a table last.
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
from gpu_issue2 import QWEN3_06B, env, w1  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HBM_BYTES_PER_S = 3.0e12  # measured device-to-device copy on the H100 (GPU.md)

LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
)


def _config_dir(tmp: str, name: str, cfg: dict, cls_name: str) -> str:
    import transformers

    path = os.path.join(tmp, name)
    getattr(transformers, cls_name)(**cfg).save_pretrained(path)
    return path


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_latency(llm, prompt_len: int, out_len: int, batch: int) -> list[float]:
    """Per-step wall times (ms) of pure decode steps for ``batch`` requests."""
    from kvserve import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(None, torch.randint(0, 10000, (prompt_len,), generator=g).tolist(), sp)
    times = []
    while eng.has_unfinished_requests():
        decode_only = all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.engine_core.scheduler.running) \
            and len(eng.engine_core.scheduler.waiting) == 0 and eng.engine_core.scheduler.running
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        if decode_only:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def w2_ours(tmp: str, backend: str) -> dict:
    from kvserve import LLM

    path = _config_dir(tmp, "llama-3.1-8b-config", LLAMA31_8B, "LlamaConfig")
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              attention_backend=backend, max_model_len=4096, kv_cache_memory="4GiB", disable_log_stats=True)
    weight_bytes = _param_bytes(llm.llm_engine.engine_core.model_runner.model)
    decode_latency(llm, 128, 16, 1)  # warm-up
    times = decode_latency(llm, 128, 256, 1)
    ms = statistics.median(times[8:])
    floor = weight_bytes / HBM_BYTES_PER_S * 1e3
    del llm
    torch.cuda.empty_cache()
    return dict(workload="W2", backend=backend, ms_per_token=round(ms, 3), roofline_ms=round(floor, 3),
                roofline_fraction=round(floor / ms, 4), weight_bytes=weight_bytes)


def w2_peer() -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA31_8B), dtype=torch.bfloat16).cuda().eval()
    x = torch.randint(0, 10000, (1, 128), device="cuda")
    res = {}
    for label, n in (("warm", 16), ("short", 8), ("long", 264)):
        gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                              eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
        torch.cuda.synchronize()
        res[label] = time.perf_counter() - t0
    # (long - short) / 256 cancels the prefill and the first steps.
    ms = (res["long"] - res["short"]) / 256 * 1e3
    del model
    torch.cuda.empty_cache()
    return dict(workload="W2", peer="transformers generate, static cache", ms_per_token=round(ms, 3))


def decode_steps(tmp: str, backend: str) -> list[dict]:
    from kvserve import LLM

    path = _config_dir(tmp, "qwen3-0.6b-config", QWEN3_06B, "Qwen3Config")
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              attention_backend=backend, max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.8,
              disable_log_stats=True)
    runner = llm.llm_engine.engine_core.model_runner
    weight_bytes = _param_bytes(runner.model)
    out = []
    decode_latency(llm, 64, 8, 4)  # warm-up
    for b in (1, 8, 64, 256):
        times = decode_latency(llm, 1024, 24, b)
        ms = statistics.median(times[4:])
        kv_bytes = runner.bytes_per_token * b * (1024 + 12)
        floor = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
        out.append(dict(workload=f"decode_step_qwen3-0.6b_b{b}_ctx1k", backend=backend, ms_per_step=round(ms, 3),
                        output_tok_per_s=round(b / ms * 1e3, 1), roofline_ms=round(floor, 4),
                        roofline_fraction=round(floor / ms, 4)))
    del llm
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-gpu")
    ap.add_argument("--backends", default="torch_ref,triton")
    ap.add_argument("--w1-backends", default="triton", help="backends to run W1 with ('' for none)")
    ap.add_argument("--skip-peer", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.tmp, exist_ok=True)
    e = env()
    recs = []

    def emit(r):
        r = {**r, **e}
        recs.append(r)
        json.dump(recs, open(os.path.join(a.out, "decode_bench.json"), "w"), indent=1)
        print(json.dumps({k: v for k, v in r.items() if k not in e}), flush=True)

    if not a.skip_peer:
        emit(w2_peer())
    for b in a.backends.split(","):
        emit(w2_ours(a.tmp, b))
        for r in decode_steps(a.tmp, b):
            emit(r)
        if b in a.w1_backends.split(","):
            emit(w1(a.tmp, b))
    print(f"\n{e['device']} torch {e['torch']} triton {e['triton']} commit {e['commit'][:10]}")
    for r in recs:
        fig = r.get("ms_per_token") or r.get("ms_per_step") or r.get("output_tok_per_s")
        print(f"{r['workload']:36s} {r.get('backend', r.get('peer', '')):36s} {fig!s:>10s}  roofline {r.get('roofline_fraction', '')}")


if __name__ == "__main__":
    main()
