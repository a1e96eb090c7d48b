"""The engine core loop: schedule -> execute -> update. Tokens in, tokens out.

Knows nothing of text: tokenization, detokenization and stop strings live in the
frontend (``LLMEngine`` offline, the API server later).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.request import Request, RequestStatus
from kvserve.worker.model_runner import AsyncModelRunnerOutput, ModelRunner, ModelRunnerOutput

logger = logging.getLogger("kvserve")


@dataclass
class StepResult:
    """One step's outcome: requests that got a token, and tokens computed."""

    updated: list[Request]
    num_scheduled_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int


class EngineCore:
    """Owns the model runner, the KV cache manager and the scheduler.

    Raises:
        ValueError: if the KV cache cannot hold one request of ``max_model_len`` tokens.
    """

    def __init__(self, config: EngineConfig, max_model_len_explicit: bool = False) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        cc, sc = config.cache_config, config.scheduler_config
        num_blocks = self.model_runner.determine_num_blocks()
        capacity = max(num_blocks - 1, 0) * cc.block_size  # block 0 is the null block
        if capacity < sc.max_model_len:
            if max_model_len_explicit or capacity < cc.block_size:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cc.block_size}), "
                    f"fewer than max_model_len={sc.max_model_len}; raise --kv-cache-memory / "
                    f"--gpu-memory-utilization or lower --max-model-len"
                )
            logger.warning("max_model_len lowered from %d to the KV capacity %d", sc.max_model_len, capacity)
            sc.max_model_len = config.model_config.max_model_len = capacity
        cc.num_blocks = num_blocks
        self.model_runner.init_kv_cache(num_blocks)
        self.model_runner.maybe_capture_cuda_graphs()
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        hf = config.model_config.hf_config
        if cc.enable_prefix_caching and getattr(hf, "sliding_window", None):
            logger.warning(
                "prefix caching with a sliding-window model (window %s): blocks outside the window "
                "are kept, so reuse stays exact but saves no memory there", hf.sliding_window)
        self.scheduler = Scheduler(sc, self.kv_cache_manager)
        self.async_scheduling = config.async_scheduling
        # Async scheduling: the step launched last, whose tokens have not been read yet.
        self._in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        bpt = self.model_runner.bytes_per_token
        logger.info(
            "KV cache: %d bytes/token (2 x %d layers x %d kv_heads x %d head_dim x %s), %d blocks x %d "
            "tokens = %d tokens (%.2f GiB); max concurrency at max_model_len=%d: %.2fx",
            bpt, self.model_runner.num_layers, self.model_runner.num_kv_heads, self.model_runner.head_dim,
            cc.kv_cache_dtype, num_blocks - 1, cc.block_size, capacity, capacity * bpt / 2**30,
            sc.max_model_len, capacity / sc.max_model_len,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> StepResult:
        """Schedule, run and update one step.

        With async scheduling the step scheduled and launched now is N+1, and the result
        returned is step N's: the host schedules and prepares N+1 while the device still
        runs N, so the device does not idle between steps. Requests whose sampling reads
        their own output history (penalties, min_tokens not reached) need step N's token on
        the host first; while one is running, the engine runs steps one at a time.
        """
        if not self.async_scheduling:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return StepResult([], 0, 0, 0)
            return self._update(sched, self.model_runner.execute_model(sched))
        prev = self._in_flight
        self._in_flight = None
        if prev is not None and self._needs_host_tokens():
            return self._update(prev[0], prev[1].get())
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self._in_flight = (sched, self.model_runner.execute_model_async(sched))
        if prev is None:
            return StepResult([], 0, 0, 0)
        return self._update(prev[0], prev[1].get())

    def _needs_host_tokens(self) -> bool:
        for r in self.scheduler.running:
            if r.num_pending_tokens:
                sp = r.sampling_params
                if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty \
                        or r.num_output_tokens < sp.min_tokens:
                    return True
        return False

    def _update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> StepResult:
        num_decode = sum(1 for (r, n), c in zip(sched.scheduled, sched.num_computed)
                         if n == 1 and c >= r.num_prompt_tokens)
        updated = self.scheduler.update_from_output(sched, out.sampled)
        for req in updated:
            lp = out.logprobs.get(req.request_id)
            if lp is not None:
                req.logprobs.append(lp)
        return StepResult(updated, sched.num_scheduled_tokens, sched.num_scheduled_tokens - num_decode,
                          len(updated))
