"""The only door the scheduler uses into the KV cache: lookup, can_allocate / allocate_slots, rollback, free.

The cache is split into KV cache groups (``kv_cache_spec.KVCacheConfig``): layers with the
same spec share one block table per request. Each group has its own block pool and radix
tree (``SingleTypeKVCacheManager``); this class keeps them in step. A request's blocks are a
``KVCacheBlocks``: one block list per group.

Sliding-window groups (``SlidingWindowSpec``) are served by ``SlidingWindowManager``: their
blocks below the window are freed as requests advance (``remove_skipped_blocks``), so a
window group holds ``ceil(window / block_size) + 1`` blocks per request between steps.

Bounded-KV groups (``BoundedKVSpec``: StreamingLLM sinks + window, H2O) are served by
``BoundedKVManager`` (``bounded_kv.py``): blocks are evicted as requests advance and the
nulled block-table columns travel to the workers in ``SchedulerOutput.evicted_blocks``.

Prefix hits: every group holds the same computed prefix. Full-attention groups look the
request up left to right and the shortest match wins (each is cut to it). Window groups then
look right to left from that point for the longest hit whose last window is cached; the
shortest of theirs is the hit and the other groups are cut to it (repeated until every
window group agrees, as a window group's hit at a shorter point is not implied by its hit at
a longer one). A hybrid hit is block-granular. Allocation is all-or-nothing across groups.
With one group each call goes straight to that group's manager.
"""

from __future__ import annotations

from typing import Optional

from kvserve.core.block_pool import BlockPool, KVCacheBlock
from kvserve.core.bounded_kv import BoundedKVManager
from kvserve.core.kv_cache_spec import (
    BoundedKVSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec,
)
from kvserve.core.prefix_cache import PartialHit, PrefixMatch
from kvserve.core.sched_output import BlockOp
from kvserve.core.single_type_manager import SingleTypeKVCacheManager, hash_block_tokens
from kvserve.core.sliding_window_manager import SlidingWindowManager
from kvserve.request import Request

def _group_manager(g: KVCacheGroup, enable_caching: bool) -> SingleTypeKVCacheManager:
    """The manager serving one KV cache group, by its spec's type."""
    spec = g.spec
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(g.num_blocks, spec.block_size, spec.sliding_window, enable_caching, g.group_id)
    if isinstance(spec, BoundedKVSpec):
        return BoundedKVManager(g.num_blocks, spec.block_size, spec.policy, spec.sink_tokens, spec.window,
                                spec.budget_tokens, g.group_id, enable_caching)
    return SingleTypeKVCacheManager(g.num_blocks, spec.block_size, enable_caching, g.group_id)


#: Per KV cache group, a list of blocks (a ``PrefixMatch`` for lookups).
KVCacheBlocks = tuple[list[KVCacheBlock], ...]

__all__ = ["KVCacheManager", "KVCacheBlocks", "hash_block_tokens"]


class KVCacheManager:
    """Maps requests to their KV blocks in every KV cache group.

    Args:
        kv_cache_config: the groups and their block counts.
        enable_caching: reuse full blocks of identical prefixes across requests.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = True) -> None:
        self.kv_cache_config = kv_cache_config
        self.enable_caching = enable_caching
        self.block_size = kv_cache_config.block_size
        self.groups: list[SingleTypeKVCacheManager] = [_group_manager(g, enable_caching)
                                                        for g in kv_cache_config.groups]
        self.bounded_groups = [g for g in self.groups if isinstance(g, BoundedKVManager)]
        self._single = self.groups[0] if len(self.groups) == 1 else None
        self.window_groups = [g for g in self.groups if isinstance(g, SlidingWindowManager)]
        self.full_groups = [g for g in self.groups if not isinstance(g, SlidingWindowManager)]
        # A format that keeps the filling block exact (KVFormat.residual) recomputes a partial
        # block instead of reading it from its page: a prefix hit then computes what a cold run does.
        self.block_granular_hits = any(g.spec.format.residual for g in kv_cache_config.groups)
        # One plain full-attention group: its per-request block states, for the scheduler's
        # decode fast path (``fits_in_held_blocks``); None where another manager type serves it.
        self.plain_req_blocks = (self._single._reqs if type(self._single) is SingleTypeKVCacheManager
                                 else None)

    @property
    def bounds_kv(self) -> bool:
        """Whether every group bounds a request's KV (bounded-KV eviction): requests may then
        run past ``max_model_len`` up to their ``max_tokens``."""
        return bool(self.bounded_groups) and len(self.bounded_groups) == len(self.groups)

    def take_evictions(self) -> dict[str, list[tuple[int, int]]]:
        """Request id -> ``(group id, block-table column)`` entries nulled by bounded-KV eviction
        since the last call (for ``SchedulerOutput.evicted_blocks``)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for g in self.bounded_groups:
            for rid, cols in g.take_evictions().items():
                out.setdefault(rid, []).extend((g.group_id, c) for c in cols)
        return out

    def observe_block_mass(self, request_id: str, mass_per_group: dict[int, dict[int, float]]) -> None:
        """Attention mass per block-table column of a request (h2o scores), per group id."""
        for g in self.bounded_groups:
            m = mass_per_group.get(g.group_id)
            if m:
                g.observe_block_mass(request_id, m)

    @property
    def num_evicted_blocks(self) -> int:
        """Blocks freed by bounded-KV eviction, cumulative (all groups)."""
        return sum(g.num_evicted_blocks for g in self.bounded_groups)

    @property
    def num_evicted_tokens(self) -> int:
        """Token slots freed by bounded-KV eviction, cumulative (all groups)."""
        return sum(g.num_evicted_tokens for g in self.bounded_groups)

    @property
    def has_sliding_window(self) -> bool:
        """Whether some group frees blocks outside a sliding window."""
        return bool(self.window_groups)

    @classmethod
    def for_blocks(cls, num_blocks: int, block_size: int, enable_caching: bool = True) -> "KVCacheManager":
        """One full-attention group of ``num_blocks`` blocks (tests, toy configs)."""
        spec = FullAttentionSpec(block_size, 1, 1, "float32", "float32")
        return cls(KVCacheConfig([KVCacheGroup(0, [0], spec, num_blocks)]), enable_caching)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def pool(self) -> BlockPool:
        """The block pool of a single-group cache. Raises ValueError with several groups."""
        if self._single is None:
            raise ValueError("several KV cache groups: use groups[i].pool")
        return self._single.pool

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Request id -> its blocks in group 0 (every request holds blocks in every group)."""
        return self.groups[0].req_to_blocks

    @property
    def num_cached_blocks(self) -> dict[str, int]:
        return self.groups[0].num_cached_blocks

    # ---- scheduler API ------------------------------------------------------------------
    def begin_step(self) -> None:
        """The scheduler starts building a step (blocks registered before now hold written KV)."""
        for g in self.groups:
            g.begin_step()

    def take_block_ops(self) -> list[BlockOp]:
        """This step's block operations, every group's, in order."""
        if self._single is not None:
            return self._single.take_block_ops()
        return [op for g in self.groups for op in g.take_block_ops()]

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest prefix every group holds: ``(hits per group, tokens covered)``.

        The last token is never counted (its logits are needed). Pass the hits to
        ``allocate_slots``; nothing is referenced until then. Token-granular (a partial block's
        tokens are copied on write) unless a group's format keeps the filling block exact.
        """
        hits, n = self._computed_blocks(request)
        if n % self.block_size and self.block_granular_hits:
            n -= n % self.block_size
            for h in hits:
                h.partial = None
        return hits, n

    def _computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        if self._single is not None:
            m, n = self._single.get_computed_blocks(request)
            return (m,), n
        if self.window_groups:
            return self._hybrid_computed_blocks(request)
        matches = [g.get_computed_blocks(request) for g in self.groups]
        n = min(num for _, num in matches)
        bs = self.block_size
        out = []
        for m, num in matches:
            cut = PrefixMatch(m[: n // bs])
            rem = n - len(cut) * bs
            if rem:
                # Keep a token-granular tail only where this group's match reaches that far.
                if len(m) > n // bs:
                    cut.partial = PartialHit(m[n // bs], rem)
                elif m.partial is not None and m.partial.num_tokens >= rem:
                    cut.partial = PartialHit(m.partial.block, rem)
            out.append(cut)
        if n % bs and any(c.partial is None for c in out):  # groups disagree inside a block
            n -= n % bs
            for c in out:
                c.partial = None
        return tuple(out), n

    def _hybrid_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Full groups left to right, then window groups right to left from that point,
        until every group agrees (block-granular)."""
        if not self.enable_caching:
            return tuple(PrefixMatch() for _ in self.groups), 0
        bs = self.block_size
        full = [g.get_computed_blocks(request)[0] for g in self.full_groups]
        k = min(len(m) for m in full) if full else (request.num_tokens - 1) // bs
        while True:
            wins = [g.find_longest_hit(request, k) for g in self.window_groups]
            k2 = min(len(w) for w in wins)
            if k2 == k and all(len(w) == k for w in wins):
                break
            k = k2
        by_id = {g.group_id: PrefixMatch(m[:k]) for g, m in zip(self.full_groups, full)}
        by_id.update((g.group_id, w) for g, w in zip(self.window_groups, wins))
        return tuple(by_id[g.group_id] for g in self.groups), k * bs

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Optional[KVCacheBlocks] = None) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed. Allocates nothing;
        window and bounded-KV groups first free what the request no longer reads (as
        ``allocate_slots`` does, whether or not it succeeds)."""
        if self._single is not None:
            return self._single.can_allocate(request, num_new_tokens,
                                             None if new_computed_blocks is None else new_computed_blocks[0])
        hits = new_computed_blocks or (None,) * len(self.groups)
        return all(g.can_allocate(request, num_new_tokens, h) for g, h in zip(self.groups, hits))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[KVCacheBlocks] = None) -> Optional[KVCacheBlocks]:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``new_computed_blocks``: prefix hits from ``get_computed_blocks`` for a request being
        admitted (its ``num_computed_tokens`` still excludes them). Returns the newly
        allocated blocks per group, or None (and changes nothing) if any group is short
        (``can_allocate`` asks the same question without allocating).
        """
        if self._single is not None:
            new = self._single.allocate_slots(request, num_new_tokens,
                                              None if new_computed_blocks is None else new_computed_blocks[0])
            return None if new is None else (new,)
        hits = new_computed_blocks or (None,) * len(self.groups)
        if not all(g.can_allocate(request, num_new_tokens, h) for g, h in zip(self.groups, hits)):
            return None
        return tuple(g.allocate_slots(request, num_new_tokens, h) for g, h in zip(self.groups, hits))

    def fits_in_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens)`` would be a no-op returning no new
        blocks: one plain full-attention group, a running request whose held blocks already
        hold the tokens and no block of it becoming full (to register). False means "ask
        ``allocate_slots``", not "does not fit". The scheduler inlines this test (hot)."""
        reqs = self.plain_req_blocks
        st = reqs.get(request.request_id) if reqs is not None else None
        if st is None:
            return False
        total = request.num_computed_tokens + num_new_tokens
        return total <= len(st.blocks) * self.block_size and total < st.cache_at

    def rollback(self, request: Request) -> None:
        """Free blocks past ``ceil(num_computed_tokens / block_size)`` in every group (after
        rejected draft tokens lowered ``num_computed_tokens``)."""
        for g in self.groups:
            g.rollback(request)

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: Optional[int] = None) -> None:
        """Free the request's blocks that no query from ``num_computed_tokens`` (default: the
        request's) on can read, in every sliding-window group."""
        for g in self.window_groups:
            g.remove_skipped_blocks(request, num_computed_tokens)

    def evict_after_step(self, request: Request, num_computed_tokens: int) -> None:
        """Bounded-KV groups: evict what no query from ``num_computed_tokens`` on needs (after a
        step's queries ran; h2o: with that step's attention mass already observed)."""
        for g in self.bounded_groups:
            g.evict(request, 0, num_computed_tokens)

    def num_live_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group, the blocks the request holds now (freed window entries excluded)."""
        null = [g.pool.null_block for g in self.groups]
        return tuple(sum(b is not nb for b in g.req_to_blocks.get(request_id, ()))
                     for g, nb in zip(self.groups, null))

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks in every group."""
        for g in self.groups:
            g.free(request)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Per group, the request's block ids in order (new lists; empty for an unknown request)."""
        return tuple(g.get_block_ids(request_id) for g in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by live requests, in [0, 1] (the fullest group's)."""
        return max(g.usage for g in self.groups)

    def check_invariants(self) -> None:
        for g in self.groups:
            g.pool.check_invariants()
