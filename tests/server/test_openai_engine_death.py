"""Engine death: a second server whose engine-core process we kill (dummy weights: fast start)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest


@pytest.fixture
def doomed_server(tmp_path, remote_server):
    h = remote_server.serve(["--load-format", "dummy", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                      "--served-model-name", "doomed"], str(tmp_path / "doomed.log"), api_key=None)
    try:
        h.wait_ready()
        yield h
    finally:
        h.stop()


def test_engine_death_fails_fast(doomed_server):
    import httpx

    url = doomed_server.url
    # An in-flight stream that would run for minutes.
    result = {}

    def stream():
        lines = []
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 2:
                        result["started"] = time.monotonic()
        except httpx.HTTPError as exc:
            result["exc"] = exc
        result["lines"] = lines
        result["ended"] = time.monotonic()

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while "started" not in result and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "started" in result, doomed_server.read_log()
    killed = time.monotonic()
    os.kill(doomed_server.engine_pid(), signal.SIGKILL)
    t.join(15)
    assert not t.is_alive()
    assert result["ended"] - killed < 5
    assert any("error" in line for line in result["lines"])  # the stream ends with an error event
    # /health says 503 and new requests fail at once with 503.
    assert httpx.get(url + "/health").status_code == 503
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "error" in r.json()
    assert time.monotonic() - t0 < 2
