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

Host cost (the scheduler runs this on every step): a request's blocks are hashed once,
lazily (a lookup hashes only the blocks it walks, the rest are hashed when they become
full, and one token tuple serves a block's hash and its node); children are indexed by
their first token (a partial match compares only the children that share the next token);
a waiting request's repeated lookup resumes the remembered walk; a leaf is evicted without
a subtree walk.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvserve.core.block_pool import BlockPool, KVCacheBlock


class RadixNode:
    """One cached full block (or a root: ``block is None``).

    ``children`` is None for a leaf, else first token -> the child whose tokens start with
    it, or a list of them (in insertion order) where several do, so a token-granular match
    only compares children that share the request's next token. Sibling token tuples are
    distinct. ``seq`` orders nodes by creation (siblings are walked in that order when a
    subtree is removed).
    """

    __slots__ = ("block", "tokens", "block_hash", "parent", "children", "step", "salt", "seq")

    def __init__(self, block, tokens: tuple[int, ...], block_hash: Optional[int],
                 parent: Optional["RadixNode"], step: int, salt=None, seq: int = 0) -> None:
        self.block = block
        self.tokens = tokens
        self.block_hash = block_hash
        self.parent = parent
        self.children: Optional[dict[int, RadixNode | list[RadixNode]]] = None
        self.step = step  # scheduler step whose forward writes the block's KV
        self.salt = salt
        self.seq = seq

    def child_nodes(self) -> list["RadixNode"]:
        """The children, oldest first."""
        if not self.children:
            return []
        out = []
        for c in self.children.values():
            if type(c) is list:
                out.extend(c)
            else:
                out.append(c)
        return sorted(out, key=_by_seq)

    def __repr__(self) -> str:
        bid = None if self.block is None else self.block.block_id
        return f"RadixNode(block={bid}, tokens={self.tokens}, children={len(self.child_nodes())})"


_by_seq = attrgetter("seq")


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


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    if len(a) >= limit and len(b) >= limit and a[:limit] == tuple(b[:limit]):
        return limit
    n = 0
    for x, y in zip(a, b):
        if n >= limit or x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The tree; the block pool owns the blocks and evicts through ``remove_leaf`` /
    ``remove_subtree``."""

    def __init__(self, pool: "BlockPool", block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.roots: dict[object, RadixNode] = {}
        self._seq = 0  # nodes created so far
        # The last match: (token_ids, root, max_tokens, salt, blocks, nodes).
        self._memo: Optional[tuple] = None
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

        ``hashes`` is the request's hash chain so far (``h_i = hash((h_{i-1}, tokens_i,
        salt))``, ``h_{-1} = None``); the walk extends it in place over the blocks it reaches.
        Full blocks come back in the list; where the match goes on inside the next block,
        ``partial`` names a cached block whose first tokens agree with the request's. Only
        blocks whose KV was written by an earlier step qualify as copy sources (the copy runs
        before this step's forward).

        The last walk is remembered: a repeat lookup of the same token list (a waiting
        request that could not be admitted) re-checks the remembered blocks by node identity
        (a node still attached to its block has the same parent, tokens and hash), keeps the
        longest prefix still attached and resumes the walk there, so the result is the same
        as a fresh walk's.
        """
        bs = self.block_size
        out = PrefixMatch()
        root = node = self.roots.get(salt)
        if node is None or max_tokens <= 0:
            return out
        cached = self.pool.cached
        num_hashed = len(hashes)
        h = None
        nodes = []
        first = 0
        memo = self._memo
        if memo is not None and memo[0] is token_ids and memo[1] is root and memo[2] == max_tokens \
                and memo[3] == salt:
            mblocks, mnodes = memo[4], memo[5]
            now = [b.node for b in mblocks]
            if now == mnodes:  # identity: every node still attached
                first = len(mnodes)
            else:  # keep the prefix whose nodes are all still attached
                first = next(i for i, (a, b) in enumerate(zip(now, mnodes)) if a is not b)
                del mblocks[first:], mnodes[first:]
            if first:
                out.extend(mblocks)
                nodes = mnodes
                node = mnodes[-1]
                h = hashes[first - 1]
        for i in range(first, min(max_tokens, len(token_ids)) // bs):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            if i < num_hashed:
                h = hashes[i]
            else:
                h = hash((h, toks, salt))  # h is h_{i-1} here
                hashes.append(h)
            b = cached.get(h)
            if b is None:
                break
            child = b.node
            if child is None or child.parent is not node or child.tokens != toks:  # hash collision
                break
            out.append(b)
            nodes.append(child)
            node = child
        self._memo = (token_ids, root, max_tokens, salt, list(out), nodes)
        start = len(out) * bs
        limit = min(max_tokens - start, bs)
        if limit > 0 and node.children:
            cands = node.children.get(token_ids[start])
            if cands is not None:
                if type(cands) is not list:
                    cands = (cands,)
                nxt = token_ids[start:start + limit]
                best, best_n = None, 0
                for child in cands:
                    if child.step >= current_step:
                        continue
                    n = _common_prefix(child.tokens, nxt, limit)
                    if n > best_n:
                        best, best_n = child, n
                if best is not None:
                    out.partial = PartialHit(best.block, best_n)
        return out

    # ---- insertion and removal ---------------------------------------------------------
    def insert_blocks(self, token_ids: list[int], hashes: list[int], salt, blocks: list["KVCacheBlock"],
                      start: int, end: int, step: int) -> None:
        """Register a request's full blocks ``blocks[start:end]`` (KV written by ``step``).

        ``token_ids`` are the request's tokens (at least ``end`` full blocks); ``hashes``
        its hash chain, extended here to ``end`` entries. Blocks already in the tree (shared
        hits) are skipped; a block whose hash is taken stays private to its request (it is
        a duplicate); registration stops where the chain above was evicted.
        """
        bs = self.block_size
        first_new = len(hashes)
        tups = []  # token tuples of the blocks hashed now, reused for their nodes
        if first_new < end:
            h = hashes[first_new - 1] if first_new else None
            for j in range(first_new * bs, end * bs, bs):
                t = tuple(token_ids[j:j + bs])
                h = hash((h, t, salt))
                hashes.append(h)
                tups.append(t)
        pool = self.pool
        cached = pool.cached
        caching = pool.enable_caching
        seq = self._seq
        events = pool.kv_events  # a KVEventRecorder, or None
        parent = None  # the node holding h_{i-1}, where known
        for i in range(start, end):
            block = blocks[i]
            node = block.node
            if node is not None:  # a shared hit: already in the tree (it holds h_i)
                parent = node
                continue
            if i == 0:
                parent = self.root(salt, create=True)
            elif parent is None:
                # Whichever block holds h_{i-1}: this request's own, or the cached twin of
                # a private duplicate.
                pb = cached.get(hashes[i - 1])
                parent = pb.node if pb is not None else None
                if parent is None:
                    break  # the chain above was evicted: nothing below can be found
            h = hashes[i]
            # An existing sibling with these tokens has this very hash, so "hash taken"
            # also covers "edge taken".
            if not caching or block.block_hash is not None or h in cached:
                if parent.block is None and not parent.children:
                    self.roots.pop(salt, None)  # a root made for this insert stays empty
                parent = None
                continue
            t = tups[i - first_new] if i >= first_new else tuple(token_ids[i * bs:(i + 1) * bs])
            block.block_hash = h
            cached[h] = block
            seq += 1
            node = RadixNode(block, t, h, parent, step, salt, seq)
            kids = parent.children
            if kids is None:
                parent.children = {t[0]: node}
            else:
                same = kids.get(t[0])
                if same is None:
                    kids[t[0]] = node
                elif type(same) is list:
                    same.append(node)
                else:
                    kids[t[0]] = [same, node]
            block.node = node
            if events is not None:
                events.stored(h, parent.block_hash, t, salt)
            parent = node
        self._seq = seq

    def remove_leaf(self, node: RadixNode) -> None:
        """Detach a childless ``node`` (the pool un-caches its block)."""
        parent = node.parent
        kids = parent.children
        first = node.tokens[0]
        same = kids[first]
        if same is node:
            del kids[first]
            if not kids:
                parent.children = None
                if parent.block is None:
                    self.roots.pop(parent.salt, None)
        else:
            same.remove(node)
            if len(same) == 1:
                kids[first] = same[0]
        node.parent = None

    def remove_subtree(self, node: RadixNode) -> list["KVCacheBlock"]:
        """Detach ``node`` and everything under it; returns their blocks (the pool un-caches them)."""
        stack = node.child_nodes()
        node.children = None
        self.remove_leaf(node)
        out = [node.block]
        while stack:
            n = stack.pop()
            stack.extend(n.child_nodes())
            n.children = None
            n.parent = None
            out.append(n.block)
        return out

    def clear(self) -> None:
        self.roots.clear()
        self._memo = None

    # ---- tests -------------------------------------------------------------------------
    def nodes(self) -> list[RadixNode]:
        out, stack = [], [c for r in self.roots.values() for c in r.child_nodes()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.child_nodes())
        return out

    def check_invariants(self) -> None:
        """Every cached block is exactly one reachable node; edges and hashes agree."""
        nodes = self.nodes()
        for salt, r in self.roots.items():
            assert r.block is None and r.parent is None and r.salt == salt
            assert r.children, "empty roots are dropped"
        for n in list(self.roots.values()) + nodes:
            assert n.children is None or n.children, "no empty child index"
            kids = n.child_nodes()
            assert len({c.tokens for c in kids}) == len(kids), "sibling tokens are distinct"
            for first, same in (n.children or {}).items():
                if type(same) is list:
                    assert len(same) >= 2 and same == sorted(same, key=_by_seq)
                else:
                    same = [same]
                assert all(c.tokens[0] == first and c.parent is n for c in same)
        seen = set()
        for n in nodes:
            assert n.block.block_id not in seen
            seen.add(n.block.block_id)
            assert n.block.node is n and n.block.block_hash == n.block_hash
            assert self.pool.cached[n.block_hash] is n.block
            same = n.parent.children[n.tokens[0]]
            assert same is n or sum(c is n for c in same) == 1
            assert n.block_hash == hash((n.parent.block_hash, n.tokens, n.salt)) and n.salt == n.parent.salt
            assert len(n.tokens) == self.block_size
        assert seen == {b.block_id for b in self.pool.cached.values()}
