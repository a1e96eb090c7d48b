"""Radix tree over token blocks: the prefix cache's structure.

Every cached block is a node; its edge label is the block's ``block_size`` tokens and
its name is the chained hash ``h_i = hash((h_{i-1}, tokens_i, salt))`` (so a lookup is
one dict probe per block, and the stored tokens and parent are checked against the
request, which guards against hash collisions). Each ``cache_salt`` has its own root,
so tenants never share blocks (the salt is in every hash as well).

Matching is token-granular: after the longest chain of full blocks, the children of the
last matched node are searched for the longest common token prefix with the request's
next tokens. Those ``m`` tokens are not shared by reference (the request will write the
rest of that block); their KV is copied into the request's own fresh block before the
forward (copy-on-write), see ``KVCacheManager.allocate_slots``.

Eviction (in ``BlockPool``) removes unreferenced nodes leaf-first in LRU order; a node
is only ever removed together with its subtree, so every cached block stays reachable
from its root. Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvserve.core.block_pool import BlockPool, KVCacheBlock


class RadixNode:
    """One cached full block (or a root: ``block is None``)."""

    __slots__ = ("block", "tokens", "block_hash", "parent", "children", "step", "salt")

    def __init__(self, block, tokens: tuple[int, ...], block_hash: Optional[int],
                 parent: Optional["RadixNode"], step: int, salt=None) -> None:
        self.block = block
        self.tokens = tokens
        self.block_hash = block_hash
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.step = step  # scheduler step whose forward writes the block's KV
        self.salt = salt

    def __repr__(self) -> str:
        bid = None if self.block is None else self.block.block_id
        return f"RadixNode(block={bid}, tokens={self.tokens}, children={len(self.children)})"


class PartialHit:
    """The token-granular tail of a match: the first ``num_tokens`` slots of ``block``."""

    __slots__ = ("block", "num_tokens")

    def __init__(self, block: "KVCacheBlock", num_tokens: int) -> None:
        self.block = block
        self.num_tokens = num_tokens

    def __repr__(self) -> str:
        return f"PartialHit({self.block.block_id}, {self.num_tokens})"


class PrefixMatch(list):
    """Full cached blocks of a match (a list of blocks), plus an optional ``partial`` tail."""

    partial: Optional[PartialHit] = None


def _common_prefix(a: tuple[int, ...], b, limit: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if n >= limit or x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The tree; the block pool owns the blocks and evicts through ``remove_subtree``."""

    def __init__(self, pool: "BlockPool", block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.roots: dict[object, RadixNode] = {}
        pool.prefix_cache = self

    def root(self, salt, create: bool = False) -> Optional[RadixNode]:
        r = self.roots.get(salt)
        if r is None and create:
            r = self.roots[salt] = RadixNode(None, (), None, None, -1, salt)
        return r

    # ---- lookup ------------------------------------------------------------------------
    def match(self, token_ids: list[int], hashes: list[int], salt, max_tokens: int,
              current_step: int) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` covering at most ``max_tokens`` tokens.

        Full blocks come back in the list; where the match goes on inside the next block,
        ``partial`` names a cached block whose first tokens agree with the request's. Only
        blocks whose KV was written by an earlier step qualify as copy sources (the copy runs
        before this step's forward).
        """
        bs = self.block_size
        out = PrefixMatch()
        node = self.root(salt)
        if node is None or max_tokens <= 0:
            return out
        for i in range(min(max_tokens // bs, len(hashes))):
            b = self.pool.lookup(hashes[i])
            if b is None or b.node is None:
                break
            child = b.node
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            if child.parent is not node or child.tokens != toks:  # token check (hash collision)
                break
            out.append(b)
            node = child
        start = len(out) * bs
        limit = min(max_tokens - start, bs)
        if limit > 0 and node.children:
            nxt = token_ids[start:start + limit]
            best, best_n = None, 0
            for child in node.children.values():
                if child.step >= current_step:
                    continue
                n = _common_prefix(child.tokens, nxt, limit)
                if n > best_n:
                    best, best_n = child, n
            if best is not None:
                out.partial = PartialHit(best.block, best_n)
        return out

    # ---- insertion and removal ---------------------------------------------------------
    def insert(self, parent: RadixNode, tokens: tuple[int, ...], block: "KVCacheBlock",
               block_hash: int, step: int) -> Optional[RadixNode]:
        """Register ``block`` under ``parent``; None (nothing changes) if the edge or the
        hash is taken (a duplicate block stays private to its request)."""
        if tokens in parent.children or not self.pool.cache_block(block, block_hash):
            if parent.block is None and not parent.children:
                self.roots.pop(parent.salt, None)  # a root made for this insert stays empty
            return None
        node = RadixNode(block, tokens, block_hash, parent, step, parent.salt)
        parent.children[tokens] = node
        block.node = node
        return node

    def remove_subtree(self, node: RadixNode) -> list["KVCacheBlock"]:
        """Detach ``node`` and everything under it; returns their blocks (the pool un-caches them)."""
        parent = node.parent
        del parent.children[node.tokens]
        if parent.block is None and not parent.children:
            self.roots.pop(parent.salt, None)
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}
            n.parent = None
            out.append(n.block)
        return out

    def clear(self) -> None:
        self.roots.clear()

    # ---- tests -------------------------------------------------------------------------
    def nodes(self) -> list[RadixNode]:
        out, stack = [], [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check_invariants(self) -> None:
        """Every cached block is exactly one reachable node; edges and hashes agree."""
        nodes = self.nodes()
        for salt, r in self.roots.items():
            assert r.block is None and r.parent is None and r.salt == salt
            assert r.children, "empty roots are dropped"
        seen = set()
        for n in nodes:
            assert n.block.block_id not in seen
            seen.add(n.block.block_id)
            assert n.block.node is n and n.block.block_hash == n.block_hash
            assert self.pool.cached[n.block_hash] is n.block
            assert n.parent.children[n.tokens] is n
            assert len(n.tokens) == self.block_size
        assert seen == {b.block_id for b in self.pool.cached.values()}
