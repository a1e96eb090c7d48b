"""Data parallelism behind one API server: ``DPAsyncLLM``, N engine cores behind ``AsyncLLM``'s interface.

``kvserve serve --data-parallel-size N`` (vLLM's flag) starts N engine-core processes, one
``AsyncLLM`` client each, every core a full copy of the model with its own KV cache and
scheduler; core ``i`` sees GPUs ``[i * world_size, (i + 1) * world_size)`` of the server's
visible ones (``CUDA_VISIBLE_DEVICES`` set per core; ``world_size`` = the ranks of one core).

* placement: the router's policy object (``kvserve.router.policies``, cache-aware by default:
  longest cached prefix unless the loads are imbalanced), fed the prompt's token ids as text
  (one character per token id, so a match is a shared token prefix) and each core's load
  (requests its client still waits on);
* an abort goes to the core that owns the request; outputs come back through that core's client;
* one dead or stalled core fails the whole engine: its requests and every other core's end with
  ``EngineDeadError`` naming the core, ``is_running`` turns False (``/health`` 503) and the
  server exits as it does for one dead core;
* stats: each core reports through its own ``StatLogger`` (``PrometheusStatLogger.for_engine(i)``:
  series labelled ``engine="<i>"``); the periodic log line sums the cores.

``kvserve launch --replicas N`` remains the form for replicas in separate servers or on
several machines (behind ``kvserve router``).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Optional

from kvserve.engine.async_client import AsyncLLM, EngineDeadError
from kvserve.engine.core_env import core_devices
from kvserve.engine.input_processor import PromptType, log_stats_line
from kvserve.engine.stat_logger import StatLogger
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

#: Seconds between two checks that every core is alive.
WATCH_INTERVAL_S = 0.1


def tokens_as_text(ids: list[int]) -> str:
    """Token ids as a string, one character per id, for the routing policies' character tree."""
    return "".join(map(chr, ids))


def _policies():
    """``kvserve.router.policies``, by name: the router's own policies (pure Python), which sit in
    a layer above the engine."""
    return importlib.import_module("kvserve.router.policies")


def make_policy(name: str) -> Any:
    """The router's policy called ``name`` (``cache_aware``, ``least_loaded``, ``round_robin``);
    ValueError otherwise."""
    if name == "kv_events":
        raise ValueError("routing policy kv_events needs the router's event subscriptions; data-parallel "
                         "cores use cache_aware, least_loaded or round_robin")
    return _policies().make_policy(name)


class _CoreStats(StatLogger):
    """One core's hooks: forwarded to its own logger, the step stats kept for the summed line."""

    def __init__(self, dp: "DPAsyncLLM", index: int, inner: StatLogger) -> None:
        self.dp, self.index, self.inner = dp, index, inner

    def on_step(self, stats: Any, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.inner.on_step(stats, num_prompt_tokens, num_generation_tokens)
        self.dp._on_core_step(self.index, stats, num_prompt_tokens, num_generation_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.inner.on_first_token(ttft_s)

    def on_inter_token(self, itl_s: float) -> None:
        self.inner.on_inter_token(itl_s)

    def on_prefill_done(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.inner.on_prefill_done(num_prompt_tokens, num_cached_tokens)

    def on_finished(self, finish_reason: str, e2e_s: float, queue_s: Optional[float],
                    num_prompt_tokens: int, num_generation_tokens: int, ttft_s: Optional[float] = None) -> None:
        self.inner.on_finished(finish_reason, e2e_s, queue_s, num_prompt_tokens, num_generation_tokens, ttft_s)


class DPAsyncLLM:
    """``data_parallel_size`` engine cores behind ``AsyncLLM``'s interface (what the API server uses).

    Build with ``await DPAsyncLLM.from_engine_args(args)`` (``args.data_parallel_size`` cores).

    Attributes (after start): ``cores`` (one ``AsyncLLM`` per engine core), ``config`` (the
    resolved ``EngineConfig``, ``data_parallel_size`` included), ``policy`` (the routing
    policy), ``owner`` (request id -> core index, for requests in flight), ``errored``; the
    model's ``tokenizer``, ``max_model_len``, ``vocab_size``, ``eos_token_id``, ``model_path``
    come from core 0 (the cores serve the same model).

    ``stat_logger``: a ``PrometheusStatLogger`` built with ``engine=0`` (each core then reports
    through ``for_engine(i)``; one built without is a ValueError), or a ``StatLogger`` without
    ``for_engine`` (shared by every core).
    ``routing_policy``: a policy name of ``kvserve.router.policies`` (default ``cache_aware``)
    or a policy object (``choose(text, candidates, salt) -> Decision``).
    """

    def __init__(self, engine_args: Any, stat_logger: Optional[StatLogger] = None, *,
                 routing_policy: Any = "cache_aware", **client_kwargs: Any) -> None:
        self.engine_args = engine_args
        self.data_parallel_size = int(engine_args.data_parallel_size)
        if hasattr(stat_logger, "for_engine") and getattr(stat_logger, "engine", None) is None:
            raise ValueError("data parallelism needs per-core metrics: build the PrometheusStatLogger with "
                             "engine=0 (each core then reports through for_engine(i))")
        self.stat_logger = stat_logger or StatLogger()
        self.policy = make_policy(routing_policy) if isinstance(routing_policy, str) else routing_policy
        self.cores: list[AsyncLLM] = []
        self.owner: dict[str, int] = {}
        self.config = None
        self._client_kwargs = client_kwargs
        self._errored: Optional[BaseException] = None
        self._refuse: Optional[BaseException] = None
        self._closing = False
        self._watch_task: Optional[asyncio.Task] = None
        self._core_stats: list[Any] = []
        self._log_tokens = [0, 0]
        self._log_last = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def from_engine_args(cls, engine_args: Any, stat_logger: Optional[StatLogger] = None,
                               startup_timeout: float = 900.0, **kwargs: Any) -> "DPAsyncLLM":
        """Start every engine core (concurrently); returns when all are ready.

        Raises:
            ValueError: bad flags (a feature that cannot be shared by several cores, too few
                GPUs), or what one core's start-up raised.
            EngineDeadError: a core died during start-up or did not get ready in time.
        """
        routing = kwargs.pop("routing_policy", "cache_aware")
        self = cls(engine_args, stat_logger, routing_policy=routing, **kwargs)
        await self._start(startup_timeout)
        return self

    async def _start(self, startup_timeout: float) -> None:
        args, n = self.engine_args, self.data_parallel_size
        config = await asyncio.to_thread(args.create_engine_config)
        self.config = config
        for name in ("kv_transfer_config", "kv_events_config"):
            if getattr(config, name, None) is not None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} is not supported with data_parallel_size {n} (each core would bind the "
                                 f"same endpoints): run one server per replica (kvserve launch --replicas)")
        envs: list[dict] = [{} for _ in range(n)]
        if config.device_config.device == "cuda":
            import torch

            world = config.parallel_config.world_size
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            envs = [{"CUDA_VISIBLE_DEVICES": core_devices(i, world, visible, torch.cuda.device_count())}
                    for i in range(n)]
        prof = os.environ.get("KVSERVE_TORCH_PROFILER_DIR")
        if prof:  # each core's ranks write their traces into their own sub-directory
            for i, e in enumerate(envs):
                e["KVSERVE_TORCH_PROFILER_DIR"] = os.path.join(prof, f"dp{i}")
        # Each core: one engine; the summed stats line is logged here, not by each client.
        core_args = replace(args, data_parallel_size=1, disable_log_stats=True)
        loggers = [self._core_logger(i) for i in range(n)]
        self._core_stats = [None] * n
        results = await asyncio.gather(*(
            AsyncLLM.from_engine_args(core_args, loggers[i], startup_timeout, core_env=envs[i],
                                      **self._client_kwargs) for i in range(n)), return_exceptions=True)
        self.cores = [r for r in results if isinstance(r, AsyncLLM)]
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(c.shutdown() for c in self.cores), return_exceptions=True)
            i, exc = errors[0]
            if isinstance(exc, EngineDeadError):
                raise EngineDeadError(f"data-parallel engine core {i}: {exc}") from exc
            raise exc
        logger.info("data parallel: %d engine cores ready (pids %s%s)", n, [c.proc.pid for c in self.cores],
                    "; GPUs " + " | ".join(e["CUDA_VISIBLE_DEVICES"] for e in envs)
                    if "CUDA_VISIBLE_DEVICES" in envs[0] else "")
        self._watch_task = asyncio.create_task(self._watch(), name="kvserve-dp-watch")

    def _core_logger(self, index: int) -> StatLogger:
        for_engine = getattr(self.stat_logger, "for_engine", None)
        return _CoreStats(self, index, for_engine(index) if for_engine is not None else self.stat_logger)

    async def _watch(self) -> None:
        while not self._closing and self._errored is None:
            self._check_cores()
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _check_cores(self) -> None:
        """One failed core fails the engine: every other core's requests end with the same error."""
        if self._errored is not None or self._closing:
            return
        for i, core in enumerate(self.cores):
            if core.errored is not None:
                exc = core.errored
                err = type(exc)(f"data-parallel engine core {i} failed: {exc}") \
                    if isinstance(exc, EngineDeadError) else EngineDeadError(f"data-parallel engine core {i} "
                                                                             f"failed: {exc!r}")
                self._errored = err
                logger.error("%s; stopping all %d engine cores' requests", err, len(self.cores))
                for other in self.cores:
                    if other is not core:
                        other.fail_requests(err)
                return

    @property
    def errored(self) -> Optional[BaseException]:
        """The error that ended the engine (a core died or stalled), or None."""
        self._check_cores()
        return self._errored

    @property
    def is_running(self) -> bool:
        """True while every engine core is alive and the engine is not shutting down."""
        return self.errored is None and not self._closing and all(c.is_running for c in self.cores)

    @property
    def proc(self):
        """Core 0's process (the server's hard-exit path kills it; the others follow their parent)."""
        return self.cores[0].proc if self.cores else None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every engine core (``AsyncLLM.shutdown``, concurrently). Safe to call twice."""
        if self._closing:
            return
        self._closing = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        await asyncio.gather(*(c.shutdown(timeout) for c in self.cores), return_exceptions=True)

    # ------------------------------------------------------------------ model facts (from core 0)
    def __getattr__(self, name: str) -> Any:
        if name in ("tokenizer", "max_model_len", "vocab_size", "eos_token_id", "model_path",
                    "kv_transfer_info", "num_blocks", "block_size", "last_stats"):
            cores = self.__dict__.get("cores") or []
            if cores:
                return getattr(cores[0], name)
        raise AttributeError(name)

    # ------------------------------------------------------------------ stats
    def _on_core_step(self, index: int, stats: Any, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._core_stats[index] = stats
        self._log_tokens[0] += num_prompt_tokens
        self._log_tokens[1] += num_generation_tokens
        now = time.monotonic()
        dt = now - self._log_last
        if self.engine_args.disable_log_stats or dt < self.engine_args.log_stats_interval:
            return
        live = [s for s in self._core_stats if s is not None]
        tot = {k: sum(getattr(s, k, 0) or 0 for s in live) for k in (
            "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
            "prefix_cache_recompute_hits", "num_draft_tokens", "num_accepted_tokens", "num_drafts",
            "num_evicted_blocks")}
        usage = sum(s.kv_cache_usage for s in live) / len(live)
        log_stats_line(self._log_tokens[0] / dt, self._log_tokens[1] / dt, tot["num_running"], tot["num_waiting"],
                       usage, tot["prefix_cache_queries"], tot["prefix_cache_hits"], tot["num_preemptions"],
                       tot["prefix_cache_recompute_hits"], tot["num_draft_tokens"], tot["num_accepted_tokens"],
                       tot["num_drafts"], None, tot["num_evicted_blocks"])
        per = [(s.num_running, s.num_waiting, s.kv_cache_usage) if s is not None else (0, 0, 0.0)
               for s in self._core_stats]
        logger.info("data parallel (%d engine cores, summed above): running %s, waiting %s, KV cache usage %s",
                    len(per), [p[0] for p in per], [p[1] for p in per], [f"{100 * p[2]:.1f}%" for p in per])
        self._log_last, self._log_tokens = now, [0, 0]

    # ------------------------------------------------------------------ requests
    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if the engine cannot take requests."""
        if self.errored is not None:
            raise EngineDeadError(str(self._errored))
        if self._closing:
            raise EngineDeadError("the engine is shutting down")
        if self._refuse is not None:
            raise type(self._refuse)(str(self._refuse))
        for c in self.cores:
            c.check_alive()

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        return self.cores[0].tokenize(prompt)

    def validate(self, ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        self.cores[0].validate(ids, params, priority)

    def choose(self, ids: list[int], cache_salt: Optional[str] = None) -> int:
        """The index of the core that gets a prompt of token ``ids`` (the routing policy's pick)."""
        cands = [_policies().Candidate(str(i), c.num_unfinished()) for i, c in enumerate(self.cores)]
        return int(self.policy.choose(tokens_as_text(ids), cands, cache_salt).url)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        priority: int = 0,
        delta: bool = False,
        prompt_text: Optional[str] = None,
        cache_salt: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.generate`` on the core the routing policy picks (same arguments, outputs
        and errors); the prompt is tokenized once, here."""
        self.check_alive()
        params = sampling_params or SamplingParams()
        text, ids = self.tokenize(prompt)
        self.validate(ids, params, priority)
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} already exists")
        index = self.choose(ids, cache_salt)
        self.owner[request_id] = index
        try:
            async for out in self.cores[index].generate(
                    ids, params, request_id, priority=priority, delta=delta,
                    prompt_text=text if text is not None else prompt_text, cache_salt=cache_salt):
                yield out
        finally:
            self.owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request on the core that owns it (unknown or finished ids are ignored)."""
        index = self.owner.get(request_id)
        if index is not None:
            await self.cores[index].abort(request_id)

    def fail_requests(self, exc: BaseException) -> int:
        """``AsyncLLM.fail_requests`` on every core; returns how many requests it ended."""
        self._refuse = exc
        return sum(c.fail_requests(exc) for c in self.cores)

    def reset_prefix_cache(self) -> None:
        """Ask every core to forget its unheld cached blocks. Raises EngineDeadError."""
        self.check_alive()
        for c in self.cores:
            c.reset_prefix_cache()

    def profile(self, is_start: bool) -> None:
        """``AsyncLLM.profile`` on every core. Raises EngineDeadError."""
        self.check_alive()
        for c in self.cores:
            c.profile(is_start)

    def num_unfinished(self) -> int:
        """Requests (parents) the cores' clients still wait on, summed."""
        return sum(c.num_unfinished() for c in self.cores)
