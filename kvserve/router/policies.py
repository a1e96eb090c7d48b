"""Routing policies of ``kvserve router``: pure functions of the candidate workers' state (no HTTP).

A policy gets the request's routing text and the candidates (``Candidate``: URL and load =
requests in flight, router-tracked, plus the worker's own running + waiting count when
``--load-from-metrics`` refreshes it) and returns a ``Decision``. Policies never see dead
or circuit-open workers: the registry filters them first.

* ``round_robin``: the next candidate in turn.
* ``least_loaded``: the candidate with the least load (ties: the one picked longest ago).
* ``cache_aware`` (default, SGLang's idea): an approximate radix tree of the text each worker
  was recently sent (character level, one tree with per-node worker sets, bounded in
  characters with least-recently-used eviction). The worker holding the longest prefix of
  the request wins when the match covers at least ``cache_threshold`` of the request's
  characters; otherwise, or when the load is imbalanced (``max - min > balance_abs`` and
  ``max > balance_rel * min``), the least-loaded worker wins. The chosen worker's tree gets
  the request's text. It is approximate: the router does not see the worker's evictions.
  Requests with a ``cache_salt`` live in their salt's own namespace of the tree (workers
  share KV only between equal salts, so a prefix sent under another salt is no hit).
* ``kv_events``: exact placement from the workers' KV events (``kvserve.router.kv_events``,
  built by the router with its event subscriptions), this tree as its fallback.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

POLICIES = ("cache_aware", "least_loaded", "round_robin", "kv_events")


@dataclass(frozen=True)
class Candidate:
    """A routable worker as the policy sees it. ``load``: requests in flight (>= 0)."""

    url: str
    load: int = 0


@dataclass(frozen=True)
class Decision:
    """The chosen worker; ``matched_chars``: the cache-aware prefix match (0 for other policies)."""

    url: str
    matched_chars: int = 0
    reason: str = ""


class _Node:
    __slots__ = ("children", "text", "workers", "parent")

    def __init__(self, text: str = "", parent: Optional["_Node"] = None) -> None:
        self.children: dict[str, _Node] = {}
        self.text = text
        self.workers: dict[str, int] = {}  # worker -> last access tick
        self.parent = parent


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ApproxRadixTree:
    """Character-level radix tree; each node knows which workers were sent text through it.

    ``max_chars``: bound on the characters stored (sum of edge labels); past it, the least
    recently used leaves are evicted. Not thread-safe (the router uses it from one loop).
    """

    def __init__(self, max_chars: int = 1 << 20) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.root = _Node()
        self.max_chars = max_chars
        self.size = 0
        self._tick = itertools.count(1)

    def insert(self, text: str, worker: str) -> None:
        """Record that ``worker`` was sent ``text`` (its prefixes are now warm there)."""
        tick = next(self._tick)
        node, rest = self.root, text
        node.workers[worker] = tick
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                leaf = _Node(rest, node)
                leaf.workers[worker] = tick
                node.children[rest[0]] = leaf
                self.size += len(rest)
                break
            k = _common(child.text, rest)
            if k < len(child.text):  # split the edge at k
                mid = _Node(child.text[:k], node)
                mid.workers = dict(child.workers)
                node.children[rest[0]] = mid
                child.text = child.text[k:]
                child.parent = mid
                mid.children[child.text[0]] = child
                child = mid
            child.workers[worker] = tick
            node, rest = child, rest[k:]
        if self.size > self.max_chars:
            self.evict(self.max_chars)

    def match(self, text: str) -> dict[str, int]:
        """Per worker, the longest prefix of ``text`` (in characters) it was sent."""
        out: dict[str, int] = {}
        node, rest, depth = self.root, text, 0
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            k = _common(child.text, rest)
            for w in child.workers:
                out[w] = depth + k
            if k < len(child.text):
                break
            node, rest, depth = child, rest[k:], depth + k
        return out

    def evict(self, target_chars: int) -> None:
        """Remove least-recently-used leaves until at most ``target_chars`` are stored."""
        heap = [(max(n.workers.values(), default=0), id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > target_chars and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or parent.children.get(leaf.text[:1]) is not leaf:
                continue
            del parent.children[leaf.text[0]]
            self.size -= len(leaf.text)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (max(parent.workers.values(), default=0), id(parent), parent))

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` everywhere (it left the pool); prunes nodes no worker holds."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.workers.pop(worker, None)
            for key, child in list(node.children.items()):
                child.workers.pop(worker, None)
                if not child.workers:
                    self.size -= self._subtree_chars(child)
                    del node.children[key]
                else:
                    stack.append(child)

    def chars_of(self, worker: str) -> int:
        """Characters of the tree ``worker`` holds (for tests and /workers)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if worker in child.workers:
                    total += len(child.text)
                    stack.append(child)
        return total

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                yield node
            stack.extend(node.children.values())

    @staticmethod
    def _subtree_chars(node: _Node) -> int:
        total, stack = 0, [node]
        while stack:
            n = stack.pop()
            total += len(n.text)
            stack.extend(n.children.values())
        return total


def salt_namespace(salt: Optional[str]) -> str:
    """The tree-key prefix of a ``cache_salt``: prefix-free (no salt's prefix followed by any
    text is another salt's prefix), and distinct from the unsalted one."""
    return "\x01" if salt is None else f"\x00{len(salt)}:{salt}"


class Policy:
    """Base class: ``choose(text, candidates, salt) -> Decision``; ``candidates`` is non-empty;
    ``salt``: the request's ``cache_salt`` (None: none)."""

    name = "base"

    def choose(self, text: str, candidates: Sequence[Candidate], salt: Optional[str] = None) -> Decision:
        raise NotImplementedError

    def remove_worker(self, url: str) -> None:
        """Forget a worker that left the pool (default: nothing to forget)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._n = 0

    def choose(self, text: str, candidates: Sequence[Candidate], salt: Optional[str] = None) -> Decision:
        c = candidates[self._n % len(candidates)]
        self._n += 1
        return Decision(c.url, 0, "round_robin")


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._tick = itertools.count(1)

    def choose(self, text: str, candidates: Sequence[Candidate], salt: Optional[str] = None) -> Decision:
        c = min(candidates, key=lambda c: (c.load, self._last.get(c.url, 0)))
        self._last[c.url] = next(self._tick)
        return Decision(c.url, 0, "least_loaded")

    def remove_worker(self, url: str) -> None:
        self._last.pop(url, None)


class CacheAware(Policy):
    """Longest cached prefix unless the load is imbalanced (see the module docstring).

    ``cache_threshold``: the fraction of the request's characters (0..1) a match must cover
    to win; ``balance_abs`` (requests) and ``balance_rel`` (ratio): the imbalance test;
    ``max_tree_chars``: the tree's bound in characters.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.5,
                 max_tree_chars: int = 1 << 22) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.tree = ApproxRadixTree(max_tree_chars)
        self._ll = LeastLoaded()

    def choose(self, text: str, candidates: Sequence[Candidate], salt: Optional[str] = None) -> Decision:
        loads = [c.load for c in candidates]
        lo, hi = min(loads), max(loads)
        ns = salt_namespace(salt)
        # Only matches past the whole namespace count, in characters of the request's text.
        matches = {u: n - len(ns) for u, n in self.tree.match(ns + text).items() if n > len(ns)}
        urls = {c.url for c in candidates}
        best = max(((n, u) for u, n in matches.items() if u in urls), default=(0, None))
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            d = self._ll.choose(text, candidates)
            d = Decision(d.url, matches.get(d.url, 0), "imbalanced")
        elif best[1] is not None and text and best[0] >= self.cache_threshold * len(text):
            # Longest match; among equal matches the less loaded one.
            n = best[0]
            tied = [c for c in candidates if matches.get(c.url, 0) == n]
            d = Decision(min(tied, key=lambda c: c.load).url, n, "cache_hit")
            self._ll._last[d.url] = next(self._ll._tick)
        else:
            d = self._ll.choose(text, candidates)
            d = Decision(d.url, matches.get(d.url, 0), "cache_miss")
        self.tree.insert(ns + text, d.url)
        return d

    def remove_worker(self, url: str) -> None:
        self.tree.remove_worker(url)
        self._ll.remove_worker(url)


def make_policy(name: str, **kwargs) -> Policy:
    """The policy called ``name`` (one of ``POLICIES``); ValueError otherwise."""
    if name == "cache_aware":
        return CacheAware(**kwargs)
    if name == "least_loaded":
        return LeastLoaded()
    if name == "round_robin":
        return RoundRobin()
    if name == "kv_events":
        raise ValueError("the kv_events policy needs the workers' event subscriptions: "
                         "kvserve.router.kv_events.KVEventsPolicy(hub)")
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
