"""A sliding-window KV cache group's blocks: freed once outside the window, found right to left.

A layer with window ``w`` lets the token at position ``p`` attend to keys ``(p - w, p]``.
Once a request's next token to compute is at position ``c`` (``num_computed_tokens``), no
query of it reads keys below ``c - w + 1``, so its blocks entirely below that point go back
to the pool; their block-table entries become the null block (id 0), which no kernel reads
(kernels start at the window). A request then holds at most ``ceil(w / block_size) + 1``
blocks between steps, whatever its length. The block table keeps its logical layout (entry
``i`` covers positions ``[i * block_size, (i + 1) * block_size)``), so the invariant of
``SingleTypeKVCacheManager`` (``ceil(num_computed_tokens / block_size)`` entries per
request) and the worker's mirroring of appended ids stay as they are.

Prefix caching (vLLM's hybrid KV cache manager idea, in our own shape): a hit of ``k``
blocks needs only the ``ceil((w - 1) / block_size)`` blocks before position ``k *
block_size`` (everything the next query can see), so the lookup scans the request's block
hashes right to left for the longest run of that many cached blocks; blocks before the run
are the null block in the hit. Window blocks are registered by hash in the pool (no radix
tree: a tree evicts a node with its subtree, and the out-of-window blocks that leave first
are the tree's inner nodes, which would take the useful tail with them), each with the
parent hash, tokens and salt it was registered with, re-checked on every hit (Python's
tuple hash is not collision-resistant). A finished request frees its blocks front to back,
so its tail (what the next turn of a chat needs) is evicted last.
"""

from __future__ import annotations

from typing import Optional

from kvserve.core.block_pool import KVCacheBlock
from kvserve.core.prefix_cache import PrefixMatch
from kvserve.core.single_type_manager import SingleTypeKVCacheManager, _ReqBlocks
from kvserve.request import Request


def extend_block_hashes(request: Request, num_blocks: int, block_size: int) -> list[int]:
    """The request's hash chain over its first ``num_blocks`` full blocks (extended in place,
    the same chain as the radix tree's: ``h_i = hash((h_{i-1}, tokens_i, salt))``)."""
    hashes = request.block_hashes
    n = len(hashes)
    if n < num_blocks:
        toks = request.all_token_ids
        salt = getattr(request, "cache_salt", None)
        h = hashes[-1] if n else None
        for i in range(n, num_blocks):
            h = hash((h, tuple(toks[i * block_size:(i + 1) * block_size]), salt))
            hashes.append(h)
    return hashes


def register_full_blocks(mgr: SingleTypeKVCacheManager, request: Request, st: _ReqBlocks, num_full: int,
                         hashes: list[int], salt) -> None:
    """Register ``request``'s live full blocks ``[st.num_cached, num_full)`` in ``mgr``'s pool by
    hash, each keyed in ``mgr._keys`` by the parent hash, tokens and ``salt`` a hit re-checks
    (window and bounded groups: no radix tree, null entries skipped)."""
    bs = mgr.block_size
    pool, null, keys = mgr.pool, mgr.pool.null_block, mgr._keys
    toks = request.all_token_ids
    for i in range(st.num_cached, num_full):
        b = st.blocks[i]
        if b is null or b.block_hash is not None:
            continue
        if pool.cache_block(b, hashes[i]):
            keys[b.block_id] = (hashes[i - 1] if i else None, tuple(toks[i * bs:(i + 1) * bs]), salt)
    st.num_cached = num_full
    st.cache_at = (num_full + 1) * bs


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Maps requests to their blocks in one sliding-window KV cache group.

    Args:
        num_blocks: blocks in the pool, null block included.
        block_size: tokens per block.
        sliding_window: the group's window in tokens (>= 1).
        enable_caching: reuse blocks of identical prefixes across requests.
        group_id: the KV cache group this manager serves.

    Raises ValueError for a window below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int, enable_caching: bool = True,
                 group_id: int = 0) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        super().__init__(num_blocks, block_size, enable_caching, group_id)
        self.sliding_window = sliding_window
        self.tree = None
        self.pool.prefix_cache = None  # blocks are found by hash, evicted LRU
        # Blocks before a hit point that the next query can see.
        self.num_hit_blocks = -(-(sliding_window - 1) // block_size)
        # block id -> (parent hash, tokens, salt) it was registered under.
        self._keys: dict[int, tuple] = {}

    # ---- freeing outside the window ---------------------------------------------------
    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from position ``num_computed_tokens`` on can read."""
        return max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: Optional[int] = None) -> int:
        """Free the request's blocks below its window (from ``num_computed_tokens``, default
        the request's), oldest first; their entries become the null block. Returns how many."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return 0
        c = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        n = min(self.num_skipped_blocks(c), len(st.blocks))
        null = self.pool.null_block
        blocks, ids = st.blocks, st.ids
        freed = []
        i = st.num_skipped
        while i < n:
            b = blocks[i]
            if b is not null:
                freed.append(b)
                blocks[i] = null
                ids[i] = 0
            i += 1
        if i > st.num_skipped:
            st.num_skipped = i
        if freed:
            self.pool.free(freed)
        return len(freed)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> Optional[list[KVCacheBlock]]:
        """As ``SingleTypeKVCacheManager.allocate_slots``, after freeing the blocks below the
        window of the request's next token (they are not needed whether or not this succeeds)."""
        if new_computed_blocks is None:
            self.remove_skipped_blocks(request)
        new = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        if new is not None and new_computed_blocks is not None:
            # Admission: the hit's leading null blocks are already "skipped".
            hit_end = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
            self.remove_skipped_blocks(request, hit_end)
        return new

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> bool:
        if new_computed_blocks is None:
            self.remove_skipped_blocks(request)
        return super().can_allocate(request, num_new_tokens, new_computed_blocks)

    # ---- prefix caching --------------------------------------------------------------
    def _lookup(self, request: Request, hashes: list[int], i: int) -> Optional[KVCacheBlock]:
        """The cached block holding block ``i`` of the request, or None."""
        b = self.pool.cached.get(hashes[i])
        if b is None:
            return None
        bs = self.block_size
        key = (hashes[i - 1] if i else None, tuple(request.all_token_ids[i * bs:(i + 1) * bs]),
               getattr(request, "cache_salt", None))
        return b if self._keys.get(b.block_id) == key else None

    def find_longest_hit(self, request: Request, max_blocks: int) -> PrefixMatch:
        """Longest hit of at most ``max_blocks`` blocks: ``k`` entries whose last
        ``min(k, ceil((w - 1) / block_size))`` are cached blocks and the rest the null block.
        Nothing is referenced (pass it to ``allocate_slots``)."""
        out = PrefixMatch()
        if not self.enable_caching or max_blocks <= 0:
            return out
        need = self.num_hit_blocks
        null = self.pool.null_block
        if need == 0:  # a window of one token sees only itself
            out.extend([null] * max_blocks)
            return out
        hashes = extend_block_hashes(request, max_blocks, self.block_size)
        run: list[KVCacheBlock] = []  # right to left
        k = 0
        for i in range(max_blocks - 1, -1, -1):
            b = self._lookup(request, hashes, i)
            if b is None:
                run = []
                continue
            run.append(b)
            if len(run) == need:
                k = i + need
                break
        else:
            k = len(run)  # a run that reaches block 0 needs no more blocks
        run.reverse()
        out.extend([null] * (k - len(run)))
        out.extend(run)
        return out

    def get_computed_blocks(self, request: Request):
        """Longest hit for this group alone (block-granular): ``(match, tokens)``. The last
        token is never counted."""
        if not self.enable_caching:
            return PrefixMatch(), 0
        m = self.find_longest_hit(request, (request.num_tokens - 1) // self.block_size)
        return m, len(m) * self.block_size

    def _cache_full_blocks(self, request: Request, st: _ReqBlocks, num_tokens: int) -> None:
        if getattr(request, "delay_cache_blocks", False):  # KV still on its way from another engine
            return
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        if num_full <= st.num_cached:
            return
        hashes = extend_block_hashes(request, num_full, bs)
        register_full_blocks(self, request, st, num_full, hashes, getattr(request, "cache_salt", None))

    def free(self, request: Request) -> None:
        """Release a request's blocks front to back, so its tail is the last evicted."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self.pool.free(st.blocks)

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (null entries excluded)."""
        st = self._reqs.get(request_id)
        return 0 if st is None else sum(b is not self.pool.null_block for b in st.blocks)
