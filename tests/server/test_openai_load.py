"""Concurrency, client disconnects and metrics on the live server."""

from __future__ import annotations

import time

import pytest

from tests.utils import load_benchmark

MODEL = "SmolLM2-135M-Instruct"


N_STREAMS = 16  # benchmarks/load/concurrent_streams.py: 100


def test_concurrent_streams(server, http, wait_idle, metric_value):
    before = http.get("/metrics").text
    n_before = metric_value(before, "kvserve:request_success_total")
    t0 = time.monotonic()
    results = load_benchmark("concurrent_streams").run(server.url, server.api_key, streams=N_STREAMS, max_tokens=8,
                                                       model=MODEL)
    elapsed = time.monotonic() - t0
    assert len(results) == N_STREAMS
    for text, finish, usage in results:
        assert finish == "length"
        assert usage.completion_tokens == 8
    text = wait_idle(http)
    assert metric_value(text, "kvserve:request_success_total") - n_before == N_STREAMS
    print(f"{N_STREAMS} concurrent streams of 8 tokens: {elapsed:.1f} s")


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
