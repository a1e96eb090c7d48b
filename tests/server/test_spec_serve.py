"""``kvserve serve --speculative-config`` (n-gram, a tiny dummy Llama, no tokenizer): the
completion equals the offline engine without speculation, and /metrics exposes the
spec_decode counters. The server is the session's shared small server (``tiny_server``,
tests/server/conftest.py: float32, n-gram speculation of 3 tokens)."""

from __future__ import annotations

import re

import pytest


def test_serve_with_ngram_speculation(tiny_server):
    pytest.importorskip("fastapi")
    import httpx

    from kvserve import LLM, SamplingParams

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    ref = LLM(model=tiny_server.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              kv_cache_memory="32MiB", disable_log_stats=True).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body).json()
        assert r["choices"][0]["token_ids"] == ref.outputs[0].token_ids
        text = c.get("/metrics").text
    vals = {m: float(v) for m, v in re.findall(r'^kvserve:(spec_decode_\w+)_total\{model_name="tiny"\} (\S+)$',
                                                text, re.M)}
    assert vals["spec_decode_num_draft_tokens"] > 0, text[-2000:]
    assert vals["spec_decode_num_drafts"] > 0
    assert 0 <= vals["spec_decode_num_accepted_tokens"] <= vals["spec_decode_num_draft_tokens"]
