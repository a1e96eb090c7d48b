"""GPU: DeepSeek multi-token prediction (``deepseek_mtp``) on a DeepSeek-V3-shaped small config, the
cost side (dummy weights accept nothing): batch-1 ms/token with and without MTP (``mtp``) and the
MTP layer's draft steps eager vs CUDA graphs (``mtp_graphs``). Run through ``gpu_mla.py --parts
mtp,mtp-graphs`` (run.sh part ``mla-mtp``); the configs and helpers are ``gpu_mla``'s.
"""

from __future__ import annotations

import os
import time
from typing import Iterator

from gpu_mla import TINY_MTP, V3_MTP, _config_dir


def mtp(tmp: str, device: str, smoke: bool, ks: list[int], num_layers: int, deadline: float) -> Iterator[dict]:
    """Batch-1 decode without speculation and with ``deepseek_mtp`` k in ``ks`` (one engine
    at a time in this process, each shut down before the next); stops starting engines past
    ``deadline`` seconds. Yields a record per engine as soon as it is measured."""
    import gc

    import torch

    from kvserve import LLM, SamplingParams

    t_start = time.perf_counter()
    cfg = TINY_MTP if smoke else dict(V3_MTP, num_hidden_layers=num_layers)
    path = _config_dir(os.path.join(tmp, "v3-mtp" if not smoke else "tiny-mtp"), cfg)
    n = 128 if not smoke else 8
    prompt = list(range(10, 138)) if not smoke else list(range(10, 30))
    base_ms = None
    for k in [0] + [k for k in ks if k > 0]:
        if time.perf_counter() - t_start > deadline:
            yield dict(part="mtp", k=k, error=f"skipped: past the {deadline:.0f} s deadline")
            continue
        spec = None if k == 0 else {"method": "deepseek_mtp", "num_speculative_tokens": k, "dynamic": False}
        kw = dict(model=path, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32",
                  skip_tokenizer_init=True, device=device, max_model_len=1024 if not smoke else 128, max_num_seqs=4,
                  disable_log_stats=True, speculative_config=spec)
        if smoke:
            kw.update(kv_cache_memory="8MiB", cpu_threads=1)
        else:
            kw.update(max_model_len=512, max_num_batched_tokens=512)  # fewer piecewise CUDA graphs to capture
        rec = dict(part="mtp", shape="DeepSeek-V3-shaped small" if not smoke else "tiny", k=k,
                   num_hidden_layers=cfg["num_hidden_layers"], mtp_layers=1)
        t0 = time.perf_counter()
        try:
            llm = LLM(**kw)
        except Exception as e:
            yield dict(rec, error=repr(e)[:400])
            continue
        rec["load_s"] = round(time.perf_counter() - t0, 1)
        proposer = llm.llm_engine.engine_core.model_runner.proposer
        prop_s = []
        if proposer is not None:
            orig = proposer.propose

            def timed(requests, batch, orig=orig):
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                r = orig(requests, batch)
                if device == "cuda":
                    torch.cuda.synchronize()
                prop_s.append(time.perf_counter() - t)
                return r

            proposer.propose = timed
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        prop_s.clear()
        st0 = llm.llm_engine.stats
        d0, a0, s0 = st0.num_draft_tokens, st0.num_accepted_tokens, st0.num_drafts
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        m = o.metrics
        ttft = (m.first_token_time - m.arrival_time) if getattr(m, "first_token_time", None) else 0.0
        st = llm.llm_engine.stats
        drafts, accepted, steps = st.num_draft_tokens - d0, st.num_accepted_tokens - a0, st.num_drafts - s0
        ms_tok = (wall - ttft) * 1e3 / max(n - 1, 1)
        rec.update(batch1_ms_per_token=round(ms_tok, 3), decode_tokens=n, draft_tokens=drafts,
                   accepted_tokens=accepted, acceptance_rate=round(accepted / drafts, 3) if drafts else None,
                   mean_tokens_per_step=round(1 + accepted / steps, 3) if steps else 1.0)
        if prop_s:
            rec["propose_ms_mean"] = round(1e3 * sum(prop_s) / len(prop_s), 3)
        if steps:
            rec["ms_per_step"] = round((wall - ttft) * 1e3 / steps, 3)
        if k == 0:
            base_ms = ms_tok
        elif base_ms:
            step_ms = rec.get("ms_per_step", ms_tok)
            rec["break_even_tokens_per_step"] = round(step_ms / base_ms, 3)  # step cost / plain decode step
        llm.shutdown()
        del llm, proposer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        yield rec  # after the engine is gone: the next one starts from free memory


def mtp_graphs(tmp: str, device: str, smoke: bool, num_layers: int) -> list[dict]:
    """``deepseek_mtp`` k = 4 (2 in the smoke run): draft steps eager vs graphed, engine
    ms/token with the draft graphs off vs on (``draft_graph_cost.measure``)."""
    import gc

    import torch

    from draft_graph_cost import measure
    from kvserve import LLM

    cfg = TINY_MTP if smoke else dict(V3_MTP, num_hidden_layers=num_layers)
    path = _config_dir(os.path.join(tmp, "v3-mtp" if not smoke else "tiny-mtp"), cfg)
    kw = dict(model=path, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32",
              skip_tokenizer_init=True, device=device, max_model_len=1024, max_num_seqs=16,
              max_num_batched_tokens=1024, disable_log_stats=True,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2 if smoke else 4,
                                  "dynamic": False})
    if smoke:
        kw.update(kv_cache_memory="16MiB", cpu_threads=1)
    llm = LLM(**kw)
    try:
        return measure(llm, device, smoke, "mtp " + ("tiny" if smoke else f"V3-shaped {num_layers} layers"))
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
