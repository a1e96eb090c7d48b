"""``long_prefill_token_threshold``: prefill chunks capped at the threshold beside other requests,
up to the whole ``max_num_batched_tokens`` for a lone request (fake model loop, no torch)."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler
from kvserve.engine.arg_utils import EngineArgs
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from sched_view import schedule as _schedule
from sched_view import update as _update


def _make(threshold: int, budget: int = 32) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024,
                          long_prefill_token_threshold=threshold)
    return Scheduler(cfg, KVCacheManager.for_blocks(128, 4, True))


def _req(rid: str, n: int, max_tokens: int = 3, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1000 * len(rid), 1000 * len(rid) + n)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival)


def _step(s: Scheduler) -> list[tuple[str, int]]:
    sched = _schedule(s)
    assert sched.num_scheduled_tokens <= s.config.max_num_batched_tokens
    _update(s, sched, {r.request_id: 7 for (r, _), smp in zip(sched.scheduled, sched.samples) if smp})
    return [(r.request_id, n) for r, n in sched.scheduled]


def test_lone_prompt_takes_the_whole_budget_then_is_capped_beside_others():
    s = _make(threshold=8)
    s.add_request(_req("a", 80, arrival=1.0))
    assert _step(s) == [("a", 32)]  # alone: the whole budget, not the threshold
    s.add_request(_req("bb", 4, arrival=2.0))
    assert _step(s) == [("a", 8), ("bb", 4)]  # another request: chunks of at most the threshold
    assert _step(s) == [("a", 8), ("bb", 1)]  # a decode beside it: still capped
    assert _step(s) == [("a", 8), ("bb", 1)]  # bb's third token: it finishes
    assert _step(s) == [("a", 24)]  # alone again: the rest of the prompt in one chunk (80 - 56)


def test_waiting_request_caps_the_admitted_prompt():
    s = _make(threshold=8, budget=32)
    s.add_request(_req("a", 40, arrival=1.0))
    s.add_request(_req("bb", 40, arrival=2.0))
    assert _step(s) == [("a", 8), ("bb", 8)]  # neither is alone
    s0 = _make(threshold=0)
    s0.add_request(_req("a", 40, arrival=1.0))
    s0.add_request(_req("bb", 40, arrival=2.0))
    assert _step(s0) == [("a", 32)]  # no threshold: the first prompt fills the budget as before


def test_threshold_is_a_flag():
    import argparse

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--max-num-batched-tokens", "32768", "--long-prefill-token-threshold", "8192"])
    kw = EngineArgs.from_cli_args(ns)
    assert (kw["max_num_batched_tokens"], kw["long_prefill_token_threshold"]) == (32768, 8192)
