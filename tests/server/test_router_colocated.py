"""``kvserve router`` in colocated mode over 2 real ``kvserve serve`` workers (default model).

Greedy outputs through the router equal a worker's own (stream / non-stream, completions /
chat); admin routes; errors; trace ids across the router's and the workers' logs; metrics.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.server.router_helpers import complete, free_port, start_router, start_workers, stream

httpx = pytest.importorskip("httpx")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
CHATS = ["Say hello in French.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def dep(tmp_path_factory, remote_server):
    tmp = tmp_path_factory.mktemp("router_colocated")
    ws = start_workers(tmp, 2)
    try:
        r = start_router(tmp, ["--worker", ws[0].url, "--worker", ws[1].url, "--policy", "round_robin",
                               "--decode-first-token-timeout", "5", "--health-check-timeout", "1",
                               "--load-from-metrics"],
                         env={"OTEL_TRACES_EXPORTER": "console"})
    except BaseException:
        for w in ws:
            w.stop()
        raise
    yield r, ws
    r.stop()
    for w in ws:
        w.stop()


def _chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}


def test_same_greedy_outputs_as_a_worker(dep):
    r, ws = dep
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        want, _ = complete(ws[0].url, body)
        for _ in range(2):  # round robin: both workers
            got, resp = complete(r.url, body)
            assert resp.status_code == 200
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["usage"] == want["usage"] or got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
            text, chunks = stream(r.url, body)
            assert text == want["choices"][0]["text"]
            assert all("token_ids" not in ch for c in chunks for ch in c["choices"])  # the router's own ids stripped
        # The client's return_token_ids is honoured.
        want_ids, _ = complete(ws[1].url, dict(body, return_token_ids=True))
        text, chunks = stream(r.url, dict(body, return_token_ids=True))
        assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == want_ids["choices"][0]["token_ids"]
    for msg in CHATS:
        want, _ = complete(ws[1].url, _chat(msg), "/v1/chat/completions")
        got, resp = complete(r.url, _chat(msg), "/v1/chat/completions")
        assert resp.status_code == 200 and got["object"] == "chat.completion"
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        text, chunks = stream(r.url, _chat(msg), "/v1/chat/completions")
        assert text == want["choices"][0]["message"]["content"]
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        assert sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("role")) == 1


def test_errors_are_openai_shaped(dep):
    r, _ = dep
    got, resp = complete(r.url, {"prompt": "x", "max_tokens": 0})
    assert resp.status_code == 400 and "max_tokens" in got["error"]["message"]
    resp = httpx.post(r.url + "/v1/completions", content=b"{not json", timeout=10)
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    models = httpx.get(r.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(r.url + "/health", timeout=5).status_code == 200


def test_add_remove_workers_while_running(dep):
    r, ws = dep
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    resp = httpx.post(r.url + "/remove_worker", params={"url": ws[1].url}, timeout=10)
    assert resp.status_code == 200, resp.text
    try:
        listed = httpx.get(r.url + "/workers", timeout=10).json()
        assert [w["url"] for w in listed["workers"]] == [ws[0].url] and listed["mode"] == "colocated"
        for _ in range(3):
            assert complete(r.url, body)[1].status_code == 200
        assert httpx.post(r.url + "/remove_worker", params={"url": ws[1].url}, timeout=10).status_code == 404
        bad = httpx.post(r.url + "/add_worker", params={"url": ws[1].url, "role": "gpu"}, timeout=10)
        assert bad.status_code == 400 and "unknown role" in bad.json()["error"]["message"]
        # A plain worker cannot join as a decode worker (no /v1/kv_transfer, or kv_role null).
        bad = httpx.post(r.url + "/add_worker", params={"url": ws[1].url, "role": "decode"}, timeout=10)
        assert bad.status_code == 400 and "decode worker" in bad.json()["error"]["message"]
    finally:
        resp = httpx.post(r.url + "/add_worker", params={"url": ws[1].url, "role": "worker"}, timeout=10)
    assert resp.status_code == 200, resp.text
    dup = httpx.post(r.url + "/add_worker", params={"url": ws[1].url}, timeout=10)
    assert dup.status_code == 400 and "already registered" in dup.json()["error"]["message"]
    assert len(httpx.get(r.url + "/workers", timeout=10).json()["workers"]) == 2


def test_trace_id_in_logs_and_headers(dep):
    r, ws = dep
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    tp = f"00-{trace_id}-00f067aa0ba902b7-01"
    for s in (False, True):
        with httpx.stream("POST", r.url + "/v1/completions", headers={"traceparent": tp}, timeout=60,
                          json={"prompt": "Trace me", "max_tokens": 2, "stream": s}) as resp:
            assert resp.status_code == 200
            resp.read()
            assert resp.headers["traceparent"] == tp
    # A request without one gets a fresh trace id in the response.
    _, resp = complete(r.url, {"prompt": "Hi", "max_tokens": 1})
    assert resp.headers["traceparent"].split("-")[1] not in ("", trace_id)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        router_log = r.read_log()
        worker_logs = "".join(w.read_log() for w in ws)
        if f"[trace_id={trace_id}]" in worker_logs and trace_id in router_log:
            break
        time.sleep(0.2)
    assert f"[trace_id={trace_id}] route worker" in router_log
    assert f"[trace_id={trace_id}] POST /v1/completions -> 200" in worker_logs
    # OpenTelemetry spans (OTEL_TRACES_EXPORTER=console) carry the client's trace id.
    for name in ("router.request", "router.route", "router.decode"):
        assert f'"name": "{name}"' in router_log, name
    assert f'"trace_id": "0x{trace_id}"' in router_log


def test_metrics(dep):
    r, _ = dep
    complete(r.url, {"prompt": "count me", "max_tokens": 1})
    text = httpx.get(r.url + "/metrics", timeout=10).text
    for name in ("kvserve_router:requests_total{", "kvserve_router:routing_decisions_total{",
                 "kvserve_router:worker_healthy{", "kvserve_router:phase_latency_seconds_bucket{",
                 "kvserve_router:pool_in_flight{"):
        assert name in text, name
    ok = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
             if l.startswith("kvserve_router:requests_total{") and 'outcome="ok"' in l)
    assert ok >= 1
    listed = json.loads(httpx.get(r.url + "/workers", timeout=10).text)
    assert all(w["healthy"] and w["circuit"] == "closed" for w in listed["workers"])


def _wait_all_healthy(r, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ws = httpx.get(r.url + "/workers", timeout=5).json()["workers"]
        if all(w["healthy"] for w in ws):
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not healthy again: {ws}")


def test_hung_worker_is_bounded_and_bypassed(dep):
    """A worker frozen by SIGSTOP (accepts connections, never answers): every request still
    succeeds through the other worker within the first-token deadline + a health check."""
    r, ws = dep
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    want = complete(ws[1].url, body)[0]["choices"][0]["text"]
    os.killpg(ws[0].proc.pid, signal.SIGSTOP)
    try:
        for i in range(4):
            t0 = time.monotonic()
            if i % 2:
                got = complete(r.url, body, timeout=30)[0]["choices"][0]["text"]
            else:
                got = stream(r.url, body, timeout=30)[0]
            assert got == want
            assert time.monotonic() - t0 < 8.0
    finally:
        os.killpg(ws[0].proc.pid, signal.SIGCONT)
    _wait_all_healthy(r)
    text = httpx.get(r.url + "/metrics", timeout=10).text
    assert 'kvserve_router:worker_failures_total{kind="timeout"' in text


def test_no_worker_is_a_clear_503(tmp_path, remote_server):
    """A router whose only worker is down answers 503 (OpenAI-shaped) after --queue-timeout."""
    from tests.server.router_helpers import start_router as start

    dead = f"http://127.0.0.1:{free_port()}"
    r = start(tmp_path, ["--worker", dead, "--queue-timeout", "1"], path="/workers")
    try:
        time.sleep(1.0)  # a health check has run
        assert httpx.get(r.url + "/health", timeout=5).status_code == 503
        t0 = time.monotonic()
        got, resp = complete(r.url, {"prompt": "x", "max_tokens": 1, "stream": True}, timeout=30)
        assert resp.status_code == 503 and "no healthy worker" in got["error"]["message"]
        assert time.monotonic() - t0 < 10
        assert resp.headers.get("traceparent")
    finally:
        r.stop()
