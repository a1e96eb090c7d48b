"""``kvserve launch``: workers + router from one command; clean stop on SIGTERM.

Colocated (``--prefill 0 --decode 0 --replicas 2``) runs now. P/D (``--prefill 2 --decode 1``:
greedy equality with a plain worker, a prefill worker killed -> retried on the other, decode
leg recovery) is skipped until the KV connector (``P2PKVConnector``) is in this tree.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.server.router_helpers import WORKER_ARGS, complete, p2p_connector_known, stream

from tests.utils import RemoteServer

httpx = pytest.importorskip("httpx")

ENGINE = [a for a in WORKER_ARGS if a not in ("--disable-access-log", "--uvicorn-log-level", "warning")]


def Launch(tmp_path, args: list[str]) -> RemoteServer:
    """``kvserve launch ARGS`` (engine args and worker logs under ``tmp_path/workers``), started."""
    return RemoteServer(["launch", *args, "--log-dir", str(tmp_path / "workers"), "--health-check-interval", "0.5",
                         *ENGINE], tmp_path / "launch.log").start()


def worker_pids(ln: RemoteServer) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\w+) \(pid (\d+)\)", ln.read_log())}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _reap(ln: RemoteServer) -> list[int]:
    """Workers of ``ln`` still alive (then SIGKILLed: a test never leaves one behind)."""
    time.sleep(0.5)
    left = [pid for pid in worker_pids(ln).values() if _alive(pid)]
    for pid in left:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def test_launch_colocated_serves_and_stops_cleanly(tmp_path, remote_server):
    ln = Launch(tmp_path, ["--prefill", "0", "--decode", "0", "--replicas", "2", "--restart-failed"])
    try:
        ln.wait_ready(240)
        pids = worker_pids(ln)
        assert set(pids) == {"replica0", "replica1"}
        listed = httpx.get(ln.url + "/workers", timeout=10).json()
        assert listed["mode"] == "colocated" and len(listed["workers"]) == 2
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        direct = complete(listed["workers"][0]["url"], body)[0]["choices"][0]["text"]
        assert complete(ln.url, body)[0]["choices"][0]["text"] == direct
        assert stream(ln.url, body)[0] == direct
        # --restart-failed: a replica that dies comes back on its port; meanwhile the other serves.
        os.killpg(pids["replica0"], signal.SIGKILL)
        assert complete(ln.url, body)[0]["choices"][0]["text"] == direct
        deadline = time.monotonic() + 120
        while worker_pids(ln)["replica0"] == pids["replica0"] or not all(
                w["healthy"] for w in httpx.get(ln.url + "/workers", timeout=5).json()["workers"]):
            assert time.monotonic() < deadline, ln.read_log()[-3000:]
            time.sleep(0.5)
        pids = worker_pids(ln)
        assert complete(listed["workers"][0]["url"], body)[0]["choices"][0]["text"] == direct
    finally:
        t0 = time.monotonic()
        rc = ln.stop()
        leftover = _reap(ln)
    assert rc == 0, ln.read_log()[-3000:]
    assert time.monotonic() - t0 < 30
    assert not leftover, "a worker outlived kvserve launch"
    assert "all workers stopped" in ln.read_log()


def test_launch_bad_counts_are_usage_errors():
    from kvserve.entrypoints.cli import main

    assert main(["launch", "--prefill", "1", "--decode", "0"]) == 2
    assert main(["launch", "--prefill", "0", "--decode", "0"]) == 2


@pytest.mark.skipif(not p2p_connector_known(), reason="needs the KV connector (P2PKVConnector): not in this tree yet")
def test_launch_pd_equality_and_prefill_failover(tmp_path, remote_server):
    ln = Launch(tmp_path, ["--prefill", "2", "--decode", "1"])
    try:
        ln.wait_ready(240)
        listed = httpx.get(ln.url + "/workers", timeout=10).json()
        assert listed["mode"] == "pd"
        decode_url = next(w["url"] for w in listed["workers"] if w["pool"] == "decode")
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        for p in prompts:
            body = {"prompt": p, "max_tokens": 8, "temperature": 0}
            want = complete(decode_url, body)[0]["choices"][0]["text"]  # plain, no transfer
            assert complete(ln.url, body)[0]["choices"][0]["text"] == want
            assert stream(ln.url, body)[0] == want
            chat = {"messages": [{"role": "user", "content": p}], "max_tokens": 8, "temperature": 0}
            want = complete(decode_url, chat, "/v1/chat/completions")[0]["choices"][0]["message"]["content"]
            assert stream(ln.url, chat, "/v1/chat/completions")[0] == want
        # One trace id across the router's, a prefill worker's and the decode worker's logs.
        trace_id = "0af7651916cd43dd8448eb211c80319c"
        tp = f"00-{trace_id}-b7ad6b7169203331-01"
        _, resp = complete(ln.url, {"prompt": "Trace me", "max_tokens": 2}, headers={"traceparent": tp})
        assert resp.status_code == 200 and resp.headers["traceparent"] == tp
        time.sleep(1.0)
        logs = {p.stem: p.read_text(errors="replace") for p in (tmp_path / "workers").glob("*.log")}
        assert trace_id in ln.read_log()
        assert any(f"[trace_id={trace_id}]" in t for k, t in logs.items() if k.startswith("prefill"))
        assert f"[trace_id={trace_id}]" in logs["decode0"]
        # A prefill worker dies: requests are retried on the other one.
        os.killpg(worker_pids(ln)["prefill0"], signal.SIGKILL)
        for p in prompts:
            body = {"prompt": p, "max_tokens": 8, "temperature": 0}
            assert stream(ln.url, body)[0] == complete(decode_url, body)[0]["choices"][0]["text"]
    finally:
        ln.stop()
        _reap(ln)
