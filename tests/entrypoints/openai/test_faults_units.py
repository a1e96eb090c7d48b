"""Fault-handling pieces without a server: Host allow-list, the tokenizer pool's
guards, the engine core's heartbeat, AsyncLLM's stall watchdog and request deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")


def test_host_matching():
    from kvserve.entrypoints.openai.hosts import (
        default_allowed_hosts,
        host_allowed,
        host_name,
        parse_allowed_hosts,
    )

    assert host_name("[::1]:8000") == "::1"
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("example.com.") == "example.com"
    assert host_name("::1") == "::1"  # bare IPv6: no port to strip
    loop = default_allowed_hosts(None)
    assert loop == ["localhost", "127.0.0.1", "::1"]
    assert default_allowed_hosts(None, "10.0.0.5") == [*loop, "10.0.0.5"]
    assert default_allowed_hosts(None, "0.0.0.0") == loop
    assert default_allowed_hosts("key", "0.0.0.0") == ["*"]
    for ok in ("localhost:8000", "127.0.0.1", "[::1]:1", "LOCALHOST"):
        assert host_allowed(ok, loop), ok
    for bad in ("evil.example", "localhost.evil.example", "127.0.0.1.nip.io:80", "", None):
        assert not host_allowed(bad, loop), bad
    pats = parse_allowed_hosts(" api.example.com, *.corp.example ")
    assert host_allowed("API.example.com:443", pats)
    assert host_allowed("a.b.corp.example", pats)
    assert not host_allowed("corp.example", pats) and not host_allowed("xcorp.example", pats)
    assert host_allowed(None, ["*"])
    assert parse_allowed_hosts(None) is None
    with pytest.raises(ValueError, match="allowed-hosts"):
        parse_allowed_hosts("a,,b")


class _Tok:
    """A tokenizer with a 4-character longest token; raises on 'boom'."""

    def get_vocab(self):
        return {"a": 0, "abcd": 1, "<s>": 2}

    def encode(self, text, add_special_tokens=True):
        if "boom" in text:
            raise RuntimeError("tokenizer exploded")
        return [0] * len(text)


class _Serving:
    def __init__(self, tok):
        self.tok = tok

    def tokenize(self, prompt):
        return self.tok.encode(prompt) if isinstance(prompt, str) else list(prompt)


def test_tokenizer_pool_guards():
    from kvserve.entrypoints.openai.protocol import ChatMessage
    from kvserve.entrypoints.openai.errors import APIError
    from kvserve.entrypoints.openai.tokenization import TokenizerPool

    pool = TokenizerPool(_Tok(), max_model_len=10, max_concurrency=1)
    assert pool.token_chars == 4 and pool.max_chars == 40
    serving = _Serving(pool.tokenizer)

    async def go():
        assert await pool.tokenize(serving, "x" * 40) == [0] * 40  # at the bound: tokenized
        with pytest.raises(APIError) as e:
            await pool.tokenize(serving, "x" * 41)
        assert e.value.status == 400 and e.value.param == "prompt" and "41 characters" in e.value.message
        with pytest.raises(APIError) as e:
            await pool.tokenize(serving, "ok\ud800")
        assert e.value.param == "prompt" and "character 2" in e.value.message
        with pytest.raises(APIError) as e:
            await pool.tokenize(serving, "boom")
        assert e.value.status == 400 and "tokenizer exploded" in e.value.message
        assert await pool.tokenize(serving, [5, 6]) == [5, 6]  # token ids: no tokenizer
        msgs = [ChatMessage(role="user", content="x" * 30), ChatMessage(role="user", content="y" * 10)]
        with pytest.raises(APIError) as e:
            pool.check_messages(msgs)  # 8 role characters + 40 content characters > 40
        assert e.value.param == "messages"
        with pytest.raises(APIError) as e:
            pool.check_messages([ChatMessage(role="user", content=[{"type": "text", "text": "\udfff"}])])
        assert e.value.param == "messages[0]"
        # Concurrency is bounded: with one slot, two slow calls run one after the other.
        order = []

        def slow(tag):
            order.append(("start", tag))
            time.sleep(0.05)
            order.append(("end", tag))

        await asyncio.gather(pool.run(slow, 1), pool.run(slow, 2))
        assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]

    try:
        asyncio.run(go())
    finally:
        pool.close()
    with pytest.raises(ValueError):
        TokenizerPool(_Tok(), 10, max_concurrency=0)


def test_engine_core_sends_heartbeats_when_idle():
    """An idle core sends a Heartbeat every HEARTBEAT_INTERVAL_S; one that handled messages
    sends StepOutputs instead. No model needed."""
    pytest.importorskip("zmq")
    import zmq

    from kvserve.engine import ipc
    from kvserve.engine.core_proc import HEARTBEAT_INTERVAL_S, EngineCoreProc

    from kvserve.core.scheduler import SchedulerStats as Stats  # the real fields, so the fake cannot drift

    class Core:
        class scheduler:
            @staticmethod
            def get_stats():
                return Stats()

        def has_unfinished_requests(self):
            return False

        def has_kv_transfers(self):
            return False

        def has_urgent_kv_work(self):
            return False

        def abort_requests(self, ids):
            pass

    in_addr, out_addr = ipc.make_ipc_paths()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind(in_addr)
    pull = ctx.socket(zmq.PULL)
    pull.bind(out_addr)
    proc = EngineCoreProc(Core(), in_addr, out_addr)
    dec = ipc.output_decoder()
    try:
        t0 = time.monotonic()
        assert proc.run_once()  # idle: blocks up to the interval, then a heartbeat
        assert time.monotonic() - t0 >= HEARTBEAT_INTERVAL_S * 0.9
        assert pull.poll(2000)
        msg = dec.decode(pull.recv())
        assert isinstance(msg, ipc.Heartbeat) and msg.num_steps == 0 and msg.timestamp > 0
        push.send(ipc.input_encoder().encode(ipc.AbortRequests(["x"])))
        assert proc.run_once()
        assert pull.poll(2000) and isinstance(dec.decode(pull.recv()), ipc.StepOutputs)
    finally:
        proc.close()
        push.close(0)
        pull.close(0)
        ctx.term()
        ipc.cleanup_ipc_paths(in_addr, out_addr)


def test_async_llm_limits_are_validated():
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.async_client import AsyncLLM

    with pytest.raises(ValueError, match="engine_stall_timeout"):
        AsyncLLM(EngineArgs(), engine_stall_timeout=0)
    with pytest.raises(ValueError, match="max_request_duration"):
        AsyncLLM(EngineArgs(), max_request_duration=-1)
