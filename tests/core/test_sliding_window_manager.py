"""Sliding-window KV cache groups without a model: block accounting under the scheduler,
right-to-left prefix hits, hybrid coordination with full-attention groups, pool sizing."""

from __future__ import annotations

import random

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_spec import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec, bytes_per_request, make_kv_cache_config,
    max_concurrency, max_request_tokens,
)
from kvserve.core.sched_output import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.core.sliding_window_manager import SlidingWindowManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def _manager(num_blocks: int, bs: int, window: int, full: bool = False, caching: bool = True) -> KVCacheManager:
    win = SlidingWindowSpec(bs, 1, 1, "float32", "float32", sliding_window=window)
    groups = [KVCacheGroup(0, [0, 1], win, num_blocks)]
    if full:
        groups.append(KVCacheGroup(1, [2], FullAttentionSpec(bs, 1, 1, "float32", "float32"), num_blocks))
    return KVCacheManager(KVCacheConfig(groups), caching)


def _run(sched: Scheduler, rng: random.Random, check) -> int:
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        toks = {rid: [rng.randrange(6)] for rid in out.num_scheduled_tokens if sched.requests[rid].num_pending_tokens}
        sched.update_from_output(out, ModelRunnerOutput(toks))
        check(sched)
        steps += 1
    return steps


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("window", [1, 5, 8, 13])
def test_window_group_holds_at_most_its_window_after_every_step(window, full):
    """Random prompts, chunked prefill with chunks longer than the window, preemption under a
    small pool: after every step each running request holds <= ceil(window / bs) + 1 blocks
    in the window group, the full group keeps every block, and all blocks are free at the end."""
    bs = 4
    rng = random.Random(window)
    kv = _manager(40, bs, window, full)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=200), kv)
    base = [rng.randrange(6) for _ in range(30)]
    for i in range(14):
        n = rng.randint(1, 60)
        prompt = (base[: rng.randint(0, 30)] + [rng.randrange(6) for _ in range(n)])[:n]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True),
                                  arrival_time=float(i)))
    bound = -(-window // bs) + 1
    seen = []

    def check(s):
        for req in s.running:
            live = kv.num_live_blocks(req.request_id)
            assert live[0] <= bound, (req.request_id, req.num_computed_tokens, live)
            seen.append(live[0])
            if full:  # the full group keeps the whole history
                assert live[1] == -(-req.num_computed_tokens // bs)
        kv.check_invariants()

    assert _run(sched, rng, check) > 10
    assert -(-window // bs) <= max(seen) <= bound  # long requests really do drop blocks
    for g in kv.groups:
        assert g.pool.get_num_free_blocks() == g.pool.num_usable_blocks


def _admit(kv: KVCacheManager, req: Request) -> int:
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return n


def test_hit_needs_only_the_window_before_it():
    """The blocks a request freed outside its window are evicted first; the tail it held last
    still gives a hit of the whole prefix (a left-to-right walk would find nothing)."""
    bs, window = 4, 8
    kv = _manager(12, bs, window)
    g = kv.groups[0]
    assert isinstance(g, SlidingWindowManager) and g.num_hit_blocks == 2
    a = Request("a", list(range(40)), SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(a)
    assert n == 0
    for start in range(0, 40, 8):  # chunked prefill: blocks outside the window go as it advances
        assert kv.allocate_slots(a, 8) is not None
        a.num_computed_tokens = start + 8
        kv.remove_skipped_blocks(a)
    assert kv.num_live_blocks("a") == (2,)  # positions 33..39 are all the next token sees
    kv.free(a)
    # Another request takes 8 blocks: the out-of-window blocks (freed first) are evicted.
    other = Request("x", [99] * 32, SamplingParams(max_tokens=1))
    _admit(kv, other)
    assert g.pool.lookup(a.block_hashes[0]) is None and g.pool.lookup(a.block_hashes[9]) is not None
    b = Request("b", list(range(40)) + [7, 7], SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(b)
    assert n == 40 and hits[0][:8] == [g.pool.null_block] * 8
    assert [h.block_id for h in hits[0][8:]] == [g.pool.lookup(a.block_hashes[i]).block_id for i in (8, 9)]
    kv.free(other)
    assert kv.allocate_slots(b, 2, hits) is not None
    assert kv.get_block_ids("b")[0][:8] == [0] * 8  # the worker reads the null block there
    kv.free(b)
    kv.check_invariants()


def test_hybrid_hit_agrees_over_groups():
    """Full group left to right, window group right to left from there: a hole inside the
    window group's last window moves the hit back to where a whole window is cached, and
    the full group is cut to it."""
    bs, window = 4, 8
    kv = _manager(32, bs, window, full=True)
    win, full = kv.groups
    a = Request("a", list(range(32)), SamplingParams(max_tokens=1))
    _admit(kv, a)
    kv.free(a)
    b = Request("b", list(range(32)) + [5], SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(b)
    assert n == 32 and [len(h) for h in hits] == [8, 8]
    # Evict window block 6 (inside the last window of the hit point 32): the window group's
    # longest hit is then 6 blocks (blocks 4, 5 cached), and the full group follows.
    blk = win.pool.lookup(a.block_hashes[6])
    win.pool._evict(blk)
    win.pool._free_cached.pop(blk.block_id)
    win.pool._free_uncached[blk.block_id] = None
    hits, n = kv.get_computed_blocks(b)
    assert n == 24 and [len(h) for h in hits] == [6, 6]
    assert hits[0][:4] == [win.pool.null_block] * 4 and hits[0][4].block_hash == a.block_hashes[4]
    assert all(h.block_hash == a.block_hashes[i] for i, h in enumerate(hits[1]))
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    b.num_computed_tokens = b.num_tokens
    assert kv.num_live_blocks("b") == (5, 9)  # blocks 4..8: what positions >= 24 - 7 need
    kv.remove_skipped_blocks(b)
    assert kv.num_live_blocks("b") == (3, 9)  # after the step: positions >= 33 - 7
    kv.free(b)
    kv.check_invariants()
    # Caching off: no hit, still block-accounted.
    off = _manager(32, bs, window, full=True, caching=False)
    assert off.get_computed_blocks(b)[1] == 0


def test_hash_collision_is_not_a_hit():
    bs = 4
    kv = _manager(16, bs, 8)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1))
    _admit(kv, a)
    kv.free(a)
    b = Request("b", list(range(12)) + [1], SamplingParams(max_tokens=1))
    b.block_hashes = [a.block_hashes[0], a.block_hashes[1], a.block_hashes[2]]
    b.all_token_ids[4] = 77  # block 1's tokens differ, its (forged) hash does not
    hits, n = kv.get_computed_blocks(b)
    # Block 1's tokens differ, so the run through it breaks: only block 0 (same tokens) hits.
    assert n == 4 and [h.block_hash for h in hits[0]] == [a.block_hashes[0]]


def test_gemma3_270m_shape_at_32k_holds_over_5x_more_requests():
    """Gemma 3 270M: 18 layers, every 6th global, window 512, 1 KV head x 256, bf16, blocks of
    16. At 32K context the hybrid split of one byte budget holds > 5x the requests."""
    full = FullAttentionSpec(16, 1, 256, "bfloat16", "bfloat16")
    win = SlidingWindowSpec(16, 1, 256, "bfloat16", "bfloat16", sliding_window=512)
    specs = {i: (full if i % 6 == 5 else win) for i in range(18)}
    budget, max_len = 8 << 30, 32768
    cfg = make_kv_cache_config(specs, budget, max_model_len=max_len)
    assert cfg.total_bytes <= budget
    hybrid = max_concurrency(cfg, max_len)
    flat = make_kv_cache_config({i: full for i in range(18)}, budget)
    plain = max_concurrency(flat, max_len)
    assert plain == pytest.approx(budget / bytes_per_request(flat, max_len), rel=1e-3)
    assert hybrid / plain > 5.4  # 18 * 2048 / (3 * 2048 + 15 * 33) = 5.55
    assert max_request_tokens(cfg) == (cfg.groups[1].num_blocks - 1) * 16
    # Window-only (Mistral-style): one group takes the whole budget; length is unbounded.
    mistral = make_kv_cache_config({i: win for i in range(4)}, budget, max_model_len=max_len)
    assert max_request_tokens(mistral) is None
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        SlidingWindowManager(8, 4, 0)


def test_window_groups_sized_for_max_num_seqs_within_half_the_budget():
    """With ``max_num_seqs`` the window group holds that many requests' windows (the proportional
    32K plan holds far fewer), capped at half the budget; the full group keeps the rest."""
    full = FullAttentionSpec(16, 1, 256, "bfloat16", "bfloat16")
    win = SlidingWindowSpec(16, 1, 256, "bfloat16", "bfloat16", sliding_window=512)
    specs = {i: (full if i % 6 == 5 else win) for i in range(18)}
    budget, max_len, need = 1 << 30, 32768, win.max_blocks_per_request(32768)
    plain = make_kv_cache_config(specs, budget, max_model_len=max_len)
    assert plain.groups[0].num_blocks - 1 < 32 * need  # 32 conversations' tails do not fit
    cfg = make_kv_cache_config(specs, budget, max_model_len=max_len, max_num_seqs=64)
    assert cfg.total_bytes <= budget
    assert cfg.groups[0].num_blocks - 1 >= 64 * need
    assert cfg.groups[1].num_blocks < plain.groups[1].num_blocks
    capped = make_kv_cache_config(specs, budget, max_model_len=max_len, max_num_seqs=10_000)
    win_bytes = (capped.groups[0].num_blocks - 1) * capped.groups[0].page_size_bytes
    assert win_bytes <= budget // 2 < win_bytes + need * capped.groups[0].page_size_bytes
    # A small max_num_seqs never shrinks the window group below the proportional plan.
    assert make_kv_cache_config(specs, budget, max_model_len=max_len, max_num_seqs=1).describe() == plain.describe()
