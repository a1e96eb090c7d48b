"""The engine core loop: schedule -> execute -> update. Tokens in, tokens out.

Knows nothing of text: tokenization, detokenization and stop strings live in the
frontend (``LLMEngine`` offline, ``AsyncLLM`` for the server). The model runs behind an
executor (``kvserve.executor``): in this process (``uni``) or in worker processes (``mp``)
that receive each step as data.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_spec import KVCacheConfig, make_kv_cache_config
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.engine.core_types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from kvserve.executor import Executor, get_executor_class
from kvserve.request import Request, RequestStatus

logger = logging.getLogger("kvserve")


def plan_kv_cache(config: EngineConfig, executor: Executor) -> KVCacheConfig:
    """Size the KV cache: the workers' layer specs and memory budget -> groups and block counts.

    Lowers ``max_model_len`` to the capacity when it was not set explicitly.
    Raises ValueError if the cache cannot hold one request of ``max_model_len`` tokens.
    """
    cc, sc, mc = config.cache_config, config.scheduler_config, config.model_config
    specs = executor.get_kv_cache_spec()
    kv_bytes = None if cc.num_gpu_blocks_override is not None else executor.determine_available_memory()
    kv_cfg = make_kv_cache_config(specs, kv_bytes, cc.num_gpu_blocks_override)
    num_blocks = min(g.num_blocks for g in kv_cfg.groups)
    capacity = max(num_blocks - 1, 0) * cc.block_size  # block 0 is the null block
    if capacity < sc.max_model_len:
        if mc.max_model_len_explicit or capacity < cc.block_size:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cc.block_size}), "
                f"fewer than max_model_len={sc.max_model_len}; raise --kv-cache-memory / "
                f"--gpu-memory-utilization or lower --max-model-len"
            )
        logger.warning("max_model_len lowered from %d to the KV capacity %d", sc.max_model_len, capacity)
        sc.max_model_len = mc.max_model_len = capacity
    cc.num_blocks = num_blocks
    bpt = kv_cfg.bytes_per_token
    logger.info(
        "KV cache: %d bytes/token over %d layers (%s); %d blocks x %d tokens = %d tokens (%.2f GiB); "
        "max concurrency at max_model_len=%d: %.2fx",
        bpt, kv_cfg.num_layers, kv_cfg.describe(), num_blocks - 1, cc.block_size, capacity,
        kv_cfg.total_bytes / 2**30, sc.max_model_len, capacity / sc.max_model_len,
    )
    return kv_cfg


class EngineCore:
    """Owns the executor (and through it the model), the KV cache manager and the scheduler.

    Raises:
        ValueError: if the KV cache cannot hold one request of ``max_model_len`` tokens, or
            the attention backend cannot serve the KV cache format.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        self.executor = get_executor_class(config.parallel_config)(config)
        t1 = time.perf_counter()
        try:
            kv_cfg = plan_kv_cache(config, self.executor)
            self.executor.initialize_kv_cache(kv_cfg)
            self._startup_s = (t1 - t0, time.perf_counter() - t1)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache_config = kv_cfg
        cc = config.cache_config
        self.kv_cache_manager = KVCacheManager(kv_cfg, cc.enable_prefix_caching)
        hf = config.model_config.hf_config
        if cc.enable_prefix_caching and getattr(hf, "sliding_window", None):
            logger.warning(
                "prefix caching with a sliding-window model (window %s): blocks outside the window "
                "are kept, so reuse stays exact but saves no memory there", hf.sliding_window)
        from kvserve.structured_output.manager import StructuredOutputManager

        self.structured_output_manager = StructuredOutputManager(
            config.model_config, self._vocab_size(config))
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager,
                                   self.structured_output_manager)
        self.async_scheduling = config.async_scheduling
        # Async scheduling: the step launched last, whose tokens have not been read yet.
        self._in_flight: Optional[tuple[SchedulerOutput, object]] = None

    def startup_breakdown(self) -> str:
        """``"model X s, KV cache Y s"``: where start-up went (model load, cache + graphs)."""
        return "model %.2f s, KV cache + warm-up %.2f s" % self._startup_s

    @staticmethod
    def _vocab_size(config: EngineConfig) -> int:
        hf = config.model_config.hf_config
        return int(getattr(hf, "vocab_size", 0) or 0)

    @property
    def model_runner(self):
        """The in-process model runner (``uni`` executor only; None otherwise)."""
        return getattr(self.executor, "model_runner", None)

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Queue a request. Raises ValueError for a duplicate id or an invalid structured-output
        constraint (compiled here, with the model's vocabulary)."""
        if isinstance(request, EngineCoreRequest):
            request = Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                              request.arrival_time, request.priority, request.eos_token_id, request.cache_salt)
        so = request.sampling_params.structured_outputs
        if so is not None and request.structured_output is None:
            request.structured_output = self.structured_output_manager.make_request_state(so)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests the frontend stopped (stop strings) or aborted; frees their blocks."""
        return self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """Schedule, run and update one step.

        With async scheduling the step scheduled and launched now is N+1, and the result
        returned is step N's: the host schedules and prepares N+1 while the device still
        runs N, so the device does not idle between steps. Requests whose sampling reads
        their own output history (penalties, min_tokens not reached, a grammar bitmask) need
        step N's token on the host first; while one is running, the engine runs steps one at
        a time.
        """
        if not self.async_scheduling:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return EngineCoreOutputs()
            return self._update(sched, self.executor.execute_model(sched).get())
        prev = self._in_flight
        self._in_flight = None
        if prev is not None and self._needs_host_tokens():
            return self._update(prev[0], prev[1].get())
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self._in_flight = (sched, self.executor.execute_model(sched))
        if prev is None:
            return EngineCoreOutputs()
        return self._update(prev[0], prev[1].get())

    def _needs_host_tokens(self) -> bool:
        for r in self.scheduler.running:
            if r.num_pending_tokens:
                sp = r.sampling_params
                if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty \
                        or r.num_output_tokens < sp.min_tokens or r.structured_output is not None:
                    return True
        return False

    def _update(self, sched: SchedulerOutput, runner_out) -> EngineCoreOutputs:
        updated = self.scheduler.update_from_output(sched, runner_out)
        outs = EngineCoreOutputs(num_prompt_tokens=sched.num_prompt_tokens)
        n_gen = 0
        for req, toks, lps in updated:
            n_gen += len(toks)
            outs.outputs.append(EngineCoreOutput(
                req.request_id, toks, lps if req.sampling_params.logprobs is not None else None,
                req.finish_reason, req.stop_reason, req.num_cached_tokens, req.first_scheduled_time,
                req.first_token_time, req.finished_time, req.num_preemptions))
        outs.num_generation_tokens = n_gen
        return outs

    def shutdown(self) -> None:
        self.executor.shutdown()
