"""GPU benchmarks for speculative decoding.

Parts (``--parts``, comma-separated):

* ``verify``: Llama-3.1-8B shape (dummy bf16 weights), the device time of one verification
  step -- forward of ``q = 1 + k`` tokens per request through a CUDA graph, plus logits and
  argmax for the ``q`` rows -- for k = 0..8 at batch 1 and 64 with 1k context, vs the plain
  decode step (k = 0). A step verifying k drafts pays off when the expected tokens per step,
  ``(1 - a^(k+1)) / (1 - a)`` for per-draft acceptance ``a``, exceed its cost ratio.
* ``batch1``: batch-1 decode tok/s at the 8B shape: no speculation; an *oracle* proposer
  (drafts the reference greedy continuation, each draft corrupted with probability 1 - alpha:
  acceptance set by construction since dummy weights make real acceptance meaningless) for
  (alpha, k) in {(0.6, 2), (0.9, 2), (0.9, 4)}; the n-gram proposer as measured on dummy weights.
* ``tree``: tree verification cost at the 8B shape (dummy bf16 weights, 1k context, batch 1 and
  16): one step verifying a tree of 8 / 16 / 32 nodes (EAGLE-2 shaped, 4 children per node; rotary
  positions by depth, the ancestor mask in the prefill kernel) vs a chain of k = 4 and a chain of
  as many tokens as the tree (no mask: what the mask itself costs), as a CUDA graph.
* ``load``: W1-like under load (Qwen3-0.6B shape, 128 requests at once, prompts U[100,512],
  outputs U[64,256], greedy): no speculation (async scheduling), the oracle proposer (alpha
  0.7, k=4) with dynamic speculation off, and on (``dynamic_max_batch`` 32): output tok/s.
* ``draft`` (not in the default ``--parts``): EAGLE-3 on a SmolLM2-135M-shaped target (dummy
  weights, random head): the draft steps eager vs captured in CUDA graphs, ms per call at
  batch 1 and 16 for k = 1..4, and engine ms/token with the draft graphs off vs on
  (``draft_graph_cost.py``; about 40 s). Then the same for EAGLE-2 tree drafts (topk 4, depth 4,
  16 nodes): one tree draft eager vs its CUDA graph at batch 1 and 16, depth 2 and 4, and engine
  ms/token with the tree draft graphs off vs on (``measure_tree``; about 40 s more).

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 benchmarks/gpu_spec.py --out $OUT --parts verify,batch1,load,tree
    PYTHONPATH=. python3 benchmarks/gpu_spec.py --cpu-smoke   # tiny shapes on the CPU
Writes ``$OUT/spec_bench.json`` (one record per figure) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
)
QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], bos_token_id=1, eos_token_id=2,
)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def _config_dir(tmp: str, name: str, cfg: dict) -> str:
    import transformers

    path = os.path.join(tmp, name)
    cls = transformers.Qwen3Config if cfg["architectures"][0].startswith("Qwen3") else transformers.LlamaConfig
    cls(**cfg).save_pretrained(path)
    return path


def _llm(path: str, dev: str, **kw):
    from kvserve import LLM

    args = dict(model=path, load_format="dummy", skip_tokenizer_init=True, disable_log_stats=True, device=dev,
                dtype="bfloat16" if dev == "cuda" else "float32")
    args.update(kw)
    return LLM(**args)


# ------------------------------------------------------------------------------- verify
def verify_cost(tmp: str, dev: str, smoke: bool) -> list[dict]:
    from kvserve.attention.forward_context import AttentionMetadata, forward_context

    cfg = TINY if smoke else LLAMA31_8B
    ctx, batches, kmax = (64, (1, 4), 3) if smoke else (1024, (1, 64), 8)
    llm = _llm(_config_dir(tmp, "verify", cfg), dev, enforce_eager=True, max_model_len=2048, max_num_seqs=64,
               kv_cache_memory="64MiB" if smoke else "12GiB")
    runner = llm.llm_engine.engine_core.model_runner
    model = runner.model
    nb = runner.kv_cache_config.groups[0].num_blocks
    bsz = runner.block_size
    out = []
    for b in batches:
        w = -(-2048 // bsz)
        per = -(-(ctx + kmax + 1) // bsz)
        for k in range(kmax + 1):
            q = k + 1
            t = b * q
            ids = torch.randint(0, min(1000, cfg["vocab_size"]), (t,), device=dev)
            pos = torch.arange(ctx, ctx + q, device=dev).repeat(b)
            bt = (torch.arange(b * w, device=dev, dtype=torch.int32).view(b, w) % per
                  + torch.arange(b, device=dev, dtype=torch.int32).unsqueeze(1) * per) % (nb - 1) + 1
            rows = torch.arange(b, device=dev).repeat_interleave(q)
            slots = bt[rows, pos // bsz].long() * bsz + pos % bsz  # writes land in the step's own slots
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=bt,
                query_start_loc=torch.arange(0, t + 1, q, dtype=torch.int32, device=dev),
                seq_lens=torch.full((b,), ctx + q, dtype=torch.int32, device=dev), query_lens_cpu=[q] * b,
                seq_lens_cpu=[ctx + q] * b, max_query_len=q, max_seq_len=ctx + q, num_decodes=b if q == 1 else 0)

            def step():
                with forward_context([meta]):
                    h = model(ids, pos)
                return model.compute_logits(h).argmax(-1)

            ms = _time(step, dev, 3 if smoke else 20)
            out.append(dict(part="verify", shape="tiny" if smoke else "llama-3.1-8b", batch=b, k=k, ctx=ctx,
                            ms_per_step=round(ms, 3)))
        base = out[-(kmax + 1)]["ms_per_step"]
        for r in out[-(kmax + 1):]:
            r["cost_vs_decode"] = round(r["ms_per_step"] / base, 3)
    del llm, runner, model
    _free(dev)
    return out


# ------------------------------------------------------------------------------- tree
def tree_cost(tmp: str, dev: str, smoke: bool) -> list[dict]:
    from kvserve.attention.forward_context import AttentionMetadata, forward_context
    from kvserve.spec_decode.tree import tree_ancestor_bits, tree_depths

    cfg = TINY if smoke else LLAMA31_8B
    ctx, batches = (64, (1, 4)) if smoke else (1024, (1, 16))
    llm = _llm(_config_dir(tmp, "tree", cfg), dev, enforce_eager=True, max_model_len=2048, max_num_seqs=64,
               kv_cache_memory="64MiB" if smoke else "12GiB")
    runner = llm.llm_engine.engine_core.model_runner
    model = runner.model
    nb = runner.kv_cache_config.groups[0].num_blocks
    bsz = runner.block_size
    # (name, drafted nodes, tree?): chain k=4; trees of 8/16/32 nodes; chains as long as the trees
    cases = [("chain", 4, False)] + [("tree", n, True) for n in (8, 16, 32)] \
        + [("chain", n, False) for n in (8, 16, 32)]
    out = []
    for b in batches:
        for name, n, is_tree in cases:
            q = n + 1
            t = b * q
            parents = [i // 4 - 1 for i in range(n)] if is_tree else [i - 1 for i in range(n)]  # 4 children each
            depth = torch.from_numpy(tree_depths(parents)).to(dev)
            ids = torch.randint(0, min(1000, cfg["vocab_size"]), (t,), device=dev)
            pos = (ctx + depth).repeat(b)
            idx = torch.arange(ctx, ctx + q, device=dev).repeat(b)  # sequence index: the slot
            w = -(-2048 // bsz)
            per = -(-(ctx + q) // bsz)
            bt = (torch.arange(b * w, device=dev, dtype=torch.int32).view(b, w) % per
                  + torch.arange(b, device=dev, dtype=torch.int32).unsqueeze(1) * per) % (nb - 1) + 1
            rows = torch.arange(b, device=dev).repeat_interleave(q)
            slots = bt[rows, idx // bsz].long() * bsz + idx % bsz
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=bt,
                query_start_loc=torch.arange(0, t + 1, q, dtype=torch.int32, device=dev),
                seq_lens=torch.full((b,), ctx + q, dtype=torch.int32, device=dev), query_lens_cpu=[q] * b,
                seq_lens_cpu=[ctx + q] * b, max_query_len=q, max_seq_len=ctx + q, num_decodes=0)
            if is_tree:
                meta.tree_mask = torch.from_numpy(tree_ancestor_bits(parents)).to(dev).repeat(b)
                meta.tree_start = torch.full((b,), ctx, dtype=torch.int32, device=dev)

            def step():
                with forward_context([meta]):
                    h = model(ids, pos)
                return model.compute_logits(h).argmax(-1)

            ms = _time(step, dev, 3 if smoke else 20)
            out.append(dict(part="tree", shape="tiny" if smoke else "llama-3.1-8b", batch=b, kind=name, nodes=n,
                            max_depth=int(depth.max()), ctx=ctx, ms_per_step=round(ms, 3)))
        base = out[-len(cases)]["ms_per_step"]
        for r in out[-len(cases):]:
            r["cost_vs_chain_k4"] = round(r["ms_per_step"] / base, 3)
    del llm, runner, model
    _free(dev)
    return out


def _time(fn, dev: str, n: int) -> float:
    """Median ms of ``fn`` (a CUDA graph of it on CUDA, replayed; eager on the CPU)."""
    with torch.inference_mode():
        fn()
        if dev != "cuda":
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(n):
            g.replay()
        en.record()
        en.synchronize()
        return st.elapsed_time(en) / n


def _free(dev: str) -> None:
    import gc

    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- draft graphs
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
)


def draft(tmp: str, dev: str, smoke: bool) -> list[dict]:
    import transformers

    from draft_graph_cost import measure
    from kvserve.models.llama_eagle import save_random_eagle_head

    cfg = dict(TINY, num_hidden_layers=6) if smoke else SMOLLM2_135M
    path = _config_dir(tmp, "draft-target", cfg)
    head = os.path.join(tmp, "draft-eagle3-head")
    save_random_eagle_head(head, transformers.LlamaConfig(**cfg), eagle3=True,
                           draft_vocab_size=256 if smoke else 32000, seed=1, std=0.05)
    llm = _llm(path, dev, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024,
               kv_cache_memory="64MiB" if smoke else "4GiB", **(dict(cpu_threads=1) if smoke else {}),
               speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2 if smoke else 4,
                                   "dynamic": False})
    try:
        recs = measure(llm, dev, smoke, "eagle3 smollm2-135m" if not smoke else "eagle3 tiny")
    finally:
        llm.shutdown()
        del llm
        _free(dev)
    from draft_graph_cost import measure_tree

    depth = 2 if smoke else 4
    llm = _llm(path, dev, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024,
               kv_cache_memory="64MiB" if smoke else "4GiB", **(dict(cpu_threads=1) if smoke else {}),
               speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": depth,
                                   "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 4 * depth + 1,
                                   "dynamic": False})
    try:
        return recs + measure_tree(llm, dev, smoke, "eagle3 smollm2-135m" if not smoke else "eagle3 tiny")
    finally:
        llm.shutdown()
        del llm
        _free(dev)


# ------------------------------------------------------------------------------- batch 1
def _make_oracle():
    from kvserve.spec_decode import Proposer

    class Oracle(Proposer):
        ref: dict = {}
        alpha = 0.9
        rng = random.Random(0)

        def propose(self, requests, batch):
            out = []
            for st in requests:
                ref = self.ref.get(tuple(st.prompt_token_ids), [])
                n = len(st.output_token_ids)
                d = list(ref[n:n + self.num_speculative_tokens])
                out.append([t if self.rng.random() < self.alpha else (t + 1) % 1000 for t in d])
            return out

    return Oracle


def batch1(tmp: str, dev: str, smoke: bool) -> list[dict]:
    from kvserve import SamplingParams
    from kvserve.spec_decode import register_proposer

    cfg = TINY if smoke else LLAMA31_8B
    path = _config_dir(tmp, "b1", cfg)
    n_out = 32 if smoke else 256
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (128,), generator=g).tolist() for _ in range(2 if smoke else 3)]
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    Oracle = _make_oracle()
    register_proposer("oracle", Oracle)
    common = dict(max_model_len=1024, max_num_seqs=8, kv_cache_memory="64MiB" if smoke else "8GiB")
    out, ref = [], None
    configs = [None] + [{"method": "oracle", "num_speculative_tokens": k, "alpha": a}
                        for a, k in ((0.6, 2), (0.9, 2), (0.9, 4))] + [{"method": "ngram", "num_speculative_tokens": 4}]
    for spec in configs:
        if spec and spec["method"] == "oracle":
            Oracle.alpha = spec["alpha"]
            Oracle.rng = random.Random(0)
        llm = _llm(path, dev, speculative_config=spec, **common)
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        t_all, toks, outs = 0.0, 0, []
        for p in prompts:
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = llm.generate([p], sp, use_tqdm=False)[0]
            t_all += time.perf_counter() - t0
            toks += len(o.outputs[0].token_ids)
            outs.append(o.outputs[0].token_ids)
        if ref is None:
            ref = outs
            Oracle.ref = {tuple(p): r for p, r in zip(prompts, ref)}
        st = llm.llm_engine.stats
        rec = dict(part="batch1", shape="tiny" if smoke else "llama-3.1-8b", spec=spec, output_tok_s=round(toks / t_all, 2),
                   identical=outs == ref, acceptance_rate=round(st.num_accepted_tokens / st.num_draft_tokens, 3)
                   if st.num_draft_tokens else None,
                   mean_acceptance_length=round(1 + st.num_accepted_tokens / st.num_drafts, 3) if st.num_drafts else None)
        rec["speedup"] = round(rec["output_tok_s"] / out[0]["output_tok_s"], 3) if out else 1.0
        out.append(rec)
        llm.shutdown()
        del llm
        _free(dev)
    return out


# ------------------------------------------------------------------------------- load
def load(tmp: str, dev: str, smoke: bool) -> list[dict]:
    import numpy as np

    from kvserve import SamplingParams

    cfg = TINY if smoke else QWEN3_06B
    path = _config_dir(tmp, "load", cfg)
    n = 16 if smoke else 128
    rng = np.random.default_rng(0)
    ins = rng.integers(20 if smoke else 100, 64 if smoke else 513, n)
    outs = rng.integers(16 if smoke else 64, 32 if smoke else 257, n)
    prompts = [rng.integers(3, 400, m).tolist() for m in ins]
    sps = [SamplingParams(temperature=0, max_tokens=int(o), ignore_eos=True) for o in outs]
    from kvserve.spec_decode import register_proposer

    Oracle = _make_oracle()
    register_proposer("oracle", Oracle)
    Oracle.alpha = 0.7
    common = dict(max_model_len=1024, max_num_seqs=n, kv_cache_memory="64MiB" if smoke else None,
                  gpu_memory_utilization=0.85)
    res = []
    for name, spec in [("none", None),
                       ("oracle_a0.7_k4_static", {"method": "oracle", "num_speculative_tokens": 4, "dynamic": False}),
                       ("oracle_a0.7_k4_dynamic", {"method": "oracle", "num_speculative_tokens": 4, "dynamic": True,
                                                   "dynamic_max_batch": 4 if smoke else 32})]:
        Oracle.rng = random.Random(0)
        llm = _llm(path, dev, speculative_config=spec, **{k: v for k, v in common.items() if v is not None})
        llm.generate([prompts[0]], SamplingParams(max_tokens=4), use_tqdm=False)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = llm.generate(prompts, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(x.outputs[0].token_ids) for x in o)
        if spec is None:
            Oracle.ref = {tuple(p): x.outputs[0].token_ids for p, x in zip(prompts, o)}
        st = llm.llm_engine.stats
        res.append(dict(part="load", shape="tiny" if smoke else "qwen3-0.6b", name=name, requests=n,
                        output_tok_s=round(toks / dt, 1), elapsed_s=round(dt, 2),
                        acceptance_rate=round(st.num_accepted_tokens / st.num_draft_tokens, 3)
                        if st.num_draft_tokens else None, num_draft_tokens=st.num_draft_tokens))
        llm.shutdown()
        del llm
        _free(dev)
    for r in res:
        r["vs_none"] = round(r["output_tok_s"] / res[0]["output_tok_s"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tmp", default="/tmp/kvserve-spec")
    ap.add_argument("--parts", default="verify,batch1,load,tree")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ns = ap.parse_args()
    dev = "cpu" if ns.cpu_smoke or not torch.cuda.is_available() else "cuda"
    os.makedirs(ns.out, exist_ok=True)
    os.makedirs(ns.tmp, exist_ok=True)
    records = []
    path = os.path.join(ns.out, "spec_bench.json")
    for part in ns.parts.split(","):
        fn = {"verify": verify_cost, "batch1": batch1, "load": load, "draft": draft, "tree": tree_cost}[part]
        t0 = time.perf_counter()
        try:
            records += fn(ns.tmp, dev, ns.cpu_smoke)
        except Exception as exc:  # keep the later parts
            import traceback

            traceback.print_exc()
            records.append(dict(part=part, error=repr(exc)))
        print(f"[{part}] {time.perf_counter() - t0:.1f} s", flush=True)
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                       "torch": torch.__version__, "records": records}, f, indent=1)
    print("\n| part | config | figure |\n|---|---|---|")
    for r in records:
        if r.get("part") in ("draft_cost", "draft_engine", "draft_tree_cost", "draft_tree_engine") and "error" not in r:
            from draft_graph_cost import table

            print(table([r])[0])
        elif "error" in r:
            print(f"| {r['part']} | error | {r['error'][:80]} |")
        elif r["part"] == "verify":
            print(f"| verify {r['shape']} | b={r['batch']} k={r['k']} | {r['ms_per_step']} ms ({r['cost_vs_decode']}x) |")
        elif r["part"] == "tree":
            print(f"| tree {r['shape']} | b={r['batch']} {r['kind']} n={r['nodes']} depth={r['max_depth']} | "
                  f"{r['ms_per_step']} ms ({r['cost_vs_chain_k4']}x chain k=4) |")
        elif r["part"] == "batch1":
            s = r["spec"]
            name = "none" if s is None else f"{s['method']} k={s['num_speculative_tokens']}" + (
                f" alpha={s['alpha']}" if "alpha" in s else "")
            print(f"| batch1 {r['shape']} | {name} | {r['output_tok_s']} tok/s x{r['speedup']} acc={r['acceptance_rate']} "
                  f"len={r['mean_acceptance_length']} same={r['identical']} |")
        else:
            print(f"| load {r['shape']} | {r['name']} | {r['output_tok_s']} tok/s ({r['vs_none']}x) acc={r['acceptance_rate']} |")


if __name__ == "__main__":
    main()
