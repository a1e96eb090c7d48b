"""CPU tier (``--kv-offloading-size``) and swap preemption on a tiny random Llama.

The device pool is kept small (20-24 blocks of 16 tokens) so the working set spills: the
outputs must be the same greedy tokens with the tier on or off, with swap or recompute,
and hits / recomputed tokens are counted exactly.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def _llm(path, **kw):
    args = dict(model=path, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=24, max_model_len=320,
                dtype="float32",  # the same numerics on a GPU as on the CPU (bf16 there flips near-ties)
                max_num_batched_tokens=128, max_num_seqs=16, disable_log_stats=True)
    args.update(kw)
    return LLM(**args)


def _assert_whole(llm):
    """After every request finished: device blocks all free, host slots all accounted for."""
    core = llm.llm_engine.engine_core
    kv = core.kv_cache_manager
    kv.check_invariants()
    assert not core.has_unfinished_requests()
    for g in kv.groups:
        assert g.pool.get_num_free_blocks() == g.pool.num_usable_blocks
    if core.kv_connector is not None:
        core.kv_connector.check_invariants()
        assert not core.kv_connector._swap and not core.kv_connector._reqs


def _multi_turn(llm, num_convs=6, turns=4, seed=0):
    """Each turn's prompt is the conversation so far (previous prompt + answer + 20 new tokens)."""
    rng = random.Random(seed)
    convs = [[rng.randrange(3, 256) for _ in range(40)] for _ in range(num_convs)]
    outs = []
    for _ in range(turns):
        res = llm.generate(convs, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
        for c, r in zip(convs, res):
            toks = list(r.outputs[0].token_ids)
            outs.append((toks, r.num_cached_tokens))
            c.extend(toks)
            c.extend(rng.randrange(3, 256) for _ in range(20))
    return outs


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return {
        "off": _llm(tiny_llama_dir),
        "nocache": _llm(tiny_llama_dir, enable_prefix_caching=False),
        "cpu": _llm(tiny_llama_dir, kv_offloading_size=0.01),
        "swap": _llm(tiny_llama_dir, kv_offloading_size=0.01, preemption_mode="swap"),
        # Async scheduling (the CUDA default) schedules a step while the previous one runs.
        "cpu_async": _llm(tiny_llama_dir, kv_offloading_size=0.01, async_scheduling=True),
        "swap_async": _llm(tiny_llama_dir, kv_offloading_size=0.01, preemption_mode="swap", async_scheduling=True),
        # 24 host blocks: the tier itself evicts (LRU) during the workload.
        "tiny_tier": _llm(tiny_llama_dir, kv_offloading_size=24 * 4096 / 2**30),
    }


def test_multi_turn_same_tokens_and_tier_hits(engines):
    ref = _multi_turn(engines["nocache"])
    base = engines["off"].llm_engine.engine_core.scheduler.get_stats().prefix_cache_hits
    for name in ("off", "cpu", "swap", "tiny_tier", "cpu_async", "swap_async"):
        got = _multi_turn(engines[name])
        assert [t for t, _ in got] == [t for t, _ in ref], name
        _assert_whole(engines[name])
    cpu = engines["cpu"].llm_engine.engine_core
    stats = cpu.scheduler.get_stats()
    tier = stats.kv_connector_stats
    # Hits counted exactly: the tier's hit tokens are whole blocks it loaded, and they are
    # part of the prefix-cache hits the requests report as cached tokens.
    assert tier["hit_tokens"] == tier["blocks_loaded"] * 16 > 0
    assert stats.prefix_cache_hits > base
    cached = sum(n for _, n in _multi_turn(engines["cpu"], seed=5))
    assert cached == cpu.scheduler.get_stats().prefix_cache_hits - stats.prefix_cache_hits
    assert engines["tiny_tier"].llm_engine.engine_core.kv_connector.get_stats()["blocks_evicted"] > 0


def test_returning_turn_hits_the_tier_not_the_device(tiny_llama_dir):
    """A conversation pushed out of the device pool comes back from the CPU tier whole."""
    llm = _llm(tiny_llama_dir, kv_offloading_size=0.01, num_gpu_blocks_override=12, max_model_len=176)
    rng = random.Random(3)
    first = [rng.randrange(3, 256) for _ in range(80)]  # 5 full blocks
    sp = SamplingParams(max_tokens=4, **GREEDY)
    llm.generate([first], sp, use_tqdm=False)
    for _ in range(3):  # other prompts evict every cached device block
        llm.generate([[rng.randrange(3, 256) for _ in range(150)]], sp, use_tqdm=False)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.get_computed_blocks(_req(first + [7, 8, 9]))[1] == 0  # nothing left on the device
    before = llm.llm_engine.engine_core.kv_connector.get_stats()["hit_tokens"]
    out = llm.generate([first + [7, 8, 9]], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 80
    assert llm.llm_engine.engine_core.kv_connector.get_stats()["hit_tokens"] - before == 80
    _assert_whole(llm)


def _req(tokens):
    from kvserve.request import Request

    return Request("probe", tokens, SamplingParams())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_preemption_recomputes_nothing(tiny_llama_dir, async_scheduling):
    """With async scheduling a victim's last full block fills in the step still in flight: it
    must be copied out before the next forward reuses the freed block (it once went with the
    after-forward saves and came back overwritten)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
    sp = SamplingParams(max_tokens=48, **GREEDY)
    res = {}
    for mode in ("recompute", "swap"):
        kw = dict(preemption_mode=mode, kv_offloading_size=0.01) if mode == "swap" else {}
        llm = _llm(tiny_llama_dir, num_gpu_blocks_override=20, max_model_len=300, async_scheduling=async_scheduling,
                   **kw)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        stats = llm.llm_engine.engine_core.scheduler.get_stats()
        res[mode] = ([list(o.outputs[0].token_ids) for o in outs], stats)
        _assert_whole(llm)
    assert res["swap"][0] == res["recompute"][0]
    assert res["recompute"][1].num_preemptions > 0 and res["recompute"][1].num_recomputed_tokens > 0
    assert res["swap"][1].num_preemptions > 0 and res["swap"][1].num_recomputed_tokens == 0
    assert res["swap"][1].kv_connector_stats["swap_in_blocks"] > 0


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_same_tokens(engines, data):
    """Requests sharing conversation prefixes arrive at random steps; every configuration
    gives every request the same greedy tokens, and leaks nothing."""
    seed = data.draw(st.integers(0, 10**6))
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 256) for _ in range(rng.randrange(16, 90))] for _ in range(3)]
    reqs = []
    for i in range(10):
        p = rng.choice(bases) + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))]
        reqs.append((rng.randrange(0, 30), f"r{i}", p, rng.randrange(1, 24)))
    results = {}
    for name in ("nocache", "cpu", "swap", "cpu_async", "swap_async"):
        eng = engines[name].llm_engine
        pending = sorted(reqs)
        out, step = {}, 0
        while pending or eng.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, rid, p, n = pending.pop(0)
                eng.add_request(f"{seed}-{rid}", p, SamplingParams(max_tokens=n, **GREEDY))
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
        results[name] = out
        _assert_whole(engines[name])
    for name in ("cpu", "swap", "cpu_async", "swap_async"):
        assert results[name] == results["nocache"], name


def test_bad_flags(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv-offloading-size"):
        _llm(tiny_llama_dir, preemption_mode="swap")
    with pytest.raises(ValueError, match="kv_offloading_size"):
        _llm(tiny_llama_dir, kv_offloading_size=0)
    with pytest.raises(ValueError, match="holds no block"):
        _llm(tiny_llama_dir, kv_offloading_size=1e-9)


def test_worker_process_executor(engines, tiny_llama_dir):
    """With ``mp`` the worker half (host pool, copies) lives in the worker process; the
    metadata crosses as pickled plain data."""
    pytest.importorskip("zmq")  # the mp executor's channel (absent on the GPU machine)
    llm = _llm(tiny_llama_dir, kv_offloading_size=0.01, preemption_mode="swap", distributed_executor_backend="mp")
    try:
        got = _multi_turn(llm, num_convs=4, turns=3, seed=7)
        ref = _multi_turn(engines["nocache"], num_convs=4, turns=3, seed=7)
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert llm.llm_engine.engine_core.kv_connector.get_stats()["hit_tokens"] > 0
        _assert_whole(llm)
    finally:
        llm.shutdown()
