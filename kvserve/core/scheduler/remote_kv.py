"""The scheduler's side of KV transfer between engines (disaggregated prefill/decode).

``RemoteKVTracker`` is owned by the scheduler and driven by the connector's hooks; it
holds two kinds of requests:

* **waiting for remote KV** (consumer): a request whose prompt KV a remote engine sends (the
  connector's ``get_num_new_matched_tokens`` answered ``load_async=True``) gets its blocks at
  admission and waits here (status ``WAITING_FOR_REMOTE_KVS``), its blocks kept out of the
  prefix cache (``Request.delay_cache_blocks``) until the KV landed;
* **held** (producer, delayed free): a finished request whose blocks a remote engine still
  reads (``request_finished`` answered "delay"); freed when the transfer is over.

The workers report finished pulls (and producers finished lending) in
``ModelRunnerOutput.kv_connector_output``; ``update`` resumes the requests whose KV landed
(``Request.kv_ready``: admitted next without a prefix lookup) and frees held blocks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched_output import KVConnectorOutput

logger = logging.getLogger("kvserve")


class RemoteKVTracker:
    """Requests between the scheduler and a remote engine's KV transfer.

    Args:
        kv_cache_manager: frees held blocks and a resumed request's out-of-window blocks.
        connector: the scheduler-role KV connector (``kvserve.kv_connector.KVConnectorBase_V1``),
            or None; its ``load_failure_policy`` decides what a failed pull does:
            ``"recompute"`` the prompt locally, or ``"fail"`` the request.
    """

    def __init__(self, kv_cache_manager: "KVCacheManager", connector) -> None:
        self.kv = kv_cache_manager
        self.connector = connector
        #: request id -> (request, tokens it holds once its remote KV landed)
        self.waiting: dict[str, tuple[Request, int]] = {}
        #: request id -> a finished request whose blocks stay allocated until its transfer ends
        self.held: dict[str, Request] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_transfers(self) -> bool:
        """Whether transfers are under way (the workers must be polled)."""
        return bool(self.waiting) or bool(self.held)

    # ---- consumer ------------------------------------------------------------------------
    def park(self, req: Request, num_hit: int, num_ext: int) -> None:
        """``req`` got blocks for ``num_hit`` local and ``num_ext`` remote tokens: wait for them."""
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting[req.request_id] = (req, num_hit + num_ext)

    def remove_waiting(self, request_id: str) -> None:
        """Forget a waiting request (aborted); the scheduler frees (or holds) its blocks."""
        del self.waiting[request_id]

    # ---- producer ------------------------------------------------------------------------
    def hold(self, req: Request) -> None:
        """Keep a finished request's blocks until the connector reports its transfer over."""
        self.held[req.request_id] = req

    def is_held(self, request_id: str) -> bool:
        return request_id in self.held

    def release(self, request_id: str) -> None:
        """A held request was aborted: end its transfer (its blocks are freed once the worker
        reports it finished)."""
        if request_id in self.held:
            self.connector.release_held(request_id)

    # ---- the workers' report -------------------------------------------------------------
    def update(self, kvo: "KVConnectorOutput") -> tuple[list[Request], list[Request]]:
        """Apply finished transfers. Returns ``(resumed, failed)``: requests whose KV landed
        (or whose failed pull is recomputed), status ``WAITING`` and ``kv_ready`` set, to go
        to the front of the waiting queue in this order; and requests whose pull failed under
        ``load_failure_policy == "fail"``, status ``WAITING``, for the scheduler to abort.
        Held blocks of finished transfers are freed."""
        self.connector.on_kv_connector_output(kvo)
        resumed: list[Request] = []
        failed: list[Request] = []
        for rid in kvo.finished_recving:
            entry = self.waiting.pop(rid, None)
            if entry is None:
                self._free_held(rid)
                continue
            req, target = entry
            req.delay_cache_blocks = False
            req.status = RequestStatus.WAITING
            pull_failed = rid in kvo.failed_recving
            if pull_failed and self.connector.load_failure_policy == "fail":
                logger.error("request %s: its remote KV did not arrive; finished with finish_reason abort "
                             "(kv_load_failure_policy fail)", rid)
                failed.append(req)
                continue
            if not pull_failed:
                req.num_computed_tokens = target
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            # Window groups: blocks no later query reads go back now (never registered).
            self.kv.remove_skipped_blocks(req, req.num_computed_tokens)
            req.kv_ready = True
            resumed.append(req)
        for rid in kvo.finished_sending:
            self._free_held(rid)
        return resumed, failed

    def _free_held(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.kv.free(held)
