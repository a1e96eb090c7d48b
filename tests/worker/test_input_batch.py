"""The worker's persistent input batch against a from-scratch rebuild, under random workloads.

A real ``Scheduler`` runs random arrivals, aborts, preemptions (small pools), chunked prefill,
prefix hits and draft tokens with random acceptance. Every step goes through a pickle round
trip (as it does to worker processes) and is applied to an ``InputBatch``; the batch's flat
inputs must equal inputs rebuilt from the scheduler's own requests and block ids, and the
step fed unpickled must give the same inputs as the step fed in-process.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch


def rebuild(s: Scheduler, out, before: dict[str, int], bs: int):
    """Inputs from the scheduler's objects: decodes (query length 1) first, stable."""
    rids = list(out.num_scheduled_tokens)
    rids.sort(key=lambda r: out.num_scheduled_tokens[r] != 1)
    tokens, positions, slots, q, ctx = [], [], [], [], []
    for rid in rids:
        r = s.requests[rid]
        n = out.num_scheduled_tokens[rid]
        c = before[rid]
        seq = r.all_token_ids + out.scheduled_spec_decode_tokens.get(rid, [])
        blocks = s.kv.get_block_ids(rid)[0]
        q.append(n)
        ctx.append(c)
        for p in range(c, c + n):
            tokens.append(seq[p])
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
    tables = [s.kv.get_block_ids(r)[0] for r in rids]
    return rids, tokens, positions, slots, q, ctx, tables


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_input_batch_equals_rebuild_under_random_workload(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    max_len = 48
    cfg = SchedulerConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(2, 24),
                          max_model_len=max_len, enable_chunked_prefill=True, scheduling_policy="fcfs")
    s = Scheduler(cfg, KVCacheManager.for_blocks(rng.randint(max_len // bs + 2, max_len // bs + 20), bs, rng.random() < 0.7))
    width = -(-max_len // bs)
    batch = InputBatch(cfg.max_num_seqs, max_len, bs, [width])
    twin = InputBatch(1, max_len, bs, [width])  # fed the in-process objects; starts small and grows
    base = [rng.randrange(4) for _ in range(16)]
    arrivals = []
    for i in range(rng.randint(1, 10)):
        plen = rng.randint(1, 20)
        prompt = (base[:rng.randint(0, plen)] + [rng.randrange(4) for _ in range(plen)])[:plen]
        arrivals.append((rng.randint(0, 15), Request(f"q{i}", prompt, SamplingParams(
            max_tokens=rng.randint(1, max_len - plen), ignore_eos=True), arrival_time=float(i))))
    checked = aborted = 0
    for t in range(400):
        for at, r in arrivals:
            if at == t:
                s.add_request(r)
        if t > 15 and not s.has_unfinished_requests():
            break
        if rng.random() < 0.03 and s.requests:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
            aborted += 1
        out = s.schedule()
        wire = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        batch.apply(wire)
        twin.apply(out)
        if out.is_empty:
            continue
        before = dict(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        before.update({n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs})
        inp = batch.prepare(wire)
        inp2 = twin.prepare(out)
        rids, tokens, positions, slots, q, ctx, tables = rebuild(s, out, before, bs)
        assert inp.req_ids == rids == inp2.req_ids
        assert inp.token_ids.tolist() == tokens == inp2.token_ids.tolist()
        assert inp.positions.tolist() == positions
        assert inp.slot_mappings[0].tolist() == slots == inp2.slot_mappings[0].tolist()
        assert inp.query_lens.tolist() == q and inp.ctx_lens.tolist() == ctx
        assert inp.seq_lens.tolist() == [a + b for a, b in zip(q, ctx)]
        assert inp.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(q)]).tolist()
        assert inp.num_decodes == sum(1 for x in q if x == 1)
        for row, want in zip(inp.block_tables[0], tables):
            assert row[: len(want)].tolist() == want and not row[len(want):].any()
        assert len(inp.pending_idx) == 0
        checked += 1
        # The fake model: requests that reach their end sample; drafts get a random acceptance.
        res = ModelRunnerOutput()
        for i, rid in enumerate(inp.req_ids):
            if not inp.samples[i]:
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            a = rng.randint(0, len(drafts))
            res.sampled_token_ids[rid] = drafts[:a] + [rng.randrange(4)]
            if rng.random() < 0.5:
                res.draft_token_ids[rid] = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        for rid, toks in res.sampled_token_ids.items():
            batch.append_tokens(rid, toks)
            twin.append_tokens(rid, toks)
        s.update_from_output(out, res)
        # Between steps a request holds ceil(num_computed / block_size) blocks.
        for r in s.running:
            assert len(s.kv.get_block_ids(r.request_id)[0]) == -(-r.num_computed_tokens // bs)
        s.kv.check_invariants()
    assert not s.has_unfinished_requests()
    assert checked > 0 or aborted == len(arrivals)  # nothing to check only if every request was aborted first
    assert s.kv.pool.get_num_free_blocks() == s.kv.pool.num_usable_blocks


def test_unknown_request_and_unknown_token_are_errors():
    import pytest

    from kvserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput

    batch = InputBatch(2, 16, 4, [4])
    with pytest.raises(RuntimeError, match="does not hold"):
        batch.apply(SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["x"], [None], [0], [[]]),
                                    num_scheduled_tokens={"x": 1}, total_num_scheduled_tokens=1))
    new = NewRequestData("a", [5, 6, 7], [], SamplingParams(), None, ([1],), 0)
    batch.apply(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3))
    batch.prepare(SchedulerOutput(num_scheduled_tokens={"a": 3}))
    # Two tokens past the known ones: neither known nor the previous step's sample.
    cached = CachedRequestData(["a"], [None], [3], [[]])
    step = SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2)
    batch.apply(step)
    with pytest.raises(RuntimeError, match="neither known"):
        batch.prepare(step)
