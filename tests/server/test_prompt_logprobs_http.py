"""`prompt_logprobs` in /v1/completions (vLLM's extra field) on the live server."""

from __future__ import annotations

import math


def test_prompt_logprobs_completion(http, tokenizer):
    prompt = "def add(a, b):\n    return a + b\n"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    ids = tokenizer(prompt)["input_ids"]
    pl = ch["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for tid, e in zip(ids[1:], pl[1:]):
        assert str(tid) in e and len(e) <= 3  # the prompt token + top 2
        assert e[str(tid)]["logprob"] <= 0 and e[str(tid)]["rank"] >= 1
        ranks = sorted(v["rank"] for k, v in e.items() if k != str(tid))
        assert ranks[:2] == [1, 2] or e[str(tid)]["rank"] <= 2
    ppl = math.exp(-sum(e[str(t)]["logprob"] for t, e in zip(ids[1:], pl[1:])) / (len(ids) - 1))
    assert 1.0 < ppl < 50.0  # real code under a real model
    # Bad values are a 400 naming the parameter; streaming is refused.
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]
