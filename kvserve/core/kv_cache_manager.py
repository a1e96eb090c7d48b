"""The only door the scheduler uses into the KV cache: lookup, allocate_slots, free.

Pure Python over block ids. Every full block of a request is named by a hash chain
``h_i = hash((h_{i-1}, tokens of block i, salt))`` and registered in the radix tree
(``prefix_cache.py``) as soon as the step that fills it is scheduled (its KV is written
by that step's forward, before any later request in the same batch reads it, so ``n > 1``
siblings admitted together already share the prompt's blocks).

Reuse is token-granular: full blocks are shared by reference; where the match ends
inside a block, the matched tokens' KV is copied into the request's first new block
(copy-on-write). ``allocate_slots`` queues ``(src_block, dst_block, num_tokens)`` copies
that the scheduler hands to the model runner (``SchedulerOutput.kv_copies``), which runs
them before the forward.
"""

from __future__ import annotations

from typing import Optional

import logging

from kvserve.core.block_pool import BlockPool, KVCacheBlock
from kvserve.core.prefix_cache import PrefixCache, PrefixMatch
from kvserve.request import Request

logger = logging.getLogger("kvserve")


def hash_block_tokens(parent_hash: Optional[int], tokens: tuple[int, ...], salt: Optional[str]) -> int:
    """Chained 64-bit hash naming one full block (tokens and everything before them)."""
    return hash((parent_hash, tokens, salt))


class KVCacheManager:
    """Maps requests to their KV blocks.

    Args:
        num_blocks: blocks in the pool, null block included.
        block_size: tokens per block.
        enable_caching: reuse full blocks of identical prefixes across requests.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tree = PrefixCache(self.pool, block_size)
        self.step = 0  # scheduler steps begun (a block's KV is readable from the next step on)
        self.pending_copies: list[tuple[int, int, int]] = []  # (src, dst, num_tokens) this step
        self._warned_short = False
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # full blocks of a request already registered
        # Prefix cache counters, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- hashing ------------------------------------------------------------------
    def _update_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Extend ``request.block_hashes`` to cover the full blocks among the first ``num_tokens``."""
        hashes = request.block_hashes
        bs = self.block_size
        salt = getattr(request, "cache_salt", None)
        toks = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tuple(toks[i * bs : (i + 1) * bs]), salt))
        return hashes

    # ---- scheduler API ------------------------------------------------------------
    def begin_step(self) -> None:
        """The scheduler starts building a step: blocks registered before now hold written KV."""
        self.step += 1
        self.pending_copies = []

    def take_copies(self) -> list[tuple[int, int, int]]:
        """This step's copy-on-write list ``(src_block, dst_block, num_tokens)``."""
        out, self.pending_copies = self.pending_copies, []
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
        # At most num_tokens - 1 tokens may come from the cache.
        hashes = self._update_block_hashes(request, request.num_tokens)
        m = self.tree.match(request.all_token_ids, hashes, getattr(request, "cache_salt", None),
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
        partial = getattr(new_computed_blocks, "partial", None)
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_partial = partial.num_tokens if partial else 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_partial
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once referenced; a free copy source
        # is held for the allocation too (so that it is not the block evicted for it).
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        hold_src = partial is not None and partial.block.ref_cnt == 0
        if num_needed + num_evictable_hits + hold_src > self.pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if partial is not None:
            self.pool.touch([partial.block])
        new_blocks = self.pool.allocate(max(num_needed, 0))
        if partial is not None:
            # The copy runs before this step's forward, so the source may be reused after it.
            self.pending_copies.append((partial.block.block_id, new_blocks[0].block_id, num_partial))
            self.pool.free([partial.block])
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Only tokens whose ids are known can be hashed (the prompt, and outputs so far).
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._update_block_hashes(request, num_full * self.block_size)
        salt = getattr(request, "cache_salt", None)
        toks = request.all_token_ids
        bs = self.block_size
        for i in range(start, num_full):
            if blocks[i].node is not None:  # a shared hit: already in the tree
                continue
            if i == 0:
                parent = self.tree.root(salt, create=True)
            else:
                # The parent is whichever block holds h_{i-1}: this request's own, or the
                # cached twin of a private duplicate.
                pb = self.pool.lookup(hashes[i - 1])
                parent = pb.node if pb is not None else None
                if parent is None:
                    break  # the chain above was evicted: nothing below can be found
            self.tree.insert(parent, tuple(toks[i * bs:(i + 1) * bs]), blocks[i], hashes[i], self.step)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks (tail first, so leaves evict first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by live requests, in [0, 1]."""
        return self.pool.get_usage()
