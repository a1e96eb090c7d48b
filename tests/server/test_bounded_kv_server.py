"""``kvserve serve --attention-sinks 4 --max-attention-window 32`` (a tiny dummy Llama): completions
run past --max-model-len up to max_tokens, the per-request extension fields are honoured or
refused with 400, and the eviction counters reach /metrics."""

from __future__ import annotations

import pytest

from tests.utils import tiny_dummy_server


@pytest.fixture(scope="module")
def bounded_server(remote_server, tmp_path_factory):
    yield from tiny_dummy_server(remote_server, tmp_path_factory, "tiny-llama-bounded",
                                 ["--max-model-len", "64", "--kv-cache-memory", "8MiB", "--block-size", "16",
                                  "--attention-sinks", "4", "--max-attention-window", "32"])


def test_past_max_model_len_and_per_request_fields(bounded_server):
    import httpx

    with httpx.Client(base_url=bounded_server.url, timeout=120) as c:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 150, "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 150  # 154 tokens > max_model_len 64
        r = c.post("/v1/completions", json=dict(body, attention_sinks=0, max_attention_window=16, max_tokens=20))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        r = c.post("/v1/completions", json=dict(body, max_attention_window=33))
        assert r.status_code == 400 and "max_attention_window" in r.text
        assert c.post("/v1/completions", json=dict(body, attention_window=8)).status_code == 400  # unknown field
        assert c.post("/v1/completions", json=dict(body, prompt=list(range(3, 70)))).status_code == 400
        metrics = c.get("/metrics").text
    evicted = [ln for ln in metrics.splitlines() if ln.startswith("kvserve:kv_evicted_blocks_total")]
    assert evicted and float(evicted[0].rsplit(" ", 1)[1]) > 0
