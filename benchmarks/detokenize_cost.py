"""The serving frontend's CPU per decode step for detokenization: full decode vs incremental.

An ``OutputProcessor`` with the default model's tokenizer is fed ``--batch`` requests x
``--tokens`` output tokens, one token per request per step (plain decode rows, as the engine
core sends them), and each step does what the OpenAI server's frontend does
(``AsyncLLM._process`` / ``_make_output``): ``process(..., detokenize_all=True)`` (the text of
every request), then ``take_delta`` and ``make_output`` per request (``--output delta``, the
default: the streaming path, ``make_output(since=...)`` with only the new tokens;
``--output full``: the whole output every step, as that path did before). Two detokenizers:

* ``full``: ``tokenizer.decode(output_token_ids)`` of the whole output every step (the
  behaviour before incremental detokenization); its cost grows with the output length, so it
  is timed at ``--samples`` evenly spaced steps (every step is still folded in) and its total
  is the trapezoid over those samples;
* ``incremental``: ``IncrementalDetokenizer`` (kvserve/engine/detokenizer.py), every step timed.

The outputs are slices of real text (this repository's docs, with CJK / emoji lines), encoded
by the tokenizer, so multi-byte characters split across tokens occur. Both runs' final texts
are checked equal. Reported: ms per step at output lengths 100 / 500 / 1000 (``process`` and the
whole step) and the total over all steps, as JSON.

Usage:
    PYTHONPATH=. python3 benchmarks/detokenize_cost.py --out benchmarks/results/serving/detokenize_cost
    PYTHONPATH=. python3 benchmarks/detokenize_cost.py --cpu-smoke     # tiny, seconds
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

EXTRA = "東京の天気は晴れです。🚀 naïve café — Привет, мир! 👨‍👩‍👧 絵文字😀🎉\n"


def corpus_ids(tok, need: int) -> list[int]:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")
    text = ""
    for path in sorted(glob.glob(os.path.join(root, "*.md"))):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                text += line + (EXTRA if i % 15 == 0 else "")
        if len(text) > 8 * need:
            break
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < need:
        ids += ids
    return ids


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    import tokenizers
    import transformers

    return {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__}


def commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run(tok, mode: str, batch: int, tokens: int, corpus: list[int], timed: set[int], output: str = "delta") -> dict:
    from kvserve import SamplingParams
    from kvserve.engine.input_processor import make_child_requests
    from kvserve.engine.output_processor import OutputProcessor, ParentState

    op = OutputProcessor(tok)
    if mode == "full":
        op._decode = lambda seq: tok.decode(seq.request.output_token_ids,
                                            skip_special_tokens=seq.request.sampling_params.skip_special_tokens)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    rids, outs = [], []
    stride = max(1, (len(corpus) - tokens) // max(1, batch))
    for b in range(batch):
        rid = f"r{b}"
        op.add(ParentState(rid, None, [1, 2, 3]), make_child_requests(rid, [1, 2, 3], sp, 0.0, 0, None))
        rids.append(rid)
        outs.append(corpus[b * stride % (len(corpus) - tokens):][:tokens])
    parents = [op.parents[r] for r in rids]
    sent = [[0] for _ in parents]  # tokens handed out per request (the streaming delta path)
    step_ms, process_ms = {}, {}
    for t in range(tokens):
        toks = [o[t] for o in outs]
        if t + 1 not in timed:  # untimed steps of the full decode: fold the token in, skip the work
            op.apply_plain(rids, toks)
            continue
        t0 = time.perf_counter()
        updated = op.apply_plain(rids, toks)
        t1 = time.perf_counter()
        op.process(updated, detokenize_all=True)
        t2 = time.perf_counter()
        for p, st in zip(parents, sent):
            op.take_delta(p)
            if output == "delta":
                o = op.make_output(p, since=[(st[0], 0)])
                st[0] += len(o.outputs[0].token_ids)
            else:
                op.make_output(p)
        t3 = time.perf_counter()
        step_ms[t + 1] = (t3 - t0) * 1e3
        process_ms[t + 1] = (t2 - t1) * 1e3
    texts = [op._decode(p.seqs[0]) for p in parents]
    return {"step_ms": step_ms, "process_ms": process_ms, "texts": texts}


def summarize(res: dict, lengths: list[int], tokens: int) -> dict:
    def near(d: dict, n: int) -> float:
        ks = sorted(d, key=lambda k: (abs(k - n), k))[:5]
        return round(sum(d[k] for k in ks) / len(ks), 3)

    def total(d: dict) -> float:
        ks = sorted(d)
        if len(ks) == tokens:
            return sum(d.values()) / 1e3
        s = d[ks[0]] * ks[0]  # trapezoid over the sampled steps (first sample back to step 1)
        for a, b in zip(ks, ks[1:]):
            s += (d[a] + d[b]) / 2 * (b - a)
        return s / 1e3

    return {
        "ms_per_step": {str(n): near(res["step_ms"], n) for n in lengths},
        "process_ms_per_step": {str(n): near(res["process_ms"], n) for n in lengths},
        "total_s": round(total(res["step_ms"]), 3),
        "process_total_s": round(total(res["process_ms"]), 3),
        "steps_timed": len(res["step_ms"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=40, help="timed steps of the full decode")
    ap.add_argument("--out", default=None, help="directory for result.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="batch 8 x 60 tokens")
    ap.add_argument("--output", choices=("delta", "full"), default="delta",
                    help="make_output with only the new tokens (streaming) or the whole output")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.batch, args.tokens, args.samples = 8, 60, 10
    from kvserve.model_loader import get_tokenizer, resolve_model

    path, fmt = resolve_model(None, "auto")
    tok = get_tokenizer(path, fmt)
    corpus = corpus_ids(tok, 4 * args.tokens)
    lengths = [n for n in (100, 500, 1000) if n <= args.tokens] or [args.tokens]
    every = set(range(1, args.tokens + 1))
    k = max(1, args.tokens // args.samples)
    sampled = {t for t in every if t % k == 0 or t == 1} | {t for n in lengths for t in range(n - 2, n + 3)}
    results = {}
    texts = {}
    for mode, timed in (("incremental", every), ("full", sampled & every)):
        res = run(tok, mode, args.batch, args.tokens, corpus, timed, args.output)
        texts[mode] = res.pop("texts")
        results[mode] = summarize(res, lengths, args.tokens)
        print(mode, json.dumps(results[mode]), flush=True)
    assert texts["incremental"] == texts["full"], "incremental text differs from the full decode"
    out = {
        "what": "frontend CPU per decode step: OutputProcessor.process(detokenize_all=True) + take_delta + "
                "make_output for every request, one new token per request per step",
        "batch": args.batch, "output_tokens": args.tokens, "make_output": args.output, "tokenizer": os.path.basename(path),
        "cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "versions": versions(), "commit": commit(),
        "results": results,
        "speedup_at": {n: round(results["full"]["ms_per_step"][n] / max(results["incremental"]["ms_per_step"][n],
                                                                        1e-9), 1)
                       for n in results["full"]["ms_per_step"]},
    }
    print(json.dumps(out["speedup_at"]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
