"""One live ``kvserve serve`` (the real default model) per test session, on a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerHandle:
    """A running ``kvserve serve`` subprocess."""

    def __init__(self, extra_args: list[str], log_path: str, api_key: str | None = API_KEY,
                 new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(self.port),
                "--disable-access-log", "--uvicorn-log-level", "warning", *extra_args]
        if api_key:
            args += ["--api-key", api_key]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.log_path = log_path
        self.log = open(log_path, "w")
        # new_session: the server leads its own process group (so that a group-wide signal
        # reaches the server and its engine core, never pytest).
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)

    def wait_ready(self, timeout: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready in {timeout} s; log:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def engine_pid(self) -> int:
        """Pid of the engine-core child (the spawned process that is not the resource tracker)."""
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmd:
                return int(d)
        raise RuntimeError("engine core process not found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples ``name{...}`` whose label text contains ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if labels in line:
                total += float(line.rsplit(" ", 1)[1])
                found = True
    if not found:
        raise KeyError(name)
    return total


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The live server: real default model, --max-model-len 1024, 256 MiB KV cache, API key."""
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    h = ServerHandle(["--max-model-len", "1024", "--kv-cache-memory", "256MiB"], log)
    try:
        h.wait_ready()
        import httpx

        # Warm-up: the first forward pass is slow.
        httpx.post(h.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer():
    from kvserve.model_loader import get_tokenizer, resolve_model

    path, fmt = resolve_model(None, "auto")
    return get_tokenizer(path, fmt)


@pytest.fixture
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def wait_idle(http, timeout: float = 10.0) -> str:
    """Poll /metrics until no request runs or waits and the KV cache is empty; return the text."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        if (metric_value(text, "kvserve:num_requests_running") == 0
                and metric_value(text, "kvserve:num_requests_waiting") == 0
                and metric_value(text, "kvserve:kv_cache_usage_perc") == 0):
            return text
        time.sleep(0.1)
    raise AssertionError("engine not idle:\n" + "\n".join(
        line for line in text.splitlines() if line.startswith("kvserve:") and "bucket" not in line))


@pytest.fixture(name="metric_value")
def _metric_value_fixture():
    return metric_value


@pytest.fixture(name="wait_idle")
def _wait_idle_fixture():
    return wait_idle


@pytest.fixture(name="server_handle_cls", scope="session")
def _server_handle_cls():
    """The ``ServerHandle`` class, for tests that start a server of their own."""
    return ServerHandle
