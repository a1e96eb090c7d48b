"""Robustness of the live server (the session's real-model server from conftest.py):
bad inputs never give 5xx, auth covers every non-open route, schemathesis fuzzing against
the server's own /openapi.json, and clients hanging up mid-stream leave nothing behind (the
fuzz, disconnect and soak runs are benchmarks/load/ scripts, run here at smoke size).

Each test prints one ``RELIABILITY ...`` line; docs/reliability.md is built from them.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.utils import load_benchmark

API_KEY = "test-key"  # conftest.API_KEY (conftest is not importable as a module here)


AUTH = {"Authorization": f"Bearer {API_KEY}"}
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _ok_error_body(r) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert set(err) >= {"message", "type", "param", "code"}, body
    assert err["code"] == r.status_code, body
    return err


def _assert_idle(http, wait_idle, metric_value, timeout: float = 20.0) -> str:
    """Engine idle (running = waiting = KV usage = 0) and the API server holds no request."""
    text = wait_idle(http, timeout)
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        adm = metric_value(text, "kvserve:num_requests_admitted")
        unf = metric_value(text, "kvserve:frontend_unfinished_requests")
        if adm == 0 and unf == 0:
            return text
        assert time.monotonic() < deadline, f"left behind: admitted={adm} unfinished={unf}"
        time.sleep(0.1)


# (path, JSON body or raw bytes, expected status, kind)
BIG = 10**30
BAD_INPUTS = [
    # limits
    (C, {"prompt": "hi", "max_tokens": 2, "n": 17}, 400, "n > --max-n"),
    (CH, {"messages": MSG, "max_tokens": 2, "n": 1000}, 400, "n > --max-n"),
    (C, {"prompt": "hi", "max_tokens": 2, "stop": [str(i) for i in range(17)]}, 400, "17 stop strings"),
    (C, {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 2000]}, 400, "2000-char stop string"),
    (C, {"prompt": "hi " * 1100, "max_tokens": 2}, 400, "prompt > max_model_len"),
    (C, {"prompt": list(range(1, 1100)), "max_tokens": 2}, 400, "token prompt > max_model_len"),
    (CH, {"messages": [{"role": "user", "content": "hi " * 1100}], "max_tokens": 2}, 400,
     "messages > max_model_len"),
    (C, {"prompt": "hi", "max_tokens": 1024}, 400, "prompt + max_tokens > max_model_len"),
    # huge numbers
    (C, {"prompt": "hi", "max_tokens": BIG}, 400, "huge max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 2, "n": BIG}, 400, "huge n"),
    (C, {"prompt": "hi", "max_tokens": 2, "seed": BIG}, 400, "huge seed"),
    (C, {"prompt": "hi", "max_tokens": 2, "top_k": BIG}, 400, "huge top_k"),
    (C, {"prompt": "hi", "max_tokens": 2, "priority": BIG}, 400, "huge priority"),
    (C, {"prompt": "hi", "max_tokens": 2, "min_tokens": BIG}, 400, "huge min_tokens"),
    (C, {"prompt": "hi", "max_tokens": 2, "logprobs": BIG}, 400, "huge logprobs"),
    (C, {"prompt": [BIG], "max_tokens": 2}, 400, "huge token id"),
    (C, {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [BIG]}, 400, "huge stop_token_id"),
    (C, {"prompt": "hi", "max_tokens": 2, "temperature": 1e308 * 10}, 400, "infinite temperature"),
    (CH, {"messages": MSG, "max_tokens": 2, "top_logprobs": BIG, "logprobs": True}, 400, "huge top_logprobs"),
    ("/detokenize", {"tokens": [BIG]}, 400, "huge detokenize id"),
    # negative / zero limits
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens 0"),
    (C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens -1"),
    (CH, {"messages": MSG, "max_completion_tokens": -5}, 400, "max_completion_tokens -5"),
    (C, {"prompt": "hi", "max_tokens": 2, "n": 0}, 400, "n 0"),
    (C, {"prompt": "hi", "max_tokens": 2, "n": -3}, 400, "n -3"),
    (C, {"prompt": "hi", "max_tokens": 2, "temperature": -1}, 400, "temperature -1"),
    (C, {"prompt": "hi", "max_tokens": 2, "top_p": 0}, 400, "top_p 0"),
    (C, {"prompt": "hi", "max_tokens": 2, "top_p": 1.5}, 400, "top_p 1.5"),
    (C, {"prompt": "hi", "max_tokens": 2, "min_p": -0.1}, 400, "min_p -0.1"),
    (C, {"prompt": "hi", "max_tokens": 2, "presence_penalty": 3}, 400, "presence_penalty 3"),
    (C, {"prompt": "hi", "max_tokens": 2, "frequency_penalty": -3}, 400, "frequency_penalty -3"),
    (C, {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 0}, 400, "repetition_penalty 0"),
    (C, {"prompt": "hi", "max_tokens": 2, "min_tokens": -1}, 400, "min_tokens -1"),
    (C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens > max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 2, "logprobs": -1}, 400, "logprobs -1"),
    (C, {"prompt": "hi", "max_tokens": 2, "logprobs": 21}, 400, "logprobs 21"),
    (C, {"prompt": "hi", "max_tokens": 2, "seed": -1}, 400, "seed -1"),
    (C, {"prompt": "hi", "max_tokens": 2, "best_of": 3}, 400, "best_of != n"),
    # wrong types
    (C, {"prompt": 5, "max_tokens": 2}, 400, "prompt int"),
    (C, {"prompt": {"a": 1}, "max_tokens": 2}, 400, "prompt object"),
    (C, {"prompt": [1.5, 2.5], "max_tokens": 2}, 400, "prompt floats"),
    (C, {"prompt": [[1, 2], "x"], "max_tokens": 2}, 400, "prompt mixed list"),
    (C, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens string"),
    (C, {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens float"),
    (C, {"prompt": "hi", "max_tokens": 2, "temperature": "hot"}, 400, "temperature string"),
    (C, {"prompt": "hi", "max_tokens": 2, "stop": 7}, 400, "stop int"),
    (C, {"prompt": "hi", "max_tokens": 2, "stop": [""]}, 400, "empty stop string"),
    (C, {"prompt": "hi", "max_tokens": 2, "stream": [1]}, 400, "stream list"),
    (C, {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}, 400,
     "stream_options without stream"),
    (C, {"prompt": "hi", "max_tokens": 2, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    (CH, {"messages": "hi", "max_tokens": 2}, 400, "messages string"),
    (CH, {"messages": [], "max_tokens": 2}, 400, "messages empty"),
    (CH, {"messages": [{"content": "hi"}], "max_tokens": 2}, 400, "message without role"),
    (CH, {"messages": [{"role": "user", "content": 5}], "max_tokens": 2}, 400, "content int"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
          "max_tokens": 2}, 400, "image content part"),
    (CH, {"messages": MSG, "max_tokens": 2, "top_logprobs": 2}, 400, "top_logprobs without logprobs"),
    ("/tokenize", {"prompt": 5}, 400, "tokenize int"),
    ("/tokenize", {}, 400, "tokenize nothing"),
    ("/detokenize", {"tokens": "abc"}, 400, "detokenize string"),
    ("/detokenize", {"tokens": [-1]}, 400, "detokenize negative id"),
    ("/detokenize", {"tokens": [10**9]}, 400, "detokenize id >= vocab"),
    # empty / bad token ids / unknown model
    (C, {"prompt": "", "max_tokens": 2}, 400, "empty prompt"),
    (C, {"prompt": [], "max_tokens": 2}, 400, "empty prompt list"),
    (C, {"prompt": [[]], "max_tokens": 2}, 400, "empty token list"),
    (C, {"prompt": [1, -5], "max_tokens": 2}, 400, "negative token id"),
    (C, {"prompt": [1, 10**7], "max_tokens": 2}, 400, "token id >= vocab"),
    (C, {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [10**7]}, 400, "stop_token_id >= vocab"),
    (C, {"prompt": "hi", "max_tokens": 2, "model": "nope"}, 404, "unknown model"),
    # bodies that are not a JSON object
    (C, b"", 400, "empty body"),
    (C, b"{", 400, "truncated JSON"),
    (C, b"[1, 2]", 400, "JSON array body"),
    (C, b'"hi"', 400, "JSON string body"),
    (C, b"null", 400, "JSON null body"),
    (C, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', 400, "invalid UTF-8"),
    (C, b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400, "NaN literal"),
    (C, b'{"prompt": "hi", "max_tokens": 2, "top_p": Infinity}', 400, "Infinity literal"),
    (CH, b'\x00\x01\x02', 400, "binary garbage"),
    (CH, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2' + b" " * 1000, 400,
     "unterminated object"),
]


def test_bad_inputs_are_4xx_with_openai_bodies(server, http, wait_idle, metric_value):
    kinds = {}
    t0 = time.monotonic()
    for path, body, status, kind in BAD_INPUTS:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == status, (kind, r.status_code, r.text[:300])
        _ok_error_body(r)
        kinds[kind] = r.status_code
    # Unknown top-level fields are a 400 naming the field (never silently ignored);
    # extra keys inside a message are passed on to the chat template.
    r = http.post(C, json={"prompt": "hi", "max_tokens": 2, "no_such_field": {"x": [1]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field", r.text
    r = http.post(CH, json={"messages": [{"role": "user", "content": "hi", "extra": 1}], "max_tokens": 2,
                            "tools_whatever": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools_whatever", r.text
    r = http.post(CH, json={"messages": [{"role": "user", "content": "hi", "extra": 1}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200
    _assert_idle(http, wait_idle, metric_value)
    print(f"\nRELIABILITY bad_inputs tried={len(BAD_INPUTS)} 5xx=0 ({time.monotonic() - t0:.1f} s)")


def test_body_size_limit(server, http):
    big = json.dumps({"prompt": "a" * (9 * 1024 * 1024), "max_tokens": 2}).encode()
    r = http.post(C, content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and _ok_error_body(r)["code"] == 413

    def chunks():  # chunked transfer: no Content-Length
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    r = http.post(C, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and _ok_error_body(r)["code"] == 413
    r = http.post(C, content=iter([b'{"prompt": "hi", ', b'"max_tokens": 2}']),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_auth_covers_every_non_open_route(server):
    import httpx

    url = server.url
    protected = [("POST", C), ("POST", CH), ("GET", "/v1/models"), ("POST", "/tokenize"),
                 ("POST", "/detokenize"), ("GET", "/openapi.json"), ("GET", "/docs"),
                 ("GET", "/v1/nonexistent"), ("GET", "/nonexistent"), ("GET", "//v1/models"),
                 ("GET", "/V1/models"), ("GET", "/v1/models/")]
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                   {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
                   {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": "Bearer"},
                   {"Authorization": b"Bearer \xc3\xa9"},
                   {"X-Api-Key": API_KEY}]
    n = 0
    with httpx.Client(base_url=url, timeout=30) as c:
        for method, path in protected:
            for h in bad_headers:
                r = c.request(method, path, headers=h, json={"prompt": "hi", "tokens": [1], "max_tokens": 1,
                                                             "messages": MSG})
                assert r.status_code == 401, (method, path, h, r.status_code)
                _ok_error_body(r)
                n += 1
            r = c.request(method, path, headers=AUTH, json={"prompt": "hi", "tokens": [1], "max_tokens": 1,
                                                            "messages": MSG})
            assert r.status_code != 401
        # "bearer" is case-insensitive; open routes need nothing.
        assert c.get("/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert c.get(path).status_code == 200, path
    print(f"\nRELIABILITY auth unauthenticated_requests={n} all_401=yes")


def test_auth_uses_constant_time_comparison():
    """The key check goes through hmac.compare_digest (no early-exit ==)."""
    import inspect

    from kvserve.entrypoints.openai import api_server

    src = inspect.getsource(api_server._GateMiddleware.__call__)
    assert "hmac.compare_digest(" in src and "== st.api_key" not in src


# ----------------------------------------------------------------------------- fuzzing
# The load runs live in benchmarks/load/ (fuzz.py, disconnects.py, soak.py, run by hand at full
# size); here each runs at smoke size against the session's server.

FUZZ_EXAMPLES = 4  # per route (benchmarks/load/fuzz.py: 30)


def test_schemathesis_fuzz(server, http, wait_idle, metric_value):
    pytest.importorskip("schemathesis")
    fuzz = load_benchmark("fuzz")
    t0 = time.monotonic()
    stats = fuzz.run(server.url, API_KEY, examples=FUZZ_EXAMPLES)  # asserts < 500 and OpenAI error bodies
    elapsed = time.monotonic() - t0
    assert http.get("/health", timeout=2).status_code == 200
    _assert_idle(http, wait_idle, metric_value)
    total = sum(sum(c.values()) for c in stats.values())
    print(f"\nRELIABILITY fuzz requests={total} statuses={stats} 5xx=0 ({elapsed:.1f} s)")


# ----------------------------------------------------------------------------- disconnects

N_CLIENTS = 24  # benchmarks/load/disconnects.py: 200


def test_clients_hang_up_at_random_points(server, http, wait_idle, metric_value):
    disconnects = load_benchmark("disconnects")
    t0 = time.monotonic()
    outcome = disconnects.run(server.url, API_KEY, clients=N_CLIENTS)
    elapsed = time.monotonic() - t0
    text = _assert_idle(http, wait_idle, metric_value, timeout=30)
    assert http.get("/health").status_code == 200
    # The server still serves normally afterwards.
    r = http.post(C, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    print(f"\nRELIABILITY disconnects clients={N_CLIENTS} outcomes={outcome} left_running=0 left_waiting=0 "
          f"kv_usage={metric_value(text, 'kvserve:kv_cache_usage_perc')} ({elapsed:.1f} s)")


# ----------------------------------------------------------------------------- soak

SOAK_MINUTES = 0.2  # benchmarks/load/soak.py: 10


def test_soak_short(server, http, wait_idle, metric_value):
    """benchmarks/load/soak.py for 12 s: RSS flat after warm-up, no 5xx, idle after."""
    soak = load_benchmark("soak")
    argv = ["--minutes", str(SOAK_MINUTES), "--base-url", server.url, "--api-key", API_KEY, "--pid",
            str(server.proc.pid), "--concurrency", "4", "--max-tokens", "6", "--sample-s", "0.5",
            "--max-rss-growth-pct", "10"]
    t0 = time.monotonic()
    rc = soak.main(argv)
    assert rc == 0
    _assert_idle(http, wait_idle, metric_value)
    print(f"RELIABILITY soak minutes={SOAK_MINUTES} rc={rc} ({time.monotonic() - t0:.1f} s)")


# ----------------------------------------------------------------------------- engine core


def test_engine_core_survives_a_refused_request():
    """An AddRequest the core refuses (bad params slipping past the frontend) aborts that
    request only; the engine-core loop keeps running. No model needed."""
    pytest.importorskip("zmq")
    from kvserve.engine import ipc
    from kvserve.engine.core_proc import EngineCoreProc

    class Core:
        def __init__(self):
            self.added = []

        def add_request(self, req):
            if req.request_id == "boom":
                raise RuntimeError("refused")
            self.added.append(req.request_id)

        def has_unfinished_requests(self):
            return False

    in_addr, out_addr = ipc.make_ipc_paths()
    proc = EngineCoreProc(Core(), in_addr, out_addr)
    try:
        ok = ipc.params_to_dict(__import__("kvserve.sampling_params", fromlist=["x"]).SamplingParams(max_tokens=2))
        proc._handle(ipc.AddRequest("bad-params", [1, 2], {"temperature": -5.0}, time.time()))
        proc._handle(ipc.AddRequest("boom", [1, 2], ok, time.time()))
        proc._handle(ipc.AddRequest("fine", [1, 2], ok, time.time()))
        assert [o.request_id for o in proc.rejected] == ["bad-params", "boom"]
        assert all(o.finish_reason == "abort" for o in proc.rejected)
        assert proc.core.added == ["fine"] and proc.running
    finally:
        proc.close()
        ipc.cleanup_ipc_paths(in_addr, out_addr)
