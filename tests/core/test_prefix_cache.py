"""Radix-tree prefix cache: exact block ids, ref counts and copy-on-write lists (block_size 4).

Each ``admit`` is its own scheduler step (``begin_step``), so blocks registered by an
earlier admission hold written KV and can be copy sources.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.single_type_manager import SingleTypeKVCacheManager as KVCacheManager
from kvserve.core.kv_cache_manager import KVCacheManager as FullKVCacheManager
from kvserve.core.scheduler import Scheduler
from sched_view import schedule as _schedule
from sched_view import update as _update
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def req(tokens, salt=None) -> Request:
    return Request(f"p{next(_ids)}", list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def copies(kv) -> list[tuple[int, int, int]]:
    """This step's copy-on-write ops as ``(src, dst, num_tokens)``."""
    return [(op.src, op.dst, op.num_tokens) for op in kv.take_block_ops()]


def refs(kv: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in kv.pool.blocks[1:] if b.ref_cnt}


def tree(kv: KVCacheManager) -> dict[int, tuple]:
    """block id -> (parent block id or salt root 'root:<salt>', tokens)."""
    out = {}
    for n in kv.tree.nodes():
        p = n.parent
        out[n.block.block_id] = (p.block.block_id if p.block is not None else f"root:{p.salt}", n.tokens)
    return out


def admit(kv: KVCacheManager, r: Request):
    """One scheduler step admitting ``r`` and prefilling it whole."""
    kv.begin_step()
    hits, num_hit = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    kv.pool.check_invariants()
    return ids(hits), num_hit, ids(new), copies(kv)


def test_token_granular_hit_inside_a_block_copies_the_matched_slots():
    kv = KVCacheManager(16, BS)
    a = req(range(12))
    assert admit(kv, a) == ([], 0, [1, 2, 3], [])
    assert tree(kv) == {1: ("root:None", (0, 1, 2, 3)), 2: (1, (4, 5, 6, 7)), 3: (2, (8, 9, 10, 11))}
    # Shares block 1, then 2 of block 2's 4 tokens: copied into its own block 4.
    b = req([0, 1, 2, 3, 4, 5, 99, 98])
    assert admit(kv, b) == ([1], 6, [4], [(2, 4, 2)])
    assert b.num_computed_tokens == 8
    assert kv.get_block_ids(b.request_id) == [1, 4]
    assert refs(kv) == {1: 2, 2: 1, 3: 1, 4: 1}
    # Block 4 is full: a new branch under block 1.
    assert tree(kv)[4] == (1, (4, 5, 99, 98))
    kv.free(a)
    kv.free(b)
    assert refs(kv) == {}
    # Free cached blocks, tail first: a's 3, 2, then b's 4, then 1 (held by both until b left).
    assert list(kv.pool._free_cached) == [3, 2, 4, 1]
    kv.pool.check_invariants()


def test_branches_share_up_to_the_branch_point():
    kv = KVCacheManager(16, BS)
    a = req(list(range(8)) + [10, 11, 12, 13])
    b = req(list(range(8)) + [20, 21, 22, 23])
    c = req(list(range(8)) + [10, 11, 30, 31, 32])
    assert admit(kv, a) == ([], 0, [1, 2, 3], [])
    assert admit(kv, b) == ([1, 2], 8, [4], [])  # no common token with block 3
    assert admit(kv, c) == ([1, 2], 10, [5, 6], [(3, 5, 2)])
    assert refs(kv) == {1: 3, 2: 3, 3: 1, 4: 1, 5: 1, 6: 1}
    t = tree(kv)
    assert {k: v[0] for k, v in t.items()} == {1: "root:None", 2: 1, 3: 2, 4: 2, 5: 2}
    assert t[5][1] == (10, 11, 30, 31) and 6 not in t  # block 6 holds 1 token: not cached
    for r in (a, b, c):
        kv.free(r)
    assert kv.pool.get_num_free_blocks() == 15
    kv.pool.check_invariants()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_identical_repeat_of_k_blocks_plus_delta(k, delta):
    """Prompts of 4k-1, 4k, 4k+1 tokens repeated: the last token is always computed."""
    n = 4 * k + delta
    kv = KVCacheManager(32, BS)
    first = req(range(n))
    _, _, fblocks, _ = admit(kv, first)
    second = req(range(n))
    hits, num_hit, new, copies = admit(kv, second)
    if delta == -1:  # block k holds 3 tokens (not full, not cached): k-1 full blocks
        assert (hits, num_hit, copies) == (fblocks[: k - 1], 4 * (k - 1), [])
        assert len(new) == 1
    elif delta == 0:  # k-1 full blocks + 3 tokens of block k, copied; the 4th is computed
        assert (hits, num_hit) == (fblocks[: k - 1], 4 * k - 1)
        assert len(new) == 1 and copies == [(fblocks[k - 1], new[0], 3)]
    else:  # all k full blocks; the last token gets a block of its own
        assert (hits, num_hit, copies) == (fblocks[:k], 4 * k, [])
        assert len(new) == 1
    assert second.num_computed_tokens == n
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in hits)
    kv.free(first)
    kv.free(second)
    assert kv.pool.get_num_free_blocks() == 31
    kv.pool.check_invariants()


def test_same_step_blocks_are_shared_but_never_copied():
    """Blocks registered in the current step are written by its forward: a copy (which runs
    before the forward) may not read them; sharing by reference is fine."""
    kv = KVCacheManager(16, BS)
    kv.begin_step()
    a, b = req(range(8)), req(range(8))
    for r in (a, b):
        hits, num_hit = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
        r.num_computed_tokens = r.num_tokens
    assert copies(kv) == []
    assert kv.get_block_ids(a.request_id) == [1, 2]
    assert kv.get_block_ids(b.request_id) == [1, 3]  # block 1 shared, block 2 not copied
    assert b.num_computed_tokens == 8
    # Next step, the same prompt may copy from block 2.
    c = req(range(8))
    assert admit(kv, c) == ([1], 7, [4], [(2, 4, 3)])


@pytest.mark.parametrize("salt_x, salt_y, shared", [
    ("a", None, False), (None, "a", False), ("a", "b", False), ("a", "a", True), (None, None, True),
])
def test_cache_salt_isolates_full_and_partial_hits(salt_x, salt_y, shared):
    kv = KVCacheManager(16, BS)
    x = req(range(8), salt=salt_x)
    admit(kv, x)
    y = req([0, 1, 2, 3, 4, 5, 50], salt=salt_y)
    got = admit(kv, y)
    if shared:
        assert got == ([1], 6, [3], [(2, 3, 2)])
    else:
        assert got == ([], 0, [3, 4], [])
    roots = {salt_x} | {salt_y}
    assert set(kv.tree.roots) == roots


def test_eviction_is_lru_among_leaves():
    kv = KVCacheManager(6, BS)  # 5 usable
    a = req(range(8))
    assert admit(kv, a)[2] == [1, 2]
    kv.free(a)
    b = req(range(100, 108))
    assert admit(kv, b)[2] == [3, 4]
    kv.free(b)
    assert list(kv.pool._free_cached) == [2, 1, 4, 3]
    # 3 blocks: the uncached 5 first, then a's leaf 2, then its parent 1 (now a leaf).
    c = req(range(200, 212))
    assert admit(kv, c) == ([], 0, [5, 2, 1], [])
    assert kv.pool.num_evictions == 2
    assert set(tree(kv)) == {1, 2, 3, 4, 5}  # c's blocks 5, 2, 1 are cached anew
    # b's prefix survived: full block 3, and 3 tokens of block 4 copied.
    kv.free(c)
    d = req(range(100, 108))
    assert admit(kv, d) == ([3], 7, [1], [(4, 1, 3)])


def test_a_free_parent_is_not_evicted_before_its_free_child():
    kv = KVCacheManager(3, BS)  # 2 usable
    a = req(range(8))
    admit(kv, a)
    kv.free(a)
    assert list(kv.pool._free_cached) == [2, 1]
    # Reuse block 2 as a copy source only: it becomes the most recent, its parent the oldest.
    p = kv.pool
    p.touch([p.blocks[2]])
    p.free([p.blocks[2]])
    assert list(p._free_cached) == [1, 2]
    c = req([50, 51, 52])
    assert admit(kv, c)[2] == [2]  # the leaf goes, not the LRU-oldest parent
    assert tree(kv) == {1: ("root:None", (0, 1, 2, 3))}
    kv.free(c)
    kv.pool.check_invariants()


def test_private_duplicate_and_subtree_eviction_keep_the_tree_consistent():
    kv = KVCacheManager(5, BS)  # 4 usable
    a = req(range(8))
    assert admit(kv, a) == ([], 0, [1, 2], [])
    c = req(range(8))
    assert admit(kv, c) == ([1], 7, [3], [(2, 3, 3)])
    # Block 3 duplicates block 2's hash: it stays private; c's next block hangs under node 2.
    assert kv.pool.blocks[3].block_hash is None
    for t in (8, 9, 10, 11):
        c.append_output_token(t)
        kv.begin_step()
        kv.allocate_slots(c, 1)
        c.num_computed_tokens += 1
    assert kv.get_block_ids(c.request_id) == [1, 3, 4]
    assert tree(kv)[4] == (2, (8, 9, 10, 11))
    kv.free(a)
    assert list(kv.pool._free_cached) == [2]
    # The only free block is node 2, whose child 4 is held: it goes with its subtree.
    e = req([70, 71])
    assert admit(kv, e)[2] == [2]
    assert tree(kv) == {1: ("root:None", (0, 1, 2, 3))}
    assert kv.pool.blocks[4].block_hash is None and kv.pool.blocks[4].ref_cnt == 1
    kv.free(c)
    kv.free(e)
    assert list(kv.pool._free_cached) == [1]
    assert refs(kv) == {}
    kv.pool.check_invariants()


def test_reset_prefix_cache_clears_the_tree():
    kv = KVCacheManager(8, BS)
    a = req(range(8), salt="s")
    admit(kv, a)
    assert not kv.pool.reset_prefix_cache()
    kv.free(a)
    assert kv.pool.reset_prefix_cache()
    assert kv.tree.roots == {} and kv.pool.cached == {}
    kv.pool.check_invariants()


# ---- host-cost paths: child index by first token, remembered walk, lazy hashing ------------------


def test_partial_match_takes_the_longest_of_the_children_sharing_the_next_token():
    kv = KVCacheManager(6, BS)  # 5 usable: one block per prompt below
    prompts = ([5, 6, 7, 8], [9, 9, 9, 9], [5, 6, 9, 9], [5, 6, 7, 1], [5, 0, 0, 0])
    first = {}
    for toks in prompts:
        r = req(toks)
        admit(kv, r)
        first[tuple(toks)] = kv.get_block_ids(r.request_id)[0]
        kv.free(r)
    root = kv.tree.root(None)
    assert {n.tokens for n in root.child_nodes()} == set(first)
    assert sorted(root.children) == [5, 9] and len(root.children[5]) == 4
    # [5, 6, 7, 8] and [5, 6, 7, 1] share 3 tokens with the probe: the older wins the tie.
    probe = req([5, 6, 7, 9, 4])
    kv.begin_step()
    m, num_hit = kv.get_computed_blocks(probe)
    assert (list(m), num_hit, m.partial.block.block_id) == ([], 3, first[(5, 6, 7, 8)])
    # Once it is evicted (made the least recently freed), the younger one.
    p = kv.pool
    for toks in prompts[1:]:
        b = p.blocks[first[tuple(toks)]]
        p.touch([b])
        p.free([b])
    (got,) = p.allocate(1)
    assert got.block_id == first[(5, 6, 7, 8)] and got.block_hash is None
    m, num_hit = kv.get_computed_blocks(probe)
    assert (num_hit, m.partial.block.block_id) == (3, first[(5, 6, 7, 1)])
    # Nothing shares the next token: no partial hit.
    m, num_hit = kv.get_computed_blocks(req([1, 2, 3, 4, 5]))
    assert (list(m), num_hit, m.partial) == ([], 0, None)
    p.free([got])
    p.check_invariants()


def _fresh_match(kv: KVCacheManager, r: Request):
    saved, kv.tree._memo = kv.tree._memo, None  # forget the last walk: start from the root
    m, n = KVCacheManager.get_computed_blocks(kv, r)
    kv.tree._memo = saved
    return ids(m), n, (m.partial.block.block_id, m.partial.num_tokens) if m.partial else None


def _match(kv: KVCacheManager, r: Request):
    m, n = kv.get_computed_blocks(r)
    return ids(m), n, (m.partial.block.block_id, m.partial.num_tokens) if m.partial else None


def test_repeat_lookup_of_a_waiting_request_resumes_the_remembered_walk():
    kv = KVCacheManager(8, BS)  # 7 usable
    a = req(range(16))
    admit(kv, a)  # blocks 1-4
    kv.free(a)  # free cached, tail first: 4, 3, 2, 1
    w = req(list(range(16)) + [99])  # waits: its lookup is repeated step after step
    kv.begin_step()
    assert _match(kv, w) == ([1, 2, 3, 4], 16, None) == _fresh_match(kv, w)
    assert kv.tree._memo[0] is w.all_token_ids
    # The tail leaves the tree (evicted for another request): the remembered prefix shrinks.
    other = req(range(100, 120))  # 5 blocks: the 3 uncached, then leaves 4 and 3
    admit(kv, other)
    assert _match(kv, w) == ([1, 2], 8, None) == _fresh_match(kv, w)
    # The chain grows again under block 2 (another request): the walk resumes and finds it.
    kv.free(other)
    b = req(list(range(12)) + [50])
    kv.begin_step()
    assert admit(kv, b)[:2] == ([1, 2], 8)  # block 3 of b: tokens 8-11, a new node
    kv.begin_step()
    got = _match(kv, w)
    assert got == _fresh_match(kv, w) and got[1] == 12
    # Another request's lookup in between replaces the memory; results stay the same.
    assert _match(kv, req(range(8))) == _fresh_match(kv, req(range(8)))
    assert _match(kv, w) == got
    # A token appended (a preempted request's output) changes the limit: a fresh walk.
    w.append_output_token(7)
    assert _match(kv, w) == _fresh_match(kv, w)
    kv.pool.check_invariants()


def test_hashes_are_computed_once_and_lazily():
    kv = KVCacheManager(32, BS)
    r = req(range(18))
    kv.begin_step()
    kv.get_computed_blocks(r)
    assert r.block_hashes == []  # no tree yet: nothing to walk, nothing hashed
    assert kv.allocate_slots(r, 10) is not None  # a chunk: blocks 0-1 full and registered
    assert len(r.block_hashes) == 2
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 8) is not None
    assert len(r.block_hashes) == 4
    h = None
    for i in range(4):
        h = hash((h, tuple(range(4 * i, 4 * i + 4)), None))
        assert r.block_hashes[i] == h and kv.pool.lookup(h).block_id == kv.get_block_ids(r.request_id)[i]
    # get_block_ids hands out a copy.
    got = kv.get_block_ids(r.request_id)
    got.append(0)
    assert kv.get_block_ids(r.request_id) == got[:-1]
    kv.pool.check_invariants()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_remembered_walk_equals_a_fresh_walk_under_a_random_workload(seed):
    """Every lookup the scheduler makes (blocked heads, preemptions, evictions, aborts) gives
    what a walk from the root gives."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    cfg = SchedulerConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24),
                          max_model_len=64, enable_chunked_prefill=True, scheduling_policy="fcfs")
    s = Scheduler(cfg, FullKVCacheManager.for_blocks(rng.randint(3, 12), bs))
    kv = s.kv.groups[0]
    lookup = kv.get_computed_blocks
    num_checked = 0

    def checked(r):
        nonlocal num_checked
        fresh = _fresh_match(kv, r)
        m, n = lookup(r)
        assert (ids(m), n, (m.partial.block.block_id, m.partial.num_tokens) if m.partial else None) == fresh
        num_checked += 1
        return m, n

    kv.get_computed_blocks = checked
    base = [rng.randrange(3) for _ in range(20)]
    max_total = min((kv.pool.num_usable_blocks) * bs, 20)
    for i in range(rng.randint(1, 8)):
        plen = rng.randint(1, max_total)  # prompt + outputs - 1 must fit the pool alone
        prompt = (base[:rng.randint(0, plen)] + [rng.randrange(3) for _ in range(plen)])[:plen]
        s.add_request(Request(f"q{i}", prompt, SamplingParams(max_tokens=rng.randint(1, max_total - plen + 1),
                                                              ignore_eos=True), arrival_time=float(i)))
    for t in range(300):
        if not s.has_unfinished_requests():
            break
        if t and rng.random() < 0.03 and s.requests:
            s.finish_requests([rng.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        sched = _schedule(s)
        _update(s, sched, {r.request_id: rng.randrange(3) for (r, _), smp in
                           zip(sched.scheduled, sched.samples) if smp})
        kv.pool.check_invariants()
    assert not s.has_unfinished_requests() and num_checked > 0
