"""The ``kv_events`` routing policy: exact prefix-aware placement from the workers' KV events.

Each worker publishes its prefix cache's changes (``--kv-events-config``; schema in
``kvserve.core.kv_events``). The router subscribes to every worker's PUB endpoint
(``KVEventSubscriber``, one thread each) and keeps, per worker, exactly the set of blocks it
holds (``WorkerBlockIndex``). A request goes to the worker holding the longest prefix of its
blocks.

Block identity. The engines' block hashes cannot be recomputed outside the engine (Python's
``hash`` is salted per process), so the router names blocks by content: a block's key is
``hash((parent key, its token ids))`` from a per-``cache_salt`` root key, computed here from the
events' ``parent_block_hash`` chain and ``token_ids`` (the engine hash -> key map per worker
turns a ``BlockRemoved`` into keys). A request's keys come from its token ids split into full
blocks the same way (the block size is the one the events carry).

Token ids. The router sees text; ``Router`` asks a worker's ``POST /tokenize`` (the same
tokenizer and chat template the worker applies) and passes the ids with the routing text
(``RoutingText``). A completions prompt of token ids is used as is.

Decision (``KVEventsPolicy.choose``): with a load imbalance (the ``cache_aware`` test) the
least-loaded worker; else the worker with the most leading blocks cached when they cover at
least ``cache_threshold`` of the prompt (ties: the less loaded); else the least-loaded one.
Fallback: the approximate ``cache_aware`` policy (its tree is fed with every decision, so it is
warm) decides when the request has no token ids, when a candidate has no event endpoint, when
no worker has sent an event yet, or when a worker that was sent uncached blocks published
nothing for ``stale_after`` seconds (its publisher or the subscription is down). A worker that
has published nothing holds nothing (the subscriber replays from 0 when it starts).

Wire tolerance: events decode from the map form (current vLLM, kvserve) and the positional
array form (vLLM before its PR #42892). A gap in the sequence numbers is filled from the
worker's replay endpoint when it has one (also asked from 0 when the subscriber starts, so a
router that joins late learns what the worker already holds); a live batch numbered 0 after
others means the worker restarted, and its index starts afresh.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterable, Optional, Sequence

import msgspec

from kvserve.router.policies import CacheAware, Candidate, Decision, LeastLoaded, Policy

logger = logging.getLogger("kvserve")


class RoutingText(str):
    """The routing text with the request's prompt token ids (``token_ids``; None when unknown) and
    ``cache_salt``; any policy reads it as a plain string."""

    token_ids: Optional[list[int]]
    salt: Optional[str]

    def __new__(cls, text: str, token_ids: Optional[list[int]] = None, salt: Optional[str] = None) -> "RoutingText":
        obj = super().__new__(cls, text)
        obj.token_ids, obj.salt = token_ids, salt
        return obj


def root_key(salt: Optional[str]) -> int:
    return hash(("kv-events-root", salt))


def block_keys(token_ids: Sequence[int], block_size: int, salt: Optional[str] = None) -> list[int]:
    """Keys of the full blocks of ``token_ids`` (see the module docstring)."""
    key, out = root_key(salt), []
    for i in range(len(token_ids) // block_size):
        key = hash((key, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(key)
    return out


def _fields(ev) -> tuple[Optional[str], dict]:
    """(type, fields) of one decoded event, map or positional form."""
    if isinstance(ev, dict):
        return ev.get("type"), ev
    if isinstance(ev, (list, tuple)) and ev:
        kind = ev[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                 "lora_name", "extra_keys"),
                 "BlockRemoved": ("block_hashes", "medium")}.get(kind, ())
        return kind, dict(zip(names, ev[1:]))
    return None, {}


class WorkerBlockIndex:
    """One worker's cached blocks, rebuilt from its events. Thread-safe (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_hash: dict[int, int] = {}  # engine block hash -> router key
        self.keys: set[int] = set()
        self.block_size: Optional[int] = None
        self.last_seq: Optional[int] = None
        self.last_event: Optional[float] = None  # monotonic time of the last batch
        self.expect_since: Optional[float] = None  # first decision since then that expects new blocks
        self.num_unlinked = 0  # stored events whose parent was unknown (missed events)

    def reset(self) -> None:
        """Forget everything (the worker's publisher restarted: its cache is new)."""
        with self.lock:
            self.by_hash.clear()
            self.keys.clear()
            self.last_seq = None

    def apply_batch(self, payload: bytes) -> None:
        """Apply one msgpack ``KVEventBatch`` (``[ts, events, dp_rank]``). Raises ValueError if malformed."""
        try:
            batch = msgspec.msgpack.decode(payload)
            events = batch[1] if isinstance(batch, (list, tuple)) else batch["events"]
        except (msgspec.DecodeError, IndexError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed KV event batch: {exc}") from None
        with self.lock:
            for ev in events:
                kind, f = _fields(ev)
                if kind == "BlockStored":
                    self._stored(f)
                elif kind == "BlockRemoved":
                    for h in f.get("block_hashes") or ():
                        key = self.by_hash.pop(h, None)
                        if key is not None:
                            self.keys.discard(key)
                elif kind == "AllBlocksCleared":
                    self.by_hash.clear()
                    self.keys.clear()
            self.last_event = time.monotonic()
            self.expect_since = None

    def _stored(self, f: dict) -> None:
        bs = int(f.get("block_size") or 0)
        hashes, toks = f.get("block_hashes") or [], f.get("token_ids") or []
        if bs <= 0 or len(toks) != bs * len(hashes):
            return
        self.block_size = bs
        parent = f.get("parent_block_hash")
        if parent is None:
            extra = f.get("extra_keys") or [None]
            salt = extra[0][0] if extra[0] else None
            key = root_key(salt)
        else:
            key = self.by_hash.get(parent)
            if key is None:
                self.num_unlinked += 1
                return
        for i, h in enumerate(hashes):
            key = hash((key, tuple(toks[i * bs:(i + 1) * bs])))
            self.by_hash[h] = key
            self.keys.add(key)

    def match(self, keys: Iterable[int]) -> int:
        """Leading ``keys`` this worker holds (blocks)."""
        n = 0
        with self.lock:
            for k in keys:
                if k not in self.keys:
                    break
                n += 1
        return n


class KVEventSubscriber(threading.Thread):
    """SUB socket on a worker's event endpoint feeding a ``WorkerBlockIndex``; gaps and a late
    start are filled from the replay endpoint (DEALER, vLLM's replay protocol)."""

    POLL_MS = 100
    REPLAY_TIMEOUT_MS = 2000

    def __init__(self, endpoint: str, replay_endpoint: Optional[str], index: WorkerBlockIndex, topic: str = "",
                 secret: Optional[bytes] = None) -> None:
        super().__init__(name=f"kv-events-sub {endpoint}", daemon=True)
        self.endpoint, self.replay_endpoint, self.index, self.topic = endpoint, replay_endpoint, index, topic
        self.secret = secret
        self._stop = threading.Event()
        self.num_replayed = 0  # batches received through replay
        self.num_rejected = 0  # batches whose MAC was missing or wrong (with a secret)

    def _authentic(self, seq: int, payload: bytes, mac: Optional[bytes]) -> bool:
        """With a secret: whether ``mac`` is the batch's (``batch_mac``); a forged or unsigned
        batch is counted and dropped (logged once). Without one: always."""
        if self.secret is None:
            return True
        import hmac

        from kvserve.engine.kv_events import batch_mac

        if mac is not None and hmac.compare_digest(mac, batch_mac(self.secret, self.topic.encode(), seq, payload)):
            return True
        if not self.num_rejected:
            logger.warning("KV events from %s: a batch without a valid MAC was dropped (is the worker's internal "
                           "secret the router's?)", self.endpoint)
        self.num_rejected += 1
        return False

    def stop(self) -> None:
        self._stop.set()

    def _apply(self, seq: int, payload: bytes) -> None:
        idx = self.index
        if idx.last_seq is not None and seq <= idx.last_seq:
            return  # already applied (replay overlap)
        try:
            idx.apply_batch(payload)
        except ValueError as exc:
            logger.warning("KV events from %s: %s", self.endpoint, exc)
        idx.last_seq = seq

    def _replay(self, ctx, start: int, stop: Optional[int]) -> bool:
        """Apply buffered batches ``start <= seq < stop`` (``stop`` None: all). Returns whether
        the worker answered."""
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            req = [b"", start.to_bytes(8, "big")]
            if self.secret is not None:
                from kvserve.utils.internal_auth import request_token

                req.append(request_token(self.secret, "REPLAY", f"kv_events/{start}").encode())
            sock.send_multipart(req)
            first = True
            while sock.poll(self.REPLAY_TIMEOUT_MS):
                frames = sock.recv_multipart()
                if len(frames) not in (3, 4):
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    return True
                if not self._authentic(seq, frames[2], frames[3] if len(frames) == 4 else None):
                    continue
                if first and seq > start:
                    logger.warning("KV events from %s: batches %d..%d are no longer buffered; the index may "
                                   "keep blocks the worker evicted", self.endpoint, start, seq - 1)
                first = False
                if stop is None or seq < stop:
                    self._apply(seq, frames[2])
                    self.num_replayed += 1
            return False
        finally:
            sock.close()

    def run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint is not None:
                self._replay(ctx, 0, None)  # what the worker published before we joined
            while not self._stop.is_set():
                if not sub.poll(self.POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) not in (3, 4) or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if not self._authentic(seq, frames[2], frames[3] if len(frames) == 4 else None):
                    continue
                if seq == 0 and self.index.last_seq is not None:
                    # A publisher numbers from 0 when it starts: the worker restarted, its cache is empty.
                    logger.info("KV events from %s: the publisher restarted; index reset", self.endpoint)
                    self.index.reset()
                last = self.index.last_seq
                want = 0 if last is None else last + 1
                if seq > want and self.replay_endpoint is not None:
                    self._replay(ctx, want, seq)
                self._apply(seq, frames[2])
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                logger.warning("KV events subscriber for %s stopped: %s", self.endpoint, exc)
        finally:
            sub.close()
            ctx.term()


def parse_endpoint_spec(spec: str) -> tuple[str, str, Optional[str]]:
    """``URL=ENDPOINT[,REPLAY_ENDPOINT]`` -> (worker URL, endpoint, replay endpoint). Raises ValueError."""
    url, sep, rest = spec.partition("=")
    eps = rest.split(",")
    if not sep or not url.startswith(("http://", "https://")) or len(eps) > 2 or not all(
            e.startswith(("tcp://", "ipc://")) for e in eps):
        raise ValueError(f"--kv-events-endpoint wants URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], got {spec!r}")
    return url.rstrip("/"), eps[0], eps[1] if len(eps) > 1 else None


class KVEventHub:
    """The subscriptions, one per worker URL with a known endpoint; shared by the router's pools."""

    def __init__(self, endpoints: dict[str, tuple[str, Optional[str]]], topic: str = "",
                 secret: Optional[bytes] = None) -> None:
        self.topic, self.secret = topic, secret
        self.indexes: dict[str, WorkerBlockIndex] = {}
        self.subscribers: dict[str, KVEventSubscriber] = {}
        for url, (ep, replay) in endpoints.items():
            self.add(url, ep, replay)

    def add(self, url: str, endpoint: str, replay_endpoint: Optional[str] = None) -> None:
        self.remove(url)
        idx = self.indexes[url] = WorkerBlockIndex()
        sub = self.subscribers[url] = KVEventSubscriber(endpoint, replay_endpoint, idx, self.topic, self.secret)
        sub.start()

    def remove(self, url: str) -> None:
        sub = self.subscribers.pop(url, None)
        if sub is not None:
            sub.stop()
        self.indexes.pop(url, None)

    def close(self) -> None:
        for url in list(self.subscribers):
            self.remove(url)


class KVEventsPolicy(Policy):
    """Exact prefix placement from KV events, the approximate tree as fallback (module docstring).

    Args:
        hub: the subscriptions (worker URL -> block index).
        stale_after: seconds a worker sent uncached blocks may stay silent before its events count
            as stopped.
        cache_threshold, balance_abs, balance_rel, max_tree_chars: as ``CacheAware``'s.
    """

    name = "kv_events"

    def __init__(self, hub: KVEventHub, stale_after: float = 10.0, cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.5, max_tree_chars: int = 1 << 22) -> None:
        self.hub, self.stale_after = hub, stale_after
        self.approx = CacheAware(cache_threshold, balance_abs, balance_rel, max_tree_chars)
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self._ll: LeastLoaded = self.approx._ll

    def _fallback_reason(self, ids, candidates: Sequence[Candidate], now: float) -> Optional[str]:
        if not ids:
            return "no_token_ids"
        idxs = [self.hub.indexes.get(c.url) for c in candidates]
        if any(idx is None for idx in idxs):
            return "no_endpoint"
        if self._block_size(idxs) is None:
            return "no_events_yet"
        if any(idx.expect_since is not None and now - idx.expect_since > self.stale_after for idx in idxs):
            return "events_stale"
        return None

    @staticmethod
    def _block_size(idxs) -> Optional[int]:
        """The block size the events carry (one model behind the router); None before any event."""
        return next((idx.block_size for idx in idxs if idx.block_size is not None), None)

    def choose(self, text: str, candidates: Sequence[Candidate]) -> Decision:
        ids = getattr(text, "token_ids", None)
        now = time.monotonic()
        why = self._fallback_reason(ids, candidates, now)
        if why is not None:
            d = self.approx.choose(text, candidates)
            self._expect(d.url, ids, 0, now)
            return Decision(d.url, d.matched_chars, f"fallback_{why}")
        bs = self._block_size([self.hub.indexes[c.url] for c in candidates])
        keys = block_keys(ids, bs, getattr(text, "salt", None))
        matched = {c.url: self.hub.indexes[c.url].match(keys) for c in candidates}
        loads = [c.load for c in candidates]
        lo, hi = min(loads), max(loads)
        best = max(matched.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            url, reason = self._ll.choose(text, candidates).url, "imbalanced"
        elif best > 0 and best * bs >= self.cache_threshold * len(ids):
            tied = [c for c in candidates if matched[c.url] == best]
            url, reason = min(tied, key=lambda c: c.load).url, "kv_hit"
            self._ll._last[url] = next(self._ll._tick)
        else:
            url, reason = self._ll.choose(text, candidates).url, "kv_miss"
        self.approx.tree.insert(text, url)
        self._expect(url, ids, matched[url], now)
        return Decision(url, matched[url] * bs, reason)

    def _expect(self, url: str, ids, matched_blocks: int, now: float) -> None:
        """The worker will store blocks it lacks: its events should follow within ``stale_after``."""
        idx = self.hub.indexes.get(url)
        if idx is None or not ids:
            return
        bs = idx.block_size or 1
        if len(ids) // bs > matched_blocks and idx.expect_since is None:
            with idx.lock:
                idx.expect_since = now

    def remove_worker(self, url: str) -> None:
        self.approx.remove_worker(url)
