"""Bounded KV retrieval probe on the CPU: a fact stated early, asked about late.

Each probe is one prompt of the real default model (SmolLM2-135M-Instruct, float32): ``--lead``
tokens of KJV prose, then a fact ("The secret number of NAME is NNNN."), ``--filler`` tokens of
prose, then the question ("... The secret number of NAME is"); greedy, 6 tokens. A probe is
answered when the output contains the number. The fact lies outside the window of every bounded
policy (``--budget`` tokens per request, as in ``bounded_kv.py``): the full cache can read it,
window-only and StreamingLLM (4 sinks + window) cannot unless the model guesses, and H2O keeps it
only if its block gathered enough attention mass to stay among the heavy hitters.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python benchmarks/bounded_probe.py --probes 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bounded_kv import BS, engine, text_ids  # noqa: E402

from kvserve import SamplingParams  # noqa: E402
from kvserve.bench.env import git_commit  # noqa: E402

NAMES = ["Abigail", "Benedict", "Cordelia", "Desmond", "Eleanor", "Fitzgerald", "Gwendolyn", "Horatio",
         "Isadora", "Jasper", "Katarina", "Leopold", "Marguerite", "Nathaniel", "Ophelia", "Percival"]


def probes(llm, ns) -> list[tuple[list[int], str]]:
    tok = llm.get_tokenizer()
    prose = text_ids(llm, (ns.lead + ns.filler) * 2 + ns.probes * 97)
    rng = random.Random(0)
    out = []
    for j in range(ns.probes):
        name, num = NAMES[j % len(NAMES)], str(rng.randint(1000, 9999))
        at = j * 97
        ids = (prose[at:at + ns.lead] + tok(f"\n\nThe secret number of {name} is {num}.\n\n")["input_ids"]
               + prose[at + ns.lead:at + ns.lead + ns.filler]
               + tok(f"\n\nQuestion: what is the secret number of {name}? Answer: The secret number of {name} is")[
                   "input_ids"])
        out.append((ids, num))
    return out


def run(llm, items, **extra) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=6, **extra)
    outs = llm.generate([ids for ids, _ in items], sp, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    hits = [num in t for (_, num), t in zip(items, texts)]
    return {"answered": sum(hits), "probes": len(items), "accuracy": round(sum(hits) / len(items), 3),
            "outputs": texts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--probes", type=int, default=12)
    p.add_argument("--lead", type=int, default=64, help="prose tokens before the fact (past the sink block)")
    p.add_argument("--filler", type=int, default=640, help="prose tokens between the fact and the question")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048, help="max_model_len of the engines")
    p.add_argument("--out", default="benchmarks/results/bounded_probe_cpu.json")
    ns = p.parse_args(argv)
    res: dict = {"command": " ".join(["python"] + sys.argv), "commit": git_commit(), "budget_tokens": ns.budget,
                 "lead": ns.lead, "filler": ns.filler, "results": {}}
    llm = engine(ns)
    items = probes(llm, ns)
    res["prompt_tokens"] = [len(i) for i, _ in items]
    res["results"]["full"] = run(llm, items)
    llm.shutdown()
    llm = engine(ns, kv_eviction_policy="streaming", attention_sinks=4, max_attention_window=ns.budget)
    res["results"]["window"] = run(llm, items, attention_sinks=0)
    res["results"]["streaming"] = run(llm, items, max_attention_window=ns.budget - BS)
    llm.shutdown()
    llm = engine(ns, kv_eviction_policy="h2o", attention_sinks=4, max_attention_window=ns.budget // 2,
                 kv_budget_tokens=ns.budget + BS)
    res["results"]["h2o"] = run(llm, items)
    llm.shutdown()
    for k, v in res["results"].items():
        print(f"{k:10s} {v['answered']}/{v['probes']}  {v['outputs'][:3]}", flush=True)
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
