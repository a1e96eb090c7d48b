"""The shared servers of the server tests, one each per test session on a free port:
``server`` (the real default model, an API key) and ``tiny_server`` (the tiny dummy Llama, token
ids only). Tests that stop, kill or reconfigure a server start their own (``remote_server``)."""

from __future__ import annotations

import json
import time

import pytest

from tests.utils import tiny_dummy_server

pytest.importorskip("fastapi")
pytest.importorskip("openai")

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


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
def server(tmp_path_factory, remote_server):
    """The live server: real default model, --max-model-len 1024, 256 MiB KV cache, API key."""
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    h = remote_server.serve(["--max-model-len", "1024", "--kv-cache-memory", "256MiB"], log, api_key=API_KEY)
    try:
        h.wait_ready()
        import httpx

        # Warm-up: the first forward pass is slow.
        httpx.post(h.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        yield h
    finally:
        h.stop()


# n-gram speculation on the shared small server (tests/server/test_spec_serve.py checks it).
TINY_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="session")
def tiny_server(remote_server, tmp_path_factory):
    """The shared small server for the non-destructive tiny-model tests: ``TINY_LLAMA`` with dummy
    weights (tests/utils.py), served as ``tiny`` without a tokenizer, float32, 512 tokens, 32 MiB
    of KV cache, n-gram speculation (``TINY_SPEC``); no API key. ``tiny_server.model_dir``: the
    config directory (an offline engine on it gets the same dummy weights)."""
    yield from tiny_dummy_server(remote_server, tmp_path_factory, "tiny-llama-shared",
                                 ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB",
                                  "--speculative-config", json.dumps(TINY_SPEC)])


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
