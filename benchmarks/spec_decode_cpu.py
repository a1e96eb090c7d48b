"""Batch 1: speculative decoding on the default model (SmolLM2-135M-Instruct), greedy, on the
CPU or (``--device cuda``, real weights, CUDA graphs as the engine uses them) a GPU.

Workloads (real text shipped in the repo):

* ``edit``: code editing -- the chat model is asked to return one of kvserve's own source
  functions with a small change (input-grounded: the answer copies most of the prompt);
* ``chat``: open questions (nothing to copy: the n-gram proposer rarely fires);
* ``seen``: the first corpus prompts of the shipped EAGLE head's training prompts (what a head trained
  on the traffic it serves reaches; not held out);
* ``repeat``: the code-editing requests, each asked twice (an agent retrying or re-reading: the
  second answer repeats an earlier output, which suffix decoding's global tree holds).

Methods: no speculation, n-gram (k = 2, 4), draft_model with the target itself as its
own draft (full acceptance: shows the cost of a same-size draft; a real draft is smaller),
suffix decoding at ``--suffix-ks``, and
with ``--eagle default`` the shipped EAGLE head at k = 2, 3, 4 (``--eagle-ks``; the chat
questions are not among the head's training prompts; a comma list of head directories runs
each).
Every request runs alone (batch 1), the methods interleaved prompt by prompt (a shared
machine's load drift hits them alike), after one warm-up request per engine on a prompt that is
not measured; prefix caching is off (an EAGLE head sees every request's whole context).
Outputs are checked identical to no speculation. Writes
one JSON record per (workload, method): output tok/s, speedup, acceptance rate, mean
acceptance length, accepted per position, per-request [drafts, accepted].

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/spec_decode_cpu.py \\
        --out benchmarks/results/spec_decode_cpu.json
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/spec_decode_cpu.py --workloads chat --ks "" \\
        --eagle default --chat-prompts 6 --out benchmarks/results/spec_decode_eagle_cpu.json
    # GPU (repo root; the GGUF copied to the machine): every method on every workload
    HF_HUB_OFFLINE=1 PYTHONPATH=. python3 benchmarks/spec_decode_cpu.py --device cuda \\
        --model /tmp/smollm2.gguf --workloads edit,chat,seen --draft --eagle default --out $OUT/spec.json
    # the same path on the CPU with tiny lengths (checks the script, measures nothing)
    python benchmarks/spec_decode_cpu.py --smoke --workloads edit,chat,seen --draft --eagle default

With ``--device cuda`` each record also says whether the target ran CUDA graphs and how many
of its steps replayed a whole-step graph (decodes and verifications of ``1 + k`` tokens per
request are captured; steps with prefill run piecewise graphs; the EAGLE head and the draft
model run eagerly; EAGLE-3 turns the target's graphs off).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import time
from types import SimpleNamespace

import kvserve

CHAT = ["What are three good habits for staying healthy?", "Explain what a hash table is.",
        "Write a short poem about the sea.", "Why is the sky blue?",
        "Give me tips for learning a new language.", "What is the difference between a list and a tuple in Python?"]


def edit_prompts(n: int = 6) -> list[str]:
    """Code-editing requests over kvserve's own functions of 12-30 lines."""
    root = os.path.dirname(kvserve.__file__)
    funcs = []
    for rel in ["spec_decode/ngram.py", "spec_decode/rejection_sampler.py", "core/block_pool.py",
                "sample/sampler.py", "config.py", "core/scheduler/scheduler.py"]:
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


_STAT_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _stats(llm) -> SimpleNamespace:
    """A copy of the engine's cumulative speculation counters."""
    s = llm.llm_engine.stats
    return SimpleNamespace(**{k: getattr(s, k, 0) for k in _STAT_KEYS},
                           num_accepted_tokens_per_pos=list(getattr(s, "num_accepted_tokens_per_pos", None) or []))


def _delta(a: SimpleNamespace, b: SimpleNamespace) -> SimpleNamespace:
    """Counters of ``b`` minus those of ``a`` (one workload's share of an engine's run)."""
    pa = a.num_accepted_tokens_per_pos + [0] * (len(b.num_accepted_tokens_per_pos) - len(a.num_accepted_tokens_per_pos))
    return SimpleNamespace(**{k: getattr(b, k) - getattr(a, k) for k in _STAT_KEYS},
                           num_accepted_tokens_per_pos=[y - x for x, y in zip(pa, b.num_accepted_tokens_per_pos)])


class _GraphCounter:
    """Counts a model runner's steps and those that replayed a whole-step CUDA graph."""

    def __init__(self, runner) -> None:
        self.steps = self.graphed = 0
        self.runner = runner
        gr = runner.graph_runner
        orig_step = runner.execute_model_async

        def step(sched):
            self.steps += not sched.is_empty
            return orig_step(sched)

        runner.execute_model_async = step
        if gr is not None:
            orig_run = gr.run

            def run(*a, **kw):
                self.graphed += 1
                return orig_run(*a, **kw)

            gr.run = run

    def info(self) -> dict:
        gr, pw = self.runner.graph_runner, self.runner.piecewise_runner
        return {"decode_graphs": None if gr is None else sorted(map(list, gr.graphs)),
                "piecewise_graphs": pw is not None, "steps": self.steps, "graphed_steps": self.graphed}


def label(m: dict | None) -> str:
    """A short name for a method (its speculative config, or None)."""
    if not m:
        return "none"
    extra = f" vocab {m['draft_vocab_size']}" if "draft_vocab_size" in m else ""
    head = f"[{os.path.basename(m['model'].rstrip('/'))}]" if m["method"] == "eagle" and m["model"] != "default" else ""
    return f"{m['method']}{head} k={m['num_speculative_tokens']}{extra}"


def make_llms(methods: list, model: str | None, device: str, dtype: str) -> list:
    """One engine per method (batch 1: ``max_num_seqs`` 1, so few CUDA graphs to capture). No
    prefix caching: every request computes its whole prompt, so an EAGLE head sees all of it
    (a prefix hit starts the head at the first computed position)."""
    from kvserve import LLM

    return [LLM(model=model, device=device, dtype=dtype, kv_cache_memory="256MiB", max_model_len=2048,
                max_num_seqs=1, max_num_batched_tokens=2048, disable_log_stats=True, enable_prefix_caching=False,
                speculative_config=m) for m in methods]


WARMUP = "Hello! What can you help me with today?"  # not a measured prompt


def run_all(llms: list, prompts: list[str], max_tokens: int, warmup_tokens: int = 4) -> list[dict]:
    """Every engine on every prompt, batch 1, interleaved (prompt-major: each prompt runs under
    every method back to back) so that load drift on a shared machine hits all methods alike.
    Each engine first answers ``WARMUP`` (``warmup_tokens`` tokens; when that is the whole
    answer length, the first measured prompt too)."""
    from kvserve import SamplingParams
    from kvserve.bench.throughput import spec_decode_summary

    tok = llms[0].get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    warm = [tok.apply_chat_template([{"role": "user", "content": WARMUP}], add_generation_prompt=True, tokenize=False)]
    if warmup_tokens >= max_tokens:  # (GPU) also the first measured prompt: every step shape compiled; no
        warm.append(texts[0])        # prefix caching, so the measured run recomputes it all the same
    for llm in llms:
        for w in warm:
            llm.generate([w], SamplingParams(temperature=0, max_tokens=warmup_tokens), use_tqdm=False)
    before = [_stats(llm) for llm in llms]
    counters = [getattr(llm, "_graph_counter", None) for llm in llms]
    steps0 = [(c.steps, c.graphed) if c else (0, 0) for c in counters]
    outs = [[] for _ in llms]
    elapsed = [0.0] * len(llms)
    for t in texts:
        for i, llm in enumerate(llms):
            t0 = time.perf_counter()
            outs[i].append(llm.generate([t], sp, use_tqdm=False)[0])  # prefill included in the time
            elapsed[i] += time.perf_counter() - t0
    recs = []
    for llm, o, e, b, c, s0 in zip(llms, outs, elapsed, before, counters, steps0):
        n_out = sum(len(x.outputs[0].token_ids) for x in o)
        r = {"output_tokens": n_out, "elapsed_s": e, "output_tok_s": n_out / e,
             "token_ids": [list(x.outputs[0].token_ids) for x in o],
             "spec_decode": spec_decode_summary(o, _delta(b, _stats(llm)))}
        if c is not None:
            r["cuda_graphs"] = dict(c.info(), steps=c.steps - s0[0], graphed_steps=c.graphed - s0[1])
        recs.append(r)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/spec_decode_cpu.json")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--suffix-ks", default="", help="also suffix decoding at these k (comma list)")
    ap.add_argument("--draft", action="store_true", help="also the draft_model method (target as its own draft)")
    ap.add_argument("--eagle", default=None, help="also EAGLE with these head directories (comma list; "
                                                  "'default': the shipped head for the default model; "
                                                  "DIR@K[/K..]: that head at these k only)")
    ap.add_argument("--eagle-ks", default="2,3,4")
    ap.add_argument("--eagle-vocab", default="", help="comma list of draft_vocab_size values to run beside the "
                                                      "head's own setting (0: the whole vocabulary)")
    ap.add_argument("--chat-prompts", type=int, default=4, help="how many of the chat questions (and of the "
                                                                "head's training prompts for 'seen')")
    ap.add_argument("--edit-prompts", type=int, default=6, help="how many code-editing requests")
    ap.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: the engine's rule, bfloat16 on a CPU "
                                                    "with native bf16, else float32; the checkpoint's 16-bit type "
                                                    "on a GPU)")
    ap.add_argument("--smoke", action="store_true", help="tiny lengths (8 tokens, 2 prompts): checks the script")
    ns = ap.parse_args()
    if ns.smoke:
        ns.max_tokens, ns.chat_prompts, ns.edit_prompts = 8, 2, 2
        if ns.out == ap.get_default("out"):
            ns.out = "/tmp/spec_decode_smoke.json"
    from kvserve.bench import env
    from kvserve.model_loader import resolve_model

    path = resolve_model(ns.model, "auto")[0]
    load0 = os.getloadavg()
    methods = [None] + [{"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4} for k in ns.ks.split(",") if k]
    methods += [{"method": "suffix", "num_speculative_tokens": int(k)} for k in ns.suffix_ks.split(",") if k]
    if ns.draft:
        methods.append({"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                        "draft_num_blocks": 2 * 2048 // 16 + 1})  # room for one whole request
    if ns.eagle:
        vocabs = [None] + [int(v) for v in ns.eagle_vocab.split(",") if v]
        for entry in ns.eagle.split(","):  # DIR or DIR@K[/K...]: that head at its own ks
            head, _, ks = entry.partition("@")
            methods += [{"method": "eagle", "model": head, "num_speculative_tokens": int(k), "dynamic": False,
                         **({} if v is None else {"draft_vocab_size": v or 10**9})}
                        for k in (ks.split("/") if ks else ns.eagle_ks.split(",")) if k for v in vocabs]
    t_start = time.perf_counter()
    llms = make_llms(methods, path, ns.device, ns.dtype)
    t_init = time.perf_counter() - t_start
    dtype = llms[0].llm_engine.config.model_config.dtype
    for llm in llms:
        llm._graph_counter = _GraphCounter(llm.llm_engine.engine_core.model_runner)
    records = []
    for wl in ns.workloads.split(","):
        if wl == "seen":  # the EAGLE head's own training prompts (an upper bound, not held out)
            from kvserve.spec_decode.train_eagle import chat_prompts

            prompts = chat_prompts(128, 0)[:ns.chat_prompts]
        else:
            prompts = edit_prompts(ns.edit_prompts) if wl in ("edit", "repeat") else CHAT[:ns.chat_prompts]
            if wl == "repeat":
                prompts = [p for p in prompts for _ in range(2)]
        # On a GPU the warm-up runs whole answers (kernels compiled for every step shape).
        recs = run_all(llms, prompts, ns.max_tokens, ns.max_tokens if ns.device == "cuda" else 4)
        base = recs[0]
        for m, r in zip(methods, recs):
            r["workload"], r["method"], r["label"], r["num_prompts"] = wl, m, label(m), len(prompts)
            r["speedup"] = r["output_tok_s"] / base["output_tok_s"]
            r["identical_to_no_spec"] = r["token_ids"] == base["token_ids"]
            records.append(r)
            sd = r["spec_decode"] or {}
            cg = r.get("cuda_graphs") or {}
            graphs = f" graphed {cg['graphed_steps']}/{cg['steps']}" if ns.device == "cuda" else ""
            print(f"{wl:5s} {label(m):26s} {r['output_tok_s']:8.2f} tok/s "
                  f"x{r['speedup']:.2f} acc={sd.get('acceptance_rate', 0):.2f} "
                  f"len={sd.get('mean_acceptance_length', 1):.2f} same={r['identical_to_no_spec']}{graphs}",
                  flush=True)
    for llm in llms:
        llm.shutdown()
    for r in records:
        del r["token_ids"]
    import torch

    with open(ns.out, "w") as f:
        json.dump({"env": {"commit": env.git_commit(), "device": env.device_description(ns.device),
                           "cores": os.cpu_count(), "torch": torch.__version__, "model": path,
                           "dtype": dtype, "engine_init_s": t_init, "total_s": time.perf_counter() - t_start,
                           "loadavg_start": load0, "loadavg_end": os.getloadavg()},
                   "max_tokens": ns.max_tokens, "records": records}, f, indent=1)
    print(f"wrote {ns.out} ({time.perf_counter() - t_start:.0f} s, engines {t_init:.0f} s)")
    if not all(r["identical_to_no_spec"] for r in records):
        print("WARNING: some outputs differ from no speculation (see identical_to_no_spec)")


if __name__ == "__main__":
    main()
