"""Overload and engine faults on a second, small server (dummy weights: starts in ~20 s):
``--max-num-seqs 4 --max-waiting-requests 4`` (capacity 8), burst of 40 streams (5x).
Then the engine core is killed: the server answers 503, then exits with status 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import threading
import time

import pytest


MAX_NUM_SEQS, MAX_WAITING = 4, 4
CAPACITY = MAX_NUM_SEQS + MAX_WAITING
BURST = 5 * CAPACITY


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, remote_server):
    log = str(tmp_path_factory.mktemp("small") / "small.log")
    h = remote_server.serve(["--load-format", "dummy", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                           "--max-n", "4", "--max-request-body-bytes", "65536", "--protect-metrics"],
                          log, api_key="test-key")
    try:
        h.wait_ready()
        yield h
    finally:
        h.stop()


def _auth(h):
    return {"Authorization": f"Bearer {h.api_key}"}


def test_flags_limits(small_server):
    import httpx

    with httpx.Client(base_url=small_server.url, headers=_auth(small_server), timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 5})
        assert r.status_code == 400 and "n must be <= 4" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": ["hi"] * 3, "max_tokens": 2, "n": 4})  # 12 > capacity 8
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = c.post("/v1/completions", json={"prompt": "a" * 70000, "max_tokens": 2})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        # --protect-metrics: /metrics needs the key, /health does not.
        assert httpx.get(small_server.url + "/metrics").status_code == 401
        assert c.get("/metrics").status_code == 200
        assert httpx.get(small_server.url + "/health").status_code == 200


def test_burst_5x_capacity(small_server, metric_value):
    import httpx

    url, auth = small_server.url, _auth(small_server)
    health_lat: list[float] = []
    health_bad: list[int] = []
    stop = threading.Event()

    def poll_health():  # its own thread and connection: measures the server, not our event loop
        with httpx.Client(base_url=url, timeout=5) as c:
            while not stop.is_set():
                t = time.monotonic()
                r = c.get("/health")
                health_lat.append(time.monotonic() - t)
                if r.status_code != 200:
                    health_bad.append(r.status_code)
                time.sleep(0.02)

    async def one(c: httpx.AsyncClient, i: int):
        t = time.monotonic()
        body = {"prompt": f"Burst {i}:", "max_tokens": 8, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            data = await r.aread()
            dt = time.monotonic() - t
            return r.status_code, dt, r.headers.get("retry-after"), data

    async def burst():
        limits = httpx.Limits(max_connections=BURST + 5)
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(BURST)))

    th = threading.Thread(target=poll_health)
    th.start()
    t0 = time.monotonic()
    try:
        results = asyncio.run(burst())
    finally:
        stop.set()
        th.join()
    elapsed = time.monotonic() - t0
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    assert len(ok) + len(rejected) == BURST, sorted({r[0] for r in results})
    assert len(ok) >= CAPACITY  # everything that fit was admitted
    assert rejected, "a 5x burst must overflow the queue"
    for status, dt, retry_after, data in rejected:
        assert retry_after == "1"
        assert dt < 1.0, dt  # at once, not after queueing
        assert b'"code": 429' in data or b'"code":429' in data
    for status, dt, retry_after, data in ok:  # admitted requests complete in full
        assert data.rstrip().endswith(b"data: [DONE]") and data.count(b'"finish_reason": "length"') == 1, data[-300:]
    assert not health_bad
    lat_ms = sorted(x * 1000 for x in health_lat)
    p50, p99, mx = statistics.median(lat_ms), lat_ms[int(0.99 * (len(lat_ms) - 1))], lat_ms[-1]
    assert p99 < 100, lat_ms[-10:]
    with httpx.Client(base_url=url, headers=auth, timeout=10) as c:
        deadline = time.monotonic() + 10
        while True:
            text = c.get("/metrics").text
            if (metric_value(text, "kvserve:num_requests_running") == 0
                    and metric_value(text, "kvserve:kv_cache_usage_perc") == 0
                    and metric_value(text, "kvserve:num_requests_admitted") == 0):
                break
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.1)
        assert metric_value(text, "kvserve:num_requests_rejected_total") >= len(rejected)
    max_429 = max(dt for _, dt, _, _ in rejected)
    print(f"\nRELIABILITY overload burst={BURST} capacity={CAPACITY} admitted={len(ok)} completed={len(ok)} "
          f"rejected_429={len(rejected)} max_429_latency_ms={max_429 * 1000:.0f} health_polls={len(lat_ms)} "
          f"health_p50_ms={p50:.1f} health_p99_ms={p99:.1f} health_max_ms={mx:.1f} ({elapsed:.1f} s)")


def test_engine_death_exits_nonzero(small_server):
    """Last in this module: kills the engine core; the server must exit with a non-zero status."""
    import httpx

    h = small_server
    killed = time.monotonic()
    os.kill(h.engine_pid(), signal.SIGKILL)
    time.sleep(1.0)
    assert httpx.get(h.url + "/health", timeout=5).status_code == 503
    r = httpx.post(h.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=_auth(h), timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    try:
        rc = h.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after its engine died:\n" + h.read_log())
    assert rc != 0, h.read_log()
    print(f"\nRELIABILITY engine_death exit_code={rc} exited_after_s={time.monotonic() - killed:.1f}")
