"""``kvserve bench accuracy``: what a KV cache dtype costs in accuracy, measured through the engine.

For each ``--kv-cache-dtypes`` value the engine is built with that KV storage format and:

1. perplexity on a fixed real-text corpus (``kvserve/bench/data/accuracy_corpus.jsonl.gz``:
   HumanEval prompts + solutions and King James Bible prose, 62.6k tokens with the default
   model's tokenizer, documents of 0.7k-5.1k tokens; ``benchmarks/make_accuracy_corpus.py``
   builds it) from ``prompt_logprobs`` (every token after the first of each document,
   documents cut at ``--max-doc-tokens``), as ``exp(total NLL / tokens)``, overall and per
   kind (code, prose); the relative increase is against the first dtype (the unquantized
   engine, ``auto``), and transformers' perplexity on the same token ids is reported beside;
2. greedy agreement on 24 fixed chat prompts: mean tokens until the first divergence from
   the first dtype's output (``--chat-max-tokens`` each, EOS ignored); a base model without
   a chat template gets the same prompts as plain text.

Writes one JSON (``--output-json``) and prints a table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from typing import Any

CORPUS = os.path.join(os.path.dirname(__file__), "data", "accuracy_corpus.jsonl.gz")

#: 24 chat prompts: code, explanation, arithmetic, writing, facts (fixed; the agreement set).
CHAT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in two sentences.",
    "What is 17 multiplied by 23?",
    "Write a haiku about autumn leaves.",
    "What is the capital of Australia?",
    "Give three tips for writing clean code.",
    "Write a SQL query that counts the rows of a table named users.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Write a short email asking a colleague for a meeting on Friday.",
    "Explain recursion to a ten-year-old.",
    "List the planets of the solar system in order from the Sun.",
    "Write a bash command that counts the lines of every .py file in a directory.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'Good morning, how are you?' into French.",
    "Write a function in JavaScript that returns the largest number in an array.",
    "Why is the sky blue?",
    "Give me a recipe for a simple tomato pasta.",
    "What is photosynthesis?",
    "Write a limerick about a cat who loves to code.",
    "Explain the difference between TCP and UDP.",
    "How many minutes are there in a week? Show your work.",
    "Describe the water cycle in four steps.",
]


def load_corpus(path: str = CORPUS) -> list[dict]:
    """The corpus documents ``{"source", "kind", "text"}``."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def corpus_token_ids(tokenizer, docs: list[dict], max_doc_tokens: int) -> list[list[int]]:
    """Token ids per document, cut at ``max_doc_tokens``."""
    return [tokenizer(d["text"])["input_ids"][:max_doc_tokens] for d in docs]


def perplexity(nll_by_kind: dict[str, tuple[float, int]]) -> dict[str, float]:
    """``{kind: exp(nll / n)}`` plus ``all``."""
    out = {k: math.exp(s / n) for k, (s, n) in nll_by_kind.items() if n}
    s = sum(v[0] for v in nll_by_kind.values())
    n = sum(v[1] for v in nll_by_kind.values())
    out["all"] = math.exp(s / n) if n else float("nan")
    return out


def engine_nll(llm, ids: list[list[int]], kinds: list[str]) -> dict[str, tuple[float, int]]:
    """Summed NLL and token count per kind from the engine's prompt logprobs."""
    from kvserve.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(ids, sp, use_tqdm=False)
    acc: dict[str, list] = {}
    for out, kind in zip(outs, kinds):
        toks = out.prompt_token_ids
        nll = -sum(e[t][0] for e, t in zip(out.prompt_logprobs[1:], toks[1:]))
        a = acc.setdefault(kind, [0.0, 0])
        a[0] += nll
        a[1] += len(toks) - 1
    return {k: (v[0], v[1]) for k, v in acc.items()}


def hf_nll(model, ids: list[list[int]], kinds: list[str]) -> dict[str, tuple[float, int]]:
    """The same with transformers (float32, one document per forward)."""
    import torch

    acc: dict[str, list] = {}
    with torch.no_grad():
        for x, kind in zip(ids, kinds):
            logits = model(torch.tensor([x])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(x[1:])[:, None])
            a = acc.setdefault(kind, [0.0, 0])
            a[0] += -float(lp.sum())
            a[1] += len(x) - 1
    return {k: (v[0], v[1]) for k, v in acc.items()}


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_accuracy(ns: argparse.Namespace) -> int:
    from kvserve.bench import env, report
    from kvserve.core.kv_cache_spec import get_kv_format
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.sampling_params import SamplingParams

    dtypes = [d.strip() for d in ns.kv_cache_dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d != "auto":
            get_kv_format(d)  # ValueError listing the choices
    base_args = EngineArgs.from_cli_args(ns)
    docs = load_corpus(ns.corpus)
    if ns.max_docs and ns.max_docs < len(docs):  # evenly spread: code and prose both stay in
        docs = [docs[i * len(docs) // ns.max_docs] for i in range(ns.max_docs)]
    kinds = [d["kind"] for d in docs]
    chat = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[: ns.num_chat_prompts]]
    chat_sp = SamplingParams(temperature=0.0, max_tokens=ns.chat_max_tokens, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    ids = None
    base_chat = None
    for d in dtypes:
        t0 = time.perf_counter()
        llm = env.make_llm({**base_args, "kv_cache_dtype": d})
        if ids is None:
            ids = corpus_token_ids(llm.get_tokenizer(), docs, ns.max_doc_tokens)
        nll = engine_nll(llm, ids, kinds)
        if getattr(llm.get_tokenizer(), "chat_template", None) is None:  # a base model: the prompts as plain text
            prompts_as = "text"
            gen = llm.generate([m[0]["content"] for m in chat], chat_sp, use_tqdm=False) if chat else []
        else:
            prompts_as = "chat"
            gen = llm.chat(chat, sampling_params=chat_sp, use_tqdm=False) if chat else []
        outs = [o.outputs[0].token_ids for o in gen]
        if base_chat is None:
            base_chat = outs
        agree = [first_divergence(a, b) for a, b in zip(outs, base_chat)]
        row = {"kv_cache_dtype": d, "resolved": llm.llm_engine.config.cache_config.kv_cache_dtype,
               "perplexity": perplexity(nll), "tokens": sum(n for _, n in nll.values()),
               "greedy_agreement_mean": sum(agree) / len(agree) if agree else None, "greedy_agreement": agree,
               "agreement_prompts_as": prompts_as,
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{d}: ppl {row['perplexity']['all']:.4f}  agreement {row['greedy_agreement_mean'] or 0:.1f}/"
              f"{ns.chat_max_tokens}  ({row['seconds']:.0f}s)", flush=True)
        llm.shutdown()
        del llm
    base_ppl = rows[0]["perplexity"]["all"]
    for r in rows:
        r["ppl_increase_pct"] = 100.0 * (r["perplexity"]["all"] / base_ppl - 1.0)
    hf = None
    if not ns.no_hf:
        from kvserve.bench.hf_peer import load_hf_model, resolve_checkpoint

        path, fmt = resolve_checkpoint(base_args.get("model"), base_args.get("load_format") or "auto")
        model = load_hf_model(path, fmt, seed=base_args.get("seed") or 0, dtype="float32")
        hf = perplexity(hf_nll(model, ids, kinds))
    result = {"corpus": os.path.relpath(ns.corpus), "num_docs": len(docs), "max_doc_tokens": ns.max_doc_tokens,
              "num_chat_prompts": len(chat), "chat_max_tokens": ns.chat_max_tokens, "rows": rows,
              "transformers_perplexity": hf, "engine_args": base_args,
              "env": report.env_info({"device": base_args.get("device") or "auto"}),
              "command": " ".join(sys.argv)}
    print(f"\n{'kv_cache_dtype':<12}{'ppl':>10}{'code':>9}{'prose':>9}{'vs ' + dtypes[0]:>11}{'agree':>9}")
    for r in rows:
        p = r["perplexity"]
        print(f"{r['kv_cache_dtype']:<12}{p['all']:>10.4f}{p.get('code', float('nan')):>9.3f}"
              f"{p.get('prose', float('nan')):>9.3f}{r['ppl_increase_pct']:>+10.2f}%"
              f"{r['greedy_agreement_mean'] or 0:>9.1f}")
    if hf is not None:
        print(f"{'transformers':<12}{hf['all']:>10.4f}{hf.get('code', float('nan')):>9.3f}"
              f"{hf.get('prose', float('nan')):>9.3f}")
    if ns.output_json:
        report.write_json(ns.output_json, result)
        print(f"wrote {ns.output_json}")
    ns.result = result
    return 0


def register_accuracy(subparsers: argparse._SubParsersAction) -> None:
    """Add ``accuracy`` to the ``kvserve bench`` subparsers."""
    from kvserve.engine.arg_utils import EngineArgs

    p = subparsers.add_parser("accuracy", help="Perplexity and greedy agreement per KV cache dtype.",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("accuracy arguments")
    g.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3,fp8_e5m2,int8,int4,int2",
                   help="Comma-separated dtypes; the first is the reference (default: %(default)s).")
    g.add_argument("--corpus", default=CORPUS, help="JSONL(.gz) of {kind, text} documents (default: shipped).")
    g.add_argument("--max-docs", type=int, default=0, help="Use N documents spread evenly over the corpus (0: all).")
    g.add_argument("--max-doc-tokens", type=int, default=2048, help="Cut documents here (default: %(default)s).")
    g.add_argument("--num-chat-prompts", type=int, default=24, help="Chat prompts for agreement (max 24).")
    g.add_argument("--chat-max-tokens", type=int, default=64, help="Greedy tokens per chat prompt.")
    g.add_argument("--no-hf", action="store_true", help="Skip transformers' perplexity.")
    g.add_argument("--output-json", default=None, metavar="PATH", help="Write the results as JSON here.")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_accuracy)
