"""Tests for kvserve.core.scheduler, driven by a fake model loop (no torch).

A step is ``schedule()``; every request whose scheduled tokens reach the end of its
sequence "samples" a token; ``update_from_output()``.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler
from sched_view import StepView
from sched_view import schedule as _schedule
from sched_view import update as _update
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

_arrival = itertools.count(1)


def make(num_blocks=64, block_size=4, max_num_seqs=16, budget=32, max_model_len=1024,
         chunked=True, policy="fcfs", caching=True) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
        enable_chunked_prefill=chunked, scheduling_policy=policy,
    )
    return Scheduler(cfg, KVCacheManager.for_blocks(num_blocks, block_size, caching))


def mkreq(rid, prompt, max_tokens=4, priority=0, eos=None, arrival=None, **sp) -> Request:
    return Request(
        rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sp),
        arrival_time=float(next(_arrival)) if arrival is None else arrival,
        priority=priority, eos_token_id=eos,
    )


def default_token(r: Request) -> int:
    return 1000 + r.num_output_tokens


def step(s: Scheduler, token=default_token) -> StepView:
    sched = _schedule(s)
    assert sched.num_scheduled_tokens == sum(n for _, n in sched.scheduled)
    assert sched.num_scheduled_tokens <= s.config.max_num_batched_tokens
    assert len(sched.scheduled) <= s.config.max_num_seqs
    sampled = {r.request_id: token(r) for (r, _), smp in zip(sched.scheduled, sched.samples) if smp}
    _update(s, sched, sampled)
    s.kv.pool.check_invariants()
    return sched


def pairs(sched: StepView) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in sched.scheduled]


def run_to_end(s: Scheduler, token=default_token, max_steps=500) -> list[StepView]:
    out = []
    while s.has_unfinished_requests():
        out.append(step(s, token))
        assert len(out) < max_steps, "scheduler made no progress"
    return out


def assert_all_free(s: Scheduler) -> None:
    pool = s.kv.pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert s.kv.req_to_blocks == {}
    pool.check_invariants()


# ---- budgets and chunked prefill ---------------------------------------------------------------


def test_single_request_lifecycle():
    s = make()
    r = mkreq("a", range(5), max_tokens=3)
    s.add_request(r)
    assert s.has_unfinished_requests()
    with pytest.raises(ValueError):
        s.add_request(mkreq("a", range(3)))
    sched = step(s)
    assert pairs(sched) == [("a", 5)]
    assert sched.block_ids == {"a": [1, 2]}
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 5
    assert r.output_token_ids == [1000]
    assert r.first_scheduled_time is not None and r.first_token_time is not None
    assert r.num_cached_tokens == 0
    assert pairs(step(s)) == [("a", 1)]
    assert pairs(step(s)) == [("a", 1)]
    assert r.output_token_ids == [1000, 1001, 1002]
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_computed_tokens == 7  # the last sampled token is never computed
    assert not s.has_unfinished_requests()
    assert s.requests == {} and s.running == []
    assert step(s).is_empty
    assert_all_free(s)


def test_chunked_prefill_splits_prompt_and_mixes_decodes():
    s = make(budget=8)
    a = mkreq("a", range(3), max_tokens=10)
    s.add_request(a)
    assert pairs(step(s)) == [("a", 3)]
    b = mkreq("b", range(100, 120), max_tokens=3)  # 20-token prompt
    s.add_request(b)
    sched = step(s)
    assert pairs(sched) == [("a", 1), ("b", 7)]
    assert sched.block_ids["b"] == [2, 3]
    assert (b.num_computed_tokens, b.num_output_tokens) == (7, 0)
    assert pairs(step(s)) == [("a", 1), ("b", 7)]
    assert (b.num_computed_tokens, b.num_output_tokens) == (14, 0)
    assert pairs(step(s)) == [("a", 1), ("b", 6)]
    assert (b.num_computed_tokens, b.num_output_tokens) == (20, 1)
    assert pairs(step(s)) == [("a", 1), ("b", 1)]
    assert pairs(step(s)) == [("a", 1), ("b", 1)]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 3
    run_to_end(s)
    assert a.num_output_tokens == 10
    assert_all_free(s)


def test_chunked_prefill_alone_uses_full_budget():
    s = make(budget=8)
    c = mkreq("c", range(20), max_tokens=2)
    s.add_request(c)
    assert [pairs(step(s)) for _ in range(4)] == [[("c", 8)], [("c", 8)], [("c", 4)], [("c", 1)]]
    assert c.output_token_ids == [1000, 1001]
    assert_all_free(s)


def test_no_chunking_prompt_waits_for_budget():
    s = make(budget=10, chunked=False)
    a = mkreq("a", range(3), max_tokens=2)
    s.add_request(a)
    assert pairs(step(s)) == [("a", 3)]
    b = mkreq("b", range(100, 110), max_tokens=2)  # exactly the whole budget
    c = mkreq("c", range(200, 202), max_tokens=2)
    s.add_request(b)
    s.add_request(c)
    # a's decode leaves 9 < 10: b waits, and c waits behind it (FCFS head of line).
    assert pairs(step(s)) == [("a", 1)]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.request_id not in s.kv.req_to_blocks
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert pairs(step(s)) == [("b", 10)]
    assert pairs(step(s)) == [("b", 1), ("c", 2)]
    run_to_end(s)
    assert_all_free(s)


def test_same_setup_with_chunking_fills_budget():
    s = make(budget=10, chunked=True)
    s.add_request(mkreq("a", range(3), max_tokens=2))
    assert pairs(step(s)) == [("a", 3)]
    s.add_request(mkreq("b", range(100, 110), max_tokens=2))
    s.add_request(mkreq("c", range(200, 202), max_tokens=2))
    assert pairs(step(s)) == [("a", 1), ("b", 9)]
    assert pairs(step(s)) == [("b", 1), ("c", 2)]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2, budget=100)
    reqs = [mkreq(f"r{i}", range(10 * i, 10 * i + 3), max_tokens=2) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    assert pairs(step(s)) == [("r0", 3), ("r1", 3)]
    assert len(s.running) == 2 and len(s.waiting) == 3
    assert pairs(step(s)) == [("r0", 1), ("r1", 1)]  # both finish
    assert pairs(step(s)) == [("r2", 3), ("r3", 3)]
    run_to_end(s)
    assert [r.num_output_tokens for r in reqs] == [2] * 5


def test_max_model_len_caps_sequence():
    s = make(max_model_len=10)
    r = mkreq("a", range(8), max_tokens=None)
    s.add_request(r)
    run_to_end(s)
    assert r.output_token_ids == [1000, 1001]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"


def test_identical_prompts_admitted_together_share_blocks():
    s = make()
    a = mkreq("a", range(9), max_tokens=2)
    b = mkreq("b", range(9), max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    sched = step(s)
    assert pairs(sched) == [("a", 9), ("b", 1)]
    assert sched.block_ids == {"a": [1, 2, 3], "b": [1, 2, 4]}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (18, 8)
    assert [s.kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    stats = s.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.prefix_cache_hits) == (2, 0, 8)
    run_to_end(s)
    assert_all_free(s)


# ---- admission order -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, order", [
    ("fcfs", ["r1", "r2", "r3", "r4"]),
    ("priority", ["r2", "r4", "r3", "r1"]),
])
def test_admission_order(policy, order):
    s = make(max_num_seqs=1, policy=policy)
    for rid, prio, arr in (("r1", 2, 1.0), ("r2", 0, 2.0), ("r3", 1, 3.0), ("r4", 0, 4.0)):
        s.add_request(mkreq(rid, [int(rid[1])] * 3, max_tokens=1, priority=prio, arrival=arr))
    admitted = [pairs(step(s)) for _ in range(4)]
    assert admitted == [[(rid, 3)] for rid in order]
    assert not s.has_unfinished_requests()


def test_priority_orders_running_requests_under_a_short_budget():
    s = make(budget=2, policy="priority")
    lo = mkreq("lo", [1], max_tokens=5, priority=1, arrival=1.0)
    hi = mkreq("hi", [2], max_tokens=5, priority=0, arrival=2.0)
    s.add_request(lo)
    s.add_request(hi)
    assert pairs(step(s)) == [("hi", 1), ("lo", 1)]
    s.config.max_num_batched_tokens = 1
    assert pairs(step(s)) == [("hi", 1)]
    assert pairs(step(s)) == [("hi", 1)]


# ---- preemption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, victim, survivors", [
    ("fcfs", "c", ["a", "b"]),  # latest arrival
    ("priority", "b", ["a", "c"]),  # largest priority number, despite arriving before c
])
def test_preemption_victim_and_recovery(policy, victim, survivors):
    # 6 usable blocks of 4; three 4-token prompts: 1 block each, then 2 each after one decode,
    # then at 9 computed tokens the first in order needs a third block.
    s = make(num_blocks=7, block_size=4, budget=32, policy=policy)
    reqs = {
        "a": mkreq("a", range(0, 4), max_tokens=10, priority=0, arrival=1.0),
        "b": mkreq("b", range(10, 14), max_tokens=10, priority=2, arrival=2.0),
        "c": mkreq("c", range(20, 24), max_tokens=10, priority=1, arrival=3.0),
    }
    for r in reqs.values():
        s.add_request(r)
    for i in range(5):
        sched = step(s)
        assert sched.preempted == []
        assert sorted(pairs(sched)) == [(k, 4 if i == 0 else 1) for k in "abc"]
    assert s.kv.pool.get_num_free_blocks() == 0
    sched = step(s)
    v = reqs[victim]
    assert sched.preempted == [v]
    assert pairs(sched) == [(k, 1) for k in survivors]
    assert v.status == RequestStatus.PREEMPTED
    assert v.num_computed_tokens == 0
    assert v.num_preemptions == 1 and s.num_preemptions == 1
    assert v.output_token_ids == [1000 + i for i in range(5)]  # kept for recompute
    assert v.request_id not in s.kv.req_to_blocks
    assert list(s.waiting) == [v]
    assert v not in s.running
    run_to_end(s)
    for r in reqs.values():
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [1000 + i for i in range(10)]
    assert reqs["a"].num_preemptions == 0  # the best request is never the victim
    assert sum(r.num_preemptions for r in reqs.values()) == s.num_preemptions >= 1
    assert_all_free(s)


def test_preempted_request_is_recomputed_with_its_outputs():
    s = make(num_blocks=5, block_size=4)  # 4 usable blocks
    a = mkreq("a", range(0, 4), max_tokens=10, arrival=1.0)
    b = mkreq("b", range(10, 14), max_tokens=10, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    scheds = run_to_end(s)
    log = [(pairs(x), [r.request_id for r in x.preempted]) for x in scheds]
    # Steps 1-5: both run; step 6: a needs a 3rd block, b (later arrival) is preempted.
    assert log[5] == ([("a", 1)], ["b"])
    assert all(p == [] for _, p in log[:5])
    # b is readmitted once a is done (a finishes at step 10), recomputing prompt + 5 outputs.
    assert log[9][0] == [("a", 1)]
    assert a.finished_time is not None and a.status == RequestStatus.FINISHED_LENGTH
    assert log[10] == ([("b", 9)], [])
    assert len(log) == 15
    assert b.output_token_ids == [1000 + i for i in range(10)]
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert_all_free(s)


def test_recompute_reuses_its_own_cached_blocks_counted_apart():
    s = make(num_blocks=6, block_size=4)  # 5 usable blocks
    a = mkreq("a", range(0, 4), max_tokens=8, arrival=1.0)
    b = mkreq("b", range(10, 19), max_tokens=5, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    scheds = run_to_end(s)
    log = [(pairs(x), [r.request_id for r in x.preempted], x.block_ids) for x in scheds]
    assert log[0] == ([("a", 4), ("b", 9)], [], {"a": [1], "b": [2, 3, 4]})
    # Step 5: b (12 computed tokens, 3 full cached blocks) is preempted; its blocks stay cached.
    assert log[4][:2] == ([("a", 1)], ["b"])
    # a takes b's leaf block 4 (LRU among leaves) for its third block.
    assert log[5][2] == {"a": [1, 5, 4]}
    # b's recompute finds its own blocks 2 and 3: 8 of its 13 tokens.
    assert log[8] == ([("b", 5)], [], {"b": [2, 3, 4, 5]})
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (13, 0)  # first admissions only
    assert (s.prefix_cache_recompute_queries, s.prefix_cache_recompute_hits) == (13, 8)
    st_ = s.get_stats()
    assert (st_.prefix_cache_recompute_queries, st_.prefix_cache_recompute_hits) == (13, 8)
    assert b.num_cached_tokens == 0 and b.output_token_ids == [1000 + i for i in range(5)]
    assert_all_free(s)


def test_scheduler_emits_copy_on_write_for_a_hit_inside_a_block():
    s = make(block_size=4)
    a = mkreq("a", range(12), max_tokens=1)
    s.add_request(a)
    run_to_end(s)
    b = mkreq("b", [0, 1, 2, 3, 4, 5, 99, 98], max_tokens=2)
    s.add_request(b)
    sched = step(s)
    assert pairs(sched) == [("b", 2)]  # tokens 0-5 come from the cache
    assert sched.block_ids == {"b": [1, 4]}
    assert sched.kv_copies == [(2, 4, 2)]
    assert b.num_cached_tokens == 6
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 6)
    assert step(s).kv_copies == []
    assert_all_free(s) if not s.has_unfinished_requests() else run_to_end(s)
    assert_all_free(s)


def test_no_admission_in_a_step_that_preempts():
    s = make(num_blocks=3, block_size=4)  # 2 usable blocks
    a = mkreq("a", range(4), max_tokens=3, arrival=1.0)
    b = mkreq("b", range(10, 14), max_tokens=3, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    assert pairs(step(s)) == [("a", 4), ("b", 4)]
    s.add_request(mkreq("c", [99], max_tokens=1, arrival=3.0))
    sched = step(s)  # a needs a 2nd block: b is preempted, c must not be admitted
    assert pairs(sched) == [("a", 1)]
    assert sched.preempted == [b]
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # preempted go to the front
    run_to_end(s)
    assert_all_free(s)


def test_two_victims_in_one_step_keep_arrival_order_in_waiting():
    s = make(num_blocks=4, block_size=4)  # 3 usable blocks
    a, b, c = (mkreq(k, range(10 * i, 10 * i + 4), max_tokens=3, arrival=float(i + 1))
               for i, k in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    assert pairs(step(s)) == [("a", 4), ("b", 4), ("c", 4)]
    sched = step(s)
    # a takes c's block; b then needs one too, and is itself the worst left.
    assert pairs(sched) == [("a", 1)]
    assert sched.preempted == [c, b]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.running == [a]
    assert (b.num_computed_tokens, c.num_computed_tokens) == (0, 0)
    assert s.get_stats().num_preemptions == 2
    run_to_end(s)
    assert [r.num_output_tokens for r in (a, b, c)] == [3, 3, 3]
    assert_all_free(s)


# ---- stop rules ------------------------------------------------------------------------------------


def run_one(tokens, prompt=(1, 2, 3), max_model_len=1024, **kw) -> Request:
    s = make(max_model_len=max_model_len)
    r = mkreq("x", prompt, **kw)
    s.add_request(r)
    it = iter(tokens)
    run_to_end(s, token=lambda _r: next(it))
    assert_all_free(s)
    assert s.requests == {}
    return r


@pytest.mark.parametrize("kw, tokens, outputs, status, stop_reason", [
    (dict(max_tokens=3), [5, 6, 7, 8], [5, 6, 7], RequestStatus.FINISHED_LENGTH, None),
    (dict(max_tokens=1), [5, 6], [5], RequestStatus.FINISHED_LENGTH, None),
    # eos
    (dict(max_tokens=10, eos=2), [5, 2, 6], [5, 2], RequestStatus.FINISHED_STOPPED, None),
    (dict(max_tokens=10, eos=2), [2, 6], [2], RequestStatus.FINISHED_STOPPED, None),
    (dict(max_tokens=4, eos=None), [2, 2, 2, 2, 2], [2, 2, 2, 2], RequestStatus.FINISHED_LENGTH, None),
    (dict(max_tokens=4, eos=2, ignore_eos=True), [2, 2, 2, 2, 2], [2, 2, 2, 2], RequestStatus.FINISHED_LENGTH, None),
    # stop_token_ids (also with ignore_eos: it only ignores EOS)
    (dict(max_tokens=10, stop_token_ids=[9]), [5, 9, 6], [5, 9], RequestStatus.FINISHED_STOPPED, 9),
    (dict(max_tokens=10, stop_token_ids=[8, 9], ignore_eos=True, eos=9), [5, 9, 6], [5, 9], RequestStatus.FINISHED_STOPPED, 9),
    # min_tokens suppresses eos / stop ids until that many outputs exist
    (dict(max_tokens=10, min_tokens=3, eos=2), [2, 2, 2, 2], [2, 2, 2], RequestStatus.FINISHED_STOPPED, None),
    (dict(max_tokens=10, min_tokens=3, stop_token_ids=[9]), [9, 9, 5, 9, 7], [9, 9, 5, 9], RequestStatus.FINISHED_STOPPED, 9),
    (dict(max_tokens=2, min_tokens=2, eos=2), [2, 5, 7], [2, 5], RequestStatus.FINISHED_LENGTH, None),
])
def test_stop_rules(kw, tokens, outputs, status, stop_reason):
    r = run_one(tokens, **kw)
    assert r.output_token_ids == outputs
    assert r.status == status
    assert r.stop_reason == stop_reason
    assert r.finish_reason == {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}[status]
    assert r.all_token_ids == [1, 2, 3] + outputs


def test_update_returns_requests_that_got_a_token():
    s = make(budget=4)
    a = mkreq("a", range(2), max_tokens=1)
    b = mkreq("b", range(10, 16), max_tokens=2)  # needs two chunks
    s.add_request(a)
    s.add_request(b)
    sched = _schedule(s)
    assert pairs(sched) == [("a", 2), ("b", 2)]
    got = _update(s, sched, {"a": 3})
    assert got == [a] and a.is_finished and b.num_output_tokens == 0


# ---- aborts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_running_and_waiting(policy):
    s = make(max_num_seqs=1, policy=policy)
    a = mkreq("a", range(6), max_tokens=5)
    b = mkreq("b", range(10, 16), max_tokens=5)
    c = mkreq("c", range(20, 26), max_tokens=5)
    for r in (a, b, c):
        s.add_request(r)
    step(s)
    assert a.status == RequestStatus.RUNNING and s.kv.get_block_ids("a")[0] == [1, 2]
    done = s.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert done == [a, b]
    for r in (a, b):
        assert r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
        assert r.finished_time is not None
    assert s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []
    assert s.kv.get_block_ids("a")[0] == []
    assert s.kv.pool.get_num_free_blocks() == s.kv.pool.num_usable_blocks
    assert list(s.waiting) == [c] and s.running == []
    assert set(s.requests) == {"c"}
    assert pairs(step(s)) == [("c", 6)]
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert_all_free(s)


def test_abort_between_schedule_and_update():
    s = make()
    a = mkreq("a", range(6), max_tokens=5)
    b = mkreq("b", range(10, 16), max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    sched = _schedule(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    got = _update(s, sched, {"a": 1, "b": 2})
    assert got == [b]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert b.output_token_ids == [2]
    run_to_end(s)
    assert_all_free(s)


def test_abort_preempted_request():
    s = make(num_blocks=3, block_size=4)
    a = mkreq("a", range(4), max_tokens=3, arrival=1.0)
    b = mkreq("b", range(10, 14), max_tokens=3, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    step(s)
    sched = step(s)
    assert sched.preempted == [b] and b.status == RequestStatus.PREEMPTED
    assert s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert len(s.waiting) == 0
    run_to_end(s)
    assert a.num_output_tokens == 3
    assert_all_free(s)


# ---- random workloads ------------------------------------------------------------------------------


def _check_blocks(s: Scheduler) -> None:
    kv, pool = s.kv, s.kv.pool
    pool.check_invariants()
    assert set(kv.req_to_blocks) == {r.request_id for r in s.running}
    users = Counter()
    for r in s.running:
        blocks = kv.get_block_ids(r.request_id)[0]
        assert 0 not in blocks and len(set(blocks)) == len(blocks)
        assert len(blocks) == -(-r.num_computed_tokens // kv.block_size)
        users.update(blocks)
    for b in pool.blocks[1:]:
        assert b.ref_cnt == users.get(b.block_id, 0), b
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert len(s.running) <= s.config.max_num_seqs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_workload(data):
    bs = data.draw(st.sampled_from([2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(2, 8), label="num_blocks")
    chunked = data.draw(st.booleans(), label="chunked")
    policy = data.draw(st.sampled_from(["fcfs", "priority"]), label="policy")
    max_num_seqs = data.draw(st.integers(1, 6), label="max_num_seqs")
    # A request computes at most prompt + max_tokens - 1 tokens; it must fit alone in the pool,
    # and without chunking a (re)admission of that many tokens must fit the budget.
    max_total = min((num_blocks - 1) * bs, 16)
    budget = data.draw(st.integers(1 if chunked else max_total, 20), label="budget")
    caching = data.draw(st.booleans(), label="caching")
    s = make(num_blocks=num_blocks, block_size=bs, max_num_seqs=max_num_seqs, budget=budget,
             max_model_len=64, chunked=chunked, policy=policy, caching=caching)
    bases = [[100 * k + i for i in range(16)] for k in range(3)]
    # "pressure": several short prompts with long outputs, so running requests outgrow the pool.
    pressure = data.draw(st.booleans(), label="pressure")
    n_req = data.draw(st.integers(3 if pressure else 1, 8), label="n_req")
    specs = []
    for i in range(n_req):
        if pressure:
            plen = data.draw(st.integers(1, max(1, max_total // 3)))
            mtok = data.draw(st.integers(max(1, max_total - plen - 2), max_total - plen + 1))
        else:
            plen = data.draw(st.integers(1, max_total))
            mtok = data.draw(st.integers(1, max_total - plen + 1))
        specs.append(dict(
            rid=f"r{i}", prompt=bases[data.draw(st.integers(0, 2))][:plen], max_tokens=mtok,
            priority=data.draw(st.integers(0, 2)), arrive=data.draw(st.integers(0, 4)),
            abort=data.draw(st.one_of(st.none(), st.tuples(st.integers(0, 25), st.booleans()))),
        ))
    specs.sort(key=lambda sp: sp["arrive"])  # stable: list order breaks ties
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    key = (lambda r: (r.priority, r.arrival_time)) if policy == "priority" else (lambda r: (0, r.arrival_time))
    content: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> prefix whose KV it holds
    pending = list(specs)
    num_copies = 0
    t = 0
    while pending or s.has_unfinished_requests():
        assert t < 400, "no progress"
        while pending and pending[0]["arrive"] <= t:
            sp = pending.pop(0)
            r = mkreq(sp["rid"], sp["prompt"], max_tokens=sp["max_tokens"], priority=sp["priority"],
                      ignore_eos=True, eos=1000)
            reqs[r.request_id] = r
            s.add_request(r)
        for sp in specs:  # aborts before the step
            if sp["abort"] is not None and sp["abort"] == (t, False) and sp["rid"] in reqs:
                aborted.update(x.request_id for x in s.finish_requests([sp["rid"]], RequestStatus.FINISHED_ABORTED))
        _check_blocks(s)

        before_running = list(s.running)
        sched = _schedule(s)
        scheduled = [r for r, _ in sched.scheduled]
        ns = [n for _, n in sched.scheduled]
        assert len(set(map(id, scheduled))) == len(scheduled)
        assert sched.num_scheduled_tokens == sum(ns) <= budget
        assert len(scheduled) <= max_num_seqs and all(n >= 1 for n in ns)
        for (r, n), c, smp in zip(sched.scheduled, sched.num_computed, sched.samples):
            assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == c + n
            assert c + n <= r.num_tokens and smp == (c + n == r.num_tokens)
            if not chunked:
                assert c + n == r.num_tokens
        if sched.preempted:
            # Victims are the worst running requests; nothing new is admitted that step.
            assert all(r in before_running for r in scheduled)
            rest = [r for r in before_running if r not in sched.preempted]
            assert max(map(key, rest), default=(-1, -1.0)) < min(map(key, sched.preempted))
            for v in sched.preempted:
                assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0
                assert v.request_id not in s.kv.req_to_blocks

        # Copy-on-write before the forward: slots [0, m) of src into the same slots of dst.
        copied = {(dst, j): content[(src, j)] for src, dst, m in sched.kv_copies for j in range(m)}
        content.update(copied)
        num_copies += len(sched.kv_copies)
        if not caching:
            assert sched.kv_copies == []
        for src, dst, m in sched.kv_copies:
            assert 0 < m < bs and s.kv.pool.blocks[dst].ref_cnt >= 1  # the source may be reused after the copy

        # "Forward": read the KV of already-computed positions, then write this step's.
        for (r, n), c in zip(sched.scheduled, sched.num_computed):
            blocks = s.kv.get_block_ids(r.request_id)[0]
            toks = r.all_token_ids
            for p in range(c):
                assert content[(blocks[p // bs], p % bs)] == tuple(toks[: p + 1]), (r, p)
            for p in range(c, c + n):
                content[(blocks[p // bs], p % bs)] = tuple(toks[: p + 1])

        for sp in specs:  # aborts after the forward, before the update
            if sp["abort"] is not None and sp["abort"] == (t, True) and sp["rid"] in reqs:
                aborted.update(x.request_id for x in s.finish_requests([sp["rid"]], RequestStatus.FINISHED_ABORTED))
        sampled = {r.request_id: 1000 + r.num_tokens % 3
                   for (r, _), smp in zip(sched.scheduled, sched.samples) if smp}
        _update(s, sched, sampled)
        _check_blocks(s)
        t += 1

    event(f"pressure={pressure} preemptions>0: {s.num_preemptions > 0}")
    event(f"prefix hits>0: {s.prefix_cache_hits > 0}")
    event(f"aborted>0: {bool(aborted)}")
    event(f"copy-on-write hits>0: {num_copies > 0}")
    event(f"recompute hits>0: {s.prefix_cache_recompute_hits > 0}")
    event(f"steps: {'<10' if t < 10 else '<40' if t < 40 else '>=40'}")

    assert len(reqs) == n_req
    for sp in specs:
        r = reqs[sp["rid"]]
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.num_output_tokens < sp["max_tokens"]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.num_output_tokens == sp["max_tokens"]
    assert s.requests == {}
    if not caching:
        assert s.prefix_cache_hits == 0 and s.kv.pool.cached == {}
    assert 0 <= s.prefix_cache_hits <= s.prefix_cache_queries
    assert s.num_preemptions == sum(r.num_preemptions for r in reqs.values())
    assert s.kv.pool.get_num_free_blocks() == s.kv.pool.num_usable_blocks
    _check_blocks(s)
