"""Admission: a waiting request joins the running ones (waiting -> running).

The head of the waiting queue is looked up (``PrefixLookup``: the device prefix cache, then
the KV connector for tokens past the device hit), its blocks are checked
(``KVCacheManager.can_allocate``) and only then allocated, as nano-vllm's
``can_allocate`` / ``allocate``. There is one retry: a token-granular hit holds its partial
block's copy source during the allocation, so when blocks are short the request is tried
once more without that partial block. A request that still does not fit stops admission for
this step (the queue's order is kept).

Three kinds of admission share that path: a plain one (prefix hit, maybe connector tokens
loaded before the forward), a request whose KV a remote engine sends (blocks now, the
request then waits in ``RemoteKVTracker``), and a request whose remote KV landed
(``Request.kv_ready``: it holds its blocks already).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvserve.core.prefix_cache import PrefixMatch
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.config import SchedulerConfig
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.scheduler.remote_kv import RemoteKVTracker
    from kvserve.core.scheduler.waiting_queue import WaitingQueue


@dataclass
class PrefixLookup:
    """Where a waiting request's computation starts.

    Attributes:
        hits: per KV cache group, the prefix-cache blocks to reference (``PrefixMatch``); None
            for a request that holds its blocks already (its remote KV landed).
        num_hit: tokens already computed when it starts (device prefix hit, or the request's
            own ``num_computed_tokens``).
        num_ext: tokens past ``num_hit`` the KV connector loads into the new blocks.
        load_async: the connector's tokens come from a remote engine over several steps: the
            request waits for them instead of running.
    """

    hits: Optional[tuple[PrefixMatch, ...]]
    num_hit: int
    num_ext: int = 0
    load_async: bool = False

    def drop_partial(self) -> bool:
        """Give up the token-granular tail of the hit (its partial block is copied, and the
        copy source is held during the allocation); False if there is none."""
        partial = self.hits[0].partial if self.hits else None
        if partial is None:
            return False
        self.num_hit -= partial.num_tokens
        for h in self.hits:
            h.partial = None
        return True


class AdmissionMixin:
    """The scheduler's admission (waiting -> running); mixed into ``Scheduler``, whose state
    (``config``, ``kv``, ``connector``, ``waiting``, ``running``, ``remote_kv``, the prefix-cache
    counters) it uses."""

    config: "SchedulerConfig"
    kv: "KVCacheManager"
    waiting: "WaitingQueue"
    running: list[Request]
    remote_kv: "RemoteKVTracker"
    connector: object  # a scheduler-role KV connector, or None
    num_recomputed_tokens: int

    def _admit_waiting(self, budget: int, scheduled: list) -> None:
        """Admit waiting requests in queue order while the budget and ``max_num_seqs`` allow;
        appends ``(request, tokens, 0)`` to ``scheduled`` for each that computes this step."""
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            n = self._admit(self.waiting.peek(), budget, scheduled)
            if n is None:
                break
            budget -= n

    def _admit(self, req: Request, budget: int, scheduled: list) -> Optional[int]:
        """Admit the queue's head ``req``: returns the tokens it computes this step (0 if it
        waits for remote KV), or None (nothing changed) if it does not fit now."""
        look = self._lookup(req)
        n = self._num_new_tokens(req, look, budget)
        if n is None:
            return None
        if not self.kv.can_allocate(req, n + look.num_ext, look.hits):
            # The one retry: without the partial block's copy source.
            if not look.drop_partial():
                return None
            n = self._num_new_tokens(req, look, budget)
            if n is None or not self.kv.can_allocate(req, n + look.num_ext, look.hits):
                return None
        if look.load_async:
            req.delay_cache_blocks = True  # not in the prefix cache until the remote KV landed
        blocks = self.kv.allocate_slots(req, n + look.num_ext, look.hits)
        assert blocks is not None, "allocate_slots failed after can_allocate"
        self.waiting.pop()
        if look.hits is None:  # its remote KV landed (or a failed pull is recomputed)
            req.kv_ready = False
            return self._start(req, n, scheduled)
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                req, self.kv.get_block_ids(req.request_id)[0] if look.num_ext else [], look.num_ext)
        if look.load_async:
            self.remote_kv.park(req, look.num_hit, look.num_ext)
            if req.num_cached_tokens < 0:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += look.num_hit
            return 0
        num_hit = look.num_hit + look.num_ext
        if req.num_cached_tokens < 0:  # first admission
            req.num_cached_tokens = num_hit
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_hit
        else:  # a preempted request's recompute, counted apart
            self.prefix_cache_recompute_queries += req.num_tokens
            self.prefix_cache_recompute_hits += num_hit
            self.num_recomputed_tokens += max(req.num_computed_at_preemption - num_hit, 0)
        req.num_computed_tokens = num_hit
        return self._start(req, n, scheduled)

    def _lookup(self, req: Request) -> PrefixLookup:
        """The device prefix cache's hit, then the connector's tokens past it (prompt logprobs
        need every prompt position's logits: no hit then)."""
        if req.kv_ready:
            return PrefixLookup(None, req.num_computed_tokens)
        hits, num_hit = self.kv.get_computed_blocks(req)
        want_prompt_logprobs = req.sampling_params.prompt_logprobs is not None
        if want_prompt_logprobs and num_hit:
            hits, num_hit = tuple(PrefixMatch() for _ in hits), 0
        if self.connector is None or want_prompt_logprobs:
            return PrefixLookup(hits, num_hit)
        base = num_hit - num_hit % self.kv.block_size  # the connector works in whole blocks
        ext, load_async = self.connector.get_num_new_matched_tokens(req, base)
        if not ext or base + ext <= num_hit:
            return PrefixLookup(hits, num_hit)
        for h in hits:
            h.partial = None
        return PrefixLookup(hits, base, ext, load_async)

    def _num_new_tokens(self, req: Request, look: PrefixLookup, budget: int) -> Optional[int]:
        """Tokens ``req`` computes this step if admitted with ``look``: what is left after the
        hit, within the budget; None if chunked prefill is off and it does not fit whole."""
        if look.load_async:
            return 0
        n = req.num_tokens - look.num_hit - look.num_ext
        if not self.config.enable_chunked_prefill and n > budget:
            return None
        return min(n, budget, self._prefill_cap())

    def _start(self, req: Request, n: int, scheduled: list) -> int:
        """A waiting request joins the running ones with ``n`` tokens this step; returns ``n``."""
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        self.running.append(req)
        scheduled.append((req, n, 0))
        return n
