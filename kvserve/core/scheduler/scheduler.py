"""The scheduler's loop: phase-free, token-budget steps with chunked prefill and preemption.

Each step every scheduled request gets some of its ``num_tokens - num_computed_tokens``
tokens (plus a pending one, see below) under one budget (``max_num_batched_tokens``) and one request cap
(``max_num_seqs``). A decode is 1 token, a prefill chunk is n tokens, a prefix-cache
hit advances ``num_computed_tokens`` for free. When blocks run out, the worst running
request (lowest priority, then latest arrival) is preempted: its blocks are freed and
it goes back to the waiting queue to be recomputed (Kwon et al., PagedAttention,
arXiv:2309.06180); with ``--preemption-mode swap`` the victim is the one with the least
sunk compute and its KV waits in the CPU tier. A KV connector (``kvserve.kv_connector``:
the CPU / disk / remote tiers) is asked for more prompt tokens where the device prefix cache
stops. Pure Python; never touches tensors.

This module holds the loop (``Scheduler.schedule``: running requests first, then
admission; the budget; preemption) and the step's description as data. Admission
(waiting -> running) is ``admission.py``, the update from the runner's output
(``update_from_output``: stops, draft rollback) ``update.py``, the requests in KV transfer
between engines ``remote_kv.py`` (``RemoteKVTracker``, owned by the scheduler).

``num_computed_tokens`` advances when a step is scheduled, not when its output comes back,
so with async scheduling (the engine schedules step N+1 while the GPU runs step N) a
request whose token from step N is still on the GPU holds one *pending* output token
(``Request.num_pending_tokens``): step N+1 computes it without the host knowing its id
(the model runner takes it from step N's sampled tokens on the device), as in vLLM's async
scheduling and SGLang's overlap scheduler.

Speculative decoding is the same rule: a decoding request that holds draft tokens
(``Request.spec_token_ids``, proposed by the workers) computes ``1 + k`` tokens; the step
returns ``1 + accepted`` tokens, and ``num_computed_tokens`` (and the KV blocks past it) roll
back over the rejected ones. The step goes to the workers as data
(``kvserve.core.sched_output``): new requests whole, running ones as a diff.

With bounded KV (``--kv-eviction-policy streaming|h2o``, ``kvserve.core.bounded_kv``) the KV cache
manager evicts blocks as requests advance (after each step, and before an allocation); the
nulled block-table entries travel in ``SchedulerOutput.evicted_blocks``, h2o's attention mass
comes back in ``ModelRunnerOutput.kv_block_mass``, and a request with ``max_tokens`` runs past
``max_model_len`` (its KV stays bounded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable, Optional

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched_output import NewRequestData, SchedulerOutput
from kvserve.core.scheduler.admission import AdmissionMixin
from kvserve.core.scheduler.remote_kv import RemoteKVTracker
from kvserve.core.scheduler.spec_policy import DynamicSpeculation
from kvserve.core.scheduler.update import OutputUpdateMixin, RequestUpdate
from kvserve.core.scheduler.waiting_queue import WaitingQueue
from kvserve.request import Request, RequestStatus

__all__ = ["Scheduler", "SchedulerStats", "RequestUpdate"]


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
    num_drafts: int = 0  # speculative decoding: verification steps with drafts, cumulative
    num_draft_tokens: int = 0  # draft tokens verified, cumulative
    num_accepted_tokens: int = 0  # draft tokens accepted, cumulative
    num_accepted_tokens_per_pos: list = field(default_factory=list)  # per draft position, cumulative
    num_speculative_tokens: int = 0  # k the dynamic policy allows now (0: off)
    # Tokens computed again for preempted requests (0 under swap unless the tier evicted).
    num_recomputed_tokens: int = 0  # cumulative
    # Bounded KV (--kv-eviction-policy streaming|h2o): blocks and token slots evicted, cumulative.
    num_evicted_blocks: int = 0
    num_evicted_tokens: int = 0
    kv_connector_stats: Optional[dict] = None  # the KV connector's counters (tiers)


class Scheduler(AdmissionMixin, OutputUpdateMixin):
    """Decides, each step, which requests compute how many tokens.

    Args:
        config: budgets and policy.
        kv_cache_manager: block accounting (shared with nothing else).
        speculative_config: with speculative decoding, its config (k, dynamic policy).
        connector: a KV connector in the scheduler role (tiers), or None. Where the device
            prefix cache misses, it is asked for more prompt tokens; its transfers travel in
            ``SchedulerOutput.kv_connector_metadata``.
        structured_output_manager: fills grammar bitmasks for constrained requests
            (``kvserve.structured_output.manager``); needed only if such requests arrive.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 speculative_config=None, connector=None, structured_output_manager=None) -> None:
        self.config = config
        # Fills grammar bitmasks (kvserve.structured_output); None: no constrained requests.
        self.structured_output_manager = structured_output_manager
        self.kv = kv_cache_manager
        self.connector = connector
        self.num_recomputed_tokens = 0
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Unfinished requests whose sampling reads their own output (``Request.reads_output``).
        self.num_output_readers = 0
        # KV transfer between engines (kvserve.kv_connector.p2p): requests whose blocks a remote
        # engine is filling, and finished requests whose blocks a remote engine still reads.
        self.remote_kv = RemoteKVTracker(kv_cache_manager, connector)
        if connector is not None:
            connector.bind_scheduler(self.requests, kv_cache_manager)
        self.num_preemptions = 0
        # Pipeline parallelism (EngineCore's batch queue): a request whose step is still in
        # flight waits for its token (earlier stages need it), and a step takes at most
        # ``max_batch_requests`` running requests, so several micro-batches share the stages.
        self.skip_in_flight = False
        self.max_batch_requests: Optional[int] = None
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_recompute_queries = 0
        self.prefix_cache_recompute_hits = 0
        # Speculative decoding counters (drafts verified, tokens proposed / accepted).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        sc = speculative_config
        k_max = sc.max_draft_tokens if sc is not None else 0
        self.num_accepted_tokens_per_pos = [0] * k_max
        self.spec_policy = None
        if sc is not None and sc.dynamic:
            self.spec_policy = DynamicSpeculation(k_max, sc.dynamic_max_batch, sc.dynamic_min_acceptance,
                                                  max_batched_tokens=sc.dynamic_max_batched_tokens,
                                                  draft_cost=sc.dynamic_draft_cost)
        self._k_max = self._k_cap = k_max  # configured / allowed this step: drafts per request
        # Requests the workers must drop before the next step (finished or aborted).
        self.finished_req_ids: set[str] = set()
        # Bounded KV: requests run to max_tokens past max_model_len (their KV stays bounded).
        self._bounded = kv_cache_manager.bounds_kv
        # Running order (worst last): a C key function, as this sort runs every step.
        self._sort_key = (attrgetter("priority", "arrival_time") if config.scheduling_policy == "priority"
                          else attrgetter("arrival_time"))

    # ---- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} already exists")
        sp = request.sampling_params
        if sp.attention_sinks is not None or sp.max_attention_window is not None:
            self._check_bounded_params(sp)
        # Sampling that reads the request's own output (penalties, min_tokens, a grammar): counted,
        # so the engine asks each running request only while one of these is unfinished.
        request.reads_output = (sp.repetition_penalty != 1.0 or bool(sp.frequency_penalty or sp.presence_penalty)
                                or sp.min_tokens > 0 or sp.structured_outputs is not None
                                or request.structured_output is not None)
        self.num_output_readers += request.reads_output
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _check_bounded_params(self, sp) -> None:
        """Per-request bounded-KV values need a bounded engine and may only lower its values.
        Raises ValueError."""
        if not self.kv.bounded_groups:
            raise ValueError("attention_sinks / max_attention_window need an engine started with "
                             "--kv-eviction-policy streaming|h2o")
        from kvserve.core.bounded_kv import request_limits

        for g in self.kv.bounded_groups:
            request_limits(sp, g.sinks, g.window)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string) wherever they are; frees their blocks."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None and status == RequestStatus.FINISHED_ABORTED:
                self.remote_kv.release(rid)  # stop lending its blocks (freed when the worker says so)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.remote_kv.remove_waiting(rid)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.time()
        delay = False
        if self.connector is not None:
            delay, req.kv_transfer_params = self.connector.request_finished(req, [])
        if delay:  # a remote engine reads (or writes) its blocks: freed when that ends
            self.remote_kv.hold(req)
        else:
            self.kv.free(req)
        del self.requests[req.request_id]
        self.num_output_readers -= req.reads_output
        self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or self.remote_kv.num_waiting > 0

    def has_kv_transfers(self) -> bool:
        """Whether KV transfers between engines are under way (the workers must be polled)."""
        return self.remote_kv.has_transfers()

    # ---- scheduling --------------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        if self.connector is not None:
            self.connector.request_preempted(req, self.kv.get_block_ids(req.request_id)[0])
        req.num_computed_at_preemption = min(req.num_computed_tokens, req.num_tokens)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_pending_tokens = 0  # a token still on the GPU is appended when it arrives
        req.spec_token_ids = []
        req.kv_ready = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req, front=True)

    def wants_drafts(self) -> bool:
        """Whether the next step would verify drafts: the engine then runs it after the previous
        step's tokens reached the host (drafts need them), not overlapped with it."""
        if not self._k_max:
            return False
        return self.spec_policy is None or self.spec_policy.peek(len(self.running)) > 0

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """How many of ``req``'s draft tokens fit beside its ``n`` tokens: a plain decode
        only, within the budget, ``max_model_len`` and ``max_tokens``."""
        k = min(len(req.spec_token_ids), self._k_cap)
        if not k or n != 1 or req.num_pending_tokens or req.structured_output is not None:
            return 0
        mt = req.sampling_params.max_tokens
        limit = self.config.max_model_len - req.num_tokens - 1
        if mt is not None:
            limit = min(limit, mt - req.num_output_tokens - 1)
        return max(min(k, budget - n, limit), 0)

    def _prefill_cap(self) -> int:
        """The largest prefill chunk this step (``long_prefill_token_threshold``): the threshold
        while other requests are running or waiting, the whole budget for a lone request (its long
        prompt in fewer, larger chunks: less of it re-read as a cached prefix). Call before the
        request in question leaves the waiting queue or after it joined the running ones."""
        thr = self.config.long_prefill_token_threshold
        if thr <= 0 or not self.config.enable_chunked_prefill or len(self.running) + len(self.waiting) <= 1:
            return self.config.max_num_batched_tokens
        return thr

    def schedule(self) -> SchedulerOutput:
        """Build the next step (see ``SchedulerOutput``)."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        self.kv.begin_step()
        if self.spec_policy is not None:
            self._k_cap = self.spec_policy.num_speculative_tokens(len(self.running))
        # The worst request sits last, so a victim is never one already scheduled this step.
        self.running.sort(key=self._sort_key)
        preempted = False

        # The loop runs once per running request every step: plain locals, no property calls;
        # each request scheduled is written into the step's description at once (its row of
        # ``scheduled_cached_reqs``, in running order), not gathered and walked again.
        cached = out.scheduled_cached_reqs
        c_ids, c_blocks, c_computed, c_tokens = (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                                 cached.new_token_ids)
        nst = out.num_scheduled_tokens
        spec_out = out.scheduled_spec_decode_tokens
        num_prompt = 0
        grammar_reqs: list[Request] = []
        max_model_len = cfg.max_model_len
        bounded, k_cap = self._bounded, self._k_cap
        running = self.running
        chunk_cap = self._prefill_cap()
        # Most decodes neither cross a block boundary nor fill a block (1 in block_size does):
        # their allocate_slots is a no-op, tested here inline (KVCacheManager.fits_in_held_blocks).
        held = self.kv.plain_req_blocks
        bs = self.kv.block_size
        skip_in_flight, max_batch_requests = self.skip_in_flight, self.max_batch_requests
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            pending = req.num_pending_tokens
            if skip_in_flight and pending:
                i += 1  # its previous step is still in flight
                continue
            if max_batch_requests is not None and len(c_ids) >= max_batch_requests:
                break
            num_tokens = len(req.all_token_ids)
            max_len = self._max_len(req) if bounded else max_model_len
            if pending:  # its pending token may be its last (``_reaches_limit``): nothing left to compute
                mt = req.sampling_params.max_tokens
                if (mt is not None and len(req.output_token_ids) + pending >= mt) or num_tokens + pending >= max_len:
                    i += 1
                    continue
            c = req.num_computed_tokens
            n = num_tokens + pending - c
            if n > budget or n > max_len - c or n > chunk_cap:  # min(), without the call (hot)
                n = min(n, budget, max_len - c, chunk_cap)
            if n <= 0:
                i += 1
                continue
            k = self._num_drafts(req, n, budget) if k_cap else 0  # 0 while speculation is off
            rid = req.request_id
            if held is not None and (st := held.get(rid)) is not None \
                    and c + n + k <= len(st.blocks) * bs and c + n + k < st.cache_at:
                c_blocks.append(None)
            else:
                # allocate_slots changes nothing when blocks are short: retry with the drafts
                # dropped, then preempting the worst request (this one last) until it fits.
                while (blocks := self.kv.allocate_slots(req, n + k)) is None:
                    if k:
                        k = 0
                        continue
                    victim = self._pick_victim(i)
                    self._preempt(victim)
                    out.preempted_req_ids.append(victim.request_id)
                    preempted = True
                    if victim is req:
                        break
                if req.status != RequestStatus.RUNNING:
                    break
                c_blocks.append(None if not any(blocks) else tuple([b.block_id for b in g] for g in blocks))
            c_ids.append(rid)
            c_computed.append(c)
            c_tokens.append([])
            nst[rid] = n + k
            if k:
                spec_out[rid] = req.spec_token_ids[:k]
                self.num_drafts += 1
                self.num_draft_tokens += k
            if req.spec_token_ids:
                req.spec_token_ids = []
            if n > 1 or c < len(req.prompt_token_ids):
                num_prompt += n
            req.num_computed_tokens = c + n + k
            if c + n == num_tokens + pending:  # reaches the end: samples
                if req.structured_output is not None:
                    grammar_reqs.append(req)
                req.num_pending_tokens = pending + 1
            budget -= n + k
            i += 1
        scheduled: list[tuple[Request, int, int]] = []  # (request, tokens, draft tokens) admitted now
        cap = self.max_batch_requests
        if not preempted and (cap is None or len(c_ids) < cap):  # none while this step preempted
            self._admit_waiting(budget, scheduled)
        return self._make_output(out, scheduled, num_prompt, grammar_reqs)

    def _make_output(self, out: SchedulerOutput, scheduled: list[tuple[Request, int, int]], num_prompt: int,
                     grammar_reqs: list[Request]) -> SchedulerOutput:
        """Add the requests admitted this step (``scheduled``, after the running ones ``schedule``
        wrote), advance their ``num_computed_tokens`` (and pending tokens) and finish the step's
        description as data."""
        nst = out.num_scheduled_tokens
        for req, n, k in scheduled:
            rid = req.request_id
            c = req.num_computed_tokens
            out.scheduled_new_reqs.append(NewRequestData(
                rid, req.prompt_token_ids, list(req.output_token_ids), req.sampling_params, req.eos_token_id,
                self.kv.get_block_ids(rid), c))
            nst[rid] = n + k
            if k:
                out.scheduled_spec_decode_tokens[rid] = req.spec_token_ids[:k]
                self.num_drafts += 1
                self.num_draft_tokens += k
            if req.spec_token_ids:
                req.spec_token_ids = []
            if n > 1 or c < len(req.prompt_token_ids):
                num_prompt += n
            req.num_computed_tokens = c + n + k
            if c + n == len(req.all_token_ids) + req.num_pending_tokens:  # reaches the end: samples
                if req.structured_output is not None:
                    grammar_reqs.append(req)
                req.num_pending_tokens += 1
        out.total_num_scheduled_tokens = sum(nst.values())
        out.num_prompt_tokens = num_prompt
        out.finished_req_ids = set(self.finished_req_ids)
        if nst:  # an empty step may never reach the workers: they learn of these with the next one
            self.finished_req_ids.clear()
        out.block_ops = self.kv.take_block_ops()
        if self._bounded:
            out.evicted_blocks = self.kv.take_evictions()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if grammar_reqs:
            # The matchers are at each request's last known token: a constrained request is
            # never scheduled with a pending token (the engine waits for it first).
            out.structured_output_request_ids = {r.request_id: i for i, r in enumerate(grammar_reqs)}
            out.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [r.structured_output for r in grammar_reqs])
        if self.spec_policy is not None:
            out.num_speculative_tokens = self._k_cap
        return out

    def _pick_victim(self, i: int) -> Request:
        """Remove and return the request to preempt among ``running[i:]`` (not yet scheduled).

        Recompute: the worst (lowest priority, then latest arrival). Swap: within the worst
        priority, the one with the least sunk compute (fewest computed tokens; then the
        latest arrival), as vLLM RFC #54644 argues: it costs the least to bring back.
        """
        if self.config.preemption_mode != "swap" or len(self.running) - i <= 1:
            return self.running.pop()
        cands = self.running[i:]
        if self.config.scheduling_policy == "priority":
            worst = max(r.priority for r in cands)
            cands = [r for r in cands if r.priority == worst]
        victim = min(cands, key=lambda r: (r.num_computed_tokens, -r.arrival_time))
        self.running.remove(victim)
        return victim

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting) + self.remote_kv.num_waiting,
            kv_cache_usage=self.kv.usage, num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_recompute_queries=self.prefix_cache_recompute_queries,
            prefix_cache_recompute_hits=self.prefix_cache_recompute_hits,
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
            num_speculative_tokens=self._k_cap,
            num_recomputed_tokens=self.num_recomputed_tokens,
            num_evicted_blocks=self.kv.num_evicted_blocks, num_evicted_tokens=self.kv.num_evicted_tokens,
            kv_connector_stats=self.connector.get_stats() if self.connector is not None else None,
        )
