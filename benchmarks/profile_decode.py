"""Host-side profile of pure decode steps (cProfile), to see what bounds a step.

Usage (GPU machine): PYTHONPATH=. python3 benchmarks/profile_decode.py --backend triton --batch 64
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_equality import QWEN3_06B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    from transformers import Qwen3Config

    from kvserve import LLM, SamplingParams

    path = "/tmp/kvserve-gpu/qwen3-0.6b-config"
    Qwen3Config(**QWEN3_06B).save_pretrained(path)
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              attention_backend=a.backend, max_model_len=2048, gpu_memory_utilization=0.5, disable_log_stats=True)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=a.steps + 20, ignore_eos=True)
    for i in range(a.batch):
        eng.add_request(None, list(range(i, i + 512)), sp)
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(a.steps):
        eng.step()
    pr.disable()
    torch.cuda.synchronize()
    print(f"{a.backend} batch {a.batch}: {(time.perf_counter() - t0) / a.steps * 1e3:.2f} ms/step (under cProfile)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
