"""The scheduler's side of KV transfer between engines (disaggregated prefill/decode).

A consumer request whose prompt KV a remote engine sends (the connector's
``get_num_new_matched_tokens`` answered ``load_async=True``) gets its blocks at admission and
waits in ``Scheduler.waiting_for_remote`` (status ``WAITING_FOR_REMOTE_KVS``), its blocks kept
out of the prefix cache (``Request.delay_cache_blocks``) until the KV landed. The workers
report finished pulls (and producers finished lending) in ``ModelRunnerOutput.kv_connector_output``;
``update_kv_transfers`` resumes those requests (``Request.kv_ready``: admitted next without a
prefix lookup) and frees blocks held past a request's end (``Scheduler.kv_held``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.sched_output import KVConnectorOutput
    from kvserve.core.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger("kvserve")


def admit_remote(sched: "Scheduler", req: Request, hits, num_hit: int, num_ext: int) -> bool:
    """Allocate blocks for ``num_ext`` tokens a remote engine sends (not registered in the
    prefix cache until they land) and park the request; False if blocks are short."""
    req.delay_cache_blocks = True
    if sched.kv.allocate_slots(req, num_ext, hits) is None:
        req.delay_cache_blocks = False
        return False
    sched.waiting.pop()
    sched.connector.update_state_after_alloc(req, sched.kv.get_block_ids(req.request_id)[0], num_ext)
    req.num_computed_tokens = num_hit
    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.waiting_for_remote[req.request_id] = (req, num_hit + num_ext)
    if req.num_cached_tokens < 0:
        sched.prefix_cache_queries += req.num_tokens
        sched.prefix_cache_hits += num_hit
    return True


def update_kv_transfers(sched: "Scheduler", kvo: "KVConnectorOutput") -> list["RequestUpdate"]:
    """Apply the connector's finished transfers: resume requests whose KV landed (or, on
    a failed pull, recompute them or end them per ``load_failure_policy``), free blocks
    held for finished transfers. Returns updates of requests it ended."""
    sched.connector.on_kv_connector_output(kvo)
    ended: list["RequestUpdate"] = []
    for rid in kvo.finished_recving:
        entry = sched.waiting_for_remote.pop(rid, None)
        if entry is None:
            held = sched.kv_held.pop(rid, None)
            if held is not None:
                sched.kv.free(held)
            continue
        req, target = entry
        req.delay_cache_blocks = False
        failed = rid in kvo.failed_recving
        if failed and getattr(sched.connector, "load_failure_policy", "recompute") == "fail":
            logger.error("request %s: its remote KV did not arrive; finished with finish_reason abort "
                         "(kv_load_failure_policy fail)", rid)
            req.status = RequestStatus.WAITING
            sched._finish(req, RequestStatus.FINISHED_ABORTED)
            ended.append((req, [], None))
            continue
        if not failed:
            req.num_computed_tokens = target
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        # Window groups: blocks no later query reads go back now (never registered).
        sched.kv.remove_skipped_blocks(req, req.num_computed_tokens)
        req.kv_ready = True
        req.status = RequestStatus.WAITING
        sched.waiting.add(req, front=True)
    for rid in kvo.finished_sending:
        held = sched.kv_held.pop(rid, None)
        if held is not None:
            sched.kv.free(held)
    return ended
