"""One KV cache group's blocks: lookup, allocate_slots, rollback, free (used by ``KVCacheManager``).

Pure Python over block ids; one instance per KV cache group, with its own block pool and
radix tree. Every full block of a request is named by a hash chain
``h_i = hash((h_{i-1}, tokens of block i, salt))`` and registered in the radix tree
(``prefix_cache.py``) as soon as the step that fills it is scheduled (its KV is written
by that step's forward, before any later request in the same batch reads it, so ``n > 1``
siblings admitted together already share the prompt's blocks).

Reuse is token-granular: full blocks are shared by reference; where the match ends
inside a block, the matched tokens' KV is copied into the request's first new block
(copy-on-write). ``allocate_slots`` queues ``(src_block, dst_block, num_tokens)`` copies
that the scheduler hands to the workers as ``BlockOp("copy", ...)`` (``SchedulerOutput.block_ops``),
which run them before the forward.

Per step, a running request costs one dict probe and two comparisons here; the tree is
touched only when one of its blocks becomes full (``_ReqBlocks.cache_at``).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

from kvserve.core.block_pool import BlockPool, KVCacheBlock
from kvserve.core.prefix_cache import PrefixCache, PrefixMatch
from kvserve.core.sched_output import BlockOp
from kvserve.request import Request

logger = logging.getLogger("kvserve")


def hash_block_tokens(parent_hash: Optional[int], tokens: tuple[int, ...], salt: Optional[str]) -> int:
    """Chained 64-bit hash naming one full block (tokens and everything before them)."""
    return hash((parent_hash, tokens, salt))


_NEVER = sys.maxsize


class _ReqBlocks:
    """One request's blocks, their ids (for ``get_block_ids``) and how many are registered.

    ``cache_at`` is the token count at which its next block becomes full and is registered
    (``(num_cached + 1) * block_size``; never with caching off), so the per-step check is one
    comparison.
    """

    __slots__ = ("blocks", "ids", "num_cached", "cache_at", "num_skipped")

    def __init__(self, cache_at: int) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.ids: list[int] = []
        self.num_cached = 0  # leading full blocks already offered to the tree
        self.cache_at = cache_at
        self.num_skipped = 0  # sliding window: leading entries already swapped for the null block


class SingleTypeKVCacheManager:
    """Maps requests to their KV blocks in one group.

    Invariant between steps: a request holds ``ceil(num_computed_tokens / block_size)``
    blocks (``rollback`` restores it after rejected draft tokens), so a worker can mirror the
    block table from appended block ids alone.

    Args:
        num_blocks: blocks in the pool, null block included.
        block_size: tokens per block.
        enable_caching: reuse full blocks of identical prefixes across requests.
        group_id: the KV cache group this manager serves (named in its block ops).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, group_id: int = 0) -> None:
        self.group_id = group_id
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tree = PrefixCache(self.pool, block_size)
        self.step = 0  # scheduler steps begun (a block's KV is readable from the next step on)
        self.pending_ops: list[BlockOp] = []  # copy-on-write ops of this step
        self._warned_short = False
        self._reqs: dict[str, _ReqBlocks] = {}
        # Prefix cache counters, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Request id -> its blocks (a new dict; the lists are the live ones)."""
        return {rid: st.blocks for rid, st in self._reqs.items()}

    @property
    def num_cached_blocks(self) -> dict[str, int]:
        """Request id -> its leading full blocks already registered (non-zero entries only)."""
        return {rid: st.num_cached for rid, st in self._reqs.items() if st.num_cached}

    # ---- scheduler API ------------------------------------------------------------
    def begin_step(self) -> None:
        """The scheduler starts building a step: blocks registered before now hold written KV."""
        self.step += 1
        self.pending_ops = []

    def take_block_ops(self) -> list[BlockOp]:
        """This step's copy-on-write ops (``BlockOp("copy", group, src, dst, num_tokens)``)."""
        out, self.pending_ops = self.pending_ops, []
        return out

    def get_computed_blocks(self, request: Request) -> tuple[PrefixMatch, int]:
        """Longest cached prefix of ``request``, token-granular.

        Returns the match (a list of full blocks, not yet referenced: pass it to
        ``allocate_slots``; its ``partial`` names a block whose first tokens are copied) and
        the number of tokens it covers. The last token is never counted: its logits are needed.
        """
        if not self.enable_caching:
            return PrefixMatch(), 0
        if request.num_tokens < 2 and not self._warned_short:
            self._warned_short = True
            logger.warning("prefix caching cannot apply to a 1-token prompt (its last token is "
                           "always computed); logged once")
        # At most num_tokens - 1 tokens may come from the cache. The walk hashes the blocks it
        # reaches (request.block_hashes); the rest are hashed when they are registered.
        m = self.tree.match(request.all_token_ids, request.block_hashes, getattr(request, "cache_salt", None),
                            request.num_tokens - 1, self.step)
        return m, len(m) * self.block_size + (m.partial.num_tokens if m.partial else 0)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``new_computed_blocks`` are prefix-cache hits found by ``get_computed_blocks`` for a
        request being admitted (its ``num_computed_tokens`` still excludes them).
        Returns the newly allocated blocks, or None (and changes nothing) if the pool is short.
        """
        bs = self.block_size
        st = self._reqs.get(request.request_id)
        if new_computed_blocks is None and st is not None:
            # A running request (decode or the next prefill chunk): the hot path.
            total = request.num_computed_tokens + num_new_tokens
            num_needed = -(-total // bs) - len(st.blocks)
            if num_needed <= 0:
                new_blocks = []
            elif num_needed > self.pool.get_num_free_blocks():
                if not st.blocks:
                    del self._reqs[request.request_id]
                return None
            else:
                new_blocks = self.pool.allocate(num_needed)
                st.blocks.extend(new_blocks)
                st.ids.extend([b.block_id for b in new_blocks])
            if total >= st.cache_at and request.num_tokens >= st.cache_at:
                self._cache_full_blocks(request, st, total)
            return new_blocks

        partial = getattr(new_computed_blocks, "partial", None)
        new_computed_blocks = new_computed_blocks or []
        if st is None:
            st = _ReqBlocks(bs if self.enable_caching else _NEVER)
        blocks = st.blocks
        num_partial = partial.num_tokens if partial else 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs + num_partial
        total = num_computed + num_new_tokens
        num_needed = -(-total // bs) - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once referenced; a free copy source
        # is held for the allocation too (so that it is not the block evicted for it).
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        hold_src = partial is not None and partial.block.ref_cnt == 0
        if num_needed + num_evictable_hits + hold_src > self.pool.get_num_free_blocks():
            if not blocks:
                self._reqs.pop(request.request_id, None)
            return None
        self._reqs[request.request_id] = st
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if partial is not None:
            self.pool.touch([partial.block])
        new_blocks = self.pool.allocate(max(num_needed, 0))
        if partial is not None:
            # The copy runs before this step's forward, so the source may be reused after it.
            self.pending_ops.append(BlockOp("copy", self.group_id, partial.block.block_id, new_blocks[0].block_id,
                                            num_partial))
            self.pool.free([partial.block])
        blocks.extend(new_blocks)
        st.ids.extend([b.block_id for b in new_computed_blocks])
        st.ids.extend([b.block_id for b in new_blocks])
        if total >= st.cache_at and request.num_tokens >= st.cache_at:
            self._cache_full_blocks(request, st, total)
        return new_blocks

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed (nothing changes)."""
        bs = self.block_size
        st = self._reqs.get(request.request_id)
        free = self.pool.get_num_free_blocks()
        if new_computed_blocks is None and st is not None:
            return -(-(request.num_computed_tokens + num_new_tokens) // bs) - len(st.blocks) <= free
        partial = getattr(new_computed_blocks, "partial", None)
        hits = new_computed_blocks or []
        held = len(st.blocks) if st is not None else 0
        num_partial = partial.num_tokens if partial else 0
        total = request.num_computed_tokens + len(hits) * bs + num_partial + num_new_tokens
        need = -(-total // bs) - held - len(hits)
        need += sum(1 for b in hits if b.ref_cnt == 0) + (partial is not None and partial.block.ref_cnt == 0)
        return need <= free

    def rollback(self, request: Request) -> None:
        """Free the blocks past ``ceil(request.num_computed_tokens / block_size)`` (the slots of
        rejected draft tokens), tail first. Such blocks hold no registered prefix: only blocks
        of known tokens are registered, and those lie below ``num_computed_tokens``."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        keep = -(-request.num_computed_tokens // self.block_size)
        if len(st.blocks) > keep:
            tail = st.blocks[keep:]
            del st.blocks[keep:], st.ids[keep:]
            self.pool.free(reversed(tail))

    def _cache_full_blocks(self, request: Request, st: _ReqBlocks, num_tokens: int) -> None:
        if getattr(request, "delay_cache_blocks", False):  # KV still on its way from another engine
            return
        # Only tokens whose ids are known can be hashed (the prompt, and outputs so far).
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full <= st.num_cached:
            return
        self.tree.insert_blocks(request.all_token_ids, request.block_hashes, getattr(request, "cache_salt", None),
                                st.blocks, st.num_cached, num_full, self.step)
        st.num_cached = num_full
        st.cache_at = (num_full + 1) * self.block_size

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks (tail first, so leaves evict first)."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self.pool.free(reversed(st.blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, in order (a new list; ``[]`` for an unknown request)."""
        st = self._reqs.get(request_id)
        return st.ids[:] if st is not None else []

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by live requests, in [0, 1]."""
        return self.pool.get_usage()
