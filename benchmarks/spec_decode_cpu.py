"""CPU, batch 1: speculative decoding on the default model (SmolLM2-135M-Instruct), greedy.

Workloads (real text shipped in the repo):

* ``edit``: code editing -- the chat model is asked to return one of kvserve's own source
  functions with a small change (input-grounded: the answer copies most of the prompt);
* ``chat``: open questions (nothing to copy: the n-gram proposer rarely fires);
* ``seen``: the first of the shipped EAGLE head's own training prompts (what a head trained
  on the traffic it serves reaches; not held out).

Methods: no speculation, n-gram (k = 2, 4), draft_model with the target itself as its
own draft (full acceptance: shows the cost of a same-size draft; a real draft is smaller), and
with ``--eagle default`` the shipped EAGLE head at k = 2, 3, 4 (``--eagle-ks``; the chat
questions are not among the head's training prompts).
Every request runs alone (batch 1), the methods interleaved prompt by prompt (a shared
machine's load drift hits them alike); outputs are checked identical to no speculation. Writes
one JSON record per (workload, method): output tok/s, speedup, acceptance rate, mean
acceptance length, accepted per position, per-request [drafts, accepted].

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/spec_decode_cpu.py \\
        --out benchmarks/results/spec_decode_cpu.json
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/spec_decode_cpu.py --workloads chat --ks "" \\
        --eagle default --chat-prompts 6 --out benchmarks/results/spec_decode_eagle_cpu.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import time

import kvserve

CHAT = ["What are three good habits for staying healthy?", "Explain what a hash table is.",
        "Write a short poem about the sea.", "Why is the sky blue?",
        "Give me tips for learning a new language.", "What is the difference between a list and a tuple in Python?"]


def edit_prompts(n: int = 6) -> list[str]:
    """Code-editing requests over kvserve's own functions of 12-30 lines."""
    root = os.path.dirname(kvserve.__file__)
    funcs = []
    for rel in ["spec_decode/ngram.py", "spec_decode/rejection_sampler.py", "core/block_pool.py",
                "sample/sampler.py", "config.py", "core/scheduler.py"]:
        src = open(os.path.join(root, rel)).read()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and 12 <= node.end_lineno - node.lineno <= 30:
                funcs.append((node.name, ast.get_source_segment(src, node)))
                break
    out = []
    for name, code in funcs[:n]:
        out.append(f"Rename the function `{name}` to `{name}_v2` and return the complete updated code, "
                   f"unchanged otherwise.\n\n```python\n{code}\n```")
    return out


def run_all(methods: list, prompts: list[str], max_tokens: int) -> list[dict]:
    """Every method on every prompt, batch 1, interleaved (prompt-major: each prompt runs under
    every method back to back) so that load drift on a shared machine hits all methods alike."""
    from kvserve import LLM, SamplingParams
    from kvserve.bench.throughput import spec_decode_summary

    llms = [LLM(kv_cache_memory="256MiB", max_model_len=2048, disable_log_stats=True, speculative_config=m)
            for m in methods]
    tok = llms[0].get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    for llm in llms:
        llm.generate([texts[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    outs = [[] for _ in methods]
    elapsed = [0.0] * len(methods)
    for t in texts:
        for i, llm in enumerate(llms):
            t0 = time.perf_counter()
            outs[i].append(llm.generate([t], sp, use_tqdm=False)[0])  # prefill included in the time
            elapsed[i] += time.perf_counter() - t0
    recs = []
    for m, llm, o, e in zip(methods, llms, outs, elapsed):
        n_out = sum(len(x.outputs[0].token_ids) for x in o)
        recs.append({"method": m, "output_tokens": n_out, "elapsed_s": e, "output_tok_s": n_out / e,
                     "token_ids": [x.outputs[0].token_ids for x in o],
                     "spec_decode": spec_decode_summary(o, llm.llm_engine.stats)})
        llm.shutdown()
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/spec_decode_cpu.json")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--draft", action="store_true", help="also the draft_model method (target as its own draft)")
    ap.add_argument("--eagle", default=None, help="also EAGLE with this head directory ('default': the shipped "
                                                  "head for the default model)")
    ap.add_argument("--eagle-ks", default="2,3,4")
    ap.add_argument("--eagle-vocab", default="", help="comma list of draft_vocab_size values to run beside the "
                                                      "head's own setting (0: the whole vocabulary)")
    ap.add_argument("--chat-prompts", type=int, default=4, help="how many of the chat questions")
    ns = ap.parse_args()
    from kvserve.bench import env
    from kvserve.model_loader import resolve_model

    path = resolve_model(None, "auto")[0]
    load0 = os.getloadavg()
    methods = [None] + [{"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4} for k in ns.ks.split(",") if k]
    if ns.draft:
        methods.append({"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    if ns.eagle:
        vocabs = [None] + [int(v) for v in ns.eagle_vocab.split(",") if v]
        methods += [{"method": "eagle", "model": ns.eagle, "num_speculative_tokens": int(k), "dynamic": False,
                     **({} if v is None else {"draft_vocab_size": v or 10**9})}
                    for k in ns.eagle_ks.split(",") if k for v in vocabs]
    records = []
    for wl in ns.workloads.split(","):
        if wl == "seen":  # the EAGLE head's own training prompts (an upper bound, not held out)
            from kvserve.spec_decode.train_eagle import chat_prompts

            prompts = chat_prompts(128, 0)[:ns.chat_prompts]
        else:
            prompts = edit_prompts() if wl == "edit" else CHAT[:ns.chat_prompts]
        recs = run_all(methods, prompts, ns.max_tokens)
        base = recs[0]
        for m, r in zip(methods, recs):
            r["workload"] = wl
            r["speedup"] = r["output_tok_s"] / base["output_tok_s"]
            r["identical_to_no_spec"] = r["token_ids"] == base["token_ids"]
            records.append(r)
            sd = r["spec_decode"] or {}
            print(f"{wl:5s} {json.dumps(m) if m else 'none':90s} {r['output_tok_s']:6.2f} tok/s "
                  f"x{r['speedup']:.2f} acc={sd.get('acceptance_rate', 0):.2f} "
                  f"len={sd.get('mean_acceptance_length', 1):.2f} same={r['identical_to_no_spec']}", flush=True)
    for r in records:
        del r["token_ids"]
    with open(ns.out, "w") as f:
        json.dump({"env": {"commit": env.git_commit(), "device": env.device_description("cpu"),
                           "cores": os.cpu_count(), "torch": __import__("torch").__version__,
                           "loadavg_start": load0, "loadavg_end": os.getloadavg()},
                   "max_tokens": ns.max_tokens, "records": records}, f, indent=1)
    print("wrote", ns.out)


if __name__ == "__main__":
    main()
