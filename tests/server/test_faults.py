"""Faults a client can cause, on one small server without an API key.

Dummy weights at the real shapes (fast start); the real tokenizer. Loopback only, bounded:
every request has a timeout, generations are a few tokens.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time

import pytest


SMALL = ["--load-format", "dummy", "--max-model-len", "512", "--kv-cache-memory", "64MiB"]
DEFAULT_MAX_TOKENS = 5
MAX_REQUEST_DURATION = 2.0


@pytest.fixture(scope="module")
def faults_server(tmp_path_factory, remote_server):
    log = str(tmp_path_factory.mktemp("faults") / "server.log")
    h = remote_server.serve([*SMALL, "--served-model-name", "faults", "--default-max-tokens", str(DEFAULT_MAX_TOKENS),
                           "--max-request-duration", str(MAX_REQUEST_DURATION), "--shutdown-timeout", "5"],
                          log, api_key=None)
    try:
        h.wait_ready()
    except BaseException:
        h.stop()
        raise
    yield h
    # Idle server: SIGTERM drains nothing and exits 0 at once.
    t0 = time.monotonic()
    h.stop()
    assert h.proc.returncode == 0, h.read_log()
    assert time.monotonic() - t0 < 5


def _conn(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict | None = None):
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, r.getheader("connection"), r.read()


def test_keepalive_survives_tokenizer_400(faults_server):
    """A lone surrogate (valid JSON, invalid Unicode) in a prompt, a chat message or /tokenize:
    400 naming the field, the same keep-alive connection serves the next request, no traceback."""
    conn = _conn(faults_server)
    bad = [("/v1/completions", b'{"prompt": "ab\\ud800c", "max_tokens": 2}', "prompt"),
           ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}',
            "messages[0]"),
           ("/tokenize", b'{"prompt": "\\ud800"}', "prompt")]
    for path, body, param in bad:
        status, connection, data = _post(conn, path, body)
        assert status == 400, data
        err = json.loads(data)["error"]
        assert err["param"] == param and "surrogate" in err["message"]
        assert (connection or "").lower() != "close"
        # The next request on the same connection works.
        status, _, data = _post(conn, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 200, data
    conn.close()
    assert "Traceback" not in faults_server.read_log()


INVALID = [
    ({"top_logprobs": 25, "logprobs": True}, "top_logprobs"),
    ({"temperature": 5}, "temperature"),
    ({"n": 100}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"model": "nope"}, "model"),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_invalid_field_same_4xx(faults_server, route):
    """Streaming requests are validated before the 200: same status, message and param."""
    import httpx

    base = {"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    with httpx.Client(base_url=faults_server.url, timeout=30) as c:
        for extra, param in INVALID:
            if route == "completions" and param == "top_logprobs":
                extra, param = {"logprobs": 25}, "logprobs"
            plain = c.post(path, json={**base, **extra})
            streamed = c.post(path, json={**base, **extra, "stream": True})
            assert 400 <= plain.status_code < 500, (extra, plain.text)
            assert streamed.status_code == plain.status_code, (extra, streamed.text)
            assert streamed.headers["content-type"].startswith("application/json")
            assert streamed.json() == plain.json()
            err = plain.json()["error"]
            assert err["param"] == param, (extra, err)


def test_host_header_allow_list(faults_server):
    """No API key: only loopback Host names (DNS-rebinding defence); probes stay open."""
    conn = _conn(faults_server)
    body = b'{"prompt": "hi", "max_tokens": 1}'
    status, _, data = _post(conn, "/v1/completions", body, {"Host": f"rebind.attacker.example:{faults_server.port}"})
    assert status == 400 and "Host" in json.loads(data)["error"]["message"]
    for host in (f"localhost:{faults_server.port}", f"127.0.0.1:{faults_server.port}", f"[::1]:{faults_server.port}"):
        status, _, data = _post(conn, "/v1/completions", body, {"Host": host})
        assert status == 200, (host, data)
    conn.request("GET", "/v1/models", headers={"Host": "evil.example"})
    r = conn.getresponse()
    r.read()
    assert r.status == 400
    conn.request("GET", "/health", headers={"Host": "10.1.2.3:8000"})  # a probe using the pod IP
    r = conn.getresponse()
    r.read()
    assert r.status == 200
    conn.close()


def test_default_max_tokens_and_request_deadline(faults_server):
    import httpx

    with httpx.Client(base_url=faults_server.url, timeout=60) as c:
        # No max_tokens: capped by --default-max-tokens. While other servers start on a 2-core
        # machine even 5 tokens can outlast the 2 s deadline ("abort"); such a run says nothing
        # about the cap, so it is retried for up to a minute.
        give_up = time.monotonic() + 60
        while True:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "ignore_eos": True})
            assert r.status_code == 200, r.text
            if r.json()["choices"][0]["finish_reason"] != "abort" or time.monotonic() > give_up:
                break
            time.sleep(1.0)
        assert r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert r.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS, r.text
        # A request that would run far longer than --max-request-duration is cut there.
        t0 = time.monotonic()
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 480, "ignore_eos": True})
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert 0 < r.json()["usage"]["completion_tokens"] < 480
        assert MAX_REQUEST_DURATION - 0.1 < took < MAX_REQUEST_DURATION + 3


_POLLER = r"""
import http.client, json, sys, time
port, duration = int(sys.argv[1]), float(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
lat, end = [], time.monotonic() + duration
while time.monotonic() < end:
    t0 = time.perf_counter()
    conn.request("GET", "/health")
    r = conn.getresponse(); r.read()
    assert r.status == 200, r.status
    lat.append(time.perf_counter() - t0)
    time.sleep(0.01)
print(json.dumps(lat))
"""


def test_health_responsive_while_huge_prompts_are_rejected(faults_server):
    """Four clients send 7.9 MB prompts (under the 8 MiB body limit) again and again; each is
    refused by the character bound before tokenization. /health, polled by another process,
    keeps answering fast."""
    import httpx

    prompt = "lorem ipsum " * (7_900_000 // 12)
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, str(faults_server.port), "4"],
                              stdout=subprocess.PIPE, text=True)
    statuses: list[int] = []
    stop = time.monotonic() + 3.5

    def client() -> None:
        with httpx.Client(base_url=faults_server.url, timeout=30) as c:
            while time.monotonic() < stop:
                r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                statuses.append(r.status_code)
                assert "too long" in r.json()["error"]["message"]

    threads = [threading.Thread(target=client) for _ in range(4)]
    time.sleep(0.3)
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out, _ = poller.communicate(timeout=30)
    assert poller.returncode == 0
    lat = sorted(json.loads(out))
    p99, worst = lat[int(0.99 * (len(lat) - 1))], lat[-1]
    print(f"RELIABILITY huge prompts: {len(statuses)} x {sorted(set(statuses))} while /health was polled "
          f"{len(lat)} times: p50 {lat[len(lat) // 2] * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {worst * 1e3:.1f} ms")
    assert len(statuses) >= 8 and set(statuses) == {400}
    assert p99 < 0.25  # generous: the target is 50 ms on an unloaded machine
