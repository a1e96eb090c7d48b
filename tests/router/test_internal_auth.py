"""The router's calls to a worker with an internal secret, over real sockets: a worker app
(``build_app`` around a fake engine, uvicorn on 127.0.0.1) refuses calls without the router's
signed header or with one made with another secret (401, logged), keeps ``/health`` open, and
a ``RouterApp`` holding the right secret registers it as a P/D worker (``GET
/v1/kv_transfer``) and lists its models; with a wrong or no secret registration fails."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from kvserve.utils import internal_auth as auth  # noqa: E402

SECRET = b"k" * 32
LAYOUT = {"model": "m", "fingerprint": "f", "num_layers": 2, "block_size": 16, "groups": []}


class FakeEngine:
    tokenizer = None
    max_model_len = 128
    vocab_size = 100
    engine_args = SimpleNamespace(max_num_seqs=4)
    is_running = True
    model_path = "m"
    kv_transfer_info = {"kv_role": "kv_consumer", "engine_id": "e1", "kv_connector": "P2PKVConnector",
                        "kv_transport": "tcp", "kv_layout": LAYOUT}

    def check_alive(self):
        pass

    def num_unfinished(self):
        return 0


@pytest.fixture(scope="module")
def worker_url():
    import uvicorn

    from kvserve.entrypoints.openai.api_server import build_app

    app = build_app(FakeEngine(), ["m"], allowed_hosts=["*"], internal_secret=SECRET)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    end = time.time() + 20
    while not server.started:
        assert time.time() < end, "worker app did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    th.join(timeout=5)


class _Records(logging.Handler):
    """The ``kvserve`` logger's records (it may not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def test_worker_refuses_unsigned_calls(worker_url):
    path = "/v1/kv_transfer"
    log, h = logging.getLogger("kvserve"), _Records()
    log.addHandler(h)
    try:
        assert httpx.get(worker_url + path).status_code == 401
        bad = {auth.HEADER: auth.request_token(b"x" * 32, "GET", path)}
        r = httpx.get(worker_url + path, headers=bad)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    finally:
        log.removeHandler(h)
    assert sum(auth.HEADER in m for m in h.messages) == 2, h.messages
    good = {auth.HEADER: auth.request_token(SECRET, "GET", path)}
    r = httpx.get(worker_url + path, headers=good)
    assert r.status_code == 200 and r.json()["kv_role"] == "kv_consumer"
    assert httpx.get(worker_url + path, headers=good).status_code == 401  # a token works once
    assert httpx.get(worker_url + "/health").status_code == 200  # open for health checks


@pytest.mark.parametrize("secret", [SECRET, b"w" * 32, None], ids=["right", "wrong", "missing"])
def test_router_calls(worker_url, secret):
    from kvserve.router.app import RouterApp
    from kvserve.router.common import RouterConfig

    async def go():
        ra = RouterApp(RouterConfig(), internal_secret=secret)
        try:
            if secret != SECRET:
                with pytest.raises(ValueError, match="cannot reach"):
                    await ra.add_worker(worker_url, "decode")
                return
            w = await ra.add_worker(worker_url, "decode")
            assert w.kv_info["engine_id"] == "e1"
            r = await ra.client.get(worker_url + "/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
        finally:
            await ra.client.aclose()

    asyncio.run(go())
