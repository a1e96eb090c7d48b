"""Disaggregated prefill/decode over HTTP: two ``kvserve serve`` processes (the real default
model), a producer and a consumer. Prefill via HTTP (``max_tokens: 1``,
``kv_transfer_params: {"do_remote_decode": true}``), decode via HTTP streaming with the
returned params; the output equals a plain run's. Also ``GET /v1/kv_transfer``, the 400 on a
mismatched ``kv_layout``, ``return_token_ids`` (streamed and not) and the transfer metrics.
Both transports: ``tcp`` and ``nixl`` (NIXL READs between the two server processes; skipped
where NIXL does not import).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")


PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


def _ktc(role: str, transport: str) -> str:
    return json.dumps({"kv_connector": "P2PKVConnector", "kv_role": role,
                       "kv_connector_extra_config": {"kv_host": "127.0.0.1", "kv_port": 0, "lease_s": 30,
                                                     "transport": transport}})


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def servers(tmp_path_factory, request, remote_server):
    if request.param == "nixl":
        from kvserve.kv_connector.p2p.nixl_transport import nixl_import_error

        if nixl_import_error():
            pytest.skip(f"NIXL does not import ({nixl_import_error()})")
    d = tmp_path_factory.mktemp("p2p_http")
    # float32 (not --dtype auto, bf16 on CPUs with native bf16): the decode leg must equal a plain run.
    base = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--disable-log-stats"]
    hs = [remote_server.serve(base + ["--kv-transfer-config", _ktc(role, request.param)], str(d / f"{role}.log"))
          for role in ("kv_producer", "kv_consumer")]
    for h in hs:
        h.transport = request.param
    try:
        for h in hs:
            h.wait_ready()
        yield hs
    finally:
        for h in hs:
            h.stop()


def _sse(lines):
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_pd_over_http(servers, metric_value):
    import httpx

    prod, cons = servers
    with httpx.Client(timeout=120) as c:
        info_p = c.get(prod.url + "/v1/kv_transfer").json()
        info_c = c.get(cons.url + "/v1/kv_transfer").json()
        assert info_p["kv_role"] == "kv_producer" and info_c["kv_role"] == "kv_consumer"
        assert info_p["kv_connector"] == "P2PKVConnector" and info_p["engine_id"] != info_c["engine_id"]
        assert info_p["kv_layout"] == info_c["kv_layout"]
        assert info_p["kv_transport"] == info_c["kv_transport"] == prod.transport

        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        # The plain run (on the consumer, apart in the prefix cache by its salt).
        ref = c.post(cons.url + "/v1/completions", json=dict(body, cache_salt="plain", return_token_ids=True))
        assert ref.status_code == 200, ref.text
        ref = ref.json()
        ref_ids = ref["choices"][0]["token_ids"]
        assert len(ref_ids) == 8 and ref["choices"][0]["prompt_token_ids"]

        # Prefill leg.
        pre = c.post(prod.url + "/v1/completions", json=dict(body, max_tokens=1, stream=False,
                                                             kv_transfer_params={"do_remote_decode": True}))
        assert pre.status_code == 200, pre.text
        ktp = pre.json()["kv_transfer_params"]
        assert ktp["do_remote_prefill"] is True and ktp["remote_engine_id"] == info_p["engine_id"]
        assert isinstance(ktp["remote_port"], int) and ktp["remote_block_ids"] and ktp["kv_layout"]
        assert ktp["num_prompt_tokens"] == ref["usage"]["prompt_tokens"]

        # A mismatched layout is refused before anything runs.
        bad = json.loads(json.dumps(ktp))
        bad["kv_layout"]["block_size"] = 32
        r = c.post(cons.url + "/v1/completions", json=dict(body, kv_transfer_params=bad))
        assert r.status_code == 400 and "block_size" in r.json()["error"]["message"], r.text
        r = c.post(prod.url + "/v1/completions", json=dict(body, kv_transfer_params=ktp))
        assert r.status_code == 400  # a producer-only server cannot take a decode leg

        # Decode leg, streamed, with token ids.
        with c.stream("POST", cons.url + "/v1/completions",
                      json=dict(body, stream=True, return_token_ids=True, kv_transfer_params=ktp)) as r:
            assert r.status_code == 200
            chunks = _sse(r.iter_lines())
        ids = [t for ch in chunks for choice in ch["choices"] for t in choice.get("token_ids", [])]
        text = "".join(choice["text"] for ch in chunks for choice in ch["choices"])
        assert ids == ref_ids and text == ref["choices"][0]["text"]
        assert chunks[0]["choices"][0]["prompt_token_ids"] == ref["choices"][0]["prompt_token_ids"]

        metrics = c.get(cons.url + "/metrics").text
        assert metric_value(metrics, "kvserve:kv_transfer_requests_total") == 1
        assert metric_value(metrics, "kvserve:kv_transfer_bytes_total") > 0
        assert metric_value(metrics, "kvserve:kv_transfer_failures_total") == 0
        assert metric_value(metrics, "kvserve:kv_transfer_seconds_count") == 1

        # The chat route, not streamed: prefill leg, decode leg, equal to a plain chat.
        chat = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}
        plain = c.post(cons.url + "/v1/chat/completions", json=dict(chat, cache_salt="plain")).json()
        pre = c.post(prod.url + "/v1/chat/completions",
                     json=dict(chat, max_tokens=1, kv_transfer_params={"do_remote_decode": True})).json()
        assert pre["kv_transfer_params"]["do_remote_prefill"] is True
        dec = c.post(cons.url + "/v1/chat/completions", json=dict(chat, kv_transfer_params=pre["kv_transfer_params"]))
        assert dec.status_code == 200, dec.text
        assert dec.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        assert dec.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == plain["usage"]["prompt_tokens"] - 1

        # Chat with return_token_ids, streamed and not (a plain request on the producer).
        chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
                "return_token_ids": True}
        r = c.post(prod.url + "/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        j = r.json()
        assert len(j["choices"][0]["token_ids"]) == j["usage"]["completion_tokens"] and j["prompt_token_ids"]
        with c.stream("POST", prod.url + "/v1/chat/completions", json=dict(chat, stream=True)) as r:
            chunks = _sse(r.iter_lines())
        assert chunks[0]["prompt_token_ids"] == j["prompt_token_ids"]
        assert [t for ch in chunks for choice in ch["choices"] for t in choice.get("token_ids", [])] \
            == j["choices"][0]["token_ids"]
