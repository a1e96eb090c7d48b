"""W1 with the Hugging Face transformers peer, in the same call as ours: its continuous
batching manager (paged attention, CUDA graphs) on the same 256 requests, each with its own
output length (``add_request(max_new_tokens=n)``), greedy, EOS ignored.

GPU.md: ``generate_batch`` with ``ContinuousBatchingConfig(use_cuda_graph=True,
max_memory_percent=0.5)`` is its fastest setting; ``generate_batch`` takes one
``max_new_tokens`` for all requests, so the manager underneath it is driven directly here.

Usage (repo root): PYTHONPATH=. python3 benchmarks/w1_peer.py --out $OUT [--tiny]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_equality import QWEN3_06B  # noqa: E402


def w1_workload(n: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)  # the same draws as gpu_equality.w1
    in_lens = rng.integers(100, 1025, n)
    out_lens = rng.integers(100, 1025, n)
    prompts = [rng.integers(0, 10000, k).tolist() for k in in_lens]
    return prompts, [int(k) for k in out_lens]


def run_peer(model, prompts, out_lens, cb_config=None, timeout_s: float = 600) -> dict:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    params = inspect.signature(model.init_continuous_batching).parameters
    kw = {"generation_config": gc}
    if cb_config is not None and "continuous_batching_config" in params:
        kw["continuous_batching_config"] = cb_config
    manager = model.init_continuous_batching(**kw)
    manager.start()
    try:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, out_lens)]
        done, n_out = {}, 0
        while len(done) < len(ids) and time.perf_counter() - t0 < timeout_s:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = r
                n_out += len(r.generated_tokens)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return dict(output_tokens=n_out, wall_s=round(wall, 2), finished=len(done), requests=len(ids),
                output_tok_per_s=round(n_out / wall, 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="tiny model, 8 short requests (CPU check)")
    ap.add_argument("--timeout", type=float, default=420)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3Config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dict(QWEN3_06B)
    if a.tiny:
        cfg.update(vocab_size=10000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), dtype=torch.bfloat16,
                                             attn_implementation="sdpa").to(dev).eval()
    prompts, out_lens = w1_workload(8 if a.tiny else 256)
    if a.tiny:
        prompts, out_lens = [p[:20] for p in prompts], [8] * len(prompts)
    cb = None
    try:
        from transformers import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(use_cuda_graph=dev == "cuda", max_memory_percent=0.5)
    except ImportError:
        pass
    rec = run_peer(model, prompts, out_lens, cb, a.timeout)
    rec.update(workload="W1" if not a.tiny else "W1-tiny", peer="transformers continuous batching (paged sdpa, CUDA graphs)",
               requested_tokens=sum(out_lens))
    try:
        from gpu_equality import env

        rec.update(env())
    except Exception:
        pass
    print(json.dumps(rec), flush=True)
    with open(os.path.join(a.out, "w1_peer.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
