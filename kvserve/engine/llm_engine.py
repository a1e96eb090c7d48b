"""LLMEngine: the engine core plus the frontend work (tokenize, validate, detokenize).

Used in-process by the offline ``LLM`` class.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from kvserve.config import EngineConfig
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.input_processor import (
    PromptType,
    log_stats_line,
    make_child_requests,
    resolve_eos_token_id,
    tokenize_prompt,
    validate_request,
)
from kvserve.engine.output_processor import OutputProcessor, ParentState
from kvserve.model_loader import get_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.request import RequestStatus
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")


@contextlib.contextmanager
def gc_paused():
    """Turn Python's cyclic garbage collector off for the block, back on after (if it was on).

    Start-up (imports, config, tokenizer JSON, weights) allocates a few hundred thousand
    long-lived objects, and every full collection walks all of them: six collections cost
    ~0.8 s of a 2-core machine's ``kvserve generate``. Reference counting still frees
    everything that is not in a cycle.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class EngineStats:
    """Cumulative counters (tokens unless said otherwise) and current gauges."""

    num_preemptions: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_recompute_queries: int = 0  # lookups of re-admitted preempted requests, apart
    prefix_cache_recompute_hits: int = 0
    num_drafts: int = 0  # speculative decoding: steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompt tokens computed (recompute included)
    num_generation_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    moe_expert_tokens: Optional[list] = None  # MoE: tokens routed per expert (summed over layers), as last read


class LLMEngine:
    """Engine core + tokenizer + output processing.

    Raises (from the constructor): ValueError for bad flags, FileNotFoundError for a
    missing model.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        t0 = time.perf_counter()
        self.tokenizer = None if mc.skip_tokenizer_init else get_tokenizer(mc.model, mc.load_format, mc.tokenizer)
        t1 = time.perf_counter()
        self.engine_core = EngineCore(config)
        t2 = time.perf_counter()
        logger.info("start-up: tokenizer %.2f s, engine core %.2f s (%s); quantization %s", t1 - t0, t2 - t1,
                    self.engine_core.startup_breakdown(), mc.quantization or "none")
        self.engine_core.structured_output_manager.tokenizer = self.tokenizer  # share, don't reload
        self.vocab_size = mc.hf_config.vocab_size
        self.eos_token_id: Optional[int] = resolve_eos_token_id(self.tokenizer, mc.hf_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._counter = itertools.count()
        self._last_log = time.monotonic()
        self._last_prompt = 0
        self._last_gen = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Resolve ``args`` (config, model, tokenizer) and build the engine, with the cyclic
        garbage collector paused meanwhile (``gc_paused``). Raises as the constructor does."""
        with gc_paused():
            return cls(args.create_engine_config())

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler_config.max_model_len

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> str:
        """Validate and queue one request; returns its id. Requests share prefix-cache
        blocks only with requests of the same ``cache_salt`` (None is a salt too).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, a prompt longer than
                max_model_len, or bad sampling parameters. Nothing is queued then.
        """
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        validate_request(ids, params, priority, self.vocab_size, self.max_model_len, self.tokenizer is not None,
                         self.config.cache_config)
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} already exists")
        arrival = time.time() if arrival_time is None else arrival_time
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        children = make_child_requests(request_id, ids, params, arrival, priority, self.eos_token_id,
                                       cache_salt)
        self.output_processor.add(ParentState(request_id, text, ids), children)
        for child in children:
            self.engine_core.add_request(child)
        return request_id

    def abort_request(self, request_id: str) -> None:
        parent = self.output_processor.parents.get(request_id)
        if parent is None:
            return
        ids = [s.request.request_id for s in parent.seqs]
        self.engine_core.abort_requests(ids)
        for cid in ids:
            self.output_processor.abort(cid)
        self.output_processor.remove(parent)

    def shutdown(self) -> None:
        """Stop the executor's workers (idempotent)."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    # ---- the loop ------------------------------------------------------------------------
    def step(self, stream: bool = False) -> list[RequestOutput]:
        """Run one engine step. Returns outputs of finished parents (and of all touched
        parents when ``stream``)."""
        res = self.engine_core.step()
        op = self.output_processor
        updated = [st for st, _ in op.apply_outputs(res.outputs)]
        if res.plain_req_ids:
            updated += op.apply_plain(res.plain_req_ids, res.plain_token_ids, stop_only=not stream)
        parents, stopped = op.process(updated, detokenize_all=stream)
        if stopped:
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outs = []
        for p in parents:
            finished = p.finished  # read once: every request is a parent here, every step
            if stream or finished:
                outs.append(op.make_output(p))
            if finished:
                op.remove(p)
        self._update_stats(res.num_prompt_tokens, res.num_generation_tokens)
        return outs

    def _update_stats(self, prompt_tokens: int, gen_tokens: int) -> None:
        s = self.stats
        ss = self.engine_core.scheduler.get_stats()
        s.num_prompt_tokens += prompt_tokens
        s.num_generation_tokens += gen_tokens
        s.num_preemptions = ss.num_preemptions
        s.kv_cache_usage = ss.kv_cache_usage
        s.prefix_cache_queries = ss.prefix_cache_queries
        s.prefix_cache_hits = ss.prefix_cache_hits
        s.prefix_cache_recompute_queries = ss.prefix_cache_recompute_queries
        s.prefix_cache_recompute_hits = ss.prefix_cache_recompute_hits
        s.num_drafts, s.num_draft_tokens = ss.num_drafts, ss.num_draft_tokens
        s.num_accepted_tokens = ss.num_accepted_tokens
        s.num_accepted_tokens_per_pos = ss.num_accepted_tokens_per_pos
        s.num_running, s.num_waiting = ss.num_running, ss.num_waiting
        s.moe_expert_tokens = getattr(self.engine_core, "moe_expert_tokens", None)
        now = time.monotonic()
        dt = now - self._last_log
        if self.config.disable_log_stats or dt < self.config.log_stats_interval:
            return
        log_stats_line(
            (s.num_prompt_tokens - self._last_prompt) / dt, (s.num_generation_tokens - self._last_gen) / dt,
            s.num_running, s.num_waiting, s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits,
            s.num_preemptions, s.prefix_cache_recompute_hits, s.num_draft_tokens, s.num_accepted_tokens,
            s.num_drafts, ss.kv_connector_stats, ss.num_evicted_blocks,
        )
        self._last_log, self._last_prompt, self._last_gen = now, s.num_prompt_tokens, s.num_generation_tokens
