"""P2PKVConnector (disaggregated prefill/decode) on a tiny random Llama: two offline engines
in one process, a producer and a consumer, talking TCP on 127.0.0.1; the tests marked with the
``transport`` fixture run again with ``"transport": "nixl"`` (pages READ through a real NIXL /
UCX agent per engine; skipped where NIXL does not import).

Checked: the consumer's KV blocks equal the producer's bit for bit (every KV dtype: float32, bfloat16,
fp8_e4m3 / e5m2, int8, int4, int2),
greedy outputs equal a colocated run's, the consumer computes one prompt token, the
handshake refuses a layout mismatch, leases expire, aborts free blocks on both sides, and an
unreachable producer falls back to recompute (or "fail").
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kv_connector.p2p.nixl_transport import nixl_import_error
from kvserve.kv_connector.p2p.wire import KVLayoutMismatch, client_handshake, layout_mismatch

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPT = [1] + [(7 * i) % 250 + 3 for i in range(45)]  # 46 tokens: 2 full blocks of 16 + 14


def _llm(path, role, kv_cache_dtype="auto", engine_kw=None, **extra):
    ktc = {"kv_connector": "P2PKVConnector", "kv_role": role,
           "kv_connector_extra_config": {"kv_host": "127.0.0.1", "kv_port": 0, **extra}}
    return LLM(model=path, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=40, max_model_len=256,
               dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=128, max_num_seqs=8,
               disable_log_stats=True, kv_transfer_config=json.dumps(ktc), **(engine_kw or {}))


@pytest.fixture(params=["tcp", "nixl"])
def transport(request):
    if request.param == "nixl":
        err = nixl_import_error()
        if err:
            pytest.skip(f"NIXL does not import ({err}); pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1")
    return request.param


def _core(llm):
    return llm.llm_engine.engine_core


def _worker(llm):
    return _core(llm).model_runner.kv_connector.worker


def _check_transport(producer, consumer, transport, reads=1):
    """The pulls went the configured way: ``reads`` NIXL READs on the consumer, or no agent."""
    if transport == "nixl":
        assert _worker(producer).nixl is not None and _worker(consumer).nixl.reads == reads
    else:
        assert _worker(producer).nixl is None and _worker(consumer).nixl is None


def _poll(llm, until, timeout=10.0):
    """Step an engine (its polls pick up finished transfers) until ``until()`` holds."""
    end = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < end, "timed out"
        _core(llm).step()
        time.sleep(0.01)


def _free_all(llm) -> bool:
    kv = _core(llm).kv_cache_manager
    return all(g.pool.get_num_free_blocks() == g.pool.num_usable_blocks for g in kv.groups)


def _prefill(producer, prompt=PROMPT):
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **GREEDY)
    out = producer.generate([prompt], sp, use_tqdm=False)[0]
    params = out.kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    return out, params


def _decode(consumer, params, prompt=PROMPT, max_tokens=8):
    sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params}, **GREEDY)
    return consumer.generate([prompt], sp, use_tqdm=False)[0]


def _pages(llm, block_ids):
    """Per layer, the raw bytes of the given blocks (per group) of the device cache."""
    core = _core(llm)
    caches = core.model_runner.kv_caches
    out = {}
    for gid, g in enumerate(core.kv_cache_config.groups):
        idx = torch.tensor(block_ids[gid], dtype=torch.long)
        for layer in g.layer_indices:
            c = caches[layer]
            out[layer] = c.index_select(1, idx.to(c.device)).contiguous().view(torch.uint8).cpu()
    return out


@pytest.fixture(scope="module")
def colocated(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=40,
              max_model_len=256, dtype="float32", disable_log_stats=True)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"])
def test_round_trip_bit_exact(tiny_llama_dir, colocated, kv_dtype, transport, monkeypatch):
    import kvserve.attention.kv_residual as kv_residual

    fills = []
    orig_fill = kv_residual.fill_from_cache
    monkeypatch.setattr(kv_residual, "fill_from_cache", lambda *a: (fills.append(a[-1]), orig_fill(*a)))
    producer = _llm(tiny_llama_dir, "kv_producer", kv_dtype, transport=transport)
    consumer = _llm(tiny_llama_dir, "kv_consumer", kv_dtype, transport=transport)
    try:
        out_p, params = _prefill(producer)
        assert params["num_prompt_tokens"] == len(PROMPT)
        assert params["kv_layout"]["kv_cache_dtype"] == ("float32" if kv_dtype == "auto" else kv_dtype)
        n_full = (len(PROMPT) - 1 + 15) // 16  # blocks holding prompt tokens 0 .. P-2
        src_ids = [g[:n_full] for g in params["remote_block_ids"]]
        before = _pages(producer, src_ids)
        # Capture the consumer's blocks when the pull landed, before any decode step writes.
        conn = _core(consumer).kv_connector
        seen = {}
        orig = conn.on_kv_connector_output

        def spy(kvo):
            for rid in kvo.finished_recving:
                ids = _core(consumer).kv_cache_manager.get_block_ids(rid)
                seen[rid] = (rid in kvo.failed_recving, _pages(consumer, [g[:n_full] for g in ids]))
            orig(kvo)

        conn.on_kv_connector_output = spy
        out_c = _decode(consumer, params)
        assert len(seen) == 1
        failed, after = next(iter(seen.values()))
        assert not failed
        for layer, t in before.items():
            # Every block but the last holds only transferred tokens: equal bit for bit.
            assert torch.equal(t[:, : n_full - 1], after[layer][:, : n_full - 1]), layer
            # The last block: its first (P-1) % 16 slots came from the producer.
            k = (len(PROMPT) - 1) - (n_full - 1) * 16
            assert torch.equal(t[:, n_full - 1, :k], after[layer][:, n_full - 1, :k]), layer
        assert out_c.num_cached_tokens == len(PROMPT) - 1  # computed one prompt token
        # int4/int2 keep the filling block exact: the consumer did not compute its first
        # (P-1) % 16 tokens, so every layer fills them from the pulled pages (kv_residual).
        n_layers = len(before)
        assert fills == ([k] * n_layers if kv_dtype in ("int4", "int2") and k else [])
        if kv_dtype == "auto":
            ref = colocated.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
            assert list(out_c.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
            assert out_c.outputs[0].token_ids[0] == out_p.outputs[0].token_ids[0]
        # The consumer released: the producer frees its held blocks on its next poll.
        _poll(producer, lambda: _free_all(producer) and not _core(producer).has_kv_transfers())
        assert _free_all(consumer)
        stats = _core(consumer).scheduler.get_stats().kv_connector_stats
        assert stats["kv_transfers"] == 1 and stats["kv_transfer_bytes"] > 0 and stats["load_failures"] == 0
        # Bytes: K and V of every pulled block of every layer, on both sides.
        page = sum(t[:, :1].numel() for t in before.values())
        assert stats["kv_transfer_bytes"] == n_full * page
        assert _core(producer).scheduler.get_stats().kv_connector_stats["kv_transfer_bytes"] == n_full * page
        _check_transport(producer, consumer, transport)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=True), dict(distributed_executor_backend="mp")],
                         ids=["async", "mp"])
def test_round_trip_async_and_mp(tiny_llama_dir, colocated, engine_kw, transport):
    """Async scheduling and worker processes: the consumer's idle engine keeps polling its
    pull (no hang), other requests decode meanwhile, and outputs equal a colocated run's."""
    producer = _llm(tiny_llama_dir, "kv_both", engine_kw=engine_kw, transport=transport)
    consumer = _llm(tiny_llama_dir, "kv_both", engine_kw=engine_kw, transport=transport)
    try:
        _, params = _prefill(producer)
        other = [5, 6, 7, 8, 9, 10]
        sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}, **GREEDY)
        outs = consumer.generate([PROMPT, other], [sp, SamplingParams(max_tokens=8, **GREEDY)], use_tqdm=False)
        ref = colocated.generate([PROMPT, other], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in ref]
        assert outs[0].num_cached_tokens == len(PROMPT) - 1
        assert _core(consumer).scheduler.get_stats().kv_connector_stats["kv_transfers"] == 1
        _poll(producer, lambda: _free_all(producer) and not _core(producer).has_kv_transfers())
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_handshake_mismatch_refused(tiny_llama_dir):
    producer = _llm(tiny_llama_dir, "kv_producer")
    try:
        mine = _core(producer).kv_transfer_info()["kv_layout"]
        other = json.loads(json.dumps(mine))
        other["block_size"] = 32
        other["kv_cache_dtype"] = "fp8_e4m3"
        msg = layout_mismatch(mine, other)
        assert "block_size" in msg and "kv_cache_dtype" in msg
        port = _core(producer).kv_connector.cfg["kv_port"]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            with pytest.raises(KVLayoutMismatch, match="block_size.*kv_cache_dtype"):
                client_handshake(s, other, "test")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            client_handshake(s, mine, "test")  # the same layout is accepted
    finally:
        producer.shutdown()


def test_mismatched_consumer_recomputes(tiny_llama_dir, colocated):
    producer = _llm(tiny_llama_dir, "kv_producer", "fp8_e4m3")
    consumer = _llm(tiny_llama_dir, "kv_consumer")
    try:
        _, params = _prefill(producer)
        out = _decode(consumer, params)
        ref = colocated.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        stats = _core(consumer).scheduler.get_stats().kv_connector_stats
        assert stats["load_failures"] == 1 and stats["kv_transfer_failures"] == 1
        assert out.num_cached_tokens == 0
        # A refused consumer cannot release: the producer's blocks wait for the lease.
        assert _core(producer).has_kv_transfers()
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_lease_expiry_frees_producer_blocks(tiny_llama_dir, transport):
    producer = _llm(tiny_llama_dir, "kv_producer", lease_s=0.5, transport=transport)
    try:
        _, params = _prefill(producer)
        core = _core(producer)
        assert core.has_kv_transfers() and not _free_all(producer)
        time.sleep(0.6)
        _poll(producer, lambda: not core.has_kv_transfers())
        assert _free_all(producer)
        stats = core.scheduler.get_stats().kv_connector_stats
        assert stats["kv_requests_expired"] == 1
    finally:
        producer.shutdown()


def test_producer_unreachable_recompute_and_fail(tiny_llama_dir, colocated, transport):
    producer = _llm(tiny_llama_dir, "kv_producer", transport=transport)
    consumer = _llm(tiny_llama_dir, "kv_consumer", transport=transport)
    failer = _llm(tiny_llama_dir, "kv_consumer", kv_load_failure_policy="fail", transport=transport)
    try:
        _, params = _prefill(producer)
        producer.shutdown()  # killed: nothing listens on its port any more
        out = _decode(consumer, params)
        ref = colocated.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        assert _core(consumer).scheduler.get_stats().kv_connector_stats["load_failures"] == 1
        assert _free_all(consumer)
        out = _decode(failer, params)
        assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
        assert _free_all(failer)
        # Unknown id on a live producer: also a load failure, recomputed.
        p2 = _llm(tiny_llama_dir, "kv_producer", transport=transport)
        try:
            bad = dict(params, remote_port=_core(p2).kv_connector.cfg["kv_port"], remote_request_id="nope")
            t0 = time.monotonic()
            out = _decode(consumer, bad)
            assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
            assert time.monotonic() - t0 < 30
        finally:
            p2.shutdown()
    finally:
        consumer.shutdown()
        failer.shutdown()


def test_abort_while_waiting_frees_both_sides(tiny_llama_dir, transport):
    producer = _llm(tiny_llama_dir, "kv_producer", transport=transport)
    consumer = _llm(tiny_llama_dir, "kv_consumer", transport=transport)
    try:
        _, params = _prefill(producer)
        # Hold the producer's lending so the pull cannot finish before the abort.
        wp = _worker(producer)
        name = "_lend_nixl" if transport == "nixl" else "_send_blocks"
        orig = getattr(wp, name)
        gate = __import__("threading").Event()

        def slow(conn, rid, blocks, *rest):
            gate.wait(5)
            orig(conn, rid, blocks, *rest)

        setattr(wp, name, slow)
        eng = consumer.llm_engine
        sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}, **GREEDY)
        eng.add_request("r1", PROMPT, sp)
        _poll(consumer, lambda: bool(_core(consumer).scheduler.remote_kv.waiting))
        assert not _free_all(consumer)
        eng.abort_request("r1")
        gate.set()
        _poll(consumer, lambda: _free_all(consumer) and not _core(consumer).has_kv_transfers())
        _poll(producer, lambda: _free_all(producer) and not _core(producer).has_kv_transfers())
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_bad_config_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="transport must be 'tcp'"):
        _llm(tiny_llama_dir, "kv_producer", transport="rdma")
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config"):
        _llm(tiny_llama_dir, "kv_producer", bogus=1)
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        _llm(tiny_llama_dir, "kv_consumer", kv_load_failure_policy="maybe")
    with pytest.raises(ValueError, match="cannot be combined"):
        _llm(tiny_llama_dir, "kv_producer", engine_kw=dict(kv_offloading_size=0.01))


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny random Qwen2 with full (layers 0-1) and 8-token sliding-window (2-3) layers."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False, num_hidden_layers=4, use_sliding_window=True,
                      sliding_window=8, max_window_layers=2, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    d = tmp_path_factory.mktemp("hybrid")
    model.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("chunk", [128, 16])
def test_hybrid_groups_round_trip(hybrid_dir, chunk, transport):
    """Two KV cache groups (full + sliding window), prefilled in one or several chunks (the
    producer's window group then nulls early blocks: those ids are 0 and skipped)."""
    kw = dict(block_size=4, num_gpu_blocks_override=96, max_num_batched_tokens=chunk, enable_chunked_prefill=True)

    def mk(role):
        ktc = {"kv_connector": "P2PKVConnector", "kv_role": role,
               "kv_connector_extra_config": {"kv_port": 0, "transport": transport}}
        return LLM(model=hybrid_dir, skip_tokenizer_init=True, max_model_len=256, dtype="float32",
                   disable_log_stats=True, kv_transfer_config=json.dumps(ktc), **kw)

    prompt = [1] + [(11 * i) % 380 + 3 for i in range(40)]
    plain = LLM(model=hybrid_dir, skip_tokenizer_init=True, max_model_len=256, dtype="float32",
                disable_log_stats=True, **kw)
    producer, consumer = mk("kv_producer"), mk("kv_consumer")
    try:
        assert len(_core(producer).kv_cache_config.groups) == 2
        ref = plain.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
        _, params = _prefill(producer, prompt)
        assert len(params["remote_block_ids"]) == 2
        if chunk == 16:
            assert 0 in params["remote_block_ids"][1]  # window blocks freed between chunks
        out = _decode(consumer, params, prompt)
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        assert out.num_cached_tokens == len(prompt) - 1
        _check_transport(producer, consumer, transport)
        _poll(producer, lambda: _free_all(producer) and not _core(producer).has_kv_transfers())
        assert _free_all(consumer)
    finally:
        for x in (plain, producer, consumer):
            x.shutdown()


def test_producer_abort_and_cached_prompt_release(tiny_llama_dir):
    """Aborting a finished, lending request on the producer frees its blocks; a consumer whose
    prefix cache already holds the prompt pulls nothing and releases the producer's blocks."""
    producer = _llm(tiny_llama_dir, "kv_producer")
    consumer = _llm(tiny_llama_dir, "kv_consumer")
    try:
        _, params = _prefill(producer)
        core = _core(producer)
        core.abort_requests([params["remote_request_id"]])
        _poll(producer, lambda: _free_all(producer) and not core.has_kv_transfers())
        # The consumer computes the prompt once (plain), then a decode leg finds it all cached.
        consumer.generate([PROMPT + [9]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
        _, params = _prefill(producer)
        out = _decode(consumer, params)
        assert out.num_cached_tokens >= 32  # its own prefix cache, no pull
        _poll(producer, lambda: _free_all(producer) and not core.has_kv_transfers())
        stats = _core(consumer).scheduler.get_stats().kv_connector_stats
        # Where the local hit covers the prompt to a token (a partial-block hit, as on the CPU)
        # nothing is pulled; where that partial hit is not taken (seen on CUDA), only the
        # tokens past the 2 full blocks are.
        assert stats.get("kv_transfers", 0) <= 1 and stats.get("remote_prefill_tokens", 0) <= len(PROMPT) - 1 - 32
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_tensor_parallel_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor/pipeline parallelism"):
        _llm(tiny_llama_dir, "kv_consumer", engine_kw=dict(tensor_parallel_size=2, device="cpu"))


def test_producer_abort_during_pull_waits_for_it(tiny_llama_dir, colocated, monkeypatch, transport):
    """A producer-side abort while a consumer reads the blocks frees them only after that read:
    the consumer still gets valid KV (its output equals the colocated run's)."""
    import threading

    from kvserve.kv_connector.p2p import worker_side

    producer = _llm(tiny_llama_dir, "kv_producer", transport=transport)
    consumer = _llm(tiny_llama_dir, "kv_consumer", transport=transport)
    gate, reading = threading.Event(), threading.Event()
    orig = worker_side.send_frame
    # The producer's first data frame: a layer's pages (tcp) or its NIXL descriptor (the
    # blocks are pinned from there until the consumer reports its READ over).
    first = "nixl" if transport == "nixl" else "layer"

    def gated(sock, header, payload=None):
        if header.get("op") == first and not gate.is_set():
            reading.set()
            gate.wait(10)
        orig(sock, header, payload)

    try:
        _, params = _prefill(producer)
        rid = params["remote_request_id"]
        monkeypatch.setattr(worker_side, "send_frame", gated)
        sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}, **GREEDY)
        consumer.llm_engine.add_request("c1", PROMPT, sp)
        _poll(consumer, reading.is_set)
        core = _core(producer)
        core.abort_requests([rid])
        for _ in range(5):
            core.step()
        assert not _free_all(producer)  # still read by the pull
        gate.set()
        outs, end = [], time.monotonic() + 10
        while not outs:  # the engine's own step: its outputs reach the output processor
            assert time.monotonic() < end
            outs.extend(o for o in consumer.llm_engine.step() if o.finished)
        ref = colocated.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
        assert list(outs[0].outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        assert outs[0].num_cached_tokens == len(PROMPT) - 1
        _check_transport(producer, consumer, transport)
        _poll(producer, lambda: _free_all(producer) and not core.has_kv_transfers())
    finally:
        gate.set()
        producer.shutdown()
        consumer.shutdown()
