"""W3 prefix reuse on the GPU: throughput and mean TTFT with prefix caching on vs off, and
the per-request TTFT of a prefix hit vs the same request computed cold.

Qwen3-0.6B shape, dummy bf16 weights; 512 requests, each one of 4 shared 2048-token prefixes
+ 128 unique tokens, 128 output tokens (ignore_eos). A 0%-hit workload (all 2176 tokens
unique) shows the cost of caching when nothing hits.

Per-request TTFT (record ``W3-TTFT-hit-vs-cold``), on the idle caching-on engine before the
throughput runs: a *cold* request is a fresh 2048-token prefix + 128 unique tokens under a
cache_salt of its own (nothing of it is cached); the *hit* request right after it has the same
prefix and salt and a new 128-token suffix, so its 2048 prefix tokens come from the cache.
TTFT = first-token time - arrival time of a 1-token request; ``--ttft-repeats`` pairs after
one warm-up pair; medians and their ratio (target: hit <= 0.15 x cold).

Usage (GPU machine, repo root): PYTHONPATH=. python3 benchmarks/w3_prefix.py --out $OUT
CPU smoke run (tiny random model, small sizes): python3 benchmarks/w3_prefix.py --tiny --out /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_equality import QWEN3_06B  # noqa: E402

TINY = dict(QWEN3_06B, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
FULL_SIZES = dict(requests=512, prefix_len=2048, suffix_len=128, output_len=128, vocab=10000)
TINY_SIZES = dict(requests=32, prefix_len=256, suffix_len=32, output_len=16, vocab=2000)


def env() -> dict:
    if torch.cuda.is_available():
        from gpu_equality import env as gpu_env

        return gpu_env()
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        commit = "unknown"
    return dict(device=platform.processor() or platform.machine(), torch=torch.__version__,
                python=platform.python_version(), commit=commit, command=" ".join([sys.executable] + sys.argv))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def workload(shared: bool, n: int = 512, seed: int = 0, prefix_len: int = 2048, suffix_len: int = 128,
             vocab: int = 10000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, prefix_len).tolist() for _ in range(4)]
    out = []
    for i in range(n):
        head = prefixes[i % 4] if shared else rng.integers(0, vocab, prefix_len).tolist()
        out.append(head + rng.integers(0, vocab, suffix_len).tolist())
    return out


def run(llm, prompts, output_len: int = 128) -> dict:
    from kvserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return dict(wall_s=round(wall, 3), output_tok_per_s=round(n_out / wall, 1),
                total_tok_per_s=round((n_out + sum(map(len, prompts))) / wall, 1),
                mean_ttft_s=round(float(np.mean(ttft)), 4), cached_prompt_tokens=cached,
                prompt_tokens=sum(map(len, prompts)))


def ttft_hit_vs_cold(llm, repeats: int, prefix_len: int, suffix_len: int, vocab: int, seed: int = 1000) -> dict:
    """Per-request TTFT on an idle engine: cold (fresh prefix) vs hit (prefix cached), in seconds."""
    from kvserve import SamplingParams

    rng = np.random.default_rng(seed)
    sp = SamplingParams(temperature=0, max_tokens=1)

    def one(prompt: list[int], salt: str) -> tuple[float, int]:
        sync()
        o = llm.generate([prompt], sp, use_tqdm=False, cache_salt=salt)[0]
        return o.metrics.first_token_time - o.metrics.arrival_time, o.num_cached_tokens

    cold, hit, cold_cached, hit_cached = [], [], [], []
    for k in range(repeats + 1):  # pair 0 warms up (kernels for both shapes), not counted
        salt = f"w3-ttft-{seed}-{k}"  # a namespace of its own: the cold request finds nothing
        prefix = rng.integers(0, vocab, prefix_len).tolist()
        tc, nc = one(prefix + rng.integers(0, vocab, suffix_len).tolist(), salt)  # also warms the prefix
        th, nh = one(prefix + rng.integers(0, vocab, suffix_len).tolist(), salt)
        if k:
            cold.append(tc)
            hit.append(th)
            cold_cached.append(nc)
            hit_cached.append(nh)
    c, h = statistics.median(cold), statistics.median(hit)
    return dict(workload="W3-TTFT-hit-vs-cold", prefix_len=prefix_len, suffix_len=suffix_len, repeats=repeats,
                cold_ttft_s=[round(x, 5) for x in cold], hit_ttft_s=[round(x, 5) for x in hit],
                cold_cached_tokens=cold_cached, hit_cached_tokens=hit_cached,
                cold_median_ttft_s=round(c, 5), hit_median_ttft_s=round(h, 5),
                hit_cold_ratio=round(h / c, 3), target_ratio=0.15)


def main() -> None:
    from transformers import Qwen3Config

    from kvserve import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true",
                    help="tiny random Qwen3 on the CPU, small sizes: checks the script end to end")
    ap.add_argument("--requests", type=int, default=None, help="requests per workload (512; tiny 32)")
    ap.add_argument("--ttft-repeats", type=int, default=5, help="cold/hit TTFT pairs after one warm-up pair")
    a = ap.parse_args()
    sizes = dict(TINY_SIZES if a.tiny else FULL_SIZES)
    if a.requests:
        sizes["requests"] = a.requests
    path = "/tmp/kvserve-gpu/qwen3-tiny-config" if a.tiny else "/tmp/kvserve-gpu/qwen3-0.6b-config"
    Qwen3Config(**(TINY if a.tiny else QWEN3_06B)).save_pretrained(path)
    if a.tiny:
        torch.set_num_threads(1)  # a tiny model: extra threads only wait on a shared CPU
        engine = dict(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=16, kv_cache_memory="64MiB")
    else:
        engine = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, kv_cache_memory="24GiB")
    e = env()
    res = []
    llms = {}
    for caching in (True, False):
        llms[caching] = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=caching,
                            disable_log_stats=True, **engine)
        llms[caching].generate([list(range(64))] * 4, use_tqdm=False)  # warm-up
    rec = dict(ttft_hit_vs_cold(llms[True], a.ttft_repeats, sizes["prefix_len"], sizes["suffix_len"],
                                sizes["vocab"]), **e)
    res.append(rec)
    print(json.dumps({k: v for k, v in rec.items() if k not in e}), flush=True)
    for shared in (True, False):
        prompts = workload(shared, sizes["requests"], prefix_len=sizes["prefix_len"], suffix_len=sizes["suffix_len"],
                           vocab=sizes["vocab"])
        r = {c: run(llms[c], prompts, sizes["output_len"]) for c in (True, False)}
        rec = dict(workload="W3" if shared else "W3-0%-hits", caching_on=r[True], caching_off=r[False],
                   throughput_ratio=round(r[True]["output_tok_per_s"] / r[False]["output_tok_per_s"], 3),
                   ttft_ratio=round(r[True]["mean_ttft_s"] / r[False]["mean_ttft_s"], 3), **e)
        res.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in e}), flush=True)
    name = "w3_prefix_tiny.json" if a.tiny else "w3_prefix.json"
    json.dump(res, open(os.path.join(a.out, name), "w"), indent=1)


if __name__ == "__main__":
    main()
