"""Concurrency, client disconnects and metrics on the live server."""

from __future__ import annotations

import asyncio
import time

import pytest

MODEL = "SmolLM2-135M-Instruct"


def test_100_concurrent_streams(server, http, wait_idle, metric_value):
    import openai

    before = http.get("/metrics").text
    n_before = metric_value(before, "kvserve:request_success_total")

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
                                    timeout=600)

        async def one(i: int):
            stream = await client.completions.create(model=MODEL, prompt=f"Item {i}: the", max_tokens=8,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage
            return text, finish, usage

        try:
            return await asyncio.gather(*(one(i) for i in range(100)))
        finally:
            await client.close()

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert len(results) == 100
    for text, finish, usage in results:
        assert finish == "length"
        assert usage.completion_tokens == 8
    text = wait_idle(http)
    assert metric_value(text, "kvserve:request_success_total") - n_before == 100
    print(f"100 concurrent streams of 8 tokens: {elapsed:.1f} s")


def test_disconnect_mid_stream_frees_request(server, http, wait_idle, metric_value):
    aborted_before = 0.0
    try:
        aborted_before = metric_value(http.get("/metrics").text, "kvserve:request_success_total",
                                      'finished_reason="abort"')
    except KeyError:
        pass
    payload = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 900, "ignore_eos": True,
               "stream": True}
    with http.stream("POST", "/v1/completions", json=payload) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break
    # The response is closed: the engine must drop the request within a step or so.
    text = wait_idle(http, timeout=10)
    assert metric_value(text, "kvserve:request_success_total", 'finished_reason="abort"') == aborted_before + 1


def test_disconnect_non_streaming_frees_request(server, http, wait_idle):
    import httpx

    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": MODEL, "prompt": "Story:", "max_tokens": 900,
                                           "ignore_eos": True}, timeout=2.0)
    wait_idle(http, timeout=10)


def test_metrics_families_after_traffic(server, http, client, metric_value, wait_idle):
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
    text = wait_idle(http)
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"]:
        assert metric_value(text, f"kvserve:{name}_count") >= 2
        assert metric_value(text, f"kvserve:{name}_sum") >= 0
    assert metric_value(text, "kvserve:e2e_request_latency_seconds_sum") > 0
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]:
        assert metric_value(text, f"kvserve:{name}") == 0
    assert metric_value(text, "kvserve:prompt_tokens_total") > 0
    assert metric_value(text, "kvserve:generation_tokens_total") >= 8
    q = metric_value(text, "kvserve:prefix_cache_queries_total")
    h = metric_value(text, "kvserve:prefix_cache_hits_total")
    assert 0 <= h <= q and q > 0
    assert metric_value(text, "kvserve:num_preemptions_total") >= 0
    assert metric_value(text, "kvserve:request_success_total", 'finished_reason="length"') >= 2
    assert 'model_name="SmolLM2-135M-Instruct"' in text
