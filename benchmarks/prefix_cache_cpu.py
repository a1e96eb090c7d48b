"""Prefix caching on vs off on the CPU (scaled-down W3), side by side in one run.

Two engines (SmolLM2-135M-Instruct, float32, CPU), one with ``enable_prefix_caching`` and
one without, run the same two workloads, each submitted at once through ``LLM.generate``:

- shared-prefix: ``--num-prefixes`` system prompts x ``--questions`` questions each
  (kvserve.bench.datasets.sample_shared_prefix_requests), so most prompt tokens repeat;
- no-hit: random token prompts of the same lengths, distinct from the first token on, so
  the cache finds nothing and only its overhead shows.

The prefix cache is reset before every timed run (warm-up hits do not count). Prints a
table and writes JSON to benchmarks/results/prefix_cache_cpu.json.

    HF_HUB_OFFLINE=1 python benchmarks/prefix_cache_cpu.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.bench.datasets import sample_shared_prefix_requests  # noqa: E402


def build_workloads(tok, ns) -> dict[str, list[list[int]]]:
    reqs = sample_shared_prefix_requests(ns.num_prefixes, ns.questions, ns.prefix_words, (4, 12),
                                         (ns.output_len, ns.output_len), seed=0)
    shared = [tok.encode(r.prompt_text) for r in reqs]
    rng = random.Random(1)
    vocab = tok.vocab_size
    firsts = rng.sample(range(1000, vocab), len(shared))
    nohit = [[f] + [rng.randrange(1000, vocab) for _ in range(len(p) - 1)] for f, p in zip(firsts, shared)]
    return {"shared-prefix": shared, "no-hit": nohit}


def timed_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    eng = llm.llm_engine
    assert eng.engine_core.kv_cache_manager.pool.reset_prefix_cache()
    q0, h0 = eng.stats.prefix_cache_queries, eng.stats.prefix_cache_hits
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    q, h = eng.stats.prefix_cache_queries - q0, eng.stats.prefix_cache_hits - h0
    return {
        "elapsed_s": dt, "num_requests": len(prompts), "prompt_tokens": n_in, "output_tokens": n_out,
        "requests_per_s": len(prompts) / dt, "total_tokens_per_s": (n_in + n_out) / dt,
        "output_tokens_per_s": n_out / dt, "mean_ttft_s": sum(ttft) / len(ttft),
        "prefix_cache_queries": q, "prefix_cache_hits": h, "hit_rate": h / q if q else 0.0,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--questions", type=int, default=8, help="questions per prefix")
    ap.add_argument("--prefix-words", type=int, default=250)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell (the best is kept)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "prefix_cache_cpu.json"))
    ns = ap.parse_args()

    t_start = time.perf_counter()
    common = dict(kv_cache_memory="256MiB", max_model_len=2048, disable_log_stats=True)
    engines = {"on": LLM(enable_prefix_caching=True, **common), "off": LLM(enable_prefix_caching=False, **common)}
    tok = engines["on"].get_tokenizer()
    workloads = build_workloads(tok, ns)
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    warm = [list(range(2000, 2100))] * 2
    for llm in engines.values():
        llm.generate(warm, params, use_tqdm=False)

    results: dict[str, dict[str, dict]] = {}
    for wname, prompts in workloads.items():
        results[wname] = {}
        for _ in range(ns.repeats):  # interleave on/off so drift hits both alike
            for ename, llm in engines.items():
                r = timed_run(llm, prompts, params)
                best = results[wname].get(ename)
                if best is None or r["elapsed_s"] < best["elapsed_s"]:
                    results[wname][ename] = r
        same = results[wname]["on"]["outputs"] == results[wname]["off"]["outputs"]
        results[wname]["outputs_identical"] = same
        for e in ("on", "off"):
            results[wname][e].pop("outputs")

    lines = [
        f"{'workload':<14} {'cache':<5} {'req/s':>7} {'tok/s':>8} {'mean TTFT s':>12} {'hit rate':>9} "
        f"{'speedup':>8} {'TTFT ratio':>11}",
    ]
    for wname, r in results.items():
        on, off = r["on"], r["off"]
        for e, x in (("off", off), ("on", on)):
            sp = x["total_tokens_per_s"] / off["total_tokens_per_s"]
            tr = x["mean_ttft_s"] / off["mean_ttft_s"]
            lines.append(f"{wname:<14} {e:<5} {x['requests_per_s']:>7.2f} {x['total_tokens_per_s']:>8.1f} "
                         f"{x['mean_ttft_s']:>12.3f} {100 * x['hit_rate']:>8.1f}% {sp:>7.2f}x {tr:>10.2f}x")
        lines.append(f"{'':<14} greedy outputs identical on/off: {r['outputs_identical']}")
    table = "\n".join(lines)
    print(table)

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = None
    doc = {
        "benchmark": "prefix caching on vs off, CPU (scaled-down W3)",
        "command": "HF_HUB_OFFLINE=1 python benchmarks/prefix_cache_cpu.py " + " ".join(sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct (GGUF, float32)", "device": platform.processor() or platform.machine(),
        "cpu_cores": len(os.sched_getaffinity(0)), "torch": torch.__version__, "commit": commit,
        "note": "commit is the base; the prefix-cache change was uncommitted when measured",
        "args": vars(ns), "results": results, "table": table,
        "wall_s": time.perf_counter() - t_start,
    }
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {ns.out} ({doc['wall_s']:.0f} s)")
    return 0 if all(r["outputs_identical"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
