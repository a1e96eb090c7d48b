"""Structured outputs and tool calls over HTTP with the official ``openai`` SDK, on the live
server (real default model). Every constrained output must parse and validate."""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
                                       "required": ["tz"]}}}
MSG = [{"role": "user", "content": "Describe a person as JSON."}]


def _reassemble(stream) -> tuple[str, dict[int, dict], list]:
    content, calls, finishes = "", {}, []
    for ch in stream:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                cur = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                cur["id"] = tc.id or cur["id"]
                if tc.function is not None:
                    cur["name"] += tc.function.name or ""
                    cur["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return content, calls, finishes


def test_json_schema_many_seeds(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=MSG, temperature=1.0, seed=seed, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_schema_streaming_and_n2(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MSG, temperature=1.0, seed=7, max_tokens=80, n=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    texts: dict[int, str] = {}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1]
    for t in texts.values():
        jsonschema.validate(json.loads(t), PERSON)


def test_json_object_and_completions_extras(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG, temperature=0.7, seed=3,
                                       max_tokens=60, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Phone:", max_tokens=20, temperature=1.0,
                                  seed=1, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    import re
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].text)
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=1.0, seed=2, max_tokens=10,
                                       messages=[{"role": "user", "content": "Pick a colour."}],
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs"),
    ({"guided_regex": "(abc"}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "structured_outputs"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto without --enable-auto-tool-choice
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"audio": {"voice": "x"}}, "audio"),
])
def test_bad_requests_400(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_named_tool_call_stream_and_not(client):
    kw = dict(model="SmolLM2-135M-Instruct", tools=[WEATHER, TIME], temperature=1.0, max_tokens=60,
              messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for seed in range(3):
        r = client.chat.completions.create(seed=seed, **kw)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    _, calls, finishes = _reassemble(client.chat.completions.create(seed=0, stream=True, **kw))
    ref = client.chat.completions.create(seed=0, **kw).choices[0].message.tool_calls[0]
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert calls[0]["arguments"] == ref.function.arguments and calls[0]["id"]
    assert finishes == ["stop"]


def test_required_tool_calls(client):
    kw = dict(model="SmolLM2-135M-Instruct", tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
              max_tokens=120, messages=[{"role": "user", "content": "Weather in Oslo, and the time in UTC?"}])
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        r = client.chat.completions.create(seed=seed, **kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    ref = client.chat.completions.create(seed=1, **kw).choices[0].message.tool_calls
    _, calls, finishes = _reassemble(client.chat.completions.create(seed=1, stream=True, **kw))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(t.function.name, t.function.arguments) for t in ref]
    assert finishes == ["tool_calls"]


def test_tool_choice_none_and_agent_loop_messages(client):
    msgs = [{"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls in (None, [])
    assert isinstance(r.choices[0].message.content, str)


def test_models_retrieve(client):
    m = client.models.retrieve("SmolLM2-135M-Instruct")
    assert m.id == "SmolLM2-135M-Instruct"
    import openai
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_busy_port_fails_fast(server, tmp_path):
    import subprocess
    import sys
    import time

    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(server.port)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert f"cannot listen on 127.0.0.1:{server.port}" in p.stderr + p.stdout
    assert "KV cache" not in p.stderr + p.stdout  # failed before loading the model
    assert time.monotonic() - t < 60
