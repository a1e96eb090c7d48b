"""Cost of an EAGLE-style proposer's draft steps, eager vs CUDA graphs (``draft_graphs.py``).

Used by ``gpu_spec.py --parts draft`` (EAGLE-3 on a SmolLM2-135M-shaped target) and
``gpu_mla.py --parts mtp-graphs`` (DeepSeek MTP on the V3-shaped small config). Dummy
weights accept (almost) nothing, so only the cost side is measured:

- ``draft``: one proposer call's ``k`` draft steps at batch ``b`` (one new pair per request,
  ``--ctx`` pairs of head context), eager (``_draft_eager``) vs the captured graph
  (``DraftGraphRunner.run``): ms per call and per draft step (host included, as the engine pays);
- ``engine``: ms per output token of ``b`` concurrent greedy requests in the engine (target
  decode / verify graphed in both) with the draft graphs off vs on;
- ``tree`` (``measure_tree``; EAGLE-2 tree drafts, ``speculative_eagle_topk > 1``): one proposer
  call's tree draft of depth ``k`` (the candidate pool back on the host) eager
  (``_draft_tree_eager``) vs the captured tree graph (``TreeDraftGraphRunner.run``), and the
  engine's ms per token with the tree draft graphs off vs on.

One engine of ``num_speculative_tokens = max(ks)`` serves every ``k`` (the proposer drafts
``k``; the verify step replays the smallest captured ``q >= 1 + k``).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _rows(proposer, b: int, ctx: int, extra: int = 8):
    """``b`` synthetic head states of ``ctx`` pairs each (blocks from the head's pool, ``extra``
    slots past them for the drafts)."""
    from kvserve.spec_decode.eagle import _EagleState

    rows = []
    for i in range(b):
        st = _EagleState()
        st.base, st.n = 1, ctx - 1  # not at position 0 (MTP's first pair drafts eagerly)
        if not proposer._ensure_blocks(st, ctx + extra):
            raise RuntimeError("head KV pool too small for the benchmark rows")
        rows.append((i, st, None, ctx - 1, ctx))
    return rows


def draft_cost(proposer, dev: str, batches, ks, ctx: int, iters: int, tree: bool = False) -> list[dict]:
    """Per (batch, k): ms of a proposer call's draft steps (``tree``: tree draft of depth k)
    eager and graphed."""
    out = []
    g = proposer.draft_graphs
    eager_fn = proposer._draft_tree_eager if tree else proposer._draft_eager
    for b in batches:
        rows = _rows(proposer, b, ctx, extra=max(ks) * max(proposer.tree_topk, 1) + 8 if tree else 8)
        ids = np.random.randint(3, 200, size=b).astype(np.int64)  # in every vocabulary here
        pos = np.full(b, ctx - 1, dtype=np.int64)
        hid = torch.randn(b, proposer.feature_size, device=proposer.device, dtype=proposer.head.dtype) * 0.1
        qlens, seq = [1] * b, [ctx] * b
        for k in ks:
            rec = dict(part="draft_tree_cost" if tree else "draft_cost", batch=b, k=k, ctx=ctx)
            if tree:
                rec["topk"] = proposer.tree_topk
            for name, fn in (("eager", lambda: eager_fn(rows, ids, pos, hid, qlens, seq, k)),
                             ("graph", (lambda: g.run(proposer._block_tables(rows), ids, pos, hid, qlens, seq, k))
                              if g is not None and g.can_run(b, qlens, k) else None)):
                if fn is None:
                    rec[f"{name}_ms"] = None
                    continue
                fn()
                ts = []
                for _ in range(iters):
                    _sync(dev)
                    t0 = time.perf_counter()
                    fn()  # returns host drafts: synchronous
                    ts.append((time.perf_counter() - t0) * 1e3)
                rec[f"{name}_ms"] = round(statistics.median(ts), 3)
                rec[f"{name}_ms_per_step"] = round(rec[f"{name}_ms"] / k, 3)
            if rec.get("graph_ms"):
                rec["speedup"] = round(rec["eager_ms"] / rec["graph_ms"], 2)
            out.append(rec)
        for _, st, *_ in rows:
            proposer.free_blocks.extend(st.blocks)
    return out


def engine_cost(llm, dev: str, batches, ks, prompt_len: int, max_tokens: int, part: str = "draft_engine") -> list[dict]:
    """Per (batch, k, draft graphs off/on): ms per output token of ``batch`` greedy requests."""
    from kvserve import SamplingParams

    proposer = llm.llm_engine.engine_core.model_runner.proposer
    graphs = proposer.draft_graphs
    k_cfg = proposer.num_speculative_tokens
    out = []
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for b in batches:
        prompts = [list(range(10 + i, 10 + i + prompt_len)) for i in range(b)]
        for k in ks:
            for mode in ("eager", "graph"):
                if mode == "graph" and graphs is None:
                    continue
                proposer.draft_graphs = graphs if mode == "graph" else None
                proposer.num_speculative_tokens = k
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
                st = llm.llm_engine.stats
                d0, a0, s0 = st.num_draft_tokens, st.num_accepted_tokens, st.num_drafts
                _sync(dev)
                t0 = time.perf_counter()
                res = llm.generate(prompts, sp, use_tqdm=False)
                _sync(dev)
                wall = time.perf_counter() - t0
                ttft = max((r.metrics.first_token_time - r.metrics.arrival_time)
                           if getattr(r.metrics, "first_token_time", None) else 0.0 for r in res)
                st = llm.llm_engine.stats
                out.append(dict(part=part, batch=b, k=k, draft=mode, decode_tokens=max_tokens,
                                ms_per_token=round((wall - ttft) * 1e3 / max(max_tokens - 1, 1), 3),
                                drafts=st.num_drafts - s0, draft_tokens=st.num_draft_tokens - d0,
                                accepted_tokens=st.num_accepted_tokens - a0))
    proposer.draft_graphs, proposer.num_speculative_tokens = graphs, k_cfg
    return out


def measure(llm, dev: str, smoke: bool, label: str) -> list[dict]:
    """Both figures for an engine built with an EAGLE-style proposer (graphs captured on CUDA;
    on the CPU smoke run the eager stand-in graphs are built here)."""
    proposer = llm.llm_engine.engine_core.model_runner.proposer
    if proposer.draft_graphs is None and dev != "cuda":
        proposer.capture_cuda_graphs(eager=True)
    batches = (1, 4) if smoke else (1, 16)
    ks = (1, 2) if smoke else (1, 2, 3, 4)
    with torch.inference_mode():  # as the engine's propose
        recs = draft_cost(proposer, dev, batches, ks, ctx=32 if smoke else 512, iters=3 if smoke else 20)
    recs += engine_cost(llm, dev, batches, ks, prompt_len=16 if smoke else 128, max_tokens=8 if smoke else 48)
    for r in recs:
        r["model"] = label
    return recs


def measure_tree(llm, dev: str, smoke: bool, label: str) -> list[dict]:
    """``measure`` for an engine drafting EAGLE-2 trees: the tree draft eager vs graphed per
    (batch, depth) and the engine's ms per token at the configured depth, graphs off vs on."""
    proposer = llm.llm_engine.engine_core.model_runner.proposer
    if proposer.draft_graphs is None and dev != "cuda":
        proposer.capture_cuda_graphs(eager=True)
    batches = (1, 4) if smoke else (1, 16)
    depth = proposer.num_speculative_tokens
    ks = sorted({2, depth})
    with torch.inference_mode():
        recs = draft_cost(proposer, dev, batches, ks, ctx=32 if smoke else 512, iters=3 if smoke else 20, tree=True)
    recs += engine_cost(llm, dev, batches, (depth,), prompt_len=16 if smoke else 128, max_tokens=8 if smoke else 48,
                        part="draft_tree_engine")
    for r in recs:
        r["model"], r["topk"] = label, proposer.tree_topk
    return recs


def table(recs: list[dict]) -> list[str]:
    """Markdown rows for the figures of ``measure``."""
    lines = []
    for r in recs:
        if r.get("part") in ("draft_cost", "draft_tree_cost"):
            kind = f"tree topk={r['topk']} depth" if "topk" in r else "draft"
            lines.append(f"| {r['model']} {kind} b={r['batch']} k={r['k']} | eager {r['eager_ms']} ms, graph "
                         f"{r.get('graph_ms')} ms ({r.get('speedup')}x); per step {r['eager_ms_per_step']} / "
                         f"{r.get('graph_ms_per_step')} ms |")
        elif r.get("part") in ("draft_engine", "draft_tree_engine"):
            kind = f"engine tree topk={r['topk']}" if "topk" in r else "engine"
            lines.append(f"| {r['model']} {kind} b={r['batch']} k={r['k']} drafts {r['draft']} | "
                         f"{r['ms_per_token']} ms/token (accepted {r['accepted_tokens']}/{r['draft_tokens']}) |")
    return lines
