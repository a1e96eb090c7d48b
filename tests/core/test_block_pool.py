"""Tests for kvserve.core.block_pool: ref counts, free-queue order, eviction, invariants.

White-box where order matters: ``_free_uncached`` / ``_free_cached`` are read to state the
exact queue order; every behavioural claim is also checked through ``allocate``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvserve.core.block_pool import BlockPool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> tuple[list[int], list[int]]:
    """(uncached free queue, cached free queue), each head first."""
    return list(pool._free_uncached), list(pool._free_cached)


# ---- construction / basics ----------------------------------------------------------------


@pytest.mark.parametrize("n", [-1, 0, 1])
def test_too_few_blocks_rejected(n):
    with pytest.raises(ValueError):
        BlockPool(n)


def test_fresh_pool():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.ref_cnt == 1
    assert [b.ref_cnt for b in pool.blocks[1:]] == [0, 0, 0, 0]
    assert pool.cached == {}
    assert free_order(pool) == ([1, 2, 3, 4], [])
    pool.check_invariants()


def test_allocate_sets_ref_and_free_returns():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert ids(a) == [1, 2, 3]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == 0.75
    pool.check_invariants()
    pool.free([a[1]])
    assert a[1].ref_cnt == 0
    assert pool.get_num_free_blocks() == 2
    # Uncached blocks go to the back of the uncached FIFO.
    assert free_order(pool) == ([4, 2], [])
    pool.check_invariants()
    assert ids(pool.allocate(2)) == [4, 2]
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    pool.check_invariants()


def test_allocate_zero_is_noop():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.get_num_free_blocks() == 2
    pool.check_invariants()


def test_touch_and_free_ref_counts():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 123)
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 3
    pool.free([b])
    pool.free([b])
    assert b.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2  # b still held
    pool.check_invariants()
    pool.free([b])
    assert b.ref_cnt == 0
    assert free_order(pool) == ([2, 3], [1])
    assert pool.lookup(123) is b  # still findable while free
    pool.check_invariants()
    # Touching a free cached block takes it out of the free queue.
    pool.touch([b])
    assert b.ref_cnt == 1
    assert free_order(pool) == ([2, 3], [])
    assert pool.get_num_free_blocks() == 2
    pool.check_invariants()


def test_null_block_never_handed_out_and_free_of_null_is_noop():
    pool = BlockPool(4)
    for _ in range(5):
        got = pool.allocate(3)
        assert 0 not in ids(got)
        assert sorted(ids(got)) == [1, 2, 3]
        with pytest.raises(ValueError):
            pool.allocate(1)
        pool.free(got + [pool.null_block])
        assert pool.null_block.ref_cnt == 1
        pool.check_invariants()
    pool.free([pool.null_block, pool.null_block])
    assert pool.null_block.ref_cnt == 1
    assert pool.get_num_free_blocks() == 3


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    before = free_order(pool)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert free_order(pool) == before
    assert pool.get_num_free_blocks() == 1
    pool.check_invariants()
    with pytest.raises(ValueError):
        BlockPool(3).allocate(3)


def test_double_free_raises():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])
    assert b.ref_cnt == 0
    pool.check_invariants()
    # Freeing a never-allocated block is a double free too.
    with pytest.raises(RuntimeError):
        pool.free([pool.blocks[3]])


# ---- caching, eviction order ----------------------------------------------------------------


def test_cache_block_rules():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 7) is True
    assert a.block_hash == 7 and pool.lookup(7) is a
    assert pool.cache_block(a, 8) is False  # already carries a hash
    assert pool.cache_block(b, 7) is False  # hash already registered to a
    assert b.block_hash is None and pool.lookup(7) is a
    assert pool.lookup(8) is None
    pool.check_invariants()

    off = BlockPool(4, enable_caching=False)
    (c,) = off.allocate(1)
    assert off.cache_block(c, 7) is False
    assert c.block_hash is None and off.lookup(7) is None
    off.free([c])
    assert free_order(off) == ([2, 3, 1], [])


def test_uncached_handed_out_before_cached():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    b1, b2, b3, b4 = blocks
    pool.cache_block(b1, 101)
    pool.cache_block(b3, 103)
    pool.free([b1, b2, b3, b4])
    assert free_order(pool) == ([2, 4], [1, 3])
    pool.check_invariants()
    got = pool.allocate(2)
    assert ids(got) == [2, 4]
    assert pool.lookup(101) is b1 and pool.lookup(103) is b3
    assert pool.num_evictions == 0
    got = pool.allocate(1)
    assert ids(got) == [1]
    assert b1.block_hash is None and pool.lookup(101) is None
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_cached_free_blocks_evicted_in_lru_order():
    pool = BlockPool(5)
    b1, b2, b3, b4 = pool.allocate(4)
    for b, h in ((b1, 11), (b2, 12), (b3, 13)):
        pool.cache_block(b, h)
    # Free one at a time: 2 first, then 1, then 3.
    pool.free([b2])
    pool.free([b1])
    pool.free([b3])
    assert free_order(pool) == ([], [2, 1, 3])
    # Re-using block 2 (a prefix-cache hit) and freeing it again makes it most recent.
    pool.touch([b2])
    pool.free([b2])
    assert free_order(pool) == ([], [1, 3, 2])
    pool.free([b4])  # uncached: handed out first
    pool.check_invariants()
    assert ids(pool.allocate(1)) == [4]
    assert ids(pool.allocate(1)) == [1]
    assert pool.lookup(11) is None and pool.lookup(13) is b3 and pool.lookup(12) is b2
    assert ids(pool.allocate(1)) == [3]
    assert ids(pool.allocate(1)) == [2]
    assert pool.cached == {}
    assert pool.num_evictions == 3
    pool.check_invariants()


def test_free_in_given_order_tail_first_evicts_leaf_first():
    """A request's blocks freed tail-first (as the KV manager does) evict deepest first."""
    pool = BlockPool(5)
    chain = pool.allocate(3)
    for i, b in enumerate(chain):
        pool.cache_block(b, 1000 + i)
    pool.free(reversed(chain))
    assert free_order(pool) == ([4], [3, 2, 1])
    assert ids(pool.allocate(2)) == [4, 3]
    assert pool.lookup(1002) is None
    assert pool.lookup(1000) is chain[0] and pool.lookup(1001) is chain[1]
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([a])
    assert pool.reset_prefix_cache() is False  # b still in use
    assert pool.lookup(1) is a
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert a.block_hash is None and b.block_hash is None
    assert pool.get_num_free_blocks() == 3
    assert free_order(pool)[1] == []
    assert sorted(free_order(pool)[0]) == [1, 2, 3]
    pool.check_invariants()


# ---- random operation sequences against a reference model -----------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool and a tiny list-based model of it; they must agree exactly."""

    @initialize(n=st.integers(2, 9))
    def setup(self, n):
        self.pool = BlockPool(n)
        self.ref = {i: 0 for i in range(1, n)}
        self.hash: dict[int, int] = {}  # block id -> hash
        self.unc = list(range(1, n))  # model free queues, head first
        self.cch: list[int] = []
        self.held: list[int] = []  # one entry per reference we own
        self.next_hash = 0

    def _free_model(self, bid):
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            (self.cch if bid in self.hash else self.unc).append(bid)

    @rule(k=st.integers(0, 10))
    def allocate(self, k):
        nfree = len(self.unc) + len(self.cch)
        if k > nfree:
            with pytest.raises(ValueError):
                self.pool.allocate(k)
            return
        got = ids(self.pool.allocate(k))
        expect = []
        for _ in range(k):
            if self.unc:
                expect.append(self.unc.pop(0))
            else:
                bid = self.cch.pop(0)
                del self.hash[bid]
                expect.append(bid)
        assert got == expect
        for bid in got:
            assert self.ref[bid] == 0
            self.ref[bid] = 1
            self.held.append(bid)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data):
        idx = data.draw(st.lists(st.integers(0, len(self.held) - 1), unique=True, min_size=1, max_size=4))
        bids = [self.held[i] for i in idx]
        for i in sorted(idx, reverse=True):
            del self.held[i]
        self.pool.free([self.pool.blocks[b] for b in bids])
        for b in bids:
            self._free_model(b)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def cache_held(self, data):
        bid = data.draw(st.sampled_from(self.held))
        self.next_hash += 1
        ok = self.pool.cache_block(self.pool.blocks[bid], self.next_hash)
        assert ok == (bid not in self.hash)
        if ok:
            self.hash[bid] = self.next_hash

    @precondition(lambda self: self.hash)
    @rule(data=st.data())
    def touch_cached(self, data):
        bid = data.draw(st.sampled_from(sorted(self.hash)))
        blk = self.pool.lookup(self.hash[bid])
        assert blk is self.pool.blocks[bid]
        self.pool.touch([blk])
        if self.ref[bid] == 0:
            self.cch.remove(bid)
        self.ref[bid] += 1
        self.held.append(bid)

    @rule()
    def double_free(self):
        zero = [b for b, r in self.ref.items() if r == 0]
        if zero:
            with pytest.raises(RuntimeError):
                self.pool.free([self.pool.blocks[zero[0]]])

    @rule()
    def reset(self):
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.held)
        if ok:
            for bid in self.cch:
                del self.hash[bid]
            self.unc.extend(self.cch)
            self.cch = []

    @invariant()
    def agrees(self):
        pool = self.pool
        pool.check_invariants()
        assert pool.null_block.ref_cnt == 1
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == self.ref
        assert {b.block_id: b.block_hash for b in pool.blocks[1:] if b.block_hash is not None} == self.hash
        assert list(pool._free_uncached) == self.unc
        assert list(pool._free_cached) == self.cch
        assert pool.get_num_free_blocks() == len(self.unc) + len(self.cch)
        assert 0 not in self.held


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
