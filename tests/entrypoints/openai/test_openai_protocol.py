"""Protocol conversion without a model: request -> SamplingParams, logprobs formats, errors."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("pydantic")

from kvserve.entrypoints.openai import protocol as P  # noqa: E402


class FakeTok:
    """Token id i decodes to a fixed string."""

    words = {0: "A", 1: " b", 2: "cc", 3: "é"}

    def decode(self, ids, **kw):
        return "".join(self.words[i] for i in ids)


def test_completion_request_to_sampling_params():
    req = P.CompletionRequest(prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, n=2,
                              stop="x", seed=3, logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
                              repetition_penalty=1.1, ignore_eos=True, min_tokens=1)
    sp = req.to_sampling_params(default_max_tokens=16)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.n) == (7, 0.5, 0.9, 5, 0.1, 2)
    assert sp.stop == ["x"] and sp.seed == 3 and sp.logprobs == 2 and sp.ignore_eos and sp.min_tokens == 1
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.1)


def test_defaults_follow_openai():
    sp = P.CompletionRequest(prompt="hi").to_sampling_params(16)
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.max_tokens == 16 and sp.logprobs is None
    assert sp.n == 1 and sp.top_k == 0


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"), ({"temperature": 3}, "temperature"), ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"), ({"presence_penalty": 5}, "presence_penalty"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"), ({"best_of": 3}, "best_of"),
])
def test_invalid_values_name_their_param(kw, param):
    req = P.CompletionRequest(prompt="hi", **kw)
    with pytest.raises(ValueError) as ei:
        req.to_sampling_params(16)
    assert P.param_of(str(ei.value)) == param


def test_prompt_forms():
    assert P.CompletionRequest(prompt="a").prompts() == ["a"]
    assert P.CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert P.CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert P.CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(ValueError):
        P.CompletionRequest(prompt=[]).prompts()


def test_chat_request_tokens_and_logprobs():
    msgs = [{"role": "user", "content": "hi"}]
    sp = P.ChatCompletionRequest(messages=msgs, max_tokens=9, max_completion_tokens=4).to_sampling_params(100)
    assert sp.max_tokens == 4
    assert P.ChatCompletionRequest(messages=msgs).to_sampling_params(100).max_tokens == 100
    sp = P.ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=3).to_sampling_params(5)
    assert sp.logprobs == 3
    assert P.ChatCompletionRequest(messages=msgs, logprobs=True).to_sampling_params(5).logprobs == 0
    assert P.ChatCompletionRequest(messages=msgs).to_sampling_params(5).logprobs is None
    with pytest.raises(ValueError):
        P.ChatCompletionRequest(messages=msgs, top_logprobs=2).to_sampling_params(5)


def test_chat_message_content_parts():
    m = P.ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert m.to_template_dict() == {"role": "user", "content": "a\nb"}
    with pytest.raises(ValueError):
        P.ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}]).to_template_dict()


def test_completion_logprobs_format():
    lps = [{0: (-0.1, 1), 1: (-2.5, 2)}, {2: (-1.0, 1), 1: (-3.0, 3), 0: (-1.5, 2)}]
    out = P.completion_logprobs(FakeTok(), [0, 1], lps, text_offset_start=4)
    assert out["tokens"] == ["A", " b"]
    assert out["token_logprobs"] == [-0.1, -3.0]
    assert out["top_logprobs"][0] == {"A": -0.1, " b": -2.5}
    assert list(out["top_logprobs"][1]) == ["cc", "A", " b"]  # rank order, sampled one included
    assert out["text_offset"] == [4, 5]


def test_chat_logprobs_format():
    lps = [{3: (-0.2, 1), 0: (-1.7, 2), 2: (-float("inf"), 3)}]
    out = P.chat_logprobs(FakeTok(), [3], lps, top_n=2)
    e = out["content"][0]
    assert e["token"] == "é" and e["bytes"] == list("é".encode()) and e["logprob"] == -0.2
    assert [t["token"] for t in e["top_logprobs"]] == ["é", "A"]
    out = P.chat_logprobs(FakeTok(), [2], [{2: (-float("inf"), 5), 0: (-0.1, 1)}], top_n=1)
    assert out["content"][0]["logprob"] == -9999.0 and math.isfinite(out["content"][0]["logprob"])


def test_usage_and_error_bodies():
    assert P.usage(3, 4, 1) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                "prompt_tokens_details": {"cached_tokens": 1}}
    body = P.error_body("bad", "invalid_request_error", "top_p", 400)
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": 400}}


def test_ipc_roundtrip():
    pytest.importorskip("msgspec")
    from kvserve.engine import ipc
    from kvserve.sampling_params import SamplingParams

    sp = SamplingParams(n=1, temperature=0.3, stop=["x"], logprobs=2, seed=5)
    sp.all_stop_token_ids = {7, 9}
    msg = ipc.AddRequest("r1", [1, 2], ipc.params_to_dict(sp), 1.5, 2, 7)
    back = ipc.input_decoder().decode(ipc.input_encoder().encode(msg))
    assert back == msg
    sp2 = ipc.params_from_dict(back.sampling_params)
    assert sp2 == sp and sp2.all_stop_token_ids == {7, 9}
    out = ipc.StepOutputs([ipc.EngineCoreOutput("r1", [5], [{5: (-0.5, 1), 6: (-1.0, 2)}], "stop", 7, 3)],
                          ipc.SchedulerStatsMsg(1, 0, 0.5, 0, 10, 3), 4, 1, 2.0)
    back = ipc.output_decoder().decode(ipc.input_encoder().encode(out))
    assert back.outputs[0].new_logprobs == [{5: (-0.5, 1), 6: (-1.0, 2)}]
    assert back.stats.kv_cache_usage == 0.5 and back.outputs[0].finish_reason == "stop"


def test_import_kvserve_stays_light():
    import subprocess
    import sys

    # msgspec is not here: the engine's output record (EngineCoreOutput) is a msgspec struct.
    code = ("import sys, kvserve, kvserve.entrypoints.cli, kvserve.entrypoints.openai;"
            "bad=[m for m in ('fastapi','uvicorn','zmq','prometheus_client') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
