"""Bounded KV per request on the CPU: perplexity at one KV budget, and endless generation.

The real default model (SmolLM2-135M-Instruct, float32) reads ``--tokens`` tokens of long
real text (the KJV prose of the shipped accuracy corpus, documents concatenated) as one
prompt; ``prompt_logprobs`` give the perplexity of every token after the first under:

- ``full``: the whole cache (no eviction; the reference);
- ``window``: window only (``attention_sinks=0``, window ``--budget`` tokens);
- ``streaming``: StreamingLLM (arXiv:2309.17453), 4 sink tokens (one block) + window
  ``--budget - block_size`` tokens: the same number of blocks as ``window``;
- ``h2o``: H2O (arXiv:2306.14048), block-granular, ``--budget + block_size`` tokens of
  budget (the same blocks again), 4 sinks, recent window ``--budget // 2``.

``window`` and ``streaming`` are two requests on one streaming engine (per-request
``attention_sinks`` / ``max_attention_window`` below the engine's). Prompts are computed in
chunks of ``--chunk`` tokens (streaming results do not depend on it; H2O's do: a chunk's
queries all see the chunk).

Then ``--gen`` tokens are generated (greedy, ``ignore_eos``) by one StreamingLLM request from a
short prompt on an engine with ``max_model_len`` = ``--max-model-len`` (far below ``--gen``):
tokens/s per ``--every`` tokens and the blocks the request holds (constant once the window is
full); its peer, in the same run, is the same generation on a full cache (``max_model_len``
large enough), whose blocks and per-token attention grow. Writes JSON to ``--out``.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python benchmarks/bounded_kv.py --tokens 3072 --gen 2000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.bench.accuracy import load_corpus  # noqa: E402
from kvserve.bench.env import git_commit, num_cores  # noqa: E402

BS = 16


def text_ids(llm, n: int) -> list[int]:
    """The first ``n`` tokens of the corpus' prose documents, concatenated."""
    docs = [d["text"] for d in load_corpus() if d["kind"] != "code"]
    ids = llm.get_tokenizer()("\n\n".join(docs))["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the corpus has {len(ids)} prose tokens, fewer than --tokens {n}")
    return ids[:n]


def ppl(llm, ids: list[int], **extra) -> dict:
    """Perplexity of ``ids[1:]`` from one request's prompt logprobs (+ wall time)."""
    t = time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, **extra),
                       use_tqdm=False)[0]
    dt = time.perf_counter() - t
    nll = [-e[tok][0] for e, tok in zip(out.prompt_logprobs[1:], ids[1:])]
    half = len(nll) // 2
    return {"ppl": math.exp(sum(nll) / len(nll)), "ppl_second_half": math.exp(sum(nll[half:]) / (len(nll) - half)),
            "tokens": len(nll), "seconds": round(dt, 2)}


def engine(ns, **kw) -> LLM:
    args = dict(dtype="float32", block_size=BS, max_num_batched_tokens=ns.chunk, max_num_seqs=4,
                max_model_len=ns.tokens + 16, kv_cache_memory="256MiB", disable_log_stats=True,
                enable_prefix_caching=False)
    args.update(kw)
    return LLM(**args)


def endless(ns, bounded: bool = True) -> dict:
    """One greedy request generating ``--gen`` tokens: StreamingLLM past ``max_model_len``, or
    (``bounded=False``, the peer) the full cache with a ``max_model_len`` that fits them."""
    if bounded:
        llm = engine(ns, max_model_len=ns.max_model_len, kv_eviction_policy="streaming", attention_sinks=4,
                     max_attention_window=ns.budget - BS)
    else:
        llm = engine(ns, max_model_len=ns.gen + 64)
    eng = llm.llm_engine
    kv = eng.engine_core.kv_cache_manager
    prompt = llm.get_tokenizer()("In the beginning God created the heaven and the earth.")["input_ids"]
    rid = eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=ns.gen, ignore_eos=True))
    series, done, last_t, last_n = [], 0, time.perf_counter(), 0
    t0 = last_t
    while eng.has_unfinished_requests():
        for out in eng.step(stream=True):
            done = len(out.outputs[0].token_ids)
        if done - last_n >= ns.every or not eng.has_unfinished_requests():
            now = time.perf_counter()
            series.append({"tokens": done, "tok_per_s": round((done - last_n) / (now - last_t), 2),
                           "blocks_held": kv.num_live_blocks(rid)[0] if eng.has_unfinished_requests() else None})
            last_t, last_n = now, done
    total = time.perf_counter() - t0
    stats = eng.engine_core.scheduler.get_stats()
    llm.shutdown()
    return {"policy": "streaming" if bounded else "none", "max_model_len": llm.llm_engine.max_model_len,
            "generated": done, "seconds": round(total, 2),
            "tok_per_s": round(done / total, 2), "evicted_blocks": stats.num_evicted_blocks, "series": series}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=3072, help="prose tokens scored")
    p.add_argument("--budget", type=int, default=256, help="KV tokens per request (window-only window)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--gen", type=int, default=2000, help="tokens generated by the endless run (0: skip)")
    p.add_argument("--max-model-len", type=int, default=256, help="the endless run's max_model_len")
    p.add_argument("--every", type=int, default=250, help="endless run: tokens per series point")
    p.add_argument("--no-peer", action="store_true", help="skip the full-cache endless run (the peer)")
    p.add_argument("--skip", default="", help="comma list of runs to skip: full,streaming,h2o")
    p.add_argument("--out", default="benchmarks/results/bounded_kv_cpu.json")
    ns = p.parse_args(argv)
    skip = set(filter(None, ns.skip.split(",")))
    res: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": git_commit(),
                 "cores": num_cores(), "torch": torch.__version__, "machine": platform.machine(),
                 "model": "SmolLM2-135M-Instruct (GGUF, float32)", "block_size": BS, "budget_tokens": ns.budget,
                 "chunk": ns.chunk, "load_average_start": os.getloadavg(), "perplexity": {}}
    ids = None
    if "full" not in skip:
        llm = engine(ns)
        ids = text_ids(llm, ns.tokens)
        res["perplexity"]["full"] = ppl(llm, ids)
        print("full", res["perplexity"]["full"], flush=True)
        llm.shutdown()
    if "streaming" not in skip:
        llm = engine(ns, kv_eviction_policy="streaming", attention_sinks=4, max_attention_window=ns.budget)
        ids = ids or text_ids(llm, ns.tokens)
        res["perplexity"]["window"] = dict(ppl(llm, ids, attention_sinks=0), sinks=0, window=ns.budget,
                                           blocks=-(-ns.budget // BS) + 1)
        print("window", res["perplexity"]["window"], flush=True)
        res["perplexity"]["streaming"] = dict(ppl(llm, ids, max_attention_window=ns.budget - BS), sinks=4,
                                              window=ns.budget - BS, blocks=1 + -(-(ns.budget - BS) // BS) + 1)
        print("streaming", res["perplexity"]["streaming"], flush=True)
        llm.shutdown()
    if "h2o" not in skip:
        budget = ns.budget + BS
        llm = engine(ns, kv_eviction_policy="h2o", attention_sinks=4, max_attention_window=ns.budget // 2,
                     kv_budget_tokens=budget)
        ids = ids or text_ids(llm, ns.tokens)
        res["perplexity"]["h2o"] = dict(ppl(llm, ids), sinks=4, window=ns.budget // 2, budget=budget,
                                        blocks=budget // BS)
        print("h2o", res["perplexity"]["h2o"], flush=True)
        llm.shutdown()
    if ns.gen:
        for key, bounded in (("endless", True), ("endless_full_cache", False)):
            if key == "endless_full_cache" and ns.no_peer:
                continue
            res[key] = endless(ns, bounded)
            print(key, {k: v for k, v in res[key].items() if k != "series"}, flush=True)
            for pt in res[key]["series"]:
                print("  ", pt)
    res["load_average_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
