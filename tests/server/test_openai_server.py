"""The live server driven by the official ``openai`` client (real default model, CPU)."""

from __future__ import annotations

import json

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_health_version(server, http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 1024
    assert http.get("/health").status_code == 200
    assert "version" in http.get("/version").json()


def test_completion_basic_and_usage(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_basic_and_usage(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens <= 8
    # max_completion_tokens wins over max_tokens
    r2 = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, max_completion_tokens=3,
                                        temperature=0)
    assert r2.usage.completion_tokens <= 3


def test_prompt_forms(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "One, two,"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 6
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == 4
    r = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5


def test_stream_equals_non_stream_completion(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_stream_equals_non_stream_chat(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n2_with_logprobs_completion(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, logprobs=3, seed=1,
                                  temperature=1.0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert "".join(lp.tokens).startswith(c.text) or c.text == "".join(lp.tokens)
        assert lp.text_offset[0] == 0
        for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert v <= 0 and len(top) >= 3 and tok in top


def test_n2_with_logprobs_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, logprobs=True,
                                       top_logprobs=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert content
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert len(text) > 3
    stop = text[2:4]
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.find(stop)]
    chunks = list(client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    # n=3 with a seed: the completions use seeds 1, 2, 3 and differ
    others = {c.text for c in client.completions.create(seed=1, n=3, **kw).choices}
    assert len(others | {a}) > 1


def test_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT)


def test_tokenize_detokenize(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"].endswith("Hello world")


# ----------------------------------------------------------------------------- errors

def _err(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("payload,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": 12}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": [10 ** 9]}, None),
])
def test_bad_completion_params_400(http, payload, param):
    e = _err(http.post("/v1/completions", json=payload), 400)
    assert e["code"] == 400
    if param:
        assert e["param"] == param


def test_bad_chat_params_400(http):
    _err(http.post("/v1/chat/completions", json={"messages": []}), 400)
    _err(http.post("/v1/chat/completions", json={"messages": "hi"}), 400)
    _err(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "top_p": 0}), 400)
    _err(http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)


def test_too_long_prompt_400_with_counts(http):
    e = _err(http.post("/v1/completions", json={"prompt": [5] * 1100, "max_tokens": 4}), 400)
    assert "1024" in e["message"] and "1100" in e["message"]
    e = _err(http.post("/v1/completions", json={"prompt": [5] * 1000, "max_tokens": 100}), 400)
    assert "1024" in e["message"] and "1100" in e["message"] and e["param"] == "max_tokens"
    e = _err(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 1100}]}), 400)
    assert "1024" in e["message"]


def test_unknown_model_404(client, http):
    _err(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)


def test_api_key(server):
    import httpx

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        e = _err(httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                            headers=headers), 401)
        assert e["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # /health and /metrics need no key
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_still_serving_after_errors(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_stream_sse_format(http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        json.loads(line[6:])


def test_cache_salt_isolates_prefix_cache(client):
    # A prompt of several full blocks; the repeat with the same salt hits, another salt does not.
    prompt = "kvserve cache salt probe. " * 12

    def cached(salt):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 16
    assert cached("tenant-b") == 0


def test_return_token_ids(http, tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert "token_ids" not in plain  # only when asked (the server has a tokenizer)
    full = http.post("/v1/completions", json=dict(body, return_token_ids=True)).json()["choices"][0]
    assert len(full["token_ids"]) == 6 and tokenizer.decode(full["token_ids"]) == full["text"]
    assert full["prompt_token_ids"] == tokenizer.encode(PROMPT)
    with http.stream("POST", "/v1/completions",
                     json=dict(body, return_token_ids=True, stream=True)) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert ids == full["token_ids"]
