"""The scheduler's decode fast path (a running request that needs no new block skips
``allocate_slots``) against the full path: the same steps, blocks and outputs on mixed batches
(block boundaries crossed, blocks filled and registered, prefix hits, preemption, drafts with
rollback, EOS / stop tokens / min_tokens / max_tokens)."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def _scheduler(fast: bool, drafts: int, num_blocks: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=48, max_model_len=256,
                          enable_chunked_prefill=True)
    spec = SimpleNamespace(max_draft_tokens=drafts, dynamic=False) if drafts else None
    s = Scheduler(cfg, KVCacheManager.for_blocks(num_blocks, 4, True), speculative_config=spec)
    if not fast:
        s.kv.plain_req_blocks = None  # every request asks allocate_slots
    return s


def _requests() -> list[Request]:
    out = []
    shared = list(range(3, 14))  # a prefix several prompts share (prefix hits, copy-on-write)
    for i in range(14):
        prompt = (shared if i % 3 == 0 else []) + [20 + (i * 7 + j) % 50 for j in range(1 + (i * 5) % 11)]
        sp = SamplingParams(max_tokens=6 + (i * 3) % 17, min_tokens=2 if i % 4 == 1 else 0,
                            stop_token_ids=[77] if i % 5 == 2 else None, ignore_eos=(i % 6 == 5))
        out.append(Request(f"r{i}", prompt, sp, arrival_time=float(i), eos_token_id=2))
    return out


def _token(rid: str, n_out: int) -> int:
    return (zlib.crc32(f"{rid}/{n_out}".encode()) % 97) if n_out % 9 != 8 else 2  # an EOS now and then


def _run(fast: bool, drafts: int, num_blocks: int) -> tuple[list, dict, int]:
    s = _scheduler(fast, drafts, num_blocks)
    for r in _requests():
        s.add_request(r)
    calls = [0]
    allocate = s.kv.allocate_slots

    def counted(*a, **k):
        calls[0] += 1
        return allocate(*a, **k)

    s.kv.allocate_slots = counted
    trace, finished = [], {}
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        c = out.scheduled_cached_reqs
        trace.append((dict(out.num_scheduled_tokens), list(c.req_ids), list(c.new_block_ids),
                      list(c.num_computed_tokens), [n.req_id for n in out.scheduled_new_reqs],
                      [n.block_ids for n in out.scheduled_new_reqs], list(out.preempted_req_ids),
                      [(op.src, op.dst, op.num_tokens) for op in out.block_ops],
                      dict(out.scheduled_spec_decode_tokens)))
        sampled, draft_ids = {}, {}
        for rid, n in out.num_scheduled_tokens.items():
            req = s.requests[rid]
            if req.num_pending_tokens:
                spec = out.scheduled_spec_decode_tokens.get(rid, [])
                acc = len(spec) // 2  # accept half of the drafts: the rest roll back
                sampled[rid] = [_token(rid, req.num_output_tokens + j) for j in range(acc + 1)]
                if drafts:
                    draft_ids[rid] = [5, 6, 7][:drafts]
        updated = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=draft_ids))
        for req, toks, _ in updated:
            if req.is_finished:
                finished[req.request_id] = (list(req.output_token_ids), req.finish_reason, req.stop_reason)
        s.kv.check_invariants()
    assert not s.has_unfinished_requests()
    return trace, finished, calls[0]


@pytest.mark.parametrize("drafts,num_blocks", [(0, 128), (0, 24), (2, 128), (2, 24)])
def test_decode_fast_path_equals_allocate_slots(drafts, num_blocks):
    fast_trace, fast_done, fast_calls = _run(True, drafts, num_blocks)
    slow_trace, slow_done, slow_calls = _run(False, drafts, num_blocks)
    assert fast_calls < slow_calls  # some steps took the fast path
    assert fast_trace == slow_trace
    assert fast_done == slow_done and len(fast_done) == 14
    if num_blocks == 24:
        assert any(t[6] for t in fast_trace), "the small pool should preempt"


def test_fits_in_held_blocks_means_allocate_slots_is_a_no_op():
    kv = KVCacheManager.for_blocks(32, 4, True)
    r = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20), arrival_time=0.0)
    assert not kv.fits_in_held_blocks(r, 6)  # not running yet: allocate_slots admits it
    assert kv.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    seen = {True: 0, False: 0}
    for tok in range(10, 22):
        r.append_output_token(tok)
        fits = kv.fits_in_held_blocks(r, 1)
        seen[fits] += 1
        before = (kv.get_block_ids("a"), kv.num_cached_blocks.get("a", 0), kv.pool.get_num_free_blocks())
        new = kv.allocate_slots(r, 1)
        after = (kv.get_block_ids("a"), kv.num_cached_blocks.get("a", 0), kv.pool.get_num_free_blocks())
        if fits:
            assert new == ([],) and before == after
        r.num_computed_tokens += 1
    assert seen[True] and seen[False]  # both cases came up (block crossings, blocks filling)
