"""The HTTP side of KV transfer without an engine: ``GET /v1/kv_transfer`` (nulls without a
connector), request models accepting ``kv_transfer_params`` / ``return_token_ids`` on both
routes, and the 400s a decode or prefill leg gets before anything runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from kvserve.entrypoints.openai import protocol as P  # noqa: E402

LAYOUT = {"model": "m", "fingerprint": "f", "num_layers": 2, "block_size": 16, "kv_cache_dtype": "float32",
          "dtype": "float32", "tp_size": 1, "groups": [{"kind": "FullAttentionSpec", "page_bytes": 4096}]}


class FakeEngine:
    tokenizer = None
    max_model_len = 128
    vocab_size = 100
    engine_args = SimpleNamespace(max_num_seqs=4)

    def __init__(self, info=None):
        self.kv_transfer_info = info

    def check_alive(self):
        pass

    def num_unfinished(self):
        return 0


def _client(info):
    from fastapi.testclient import TestClient

    from kvserve.entrypoints.openai.api_server import build_app

    return TestClient(build_app(FakeEngine(info), ["m"], allowed_hosts=["*"]))


def test_kv_transfer_route():
    assert _client(None).get("/v1/kv_transfer").json() == \
        {"kv_role": None, "engine_id": None, "kv_connector": None, "kv_transport": None, "kv_layout": None}
    info = {"kv_role": "kv_consumer", "engine_id": "e1", "kv_connector": "P2PKVConnector", "kv_transport": "nixl",
            "kv_layout": LAYOUT}
    assert _client(info).get("/v1/kv_transfer").json() == info


def test_request_models_carry_the_params():
    ktp = {"do_remote_decode": True}
    c = P.CompletionRequest(prompt="hi", kv_transfer_params=ktp, return_token_ids=True)
    assert c.to_sampling_params(4).extra_args == {"kv_transfer_params": ktp}
    ch = P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], kv_transfer_params=ktp,
                                 return_token_ids=True)
    assert ch.to_sampling_params(4).extra_args == {"kv_transfer_params": ktp} and ch.return_token_ids
    assert P.CompletionRequest(prompt="hi").to_sampling_params(4).extra_args is None


def test_legs_refused_before_running():
    consumer = _client({"kv_role": "kv_consumer", "engine_id": "e1", "kv_connector": "P2PKVConnector",
                        "kv_layout": LAYOUT})
    bad = dict(LAYOUT, block_size=32, kv_cache_dtype="int4")
    ktp = {"do_remote_prefill": True, "kv_layout": bad}
    for path, body in (("/v1/completions", {"prompt": [1, 2, 3]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = consumer.post(path, json=dict(body, kv_transfer_params=ktp))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "block_size" in err["message"] and "kv_cache_dtype" in err["message"]
        assert err["param"] == "kv_transfer_params"
    # A prefill leg on a consumer-only server, a decode leg on a plain one: named 400s.
    r = consumer.post("/v1/completions", json={"prompt": [1], "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "kv_producer" in r.json()["error"]["message"]
    r = _client(None).post("/v1/completions", json={"prompt": [1], "kv_transfer_params": ktp})
    assert r.status_code == 400 and "kv_consumer" in r.json()["error"]["message"]
    r = consumer.post("/v1/completions", json={"prompt": [1], "n": 2, "kv_transfer_params": ktp})
    assert r.status_code == 400
