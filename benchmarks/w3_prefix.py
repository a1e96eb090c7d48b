"""W3 prefix reuse on the GPU: throughput and mean TTFT with prefix caching on vs off.

Qwen3-0.6B shape, dummy bf16 weights; 512 requests, each one of 4 shared 2048-token prefixes
+ 128 unique tokens, 128 output tokens (ignore_eos). A 0%-hit workload (all 2176 tokens
unique) shows the cost of caching when nothing hits.

Usage (GPU machine, repo root): PYTHONPATH=. python3 benchmarks/w3_prefix.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_issue2 import QWEN3_06B, env  # noqa: E402


def workload(shared: bool, n: int = 512, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 10000, 2048).tolist() for _ in range(4)]
    out = []
    for i in range(n):
        head = prefixes[i % 4] if shared else rng.integers(0, 10000, 2048).tolist()
        out.append(head + rng.integers(0, 10000, 128).tolist())
    return out


def run(llm, prompts) -> dict:
    from kvserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return dict(wall_s=round(wall, 3), output_tok_per_s=round(n_out / wall, 1),
                total_tok_per_s=round((n_out + sum(map(len, prompts))) / wall, 1),
                mean_ttft_s=round(float(np.mean(ttft)), 4), cached_prompt_tokens=cached,
                prompt_tokens=sum(map(len, prompts)))


def main() -> None:
    from transformers import Qwen3Config

    from kvserve import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    path = "/tmp/kvserve-gpu/qwen3-0.6b-config"
    Qwen3Config(**QWEN3_06B).save_pretrained(path)
    e = env()
    res = []
    llms = {}
    for caching in (True, False):
        llms[caching] = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                            max_model_len=4096, max_num_seqs=256, kv_cache_memory="24GiB",
                            enable_prefix_caching=caching, disable_log_stats=True)
        llms[caching].generate([list(range(64))] * 4, use_tqdm=False)  # warm-up
    for shared in (True, False):
        prompts = workload(shared)
        r = {c: run(llms[c], prompts) for c in (True, False)}
        rec = dict(workload="W3" if shared else "W3-0%-hits", caching_on=r[True], caching_off=r[False],
                   throughput_ratio=round(r[True]["output_tok_per_s"] / r[False]["output_tok_per_s"], 3),
                   ttft_ratio=round(r[True]["mean_ttft_s"] / r[False]["mean_ttft_s"], 3), **e)
        res.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in e}), flush=True)
    json.dump(res, open(os.path.join(a.out, "w3_prefix.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
