"""Phase-free, token-budget scheduler with chunked prefill and preemption by recompute.

Each step every scheduled request gets some of its ``num_tokens - num_computed_tokens``
tokens (plus a pending one, see below) under one budget (``max_num_batched_tokens``) and one request cap
(``max_num_seqs``). A decode is 1 token, a prefill chunk is n tokens, a prefix-cache
hit advances ``num_computed_tokens`` for free. When blocks run out, the worst running
request (lowest priority, then latest arrival) is preempted: its blocks are freed and
it goes back to the waiting queue to be recomputed (Kwon et al., PagedAttention,
arXiv:2309.06180). Pure Python; never touches tensors.

``num_computed_tokens`` advances when a step is scheduled, not when its output comes back,
so with async scheduling (the engine schedules step N+1 while the GPU runs step N) a
request whose token from step N is still on the GPU holds one *pending* output token
(``Request.num_pending_tokens``): step N+1 computes it without the host knowing its id
(the model runner takes it from step N's sampled tokens on the device), as in vLLM's async
scheduling and SGLang's overlap scheduler.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable, Optional

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What the model runner must compute this step.

    Attributes:
        scheduled: ``(request, num_new_tokens)`` pairs; request ``r`` computes tokens
            ``r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n]``.
        block_ids: request id -> its block ids (after this step's allocation).
        num_scheduled_tokens: sum of the ``n``.
        preempted: requests preempted while building this step.
        kv_copies: prefix-cache copy-on-write, ``(src_block, dst_block, num_tokens)``: the
            model runner copies slots ``[0, num_tokens)`` of ``src_block`` into the same slots
            of ``dst_block`` on every layer before the forward.
        num_computed: per ``scheduled`` entry, the request's computed tokens before this
            step: its new tokens sit at positions ``[num_computed, num_computed + n)``.
        samples: per entry, whether this step reaches the end of the request's sequence and
            so samples its next token.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_scheduled_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # tokens, cumulative
    prefix_cache_hits: int = 0  # tokens, cumulative
    # Lookups made when a preempted request is re-admitted (its own blocks, mostly), apart.
    prefix_cache_recompute_queries: int = 0  # tokens, cumulative
    prefix_cache_recompute_hits: int = 0  # tokens, cumulative


class _WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._dq: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, req: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))
        elif front:
            self._dq.appendleft(req)
        else:
            self._dq.append(req)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._dq[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._dq.popleft()

    def remove(self, req: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)
        else:
            self._dq.remove(req)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._dq)

    def __iter__(self):
        return iter([e[3] for e in self._heap] if self.policy == "priority" else list(self._dq))


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Args:
        config: budgets and policy.
        kv_cache_manager: block accounting (shared with nothing else).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = _WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_recompute_queries = 0
        self.prefix_cache_recompute_hits = 0
        # Running order (worst last): a C key function, as this sort runs every step.
        self._sort_key = (attrgetter("priority", "arrival_time") if config.scheduling_policy == "priority"
                          else attrgetter("arrival_time"))

    # ---- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} already exists")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string) wherever they are; frees their blocks."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.time()
        self.kv.free(req)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- scheduling --------------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_pending_tokens = 0  # a token still on the GPU is appended when it arrives
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req, front=True)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        self.kv.begin_step()
        # The worst request sits last, so a victim is never one already scheduled this step.
        self.running.sort(key=self._sort_key)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and self._reaches_limit(req):
                i += 1  # its pending token is its last: nothing left to compute
                continue
            n = min(req.num_tokens + req.num_pending_tokens - req.num_computed_tokens, budget,
                    cfg.max_model_len - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            out.scheduled.append((req, n))
            budget -= n
            i += 1

        # Admit waiting requests; none while this step had to preempt (memory is short).
        while not out.preempted and len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                if hits.partial is None:
                    break
                # The copy source holds one block for the allocation: try without it.
                num_hit -= hits.partial.num_tokens
                hits.partial = None
                n = req.num_tokens - num_hit
                if not cfg.enable_chunked_prefill and n > budget:
                    break
                n = min(n, budget)
                if self.kv.allocate_slots(req, n, hits) is None:
                    break
            self.waiting.pop()
            if req.num_cached_tokens < 0:  # first admission
                req.num_cached_tokens = num_hit
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_hit
            else:  # a preempted request's recompute, counted apart
                self.prefix_cache_recompute_queries += req.num_tokens
                self.prefix_cache_recompute_hits += num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n

        out.num_scheduled_tokens = cfg.max_num_batched_tokens - budget
        for req, n in out.scheduled:
            out.num_computed.append(req.num_computed_tokens)
            req.num_computed_tokens += n
            samples = req.num_computed_tokens == req.num_tokens + req.num_pending_tokens
            if samples:
                req.num_pending_tokens += 1
            out.samples.append(samples)
        out.block_ids = {r.request_id: self.kv.get_block_ids(r.request_id) for r, _ in out.scheduled}
        out.kv_copies = self.kv.take_copies()
        return out

    def update_from_output(
        self, sched: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """Append sampled tokens and finish requests that stop.

        Args:
            sched: the step's schedule (with async scheduling, a later step may already
                have been scheduled).
            sampled: request id -> sampled token, for the entries of ``sched.samples``.

        Returns:
            Requests that received a token this step (finished ones included).
        """
        now = time.time()
        updated = []
        for (req, _), samples in zip(sched.scheduled, sched.samples):
            if not samples:
                continue
            if req.status == RequestStatus.RUNNING:
                req.num_pending_tokens -= 1
            elif req.status != RequestStatus.PREEMPTED:
                continue  # finished or aborted since: a token computed past the end is dropped
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            # A request preempted after this step was scheduled keeps the token: its KV was
            # valid, and the recompute then includes it.
            req.append_output_token(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._check_stop(req, tok)
            if status is not None:
                if req.status == RequestStatus.RUNNING:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self._finish(req, status)
            updated.append(req)
        return updated

    def _reaches_limit(self, req: Request) -> bool:
        """Whether the tokens already sampled (pending included) end the request by length."""
        total = req.num_tokens + req.num_pending_tokens
        mt = req.sampling_params.max_tokens
        return (mt is not None and req.num_output_tokens + req.num_pending_tokens >= mt) \
            or total >= self.config.max_model_len

    def _check_stop(self, req: Request, tok: int) -> Optional[RequestStatus]:
        sp = req.sampling_params
        n_out = req.num_output_tokens
        # Length first, as vLLM does: a stop token that is also the last allowed one reads "length".
        if (sp.max_tokens is not None and n_out >= sp.max_tokens) or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and tok == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        return None

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_recompute_queries=self.prefix_cache_recompute_queries,
            prefix_cache_recompute_hits=self.prefix_cache_recompute_hits,
        )
