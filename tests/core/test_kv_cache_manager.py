"""Tests for kvserve.core.kv_cache_manager: exact block ids / ref counts with block_size 4."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.core.single_type_manager import SingleTypeKVCacheManager as KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def req(tokens, salt=None) -> Request:
    r = Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=8))
    if salt is not None:
        r.cache_salt = salt
    return r


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def refs(kv: KVCacheManager) -> dict[int, int]:
    """Non-zero ref counts of usable blocks."""
    return {b.block_id: b.ref_cnt for b in kv.pool.blocks[1:] if b.ref_cnt}


def snapshot(kv: KVCacheManager):
    p = kv.pool
    return (
        [(b.ref_cnt, b.block_hash) for b in p.blocks],
        list(p._free_uncached), list(p._free_cached), dict(p.cached),
        {k: ids(v) for k, v in kv.req_to_blocks.items()}, dict(kv.num_cached_blocks),
    )


def admit(kv: KVCacheManager, r: Request):
    """What the scheduler does to admit a request and prefill it in one go."""
    hits, num_hit = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    kv.pool.check_invariants()
    return ids(hits), num_hit, ids(new)


def test_two_requests_sharing_a_prefix_share_full_blocks():
    kv = KVCacheManager(10, BS)
    a = req(range(10))
    assert admit(kv, a) == ([], 0, [1, 2, 3])
    assert kv.get_block_ids(a.request_id) == [1, 2, 3]
    # Only the two full blocks are registered.
    assert [kv.pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]
    assert kv.num_cached_blocks[a.request_id] == 2

    b = req(list(range(8)) + [100, 101, 102])
    assert admit(kv, b) == ([1, 2], 8, [4])
    assert kv.get_block_ids(b.request_id) == [1, 2, 4]
    assert refs(kv) == {1: 2, 2: 2, 3: 1, 4: 1}
    assert kv.pool.get_num_free_blocks() == 5

    # Shares only the first block.
    c = req(list(range(4)) + [50, 51, 52, 53, 54])
    assert admit(kv, c) == ([1], 4, [5, 6])
    assert refs(kv) == {1: 3, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1}

    kv.free(a)
    assert refs(kv) == {1: 2, 2: 1, 4: 1, 5: 1, 6: 1}
    assert kv.get_block_ids(a.request_id) == []
    kv.free(b)
    kv.free(c)
    assert refs(kv) == {}
    assert kv.pool.get_num_free_blocks() == kv.pool.num_usable_blocks == 9
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}
    kv.pool.check_invariants()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("delta, expect_hit_blocks", [(-1, "k-1"), (0, "k-1"), (1, "k")])
def test_last_token_never_hits(k, delta, expect_hit_blocks):
    n = 4 * k + delta
    expect = k - 1 if expect_hit_blocks == "k-1" else k
    kv = KVCacheManager(16, BS)
    first = req(range(n))
    admit(kv, first)
    second = req(range(n))
    hits, num_hit = kv.get_computed_blocks(second)
    assert len(hits) == expect
    assert num_hit == 4 * expect
    assert ids(hits) == kv.get_block_ids(first.request_id)[:expect]
    # Allocating the rest gives exactly enough blocks for n tokens.
    new = kv.allocate_slots(second, n - num_hit, hits)
    assert len(new) == -(-n // BS) - expect
    assert kv.get_block_ids(second.request_id)[:expect] == ids(hits)
    assert all(b.ref_cnt == 2 for b in hits)
    kv.free(first)
    kv.free(second)
    assert kv.pool.get_num_free_blocks() == 15
    kv.pool.check_invariants()


def test_identical_repeat_after_first_finished_reuses_free_cached_blocks():
    kv = KVCacheManager(10, BS)
    x = req(range(9))
    assert admit(kv, x) == ([], 0, [1, 2, 3])
    kv.free(x)
    # Tail-first: block 3 (partial, uncached) then 2, 1 (cached) enter the free queues.
    assert list(kv.pool._free_uncached) == [4, 5, 6, 7, 8, 9, 3]
    assert list(kv.pool._free_cached) == [2, 1]
    assert kv.pool.get_num_free_blocks() == 9

    y = req(range(9))
    assert admit(kv, y) == ([1, 2], 8, [4])
    assert refs(kv) == {1: 1, 2: 1, 4: 1}
    assert list(kv.pool._free_cached) == []
    assert kv.pool.get_num_free_blocks() == 6
    kv.free(y)

    # A third repeat, after y also finished, finds the same two blocks again.
    z = req(range(9))
    assert admit(kv, z) == ([1, 2], 8, [5])
    assert kv.pool.num_evictions == 0
    kv.free(z)
    assert kv.pool.get_num_free_blocks() == 9
    kv.pool.check_invariants()


def test_repeat_after_eviction_misses():
    kv = KVCacheManager(4, BS)  # 3 usable blocks
    x = req(range(9))
    admit(kv, x)
    kv.free(x)
    other = req(range(100, 112))  # needs all 3 blocks: evicts both cached ones
    assert admit(kv, other) == ([], 0, [3, 2, 1])
    assert kv.pool.num_evictions == 2
    kv.free(other)
    y = req(range(9))
    hits, num_hit = kv.get_computed_blocks(y)
    assert (hits, num_hit) == ([], 0)


@pytest.mark.parametrize("salt_x, salt_y, shared", [
    ("a", None, False), (None, "a", False), ("a", "b", False), ("a", "a", True), (None, None, True),
])
def test_cache_salt_isolates(salt_x, salt_y, shared):
    kv = KVCacheManager(10, BS)
    x = req(range(9), salt=salt_x)
    admit(kv, x)
    y = req(range(9), salt=salt_y)
    hits, num_hit, new = admit(kv, y)
    if shared:
        assert (hits, num_hit, new) == ([1, 2], 8, [4])
        assert refs(kv) == {1: 2, 2: 2, 3: 1, 4: 1}
    else:
        assert (hits, num_hit, new) == ([], 0, [4, 5, 6])
        assert refs(kv) == {i: 1 for i in range(1, 7)}


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(4, BS)  # 3 usable
    a = req(range(8))
    admit(kv, a)
    assert kv.get_block_ids(a.request_id) == [1, 2]
    before = snapshot(kv)

    b = req(range(100, 109))  # needs 3 blocks, 1 free
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == ([], 0)
    assert kv.allocate_slots(b, 9, hits) is None
    assert snapshot(kv) == before
    assert b.request_id not in kv.req_to_blocks
    assert b.num_computed_tokens == 0

    # A running request asking for more than is free.
    assert kv.allocate_slots(a, 9) is None  # 8 + 9 = 17 tokens -> 5 blocks, has 2, 1 free
    assert snapshot(kv) == before
    # Exactly enough is fine.
    assert ids(kv.allocate_slots(a, 4)) == [3]
    assert kv.pool.get_num_free_blocks() == 0
    kv.pool.check_invariants()


def test_allocate_slots_counts_free_cached_hits_against_the_pool():
    kv = KVCacheManager(4, BS)  # 3 usable
    x = req(range(9))
    admit(kv, x)
    kv.free(x)
    assert list(kv.pool._free_cached) == [2, 1]
    before = snapshot(kv)
    # 8 shared tokens + 5 new: hits [1, 2] (both free, ref 0) + 2 new blocks = 4 > 3.
    y = req(list(range(8)) + [70, 71, 72, 73, 74])
    hits, num_hit = kv.get_computed_blocks(y)
    assert (ids(hits), num_hit) == ([1, 2], 8)
    assert kv.allocate_slots(y, 5, hits) is None
    assert snapshot(kv) == before
    assert [b.ref_cnt for b in hits] == [0, 0]

    kv2 = KVCacheManager(5, BS)  # 4 usable: fits exactly
    x2 = req(range(9))
    admit(kv2, x2)
    kv2.free(x2)
    y2 = req(list(range(8)) + [70, 71, 72, 73, 74])
    assert admit(kv2, y2) == ([1, 2], 8, [4, 3])
    assert refs(kv2) == {1: 1, 2: 1, 3: 1, 4: 1}
    assert kv2.pool.get_num_free_blocks() == 0


def test_decode_growth_and_output_blocks_get_cached():
    kv = KVCacheManager(10, BS)
    r = req(range(3))
    admit(kv, r)  # 3 tokens -> 1 block
    assert kv.get_block_ids(r.request_id) == [1]
    assert kv.num_cached_blocks.get(r.request_id, 0) == 0
    for step, tok in enumerate([90, 91, 92, 93, 94, 95]):
        r.append_output_token(tok)
        new = kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        # computed tokens after this step: 4 + step
        assert len(kv.get_block_ids(r.request_id)) == -(-(4 + step) // BS)
        assert ids(new) == {1: [2], 5: [3]}.get(step, [])
    # 9 computed tokens: 2 full blocks registered, covering prompt + outputs.
    assert kv.num_cached_blocks[r.request_id] == 2
    assert kv.pool.blocks[2].block_hash is not None
    # A new request whose prompt is those 9 tokens + 1 hits both blocks.
    s = req([0, 1, 2, 90, 91, 92, 93, 94, 95, 7])
    assert admit(kv, s) == ([1, 2], 8, [4])


def test_prefix_caching_disabled():
    kv = KVCacheManager(10, BS, enable_caching=False)
    x = req(range(9))
    assert admit(kv, x) == ([], 0, [1, 2, 3])
    y = req(range(9))
    assert admit(kv, y) == ([], 0, [4, 5, 6])
    assert kv.pool.cached == {}
    kv.free(x)
    kv.free(y)
    assert list(kv.pool._free_cached) == []
    assert kv.pool.get_num_free_blocks() == 9


def test_usage():
    kv = KVCacheManager(5, BS)
    assert kv.usage == 0.0
    r = req(range(6))
    admit(kv, r)
    assert kv.usage == 0.5
    kv.free(r)
    assert kv.usage == 0.0
    kv.free(r)  # freeing an unknown / already-freed request is a no-op
    assert kv.usage == 0.0


# ---- random admission / free sequences --------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(2, 12),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.integers(1, 14), st.integers(0, 9)),
        max_size=25,
    ),
)
def test_random_admit_free(num_blocks, ops):
    kv = KVCacheManager(num_blocks, BS)
    bases = [list(range(i * 100, i * 100 + 14)) for i in range(4)]
    live: list[Request] = []
    content: dict[int, tuple] = {}  # block id -> the token prefix whose KV it holds
    for is_free, base, length, pick in ops:
        if is_free and live:
            kv.free(live.pop(pick % len(live)))
        else:
            r = req(bases[base][:length])
            hits, num_hit = kv.get_computed_blocks(r)
            assert num_hit == BS * len(hits) <= r.num_tokens - 1
            before = snapshot(kv)
            new = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
            if new is None:
                assert snapshot(kv) == before
            else:
                toks = r.all_token_ids
                for j, b in enumerate(kv.get_block_ids(r.request_id)):
                    if j < len(hits):  # a hit must hold exactly this request's prefix
                        assert content[b] == tuple(toks[: (j + 1) * BS])
                    else:  # freshly written by this request's prefill
                        content[b] = tuple(toks[: min((j + 1) * BS, len(toks))])
                r.num_computed_tokens = r.num_tokens
                live.append(r)
                blocks = kv.get_block_ids(r.request_id)
                assert len(blocks) == -(-r.num_tokens // BS)
                assert blocks[: len(hits)] == ids(hits)
                assert 0 not in blocks and len(set(blocks)) == len(blocks)
        kv.pool.check_invariants()
        # ref count of every block == number of live requests holding it
        count = {}
        for r in live:
            for b in kv.get_block_ids(r.request_id):
                count[b] = count.get(b, 0) + 1
        assert refs(kv) == count
        # A registered block is findable under the hash of its own prefix.
        for r in live:
            blocks = kv.req_to_blocks[r.request_id]
            for i, h in enumerate(r.block_hashes[: kv.num_cached_blocks.get(r.request_id, 0)]):
                if blocks[i].block_hash is not None:
                    assert blocks[i].block_hash == h and kv.pool.lookup(h) is blocks[i]
    for r in live:
        kv.free(r)
    assert kv.pool.get_num_free_blocks() == kv.pool.num_usable_blocks
    assert refs(kv) == {}
    kv.pool.check_invariants()
