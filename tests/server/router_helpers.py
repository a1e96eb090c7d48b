"""Real ``kvserve serve`` workers and ``kvserve router`` processes on free loopback ports.

Workers run the embedded default model (``--max-model-len 512``, 64 MiB KV); each module
starts its own (module-scoped fixtures) because the chaos test kills them. No API key. The
processes are ``RemoteServer``s (tests/utils.py); a fixture or test that starts them requests
the ``remote_server`` fixture, which marks it ``slow``.
"""

from __future__ import annotations

import json
from typing import Iterator

import pytest

from tests.utils import RemoteServer, free_port  # noqa: F401 - free_port: re-exported for the tests

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

# float32: the tests compare P/D and re-prefilled outputs with plain ones token for token (--dtype
# auto is bfloat16 on CPUs with native bf16, where a near-tie can flip between the two paths).
WORKER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--disable-access-log",
               "--uvicorn-log-level", "warning"]


def start_workers(tmp_path, n: int, extra: list[str] | None = None, prefix: str = "worker") -> list[RemoteServer]:
    ws = [RemoteServer(["serve", *WORKER_ARGS, *(extra or [])], str(tmp_path / f"{prefix}{i}.log")).start()
          for i in range(n)]
    try:
        for w in ws:
            w.wait_ready(180)
    except BaseException:
        for w in ws:
            w.stop()
        raise
    return ws


def start_router(tmp_path, args: list[str], env: dict | None = None, path: str = "/health") -> RemoteServer:
    """``kvserve router`` ready when ``path`` answers 200 (``/health``: a routable worker per pool)."""
    r = RemoteServer(["router", "--health-check-interval", "0.5", *args], str(tmp_path / "router.log"), env=env).start()
    try:
        r.wait_ready(60, path)
    except BaseException:
        r.stop()
        raise
    return r


def complete(url: str, body: dict, route: str = "/v1/completions", timeout: float = 60.0,
             headers: dict | None = None) -> tuple[dict, httpx.Response]:
    """Non-streamed request: (json, response)."""
    r = httpx.post(url + route, json=body, timeout=timeout, headers=headers)
    return r.json(), r


def sse_events(r) -> Iterator[dict]:
    """The JSON events of an open SSE response ``r`` (httpx); AssertionError on an error event
    or when the stream ends without [DONE]."""
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = json.loads(data)
        assert "error" not in obj, obj
        yield obj
    raise AssertionError("stream ended without [DONE]")


def stream(url: str, body: dict, route: str = "/v1/completions", timeout: float = 60.0) -> tuple[str, list[dict]]:
    """Streamed request: (concatenated text, the chunks); AssertionError without [DONE]."""
    chunks, text = [], []
    with httpx.stream("POST", url + route, json=dict(body, stream=True), timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for obj in sse_events(r):
            chunks.append(obj)
            for ch in obj.get("choices") or []:
                text.append(ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content") or "")
    return "".join(t or "" for t in text), chunks


def kv_transfer_available(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/kv_transfer", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def p2p_connector_known() -> bool:
    try:
        from kvserve.kv_connector import _REGISTRY
    except ImportError:
        return False
    return "P2PKVConnector" in _REGISTRY
