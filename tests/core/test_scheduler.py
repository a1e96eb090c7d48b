"""Tests for kvserve.core.scheduler, driven by a fake model loop (no torch).

A step is ``schedule()``; every request whose scheduled tokens reach the end of its
sequence "samples" a token; ``update_from_output()``.
"""

from __future__ import annotations

import itertools

import pytest

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


def test_finished_ids_of_an_empty_step_reach_the_next_step():
    """An empty step is never sent to the workers, so the requests it reports finished (aborted
    while nothing else runs) ride on the next step: the workers free their rows (and exact
    filling blocks) instead of holding them forever."""
    s = make()
    s.add_request(mkreq("a", range(6)))
    step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    empty = s.schedule()
    assert empty.is_empty and empty.finished_req_ids == {"a"}
    s.add_request(mkreq("b", range(6)))
    nxt = s.schedule()
    assert nxt.finished_req_ids == {"a"} and not nxt.is_empty
    assert s.schedule().finished_req_ids == set()
