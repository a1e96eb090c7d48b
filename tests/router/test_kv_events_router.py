"""The kv_events routing policy: the router's block index rebuilt from events (map and positional
forms), and routing decisions from two real engines publishing over localhost ZMQ: a returning
conversation goes to the engine that holds it, a late router learns the blocks through replay,
evictions and clears are seen, and silent workers fall back to the approximate tree."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.router.kv_events import (
    KVEventHub, KVEventsPolicy, RoutingText, WorkerBlockIndex, block_keys, parse_endpoint_spec,
)
from kvserve.router.policies import Candidate, make_policy
from tests.utils import free_port

BS = 4


def _batch(*events) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def test_index_from_map_and_array_events():
    idx = WorkerBlockIndex()
    toks = list(range(10, 22))
    idx.apply_batch(_batch({"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
                            "token_ids": toks[:8], "block_size": BS, "lora_id": None, "medium": "GPU"}))
    # vLLM before map encoding: [tag, fields...] positionally.
    idx.apply_batch(_batch(["BlockStored", [9], 8, toks[8:], BS, None, "GPU"]))
    keys = block_keys(toks, BS)
    assert idx.match(keys) == 3 and idx.block_size == BS
    assert idx.match(block_keys(toks, BS, salt="tenant")) == 0  # another salt, another root
    idx.apply_batch(_batch(["BlockRemoved", [9], "GPU"]))
    assert idx.match(keys) == 2
    idx.apply_batch(_batch({"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 12345,
                            "token_ids": toks[:4], "block_size": BS, "lora_id": None, "medium": "GPU"}))
    assert idx.num_unlinked == 1  # its parent was never seen
    idx.apply_batch(_batch({"type": "AllBlocksCleared"}))
    assert idx.match(keys) == 0 and not idx.by_hash
    with pytest.raises(ValueError, match="malformed"):
        idx.apply_batch(b"\xc1")


def test_endpoint_spec_and_policy_names():
    assert parse_endpoint_spec("http://h:8000/=tcp://h:5557,tcp://h:5558") == ("http://h:8000", "tcp://h:5557",
                                                                               "tcp://h:5558")
    for bad in ("tcp://h:5557", "http://h:8000=h:5557", "http://h=tcp://a,tcp://b,tcp://c"):
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            parse_endpoint_spec(bad)
    with pytest.raises(ValueError, match="needs the workers' event subscriptions"):
        make_policy("kv_events")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("kv_events_router")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def engines(model_dir):
    """Two engines (32 blocks of 4 tokens each) publishing KV events on their own ports."""
    out = []
    for _ in range(2):
        pub, rep = free_port(), free_port()
        cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}"}
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=BS,
                  num_gpu_blocks_override=33, max_model_len=96, disable_log_stats=True,
                  kv_events_config=json.dumps(cfg))
        out.append((llm, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"))
    yield out
    for llm, _, _ in out:
        llm.llm_engine.engine_core.shutdown()


URLS = ("http://e0", "http://e1")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _turn(llm, ids):
    """One conversation turn: the prompt, and the next turn's prompt (+ reply + a user message)."""
    out = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.engine_core.kv_event_publisher.flush()
    return list(ids) + list(out)


def _wait(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out waiting for KV events"
        time.sleep(0.02)


def _cands(loads=(0, 0)):
    return [Candidate(u, n) for u, n in zip(URLS, loads)]


def test_returning_conversations_go_to_their_engine(engines):
    g = torch.Generator().manual_seed(3)
    conv = [torch.randint(3, 128, (14,), generator=g).tolist() for _ in range(2)]
    # Engine 0 serves conversation 0's first turn before any router exists: the router learns it by replay.
    hist0 = _turn(engines[0][0], conv[0])
    hub = KVEventHub({u: (ep, rep) for u, (_, ep, rep) in zip(URLS, engines)})
    try:
        policy = KVEventsPolicy(hub, stale_after=30.0, cache_threshold=0.5)
        _wait(lambda: hub.indexes[URLS[0]].block_size is not None)
        # Engine 1 has published nothing: it holds nothing; a new conversation goes to the least loaded.
        d = policy.choose(RoutingText("c1", conv[1]), _cands((1, 0)))
        assert (d.url, d.reason) == (URLS[1], "kv_miss")
        hist1 = _turn(engines[1][0], conv[1])
        _wait(lambda: hub.indexes[URLS[1]].block_size is not None)

        # The returning turns (history + reply + a new user message) go where their blocks are,
        # whatever the load says (within the balance thresholds).
        nxt0 = hist0 + torch.randint(3, 128, (5,), generator=g).tolist()
        nxt1 = hist1 + torch.randint(3, 128, (5,), generator=g).tolist()
        d0 = policy.choose(RoutingText("other text", nxt0), _cands((3, 0)))
        d1 = policy.choose(RoutingText("c1", nxt1), _cands((0, 3)))
        assert (d0.url, d0.reason) == (URLS[0], "kv_hit") and (d1.url, d1.reason) == (URLS[1], "kv_hit")
        # Exact: the reply's full blocks count too (the approximate tree never saw them).
        assert d0.matched_chars == (len(hist0) - 1) // BS * BS
        # A new conversation: least loaded.
        d = policy.choose(RoutingText("new", torch.randint(3, 128, (12,), generator=g).tolist()), _cands((2, 1)))
        assert (d.url, d.reason) == (URLS[1], "kv_miss")

        # reset_prefix_cache on engine 0: the router sees the clear, conversation 0 is a miss there now.
        core0 = engines[0][0].llm_engine.engine_core
        assert core0.reset_prefix_cache()
        _wait(lambda: not hub.indexes[URLS[0]].keys)
        assert policy.choose(RoutingText("x", nxt0), _cands((1, 0))).reason == "kv_miss"

        # Evictions: fill engine 1's 32-block pool with other prompts; conversation 1's blocks leave.
        idx1 = hub.indexes[URLS[1]]
        assert idx1.match(block_keys(nxt1, BS)) > 0
        engines[1][0].generate([torch.randint(3, 128, (60,), generator=g).tolist() for _ in range(3)], GREEDY,
                               use_tqdm=False)
        engines[1][0].llm_engine.engine_core.kv_event_publisher.flush()
        pool1 = engines[1][0].llm_engine.engine_core.kv_cache_manager.pool
        _wait(lambda: idx1.match(block_keys(nxt1, BS)) == 0)
        assert len(idx1.keys) == len(pool1.cached)  # the index holds exactly the engine's blocks
    finally:
        hub.close()


def test_silent_worker_falls_back_to_the_approximate_tree(engines):
    # Worker 1's endpoint has no publisher: once it was sent uncached blocks and stayed silent for
    # stale_after seconds, decisions go to the cache_aware tree.
    hub = KVEventHub({URLS[0]: (engines[0][1], None), URLS[1]: (f"tcp://127.0.0.1:{free_port()}", None)})
    try:
        policy = KVEventsPolicy(hub, stale_after=0.2)
        idx0, idx1 = hub.indexes[URLS[0]], hub.indexes[URLS[1]]
        assert policy.choose(RoutingText("abc", list(range(3, 20))), _cands()).reason == "fallback_no_events_yet"
        idx1.block_size = idx0.block_size = BS  # as if both had published before
        d = policy.choose(RoutingText("abc", list(range(3, 20))), _cands((5, 0)))
        assert (d.url, d.reason) == (URLS[1], "kv_miss") and idx1.expect_since is not None
        time.sleep(0.3)
        d = policy.choose(RoutingText("abc", list(range(3, 20))), _cands())
        assert d.reason.startswith("fallback_events_stale")
        assert policy.choose("plain text", _cands()).reason.startswith("fallback_no_token_ids")
    finally:
        hub.close()


def test_launch_gives_each_worker_its_event_ports():
    from kvserve.router.launch import Child, kv_events_args

    kids = [Child(f"replica{i}", "worker", ["--dtype", "float32"], 8100 + i, None) for i in range(2)]
    specs = kv_events_args(kids)
    seen = set()
    for c, spec in zip(kids, specs):
        assert c.args[:2] == ["--dtype", "float32"] and c.args[2] == "--kv-events-config"
        cfg = json.loads(c.args[3])
        url, ep, replay = parse_endpoint_spec(spec)
        assert url == c.url and cfg["enable_kv_cache_events"] and cfg["endpoint"].startswith("tcp://*:")
        assert ep.rsplit(":", 1)[1] == cfg["endpoint"].rsplit(":", 1)[1]
        assert replay.rsplit(":", 1)[1] == cfg["replay_endpoint"].rsplit(":", 1)[1]
        seen |= {ep, replay}
    assert len(seen) == 4  # own ports per worker


def test_router_takes_token_ids_from_a_worker_tokenize():
    import asyncio

    import httpx

    from kvserve.router.common import RouterConfig
    from kvserve.router.metrics import RouterMetrics
    from kvserve.router.proxy import Router
    from kvserve.router.workers import WorkerRegistry

    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((str(request.url), json.loads(request.content)))
        return httpx.Response(200, json={"tokens": [5, 6, 7], "count": 3, "max_model_len": 64})

    async def go():
        reg = WorkerRegistry(3, 5.0)
        reg.add("http://w0:1", "worker")
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            r = Router(RouterConfig(policy="kv_events"), reg, RouterMetrics(), client)
            try:
                chat = await r._routing_ids("chat", {"messages": [{"role": "user", "content": "hi"}], "model": "m"},
                                            {}, "worker")
                text = await r._routing_ids("completions", {"prompt": "hi"}, {}, "worker")
                ids = await r._routing_ids("completions", {"prompt": [1, 2, 3]}, {}, "worker")
                batch = await r._routing_ids("completions", {"prompt": ["a", "b"]}, {}, "worker")
            finally:
                r.kv_event_hub.close()
        return chat, text, ids, batch

    chat, text, ids, batch = asyncio.run(go())
    assert chat == text == [5, 6, 7] and ids == [1, 2, 3] and batch is None
    assert asked[0] == ("http://w0:1/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                                  "add_generation_prompt": True, "model": "m"})
    assert asked[1][1] == {"prompt": "hi"} and len(asked) == 2


def test_subscriber_follows_a_publisher_restart():
    from kvserve.config import KVEventsConfig
    from kvserve.core.kv_events import BlockStored, KVEventBatch
    from kvserve.engine.kv_events import ZmqEventPublisher

    port = free_port()
    cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})

    def stored(h, toks):
        return KVEventBatch(ts=time.time(), events=[BlockStored([h], None, toks, BS, None, "GPU", None)])

    hub = KVEventHub({URLS[0]: (f"tcp://127.0.0.1:{port}", None)})
    idx = hub.indexes[URLS[0]]
    try:
        for restart, toks in enumerate(([1, 2, 3, 4], [5, 6, 7, 8])):
            pub = ZmqEventPublisher(cfg)
            try:
                time.sleep(0.5)  # the subscription reaches the new publisher
                pub.publish(stored(11 + restart, toks))
                assert pub.flush()
                _wait(lambda: idx.match(block_keys(toks, BS)) == 1)
            finally:
                pub.shutdown()
        assert idx.match(block_keys([1, 2, 3, 4], BS)) == 0 and len(idx.keys) == 1  # the old blocks are gone
    finally:
        hub.close()


def test_signed_events_and_replay_need_the_internal_secret():
    """With an internal secret the publisher signs every batch and refuses unsigned replay
    requests; a router with the same secret indexes them, one with another secret or none drops
    or never gets them (real sockets on localhost)."""
    from kvserve.config import KVEventsConfig
    from kvserve.core.kv_events import BlockStored, KVEventBatch
    from kvserve.engine.kv_events import ZmqEventPublisher

    secret, other = b"s" * 32, b"o" * 32
    port, rport = free_port(), free_port()
    cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                    "replay_endpoint": f"tcp://*:{rport}"})
    pub = ZmqEventPublisher(cfg, secret=secret)
    hubs = {}
    try:
        early = [1, 2, 3, 4]  # published before any router joins: reachable only through replay
        pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored([21], None, early, BS, None, "GPU", None)]))
        assert pub.flush()
        for name, key in (("right", secret), ("wrong", other), ("none", None)):
            hubs[name] = KVEventHub({URLS[0]: (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")}, secret=key)
        time.sleep(0.5)  # the subscriptions reach the publisher
        toks = [5, 6, 7, 8]
        pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored([22], None, toks, BS, None, "GPU", None)]))
        assert pub.flush()
        right = hubs["right"].indexes[URLS[0]]
        _wait(lambda: right.match(block_keys(toks, BS)) == 1 and right.match(block_keys(early, BS)) == 1)
        time.sleep(0.3)
        wrong_sub = hubs["wrong"].subscribers[URLS[0]]
        assert hubs["wrong"].indexes[URLS[0]].match(block_keys(toks, BS)) == 0 and wrong_sub.num_rejected >= 1
        # without a secret the router reads the live batches (PUB is not encrypted: keep it on a
        # private network) but the publisher refuses its unsigned replay request
        none = hubs["none"].indexes[URLS[0]]
        assert none.match(block_keys(toks, BS)) == 1 and none.match(block_keys(early, BS)) == 0
    finally:
        for h in hubs.values():
            h.close()
        pub.shutdown()
