"""KV events of a real engine run, read by a ZMQ subscriber over localhost as a vLLM consumer
would: the batches decode with vLLM's event structs, and replaying them rebuilds the prefix
cache's block set exactly (stores, evictions from a small KV pool, the clear of
``reset_prefix_cache``); the replay endpoint resends what a late consumer missed. Bad
``--kv-events-config`` values fail at start-up naming the field."""

from __future__ import annotations

import json
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import torch
import zmq

from kvserve import LLM, SamplingParams
from kvserve.config import KVEventsConfig
from kvserve.engine.arg_utils import EngineArgs
from tests.utils import free_port


# vLLM's consumer-side structs (vllm.distributed.kv_events, events as tagged maps).
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[Union[VBlockStored, VBlockRemoved, VAllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)
BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = tmp_path_factory.mktemp("kv_events")
    model.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def engine(model_dir):
    """A tiny engine with 16 KV blocks of 4 tokens (evictions come fast), publishing KV events."""
    pub, rep = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
           "replay_endpoint": f"tcp://*:{rep}", "topic": "kv"}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=BS, num_gpu_blocks_override=17,
              max_model_len=64, max_num_batched_tokens=64, disable_log_stats=True, kv_events_config=json.dumps(cfg))
    yield llm, pub, rep
    llm.llm_engine.engine_core.shutdown()


def _core(llm):
    return llm.llm_engine.engine_core


def _subscriber(ctx, port):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _drain(sub, timeout_ms=300) -> list[tuple[int, bytes]]:
    out = []
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), payload))
        timeout_ms = 100
    return out


class Rebuilt:
    """The block set a consumer keeps: engine hash -> (parent hash, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[Optional[int], tuple[int, ...]]] = {}
        self.kinds: set[str] = set()

    def apply(self, payload: bytes) -> None:
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for ev in batch.events:
            self.kinds.add(type(ev).__name__[1:])  # VBlockStored -> BlockStored
            if isinstance(ev, VBlockStored):
                assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert 0 <= h < 2**64 and h not in self.blocks
                    assert parent is None or parent in self.blocks, "a stored block's parent is known"
                    self.blocks[h] = (parent, tuple(ev.token_ids[i * BS:(i + 1) * BS]))
                    parent = h
            elif isinstance(ev, VBlockRemoved):
                for h in ev.block_hashes:
                    del self.blocks[h]
            else:
                self.blocks.clear()


def _engine_blocks(llm) -> dict[int, tuple[Optional[int], tuple[int, ...]]]:
    pool = _core(llm).kv_cache_manager.pool
    u = lambda h: None if h is None else h & (2**64 - 1)  # noqa: E731
    return {u(h): (u(b.node.parent.block_hash), b.node.tokens) for h, b in pool.cached.items()}


def _prompts():
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 128, (9,), generator=g).tolist()
    return [system + torch.randint(3, 128, (int(n),), generator=g).tolist()
            for n in torch.randint(2, 20, (10,), generator=g)]


def test_events_rebuild_the_prefix_cache_and_replay(engine):
    llm, pub, rep = engine
    core = _core(llm)
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, pub)
        time.sleep(0.3)  # PUB/SUB: the subscription must reach the publisher before the first batch
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        seen, state = [], Rebuilt()
        evictions = core.kv_cache_manager.pool.num_evictions
        for i in range(0, 10, 3):  # a few batches: shared prefixes hit, the 16-block pool evicts
            llm.generate(_prompts()[i:i + 3], params, use_tqdm=False)
            assert core.kv_event_publisher.flush()
            for seq, payload in _drain(sub):
                seen.append((seq, payload))
                state.apply(payload)
            assert state.blocks == _engine_blocks(llm)  # exactly the engine's cached blocks
        assert core.kv_cache_manager.pool.num_evictions > evictions
        assert {"BlockStored", "BlockRemoved"} <= state.kinds
        assert [s for s, _ in seen] == list(range(len(seen)))  # one batch per step, seq from 0

        # The wire form is vLLM's: [ts, [{"type": ..., ...}], dp_rank].
        raw = msgspec.msgpack.decode(seen[0][1])
        assert isinstance(raw, list) and raw[1][0]["type"] == "BlockStored" and raw[2] == 0

        # reset_prefix_cache: AllBlocksCleared, and the consumer's set empties with the engine's.
        assert llm.reset_prefix_cache()
        assert core.kv_event_publisher.flush()
        last = _drain(sub)
        assert len(last) == 1 and last[0][0] == len(seen)
        state.apply(last[0][1])
        assert state.blocks == {} == _engine_blocks(llm) and "AllBlocksCleared" in state.kinds
        seen += last

        # A late consumer replays from seq 0 (and from the middle) and gets every batch back.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rep}")
        for start in (0, len(seen) // 2):
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got = []
            while True:
                assert dealer.poll(5000)
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if int.from_bytes(seq, "big", signed=True) == -1:
                    assert payload == b""
                    break
                got.append((int.from_bytes(seq, "big"), payload))
            assert got == seen[start:]
        late = Rebuilt()
        for _, payload in seen:
            late.apply(payload)
        assert late.blocks == {}
        stats = core.kv_events_stats()
        assert stats["published"] > 0 and stats["dropped"] == 0
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("cfg, message", [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be one of null, zmq"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false"),
    ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"}, "endpoint must be a ZMQ address"),
    ({"enable_kv_cache_events": True, "replay_endpoint": 5558}, "replay_endpoint must be a ZMQ address"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps must be an integer >= 1"),
    ({"enable_kv_cache_events": True, "hwm": "many"}, "hwm must be an integer >= 1"),
    ({"enable_kv_cache_events": True, "topics": "kv"}, "unknown --kv-events-config keys: ['topics']"),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"},
     "replay_endpoint must differ"),
])
def test_bad_configs_name_the_field(cfg, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KVEventsConfig.from_dict(cfg)


def test_config_defaults_follow_vllm():
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": True}).publisher == "zmq"
    off = KVEventsConfig.from_dict({})
    assert off.publisher == "null" and not off.enabled and off.endpoint == "tcp://*:5557"
    assert not KVEventsConfig.from_dict({"enable_kv_cache_events": False, "publisher": "zmq"}).enabled


def test_engine_args_errors(model_dir):
    with pytest.raises(ValueError, match="--kv-events-config must be a JSON object"):
        EngineArgs(model=model_dir, kv_events_config="{enable").create_engine_config()
    with pytest.raises(ValueError, match="turn prefix caching on"):
        EngineArgs(model=model_dir, enable_prefix_caching=False,
                   kv_events_config='{"enable_kv_cache_events": true}').create_engine_config()


def test_busy_port_fails_at_start_up(model_dir, engine):
    _, pub, _ = engine
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}"})
    with pytest.raises(ValueError, match="cannot open endpoint"):
        LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", kv_events_config=cfg,
            num_gpu_blocks_override=8, max_model_len=16, disable_log_stats=True)


def test_published_and_dropped_counters_reach_prometheus():
    from kvserve.engine.ipc import SchedulerStatsMsg
    from kvserve.metrics.prometheus import PrometheusStatLogger

    m = PrometheusStatLogger("m")
    m.on_step(SchedulerStatsMsg(kv_events={"published": 5, "dropped": 0}), 0, 0)
    m.on_step(SchedulerStatsMsg(kv_events={"published": 12, "dropped": 3}), 0, 0)
    text = m.render().decode()
    assert 'kvserve:kv_events_published_total{model_name="m"} 12.0' in text
    assert 'kvserve:kv_events_dropped_total{model_name="m"} 3.0' in text


def test_reset_message_of_the_server_path(engine):
    """The API server's ``POST /reset_prefix_cache`` sends ``ResetPrefixCache`` to the engine-core
    process: the core clears its cache, publishes ``AllBlocksCleared``, and the stats it sends back
    count the published events."""
    from kvserve.engine import ipc
    from kvserve.engine.core_proc import EngineCoreProc

    llm, pub, _ = engine
    core = _core(llm)
    llm.generate([_prompts()[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert core.kv_cache_manager.pool.cached
    core.kv_event_publisher.flush()
    before = core.kv_events_stats()["published"]
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, pub)
        time.sleep(0.3)
        in_addr, out_addr = ipc.make_ipc_paths()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(in_addr)
        pull.bind(out_addr)
        proc = EngineCoreProc(core, in_addr, out_addr, ctx)
        try:
            push.send(ipc.input_encoder().encode(ipc.ResetPrefixCache()))
            assert proc.run_once()
            assert not core.kv_cache_manager.pool.cached
            assert core.kv_event_publisher.flush()
            (seq, payload), = _drain(sub)
            assert [type(e).__name__ for e in DECODER.decode(payload).events] == ["VAllBlocksCleared"]
            assert pull.poll(5000)
            msg = ipc.output_decoder().decode(pull.recv())
            assert msg.stats.kv_events["published"] == core.kv_events_stats()["published"] == before + 1
        finally:
            proc.in_sock.close(linger=0)
            proc.out_sock.close(linger=0)
            ipc.cleanup_ipc_paths(in_addr, out_addr)
    finally:
        ctx.destroy(linger=0)
