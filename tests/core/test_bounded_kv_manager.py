"""Bounded-KV block accounting without a model (``kvserve.core.bounded_kv``): StreamingLLM and
H2O under the real scheduler with random arrivals, chunked prefill and preemption (bounds
after every step, evictions mirrored to the workers, no leak or double free); H2O's choice of
blocks from a scripted score source; requests past max_model_len; the flag resolver."""

from __future__ import annotations

import random

import pytest

from kvserve.config import SchedulerConfig, resolve_bounded_kv
from kvserve.core.bounded_kv import BoundedKVManager, sink_shift
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_spec import (
    BoundedKVSpec, KVCacheConfig, KVCacheGroup, make_kv_cache_config, max_request_tokens,
)
from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def _manager(num_blocks, policy="streaming", sinks=4, window=8, budget=0) -> KVCacheManager:
    spec = BoundedKVSpec(BS, 1, 1, "float32", "float32", policy=policy, sink_tokens=sinks, window=window,
                         budget_tokens=budget or sinks + window)
    return KVCacheManager(KVCacheConfig([KVCacheGroup(0, [0, 1], spec, num_blocks)]), True)


def _run(sched, rng, check, mass=None):
    """Drive the scheduler with random tokens; mirror block tables the way workers do."""
    tables: dict[str, list[int]] = {}
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for rid in out.preempted_req_ids:
            tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            tables[new.req_id] = list(new.block_ids[0])
        for rid, ids in zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.new_block_ids):
            if ids is not None:
                tables[rid].extend(ids[0])
        for rid, entries in out.evicted_blocks.items():
            for gid, col in entries:
                tables[rid][col] = 0
        for rid in out.num_scheduled_tokens:  # the worker's mirror equals the scheduler's table
            assert tables[rid] == sched.kv.get_block_ids(rid)[0], rid
        toks = {rid: [rng.randrange(6)] for rid in out.num_scheduled_tokens if sched.requests[rid].num_pending_tokens}
        scores = mass(out) if mass is not None else {}
        sched.update_from_output(out, ModelRunnerOutput(toks, kv_block_mass=scores))
        check(sched)
        steps += 1
    return steps


@pytest.mark.parametrize("policy,sinks,window,budget", [
    ("streaming", 4, 8, 0), ("streaming", 0, 5, 0), ("streaming", 6, 13, 0), ("h2o", 4, 8, 32), ("h2o", 0, 4, 20),
])
def test_bounds_after_every_step_and_no_leak(policy, sinks, window, budget):
    """Random prompts (chunked: chunks longer than the window), outputs past max_model_len,
    preemption under a small pool: a running request holds at most its bound after every step."""
    rng = random.Random(window + budget)
    probe = _manager(2, policy, sinks, window, budget).kv_cache_config.groups[0].spec
    # One request's prefill chunk plus about one more request: small enough to preempt.
    kv = _manager(probe.prefill_blocks(24) + probe.budget_blocks + 1, policy, sinks, window, budget)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64), kv)
    for i in range(14):
        n = rng.randint(1, 60)
        sched.add_request(Request(f"r{i}", [rng.randrange(6) for _ in range(n)],
                                  SamplingParams(max_tokens=rng.randint(1, 90), ignore_eos=True),
                                  arrival_time=float(i)))
    spec = kv.kv_cache_config.groups[0].spec
    bound = spec.budget_blocks
    seen, lengths = [], []

    def check(s):
        for req in s.running:
            live = kv.num_live_blocks(req.request_id)[0]
            assert live <= bound, (req.request_id, req.num_computed_tokens, live)
            seen.append(live)
            lengths.append(req.num_tokens)
        kv.check_invariants()

    rnd = random.Random(1)

    def mass(out):  # h2o: random scores for the blocks each scheduled request holds
        return {rid: {0: {c: rnd.random() for c, b in enumerate(kv.get_block_ids(rid)[0]) if b}}
                for rid in out.num_scheduled_tokens}

    assert _run(sched, rng, check, mass if policy == "h2o" else None) > 10
    assert max(lengths) > 64  # past max_model_len with bounded blocks
    assert max(seen) >= bound - 1  # long requests reach the bound: blocks really are freed
    assert sched.num_preemptions > 0 and kv.num_evicted_blocks > 0
    assert kv.num_evicted_tokens == BS * kv.num_evicted_blocks
    g = kv.groups[0]
    assert g.pool.get_num_free_blocks() == g.pool.num_usable_blocks


def test_h2o_keeps_sinks_window_and_heaviest_blocks():
    """A scripted score source: with a budget of 6 blocks, a 40-token request keeps its sink
    block, the window blocks and the heaviest of the rest; the lightest go first."""
    kv = _manager(30, "h2o", sinks=4, window=8, budget=24)
    g = kv.groups[0]
    assert isinstance(g, BoundedKVManager) and g.budget_blocks == 6
    req = Request("a", list(range(40)), SamplingParams(max_tokens=5))
    assert kv.allocate_slots(req, 40, kv.get_computed_blocks(req)[0]) is not None
    req.num_computed_tokens = 40
    assert kv.num_live_blocks("a") == (10,)  # the prefill holds every block
    kv.observe_block_mass("a", {0: {1: 0.1, 2: 5.0, 3: 0.2, 4: 3.0, 5: 0.3, 6: 0.05, 7: 9.0}})
    kv.evict_after_step(req, 40)
    ids = kv.get_block_ids("a")[0]
    kept = [c for c, b in enumerate(ids) if b]
    # col 0: sink; cols 8-9: the window of position 40 (33..40); heaviest of 1..7: 7, 2, 4.
    assert kept == [0, 2, 4, 7, 8, 9]
    assert sorted(c for _, c in kv.take_evictions()["a"]) == [1, 3, 5, 6]
    # The next allocation (a new block at token 40) evicts the lightest remaining: col 4.
    req.append_output_token(1)
    kv.observe_block_mass("a", {0: {2: 1.0, 4: 0.5}})
    assert kv.allocate_slots(req, 1) is not None
    assert [c for c, b in enumerate(kv.get_block_ids("a")[0]) if b] == [0, 2, 7, 8, 9, 10]
    kv.free(req)
    assert g.pool.get_num_free_blocks() == g.pool.num_usable_blocks


def test_streaming_frees_between_sinks_and_window():
    kv = _manager(30, "streaming", sinks=5, window=6)
    req = Request("a", list(range(30)), SamplingParams(max_tokens=5))
    assert kv.allocate_slots(req, 30, kv.get_computed_blocks(req)[0]) is not None
    req.num_computed_tokens = 30
    kv.evict_after_step(req, 30)
    # Sinks: 2 blocks (5 tokens); window of position 30: 25..30 -> cols 6, 7.
    assert [c for c, b in enumerate(kv.get_block_ids("a")[0]) if b] == [0, 1, 6, 7]
    assert sink_shift(30, 5, 6, BS) == 4 * (25 // 4 - 2)


def test_pool_sizing_treats_bounded_groups_as_unbounded_length():
    spec = BoundedKVSpec(16, 2, 8, "float32", "float32", policy="streaming", sink_tokens=4, window=128,
                         budget_tokens=132)
    cfg = make_kv_cache_config({0: spec, 1: spec}, 100 * 2 * spec.page_size_bytes, None, 4096, 512)
    assert max_request_tokens(cfg, 512) is None
    assert spec.max_blocks_per_request(4096) == 1 + 8 + 1


@pytest.mark.parametrize("args,expect", [
    (("none", None, 100, None), ("streaming", 4, 100, 104)),
    (("streaming", 0, None, 64), ("streaming", 0, 64, 64)),
    (("h2o", None, None, 256), ("h2o", 4, 128, 256)),
    (("none", None, None, None), ("none", None, None, None)),
])
def test_resolver(args, expect):
    d = resolve_bounded_kv(*args, block_size=16)
    assert (d["kv_eviction_policy"], d["attention_sinks"], d["max_attention_window"], d["kv_budget_tokens"]) == expect
