"""The P/D KV transfer's authentication with an internal secret, over real sockets.

Bare ``P2PWorker`` pairs (CPU caches, no engine) check the protocol: the right secret pulls
the pages bit for bit, a wrong or missing secret is refused at the handshake, a consumer
refuses a producer that does not prove the secret, a forged pull is refused with the same
words whether or not its request id exists, and pages altered in flight fail the MAC. Two
engines check the connector path: with the same secret the consumer computes one prompt
token; with another secret the pull fails and the prompt is recomputed (same tokens).
"""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
import torch

from kvserve.kv_connector.p2p.connector import P2PMetadata, RecvSpec
from kvserve.kv_connector.p2p.wire import AUTH_FAILED, KVTransferAuthError, client_handshake, recv_frame, send_frame
from kvserve.kv_connector.p2p.worker_side import P2PWorker
from kvserve.utils import internal_auth as auth

SECRET = b"s" * 32
OTHER = b"o" * 32
LAYOUT = {"model": "m", "fingerprint": "f", "num_layers": 2, "block_size": 4, "groups": [{"kind": "Full"}]}


def _caches(fill: bool) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (2, 8, 4, 2, 8)  # [K/V, blocks, block_size, kv_heads, head]
    return {i: (torch.randn(shape, generator=g) if fill else torch.zeros(shape)) for i in range(2)}


def _worker(role: str, secret, port: int = 0, caches=None) -> P2PWorker:
    from kvserve.kv_connector.p2p.wire import free_port

    w = P2PWorker(role, "127.0.0.1", port or free_port(), 5.0, LAYOUT, f"e-{role}", [[0, 1]], secret=secret)
    w.register_kv_caches(caches if caches is not None else _caches(role == "kv_producer"))
    return w


def _pull(producer: P2PWorker, consumer: P2PWorker, rid: str = "r1"):
    """Lend blocks 1, 2, 5 of ``rid`` on the producer; the consumer pulls them into 3, 4, 6.
    Returns the consumer's ``KVConnectorOutput`` of the finished pull."""
    producer.handle_meta(P2PMetadata(send=[(rid, [[1, 2, 5]])]))
    consumer.handle_meta(P2PMetadata(recv=[RecvSpec("c-" + rid, "127.0.0.1", producer.port, rid,
                                                    [([3, 4, 6], [1, 2, 5])])]))
    end = time.monotonic() + 10
    while True:
        out = consumer.take_output(wait_s=0.05)
        if out.finished_recving:
            return out
        assert time.monotonic() < end, "pull did not finish"


@pytest.fixture(scope="module")
def producer():
    p = _worker("kv_producer", SECRET)
    yield p
    p.shutdown()


def test_right_secret_pulls_pages(producer):
    consumer = _worker("kv_consumer", SECRET)
    try:
        out = _pull(producer, consumer, "ok1")
        assert not out.failed_recving
        for layer in (0, 1):
            src, dst = producer.caches[layer], consumer.caches[layer]
            assert torch.equal(dst[:, [3, 4, 6]], src[:, [1, 2, 5]])
        # The consumer's release (authenticated too) frees the producer's blocks.
        end = time.monotonic() + 5
        while "ok1" not in producer.take_output().finished_sending:
            assert time.monotonic() < end
            time.sleep(0.01)
    finally:
        consumer.shutdown()


class _Records(logging.Handler):
    """The ``kvserve`` logger's records (it may not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("secret", [OTHER, None], ids=["wrong", "missing"])
def test_wrong_or_missing_secret_refused(producer, secret):
    consumer = _worker("kv_consumer", secret)
    before = producer.stats["auth_failures"]
    log, h = logging.getLogger("kvserve"), _Records()
    log.addHandler(h)
    try:
        out = _pull(producer, consumer, f"bad-{secret is None}")
        assert out.failed_recving
        assert not consumer.caches[0][:, [3, 4, 6]].any()  # nothing written
        assert producer.stats["auth_failures"] == before + 1
        assert any(AUTH_FAILED in m and "refused" in m for m in h.messages), h.messages
    finally:
        log.removeHandler(h)
        consumer.shutdown()
        producer.release_local(f"bad-{secret is None}")


def test_consumer_refuses_unauthenticated_producer():
    open_producer = _worker("kv_producer", None)
    try:
        with socket.create_connection(("127.0.0.1", open_producer.port), timeout=5) as s:
            with pytest.raises(KVTransferAuthError, match="did not authenticate"):
                client_handshake(s, LAYOUT, "c", SECRET)
        consumer = _worker("kv_consumer", SECRET)
        try:
            assert _pull(open_producer, consumer, "x").failed_recving
        finally:
            consumer.shutdown()
    finally:
        open_producer.shutdown()


def test_forged_pull_reveals_nothing(producer):
    """A pull with a bad MAC gets the same answer for a lent id and an unknown one; a replayed
    hello's MAC does not carry over to a new connection (the challenge differs)."""
    producer.handle_meta(P2PMetadata(send=[("lent", [[1, 2]])]))
    answers = []
    for rid in ("lent", "never-lent"):
        with socket.create_connection(("127.0.0.1", producer.port), timeout=5) as s:
            hello = client_handshake(s, LAYOUT, "c", SECRET)
            # A MAC made for another connection's challenge.
            send_frame(s, {"op": "pull", "req": rid, "blocks": [[1, 2]],
                           "mac": auth.sign(SECRET, "kv-pull", "old-challenge", rid, [[1, 2]], None)})
            h, _ = recv_frame(s)
            answers.append(h)
            assert hello["challenge"] != "old-challenge"
    assert answers[0] == answers[1] == {"op": "error", "error": AUTH_FAILED}
    # A stale hello (timestamp past the allowed skew) is refused.
    with socket.create_connection(("127.0.0.1", producer.port), timeout=5) as s:
        ts = time.time() - 2 * auth.MAX_SKEW_S
        send_frame(s, {"op": "hello", "layout": LAYOUT, "engine_id": "c", "ts": ts, "nonce": "n",
                       "mac": auth.sign(SECRET, "kv-hello", "c", ts, "n")})
        assert recv_frame(s)[0] == {"op": "hello", "ok": False, "error": AUTH_FAILED}
    producer.release_local("lent")


def test_altered_pages_fail_the_mac(producer, monkeypatch):
    from kvserve.kv_connector.p2p import worker_side

    orig = worker_side.send_frame

    def flip(sock, header, payload=None):
        if header.get("op") == "layer" and payload is not None:
            b = bytearray(payload)
            b[0] ^= 1
            payload = bytes(b)
        orig(sock, header, payload)

    monkeypatch.setattr(worker_side, "send_frame", flip)
    consumer = _worker("kv_consumer", SECRET)
    try:
        assert _pull(producer, consumer, "flip").failed_recving
    finally:
        consumer.shutdown()


def test_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(auth.ENV_SECRET_FILE, raising=False)
    assert auth.load_internal_secret() is None
    monkeypatch.setenv(auth.ENV_SECRET, "e" * 20)
    assert auth.load_internal_secret() == b"e" * 20
    f = tmp_path / "secret"
    f.write_text("f" * 40 + "\n")
    f.chmod(0o600)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    assert auth.load_internal_secret() == b"f" * 40  # the file wins, newline stripped
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        auth.load_internal_secret()
    with pytest.raises(ValueError, match="cannot read"):
        auth.load_internal_secret(str(tmp_path / "missing"))


def test_http_tokens_once_and_fresh():
    v = auth.TokenVerifier(SECRET)
    tok = auth.request_token(SECRET, "post", "/v1/completions")
    assert not v.verify(tok, "POST", "/v1/chat/completions")  # bound to the path
    assert v.verify(tok, "POST", "/v1/completions")
    assert not v.verify(tok, "POST", "/v1/completions")  # replayed
    assert not v.verify(auth.request_token(OTHER, "POST", "/x"), "POST", "/x")
    assert not v.verify(None, "POST", "/x") and not v.verify("garbage", "POST", "/x")


# ---- the connector, two engines ------------------------------------------------------------

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPT = [1] + [(7 * i) % 250 + 3 for i in range(45)]


def _llm(path, role, secret, monkeypatch):
    from kvserve import LLM

    monkeypatch.setenv(auth.ENV_SECRET, secret.decode())  # read when the engine's worker starts
    ktc = {"kv_connector": "P2PKVConnector", "kv_role": role, "kv_connector_extra_config": {"kv_port": 0}}
    return LLM(model=path, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=40, max_model_len=256,
               dtype="float32", max_num_batched_tokens=128, max_num_seqs=4, disable_log_stats=True,
               kv_transfer_config=json.dumps(ktc))


def test_connector_with_secret(tiny_llama_dir, monkeypatch):
    from kvserve import SamplingParams

    producer = _llm(tiny_llama_dir, "kv_producer", SECRET, monkeypatch)
    good = _llm(tiny_llama_dir, "kv_consumer", SECRET, monkeypatch)
    bad = _llm(tiny_llama_dir, "kv_consumer", OTHER, monkeypatch)
    try:
        outs = []
        for consumer in (good, bad):
            sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **GREEDY)
            params = producer.generate([PROMPT], sp, use_tqdm=False)[0].kv_transfer_params
            sp = SamplingParams(max_tokens=6, extra_args={"kv_transfer_params": params}, **GREEDY)
            outs.append(consumer.generate([PROMPT], sp, use_tqdm=False)[0])
        assert outs[0].num_cached_tokens == len(PROMPT) - 1  # pulled
        assert outs[1].num_cached_tokens == 0  # refused: recomputed, same tokens
        assert list(outs[0].outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)
        stats = bad.llm_engine.engine_core.scheduler.get_stats().kv_connector_stats
        assert stats["load_failures"] == 1
        # The producer counts the refusal; /metrics exports it.
        core, end = producer.llm_engine.engine_core, time.monotonic() + 10
        while core.scheduler.get_stats().kv_connector_stats.get("kv_auth_failures", 0) < 1:
            assert time.monotonic() < end
            core.step()
            time.sleep(0.01)
        from prometheus_client import generate_latest

        from kvserve.metrics.prometheus import PrometheusStatLogger

        pl = PrometheusStatLogger("m")
        pl._on_transfer_stats(core.scheduler.get_stats().kv_connector_stats)
        assert b'kvserve:kv_transfer_auth_failures_total{model_name="m"} 1.0' in generate_latest(pl.registry)
    finally:
        for x in (producer, good, bad):
            x.shutdown()
