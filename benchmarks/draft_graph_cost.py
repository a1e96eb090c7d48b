"""Cost of an EAGLE-style proposer's draft steps, eager vs CUDA graphs (``draft_graphs.py``).

Used by ``gpu_spec.py --parts draft`` (EAGLE-3 on a SmolLM2-135M-shaped target) and
``gpu_mla.py --parts mtp-graphs`` (DeepSeek MTP on the V3-shaped small config). Dummy
weights accept (almost) nothing, so only the cost side is measured:

- ``draft``: one proposer call's ``k`` draft steps at batch ``b`` (one new pair per request,
  ``--ctx`` pairs of head context), eager (``_draft_eager``) vs the captured graph
  (``DraftGraphRunner.run``): ms per call and per draft step (host included, as the engine pays);
- ``engine``: ms per output token of ``b`` concurrent greedy requests in the engine (target
  decode / verify graphed in both) with the draft graphs off vs on.

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


def _rows(proposer, b: int, ctx: int):
    """``b`` synthetic head states of ``ctx`` pairs each (blocks from the head's pool)."""
    from kvserve.spec_decode.eagle import _EagleState

    rows = []
    for i in range(b):
        st = _EagleState()
        st.base, st.n = 1, ctx - 1  # not at position 0 (MTP's first pair drafts eagerly)
        if not proposer._ensure_blocks(st, ctx + 8):
            raise RuntimeError("head KV pool too small for the benchmark rows")
        rows.append((i, st, None, ctx - 1, ctx))
    return rows


def draft_cost(proposer, dev: str, batches, ks, ctx: int, iters: int) -> list[dict]:
    """Per (batch, k): ms of a proposer call's draft steps eager and graphed."""
    out = []
    g = proposer.draft_graphs
    for b in batches:
        rows = _rows(proposer, b, ctx)
        ids = np.random.randint(3, 200, size=b).astype(np.int64)  # in every vocabulary here
        pos = np.full(b, ctx - 1, dtype=np.int64)
        hid = torch.randn(b, proposer.feature_size, device=proposer.device, dtype=proposer.head.dtype) * 0.1
        qlens, seq = [1] * b, [ctx] * b
        for k in ks:
            rec = dict(part="draft_cost", batch=b, k=k, ctx=ctx)
            for name, fn in (("eager", lambda: proposer._draft_eager(rows, ids, pos, hid, qlens, seq, k)),
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


def engine_cost(llm, dev: str, batches, ks, prompt_len: int, max_tokens: int) -> list[dict]:
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
                out.append(dict(part="draft_engine", batch=b, k=k, draft=mode, decode_tokens=max_tokens,
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


def table(recs: list[dict]) -> list[str]:
    """Markdown rows for the figures of ``measure``."""
    lines = []
    for r in recs:
        if r.get("part") == "draft_cost":
            lines.append(f"| {r['model']} draft b={r['batch']} k={r['k']} | eager {r['eager_ms']} ms, graph "
                         f"{r.get('graph_ms')} ms ({r.get('speedup')}x); per step {r['eager_ms_per_step']} / "
                         f"{r.get('graph_ms_per_step')} ms |")
        elif r.get("part") == "draft_engine":
            lines.append(f"| {r['model']} engine b={r['batch']} k={r['k']} drafts {r['draft']} | "
                         f"{r['ms_per_token']} ms/token (accepted {r['accepted_tokens']}/{r['draft_tokens']}) |")
    return lines
