"""KV cache blocks: ids, reference counts, the free queue and the cached-block map.

Pure Python, no torch. Block 0 is the null block: never handed out, used to pad
block tables.

The free queue holds blocks with ``ref_cnt == 0``. Blocks that carry no cached prefix
are handed out first; blocks whose KV is still reusable (they have a block hash) stay
findable by the prefix cache until memory is needed, and then go least recently freed
first among the radix tree's leaves (``prefix_cache.py``): a block with cached children
is passed over while a leaf is free. A request frees its blocks tail-first, so the oldest
free cached block is nearly always a leaf. Evicting a node removes its subtree from the
tree (only when no free leaf is left), so every cached block stays reachable.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "node")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None
        self.node = None  # its RadixNode while cached through a PrefixCache

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Owns ``num_blocks`` blocks (including the null block 0).

    Raises:
        ValueError: if ``num_blocks < 2``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed
        # Free blocks: uncached ones (FIFO) and cached ones in LRU order.
        self._free_uncached: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block
        self.num_evictions = 0
        self.prefix_cache = None  # the PrefixCache (radix tree) that registers through this pool
        self.kv_events = None  # a KVEventRecorder (kvserve.core.kv_events) when KV events are published

    # ---- queries -------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached + evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached)

    def get_usage(self) -> float:
        """Fraction of usable blocks referenced by a live request, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def lookup(self, block_hash: int) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    # ---- mutation ------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (ref_cnt becomes 1). Raises ValueError if fewer are free."""
        unc = self._free_uncached
        if n > len(unc) + len(self._free_cached):
            raise ValueError(f"cannot allocate {n} blocks, only {self.get_num_free_blocks()} free")
        blocks = self.blocks
        remove_leaf = self.prefix_cache.remove_leaf if self.prefix_cache is not None else None
        out = []
        for _ in range(n):
            if unc:
                block = blocks[unc.popitem(last=False)[0]]
            else:
                fc = self._free_cached
                bid, _ = fc.popitem(last=False)
                block = blocks[bid]
                node = block.node
                if node is None:
                    self.num_evictions += 1
                    del self.cached[block.block_hash]
                    if self.kv_events is not None:
                        self.kv_events.removed(block.block_hash)
                    block.block_hash = None
                elif not node.children:
                    # The usual case: the least recently freed block is a leaf of the tree.
                    self.num_evictions += 1
                    remove_leaf(node)
                    block.node = None
                    del self.cached[block.block_hash]
                    if self.kv_events is not None:
                        self.kv_events.removed(block.block_hash)
                    block.block_hash = None
                else:
                    fc[bid] = None
                    fc.move_to_end(bid, last=False)  # back at the head: scan for a leaf
                    block = blocks[self._pop_evictable()]
                    self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to cached blocks a request reuses (removing them from the free queue)."""
        fc, null = self._free_cached, self.null_block
        for b in blocks:
            if b is null:  # a sliding-window hit's placeholder
                continue
            if b.ref_cnt == 0:
                fc.pop(b.block_id)
            b.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given; blocks reaching 0 become free."""
        null, fc, fu = self.null_block, self._free_cached, self._free_uncached
        for b in blocks:
            if b is null:
                continue
            n = b.ref_cnt
            if n <= 0:
                raise RuntimeError(f"double free of block {b.block_id}")
            b.ref_cnt = n - 1
            if n == 1:
                if b.block_hash is not None:
                    fc[b.block_id] = None
                else:
                    fu[b.block_id] = None

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Register ``block`` as holding the KV of ``block_hash``. Returns False if already cached."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def _pop_evictable(self) -> int:
        """The least recently freed cached block that is a leaf of the tree (else the oldest)."""
        for bid in self._free_cached:
            node = self.blocks[bid].node
            if node is None or not node.children:
                break
        else:
            bid = next(iter(self._free_cached))
        del self._free_cached[bid]
        return bid

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        self.num_evictions += 1
        node = block.node
        if node is None or not node.children:
            if node is not None:
                self.prefix_cache.remove_leaf(node)
                block.node = None
            del self.cached[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(block.block_hash)
            block.block_hash = None
            return
        # A node leaves the tree with its subtree (only non-leaves with held children get here).
        for b in self.prefix_cache.remove_subtree(block.node):
            del self.cached[b.block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(b.block_hash)
            b.block_hash = None
            b.node = None
            if b is not block and b.block_id in self._free_cached:
                del self._free_cached[b.block_id]
                self._free_uncached[b.block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no request uses. Returns False if some are in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for bid in list(self._free_cached):
            b = self.blocks[bid]
            del self.cached[b.block_hash]
            b.block_hash = None
            b.node = None
            self.num_evictions += 1
            self._free_uncached[bid] = None
        self._free_cached.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (for tests)."""
        free = set(self._free_uncached) | set(self._free_cached)
        assert len(free) == len(self._free_uncached) + len(self._free_cached)
        for b in self.blocks[1:]:
            assert (b.ref_cnt == 0) == (b.block_id in free), b
            assert b.ref_cnt >= 0
            if b.block_id in self._free_cached:
                assert b.block_hash is not None
            if b.block_hash is not None:
                assert self.cached[b.block_hash] is b
            else:
                assert b.node is None
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
