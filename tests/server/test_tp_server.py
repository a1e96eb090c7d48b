"""``kvserve serve --tensor-parallel-size 3`` (gloo ranks as worker processes of the engine
core): it answers, and a killed rank turns ``/health`` to 503 within seconds."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("zmq")


def _worker_pids(sid: int | None = None) -> list[int]:
    """Pids of the TP worker processes, of session ``sid`` only when given (the server leads its
    own session, which its ranks keep even when orphaned; other tests' ranks are in others)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if b"run_worker" not in f.read():
                        continue
                if sid is not None:
                    with open(f"/proc/{d}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[3]) != sid:
                            continue
                pids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return pids


def test_tp3_server_answers_and_a_killed_rank_is_a_503(tmp_path, remote_server):
    import httpx

    before = set(_worker_pids())
    h = remote_server.serve(["--load-format", "dummy", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                           "--tensor-parallel-size", "3"], str(tmp_path / "tp.log"), api_key=None)
    try:
        h.wait_ready()
        r = httpx.post(h.url + "/v1/completions", timeout=120,
                       json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(h.url + "/metrics").text
        assert 'tensor_parallel_size="3"' in metrics and 'distributed_executor_backend="mp"' in metrics
        assert "per rank; tensor_parallel_size=3" in h.read_log()
        ranks = sorted(set(_worker_pids(h.proc.pid)) - before)
        assert len(ranks) == 3, h.read_log()
        os.kill(ranks[1], signal.SIGKILL)
        httpx.post(h.url + "/v1/completions", timeout=60, json={"prompt": "Hello", "max_tokens": 4})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and httpx.get(h.url + "/health").status_code != 503:
            time.sleep(0.2)
        assert httpx.get(h.url + "/health").status_code == 503, h.read_log()
    finally:
        h.stop()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and set(_worker_pids(h.proc.pid)) - before:
        time.sleep(0.5)
    assert not set(_worker_pids(h.proc.pid)) - before  # no orphaned ranks
