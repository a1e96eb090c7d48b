"""Tests for kvserve.core.scheduler: stop rules, aborts, and a random workload checked after
every step (property test). Same fake model loop as ``test_scheduler.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve.core.scheduler import Scheduler
from sched_view import schedule as _schedule
from sched_view import update as _update
from kvserve.request import Request, RequestStatus
from test_scheduler import assert_all_free, make, mkreq, pairs, run_to_end, step

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
