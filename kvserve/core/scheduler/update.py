"""The update from the runner's output: new tokens, draft rollback, stops, finished transfers.

``update_from_output`` appends each request's sampled tokens, rolls ``num_computed_tokens``
(and the KV blocks past it) back over rejected draft tokens, ends requests that stop (length,
EOS, stop token, a completed grammar), applies the KV connector's finished transfers, and
frees window-group blocks no later query reads.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.config import SchedulerConfig
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.scheduler.remote_kv import RemoteKVTracker
    from kvserve.core.scheduler.waiting_queue import WaitingQueue

#: What ``update_from_output`` reports per request that got tokens: the request, its new
#: token ids and their logprobs (None unless asked).
RequestUpdate = tuple[Request, list[int], Optional[list]]


class OutputUpdateMixin:
    """The scheduler's update from the runner's output; mixed into ``Scheduler``, whose state
    (``requests``, ``running``, ``waiting``, ``kv``, ``remote_kv``, the speculation counters)
    it uses."""

    config: "SchedulerConfig"
    kv: "KVCacheManager"
    waiting: "WaitingQueue"
    running: list[Request]
    requests: dict[str, Request]
    remote_kv: "RemoteKVTracker"
    connector: object  # a scheduler-role KV connector, or None
    spec_policy: object  # DynamicSpeculation, or None
    _bounded: bool

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput,
                           plain: Optional[tuple[list[str], list[int]]] = None) -> list[RequestUpdate]:
        """Append sampled tokens, roll back rejected drafts, finish requests that stop.

        Args:
            sched: the step's schedule (with async scheduling, a later step may already
                have been scheduled).
            output: the step's sampled tokens (and drafts for the next step).
            plain: ``(request ids, token ids)`` lists to append the plain decode rows to instead
                of the returned list: a request still running after one new token, without
                logprobs or prompt logprobs, never preempted, not verifying drafts this step and
                past its first token (so nothing but the token is new since its last update).
                None: every request in the returned list.

        Returns:
            ``(request, new token ids, new logprobs)`` for requests that got tokens (finished
            ones included; with ``plain``, all but the plain rows); tokens past a stop are dropped.
        """
        now = time.time()
        updated: list[RequestUpdate] = []
        if output.kv_connector_output is not None and self.connector is not None:
            updated.extend(self._update_kv_transfers(output.kv_connector_output))
        spec = sched.scheduled_spec_decode_tokens
        all_lps = output.logprobs
        for rid, (start, entries) in output.prompt_logprobs.items():
            req = self.requests.get(rid)
            have = len(req.prompt_logprobs) if req is not None else -1
            if start <= have < start + len(entries):  # chunks in order; a recompute adds nothing new
                req.prompt_logprobs.extend(entries[have - start:])
        for rid, mass in output.kv_block_mass.items():
            if rid in self.requests:
                self.kv.observe_block_mass(rid, mass)
        requests = self.requests
        running_status, preempted_status = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        check_stop = self._check_stop
        draft_ids = output.draft_token_ids
        bounded, max_model_len = self._bounded, self.config.max_model_len
        if plain is not None:
            plain_ids, plain_toks = plain
        for rid, toks in output.sampled_token_ids.items():
            req = requests.get(rid)
            if req is None:
                continue  # finished or aborted since: a token computed past the end is dropped
            quiet = False  # a plain row if it does not stop (see ``plain``)
            if req.status == running_status:
                req.num_pending_tokens -= 1
                drafts = spec.get(rid) if spec else None
                if drafts:
                    self._roll_back_drafts(req, len(drafts), len(toks) - 1)
                elif plain is not None and req.plain_output and not req.num_preemptions \
                        and req.first_token_time is not None:
                    quiet = len(toks) == 1
                    if quiet and req.structured_output is None:
                        # The common row, one token and no grammar: the loop below unrolled.
                        tok = toks[0]
                        out_ids, all_ids, sp = req.output_token_ids, req.all_token_ids, req.sampling_params
                        out_ids.append(tok)
                        all_ids.append(tok)
                        if (bounded or (sp.max_tokens is not None and len(out_ids) >= sp.max_tokens)
                                or len(all_ids) >= max_model_len or len(out_ids) < sp.min_tokens
                                or tok == req.eos_token_id or sp.stop_token_ids) \
                                and (status := check_stop(req, tok)) is not None:
                            self.running.remove(req)
                            self._finish(req, status)
                            lps = all_lps.get(rid) if all_lps else None
                            updated.append((req, toks, lps[:1] if lps is not None else None))
                            continue
                        if draft_ids:
                            drafts = draft_ids.get(rid)
                            if drafts:
                                req.spec_token_ids = list(drafts)
                        plain_ids.append(rid)
                        plain_toks.append(tok)
                        continue
            elif req.status != preempted_status:
                continue
            # A request preempted after this step was scheduled keeps the token: its KV was
            # valid, and the recompute then includes it.
            if req.first_token_time is None:
                req.first_token_time = now
            lps = all_lps.get(rid) if all_lps else None
            status = None
            so = req.structured_output
            out_ids, all_ids, sp = req.output_token_ids, req.all_token_ids, req.sampling_params
            for j, tok in enumerate(toks):
                out_ids.append(tok)  # Request.append_output_token, inlined (hot)
                all_ids.append(tok)
                # _check_stop's common answer inlined: below every length limit, past min_tokens,
                # not EOS and no stop token ids (anything else asks _check_stop).
                if (bounded or (sp.max_tokens is not None and len(out_ids) >= sp.max_tokens)
                        or len(all_ids) >= max_model_len or len(out_ids) < sp.min_tokens
                        or tok == req.eos_token_id or sp.stop_token_ids):
                    status = check_stop(req, tok)
                if so is not None and status is None and (not so.accept(tok) or so.is_terminated):
                    status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
                if status is not None:
                    toks = toks[: j + 1]
                    break
            if status is not None:
                if req.status == RequestStatus.RUNNING:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self._finish(req, status)
            elif draft_ids and req.status == running_status:
                drafts = draft_ids.get(rid)
                if drafts:
                    req.spec_token_ids = list(drafts)
            if quiet and status is None:
                plain_ids.append(rid)
                plain_toks.append(toks[0])
                continue
            updated.append((req, toks, lps[: len(toks)] if lps is not None else None))
        if self.kv.has_sliding_window or self._bounded:
            self._free_outside_window(sched)
        return updated

    def _roll_back_drafts(self, req: Request, num_drafts: int, accepted: int) -> None:
        """Count the verification and move ``num_computed_tokens`` (and the KV blocks past it)
        back over the ``num_drafts - accepted`` rejected draft tokens."""
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.num_accepted_tokens_per_pos[j] += 1
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += accepted
        if self.spec_policy is not None:
            self.spec_policy.observe(num_drafts, accepted)
        req.num_computed_tokens -= num_drafts - accepted
        self.kv.rollback(req)

    def _update_kv_transfers(self, kvo) -> list[RequestUpdate]:
        """Finished transfers between engines: requests whose KV landed go to the front of the
        waiting queue; failed pulls under ``load_failure_policy == "fail"`` end (aborted)."""
        resumed, failed = self.remote_kv.update(kvo)
        for req in resumed:
            self.waiting.add(req, front=True)
        ended: list[RequestUpdate] = []
        for req in failed:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            ended.append((req, [], None))
        return ended

    def _free_outside_window(self, sched: SchedulerOutput) -> None:
        """The step's queries have run: free window-group blocks none of the request's later
        queries can read (up to the step's end; with async scheduling the next step was
        scheduled from that same point, so it reads none of them either)."""
        start = dict(zip(sched.scheduled_cached_reqs.req_ids, sched.scheduled_cached_reqs.num_computed_tokens))
        for new in sched.scheduled_new_reqs:
            start[new.req_id] = new.num_computed_tokens
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                c = min(start[rid] + n, req.num_computed_tokens)
                self.kv.remove_skipped_blocks(req, c)
                if self._bounded:
                    self.kv.evict_after_step(req, c)

    def _reaches_limit(self, req: Request) -> bool:
        """Whether the tokens already sampled (pending included) end the request by length."""
        total = req.num_tokens + req.num_pending_tokens
        mt = req.sampling_params.max_tokens
        return (mt is not None and req.num_output_tokens + req.num_pending_tokens >= mt) \
            or total >= self._max_len(req)

    def _max_len(self, req: Request) -> int:
        """Tokens (prompt + output) at which the request stops by length: ``max_model_len``, or,
        with bounded KV and an explicit ``max_tokens``, the prompt plus ``max_tokens`` (vLLM
        users expect ``max_tokens`` honoured; the KV a request holds stays bounded)."""
        mt = req.sampling_params.max_tokens
        if self._bounded and mt is not None:
            return max(req.num_prompt_tokens + mt, self.config.max_model_len)
        return self.config.max_model_len

    def _check_stop(self, req: Request, tok: int) -> Optional[RequestStatus]:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        # Length first, as vLLM does: a stop token that is also the last allowed one reads "length".
        max_len = self._max_len(req) if self._bounded else self.config.max_model_len
        if (sp.max_tokens is not None and n_out >= sp.max_tokens) or len(req.all_token_ids) >= max_len:
            return RequestStatus.FINISHED_LENGTH
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and tok == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        return None
