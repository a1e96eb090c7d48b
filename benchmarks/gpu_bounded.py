"""Bounded KV (StreamingLLM / H2O) on the GPU: its cost and endless generation.

Parts (each a JSON line, all written to ``$OUT/bounded_gpu.json``):
- ``cost``: decode step time at batch 64 (2,048-token prompts, a 1,024-token KV budget per
  request, so eviction is active) for ``none`` (full cache, CUDA graphs and eager),
  ``streaming`` and ``h2o`` (piecewise graphs; streaming eager too); h2o vs streaming is the
  cost of accumulating the attention mass.
- ``endless``: one greedy request under StreamingLLM (4 sinks + 1,020 window) generating until
  ``--endless-tokens`` or ``--endless-seconds``: tok/s and blocks held per ``--every`` tokens.
Dummy bf16 weights at the Qwen3-0.6B shape (``--shape 8b``: Llama-3.1-8B).
Usage (repo root): python3 benchmarks/gpu_bounded.py --out $OUT [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode import LLAMA31_8B, QWEN3_06B, _config_dir, decode_latency  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=32000, max_position_embeddings=4096)


def _llm(path: str, policy: str, a, **kw):
    from kvserve import LLM

    bounded = {} if policy == "none" else dict(kv_eviction_policy=policy, attention_sinks=4, kv_budget_tokens=a.budget)
    if policy == "streaming":
        bounded["max_attention_window"] = a.budget - 4
    return LLM(model=path, load_format="dummy", dtype=a.dtype, skip_tokenizer_init=True, max_model_len=a.max_len,
               disable_log_stats=True, enable_prefix_caching=False, **bounded, **kw)


def cost(path: str, a) -> list[dict]:
    recs = []
    for policy, eager in (("none", False), ("none", True), ("streaming", False), ("h2o", False), ("streaming", True)):
        llm = _llm(path, policy, a, enforce_eager=eager, max_num_seqs=max(a.batch, 8))
        ms = statistics.median(decode_latency(llm, a.prompt, a.steps, a.batch)[4:])
        blocks = llm.llm_engine.engine_core.scheduler.get_stats()
        recs.append(dict(part="cost", policy=policy, cuda_graphs=not eager, batch=a.batch, prompt=a.prompt,
                         budget_tokens=None if policy == "none" else a.budget, step_ms=round(ms, 3),
                         evicted_blocks=getattr(blocks, "num_evicted_blocks", None)))
        llm.shutdown()
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    base = {r["policy"]: r["step_ms"] for r in recs if r["policy"] != "none" and r["cuda_graphs"]}
    if "h2o" in base and "streaming" in base:
        recs.append(dict(part="cost", h2o_over_streaming=round(base["h2o"] / base["streaming"], 3)))
    return recs


def endless(path: str, a) -> dict:
    from kvserve import SamplingParams

    llm = _llm(path, "streaming", a)
    eng = llm.llm_engine
    kv = eng.engine_core.kv_cache_manager
    rid = eng.add_request(None, list(range(3, 67)), SamplingParams(temperature=0, max_tokens=a.endless_tokens,
                                                                    ignore_eos=True))
    series, n, last_n = [], 0, 0
    t0 = last_t = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step(stream=True):
            n = len(out.outputs[0].token_ids)
        now = time.perf_counter()
        if n - last_n >= a.every or not eng.has_unfinished_requests() or now - t0 > a.endless_seconds:
            live = eng.has_unfinished_requests()
            series.append(dict(tokens=n, tok_per_s=round((n - last_n) / (now - last_t), 1),
                               blocks_held=kv.num_live_blocks(rid)[0] if live else None))
            last_n, last_t = n, now
            if now - t0 > a.endless_seconds and live:
                eng.abort_request(rid)
                while eng.has_unfinished_requests():
                    eng.step()
                break
    total = time.perf_counter() - t0
    stats = eng.engine_core.scheduler.get_stats()
    llm.shutdown()
    return dict(part="endless", policy="streaming", max_model_len=a.max_len, generated=n, seconds=round(total, 1),
                tok_per_s=round(n / total, 1), evicted_blocks=stats.num_evicted_blocks, series=series)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="cost,endless")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "8b"])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--endless-tokens", type=int, default=None, help="default 100,000 (400 with --cpu-smoke)")
    ap.add_argument("--endless-seconds", type=float, default=150.0)
    ap.add_argument("--every", type=int, default=None, help="default 5,000 (100 with --cpu-smoke)")
    a = ap.parse_args()
    smoke = a.cpu_smoke
    if smoke:  # decode_latency syncs the device
        torch.cuda.synchronize = torch.cuda.empty_cache = lambda *args: None
    a.dtype = "float32" if smoke else "bfloat16"
    a.batch, a.prompt, a.budget, a.steps, a.max_len = (4, 96, 64, 8, 256) if smoke else (64, 2048, 1024, 32, 4096)
    a.endless_tokens = a.endless_tokens or (400 if smoke else 100_000)
    a.every = a.every or (100 if smoke else 5000)
    shape = TINY if smoke else (QWEN3_06B if a.shape == "qwen3-0.6b" else LLAMA31_8B)
    recs: list[dict] = []
    os.makedirs(a.out, exist_ok=True)
    path_json = os.path.join(a.out, "bounded_gpu.json")
    from gpu_equality import env

    e = env() if torch.cuda.is_available() else {}

    def add(r: dict) -> None:
        recs.append({**r, "shape": a.shape, **e})
        json.dump(recs, open(path_json, "w"), indent=1)
        print(json.dumps(r), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        cls = "LlamaConfig" if smoke or a.shape == "8b" else "Qwen3Config"
        path = _config_dir(tmp, a.shape, shape, cls)
        for part, fn in (("cost", cost), ("endless", endless)):
            if part not in a.parts.split(","):
                continue
            try:
                out = fn(path, a)
                for r in (out if isinstance(out, list) else [out]):
                    add(r)
            except Exception as ex:  # one part's failure must not lose the other's figures
                add(dict(part=part, error=repr(ex)[:400]))


if __name__ == "__main__":
    main()
