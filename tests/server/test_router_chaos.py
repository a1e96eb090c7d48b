"""Chaos: streamed greedy requests (32 here; benchmarks/load/router_chaos.sh runs 200 or more)
through ``kvserve router`` while workers are SIGKILLed and restarted at random. 0 lost, 0 hung, every output equal to an unkilled reference (no duplicated
or missing tokens: the token ids are compared too).

``colocated``: 2 replicas. ``pd``: 1 prefill + 2 decode workers, the decode ones killed; skipped
until the KV connector (``P2PKVConnector``, ``GET /v1/kv_transfer``) is in this tree.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.router_helpers import (
    kv_transfer_available,
    p2p_connector_known,
    sse_events,
    start_router,
    start_workers,
    stream,
)
from tests.utils import RemoteServer

httpx = pytest.importorskip("httpx")

# benchmarks/load/router_chaos.sh sets KVSERVE_CHAOS_REQUESTS (200 by default) for the full run.
N_REQUESTS = int(os.environ.get("KVSERVE_CHAOS_REQUESTS", "32"))
CONCURRENCY = 8
MAX_TOKENS = 8
REQUEST_TIMEOUT = 90.0
PROMPTS = [f"{subject} is" for subject in (
    "The capital of France", "The largest planet in the solar system", "Python", "The speed of light",
    "The tallest mountain on Earth", "A good breakfast", "The main ingredient of bread", "Machine learning",
    "The color of the sky", "Shakespeare", "The Great Wall of China", "A prime number")]


def _kv(role: str) -> list[str]:
    from kvserve.router.launch import kv_transfer_config

    return ["--kv-transfer-config", kv_transfer_config(role)]


@pytest.fixture(scope="module", params=["colocated", "pd"])
def deployment(request, tmp_path_factory, remote_server):
    mode = request.param
    if mode == "pd" and not p2p_connector_known():
        pytest.skip("P/D chaos needs the KV connector (P2PKVConnector, GET /v1/kv_transfer), not in this tree yet")
    tmp = tmp_path_factory.mktemp(f"chaos_{mode}")
    if mode == "colocated":
        targets = start_workers(tmp, 2)
        others: list[RemoteServer] = []
        args = [a for w in targets for a in ("--worker", w.url)]
    else:
        others = start_workers(tmp, 1, _kv("kv_producer"), prefix="prefill")
        targets = start_workers(tmp, 2, _kv("kv_consumer"), prefix="decode")
        if not all(kv_transfer_available(w.url) for w in others + targets):
            for w in others + targets:
                w.stop()
            pytest.skip("workers have no GET /v1/kv_transfer")
        args = ["--prefill", others[0].url] + [a for w in targets for a in ("--decode", w.url)]
    try:
        router = start_router(tmp, [*args, "--policy", "least_loaded", "--decode-first-token-timeout", "20",
                                    "--request-timeout", "80", "--queue-timeout", "60", "--cooldown", "1"])
    except BaseException:
        for w in others + targets:
            w.stop()
        raise
    yield mode, router, targets
    router.stop()
    for w in others + targets:
        w.stop()


def _body(kind: str, prompt: str, ids: bool) -> dict:
    if kind == "chat":
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": ids}
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": ids}


ROUTE = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _chat_token_ids(url: str) -> bool:
    """Whether the workers give token ids on chat (needed to resume a chat stream)."""
    r = httpx.post(url + "/v1/chat/completions", json=_body("chat", "Hi", True) | {"max_tokens": 1}, timeout=60)
    return r.status_code == 200 and "token_ids" in r.json()["choices"][0]


def _reference(url: str, kinds: list[str]) -> dict[tuple[str, str], tuple[str, list[int]]]:
    ref = {}
    for kind in kinds:
        for p in PROMPTS:
            text, chunks = stream(url, _body(kind, p, True), ROUTE[kind])
            ref[kind, p] = (text, [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])])
    return ref


def _metric(text: str, name: str) -> float:
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name))


def test_chaos_kill_and_restart(deployment):
    mode, router, targets = deployment
    t_start = time.monotonic()
    # Chat streams too (every 4th request) once the workers send token ids on chat.
    kinds = ["completions", "chat"] if _chat_token_ids(targets[0].url) else ["completions"]
    # The reference: the router before any kill, one request at a time (greedy).
    ref = _reference(router.url, kinds)
    rng = random.Random(1234)
    stop = threading.Event()
    kills: list[str] = []

    def killer() -> None:
        while not stop.wait(rng.uniform(1.0, 3.0)):
            victim = rng.choice(targets)
            victim.kill()
            kills.append(victim.url)
            victim.start()  # the same port; the router's health checks bring it back
            try:
                victim.wait_ready(120)
            except RuntimeError:
                return

    results: list = [None] * N_REQUESTS

    def one(i: int) -> None:
        kind = "chat" if "chat" in kinds and i % 4 == 3 else "completions"
        p = (kind, PROMPTS[i % len(PROMPTS)])
        ids = i % 2 == 0
        t0 = time.monotonic()
        try:
            text, chunks = stream(router.url, _body(kind, p[1], ids), ROUTE[kind], timeout=REQUEST_TIMEOUT)
            got_ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
            results[i] = ("ok", p, text, got_ids if ids else None, time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - counted as lost
            results[i] = ("lost", p, repr(exc), None, time.monotonic() - t0)

    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(N_REQUESTS)))
    finally:
        stop.set()
        kt.join(150)
    lost = [r for r in results if r[0] != "ok"]
    wrong = [(r[1], r[2], ref[r[1]][0]) for r in results if r[0] == "ok" and r[2] != ref[r[1]][0]]
    wrong_ids = [(r[1], r[3], ref[r[1]][1]) for r in results
                 if r[0] == "ok" and r[3] is not None and r[3] != ref[r[1]][1]]
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    reprefills = _metric(metrics, "kvserve_router:reprefills_total")
    retries = _metric(metrics, "kvserve_router:retries_total")
    elapsed = time.monotonic() - t_start
    print(f"chaos[{mode}]: {N_REQUESTS} requests ({'/'.join(kinds)}), {len(kills)} kills, {reprefills:.0f} re-prefills, "
          f"{retries:.0f} retries, slowest {max(r[4] for r in results):.1f} s, {elapsed:.0f} s in all")
    assert not lost, lost[:5]
    assert not wrong, wrong[:5]
    assert not wrong_ids, wrong_ids[:5]
    assert kills, "no worker was killed"
    assert reprefills + retries > 0, "no request was recovered: the kills missed every stream"
    assert max(r[4] for r in results) < REQUEST_TIMEOUT


def _wait_healthy(router, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(w["healthy"] for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]):
            return
        time.sleep(0.25)
    raise AssertionError("workers not healthy")


def test_kill_mid_stream_keeps_held_back_text(deployment):
    """A worker killed mid-stream while it holds text back (a 10-character stop string that never
    matches makes it hold the last 9 characters): the client still gets every character once."""
    import os
    import signal

    mode, router, targets = deployment
    _wait_healthy(router)
    body = {"prompt": "Write a short poem about the sea:\n", "max_tokens": 16, "temperature": 0,
            "stop": ["ZZZZZZZZZZ"], "return_token_ids": True, "stream": True}
    ref_text, ref_chunks = stream(router.url, body)
    ref_ids = [t for c in ref_chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    before = _metric(httpx.get(router.url + "/metrics", timeout=10).text, "kvserve_router:reprefills_total")
    text, ids, victim = [], [], None
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        assert r.status_code == 200
        for obj in sse_events(r):  # asserts the stream ends with [DONE]
            for ch in obj["choices"]:
                text.append(ch["text"])
                ids.extend(ch.get("token_ids", []))
            if victim is None and ids:
                busy = [w["url"] for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]
                        if w["in_flight"] > 0]
                victim = next(t for t in targets if t.url in busy)
                os.killpg(victim.proc.pid, signal.SIGSTOP)  # freeze at once, then kill
                victim.kill()
    assert victim is not None
    victim.start()
    victim.wait_ready(120)
    after = _metric(httpx.get(router.url + "/metrics", timeout=10).text, "kvserve_router:reprefills_total")
    assert after > before, "the stream was not re-prefilled"
    assert ids == ref_ids
    assert "".join(text) == ref_text
