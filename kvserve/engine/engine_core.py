"""The engine core loop: schedule -> execute -> update. Tokens in, tokens out.

Knows nothing of text: tokenization, detokenization and stop strings live in the
frontend (``LLMEngine`` offline, ``AsyncLLM`` for the server). The model runs behind an
executor (``kvserve.executor``): in this process (``uni``) or in worker processes (``mp``)
that receive each step as data.
"""

from __future__ import annotations

import collections
import logging
import time
import weakref
from typing import Optional

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_capacity import LOSSY_KV_FORMATS
from kvserve.core.kv_cache_spec import (
    KVCacheConfig, MLAAttentionSpec, bytes_per_request, make_kv_cache_config, max_concurrency, max_request_tokens,
    prefill_blocks,
)
from kvserve.core.kv_events import KVEventBatch, KVEventRecorder
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.core.single_type_manager import SingleTypeKVCacheManager
from kvserve.engine.core_types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from kvserve.engine.kv_events import make_event_publisher
from kvserve.executor import Executor, get_executor_class
from kvserve.request import Request, RequestStatus

logger = logging.getLogger("kvserve")


def kv_capacity_error(kv_cfg: KVCacheConfig, mnbt: int, kv_bytes: Optional[int]) -> str:
    """Why a KV cache holds no request: each group short of blocks, named by its real kind."""
    short = []
    for g in kv_cfg.groups:
        need = prefill_blocks(g.spec, mnbt)
        what = f"group {g.group_id} ({len(g.layer_indices)} layers {g.spec.type_name}) has {g.num_blocks} blocks"
        if need and g.num_blocks - 1 < need:
            short.append(f"{what}, fewer than one window plus a prefill chunk of max_num_batched_tokens={mnbt} "
                         f"needs ({need + 1})")
        elif not need and g.num_blocks <= 1:
            short.append(f"{what}: no room for one block of {g.spec.block_size} tokens")
    mem = "" if kv_bytes is None else f" (memory left for the KV cache: {max(kv_bytes, 0) / 2**30:.2f} GiB)"
    hint = ("raise --kv-cache-memory / --gpu-memory-utilization or lower --max-num-batched-tokens; "
            "another engine in this process that was not shut down holds its memory until shutdown()")
    return f"the KV cache cannot hold one request{mem}: {'; '.join(short) or kv_cfg.describe()}; {hint}"


def plan_kv_cache(config: EngineConfig, executor: Executor) -> KVCacheConfig:
    """Size the KV cache: the workers' layer specs and memory budget -> groups and block counts.

    Lowers ``max_model_len`` to the capacity when it was not set explicitly.
    Raises ValueError if the cache cannot hold one request of ``max_model_len`` tokens.
    """
    cc, sc, mc = config.cache_config, config.scheduler_config, config.model_config
    specs = executor.get_kv_cache_spec()
    kv_bytes = None if cc.num_gpu_blocks_override is not None else executor.determine_available_memory()
    mnbt = min(sc.max_num_batched_tokens, sc.max_model_len)  # the largest prefill chunk
    kv_cfg = make_kv_cache_config(specs, kv_bytes, cc.num_gpu_blocks_override, sc.max_model_len, mnbt,
                                  sc.max_num_seqs)
    num_blocks = min(g.num_blocks for g in kv_cfg.groups)
    capacity = max_request_tokens(kv_cfg, mnbt)  # None: window groups only, any length fits
    if capacity == 0:
        raise ValueError(kv_capacity_error(kv_cfg, mnbt, kv_bytes))
    if capacity is not None and capacity < sc.max_model_len:
        if mc.max_model_len_explicit or capacity < cc.block_size:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cc.block_size}), "
                f"fewer than max_model_len={sc.max_model_len}; raise --kv-cache-memory / "
                f"--gpu-memory-utilization or lower --max-model-len"
            )
        logger.warning("max_model_len lowered from %d to the KV capacity %d", sc.max_model_len, capacity)
        sc.max_model_len = mc.max_model_len = capacity
    cc.num_blocks = num_blocks
    max_len = sc.max_model_len
    flat = kv_cfg.total_bytes / bytes_per_request(kv_cfg, max_len, hybrid=False)
    pc = config.parallel_config
    layout = "" if pc.world_size == 1 else (
        f" per rank; tensor_parallel_size={pc.tensor_parallel_size} ({pc.distributed_executor_backend} executor), "
        f"each rank holds its share of the KV heads")
    if pc.pipeline_parallel_size > 1:
        layout += (f"; pipeline_parallel_size={pc.pipeline_parallel_size}: each stage holds these blocks for its "
                   f"own layers only (the count is the smallest over stages)")
    # What the format buys: tokens per byte relative to an unquantized cache in the model dtype.
    ref_bpt = sum(len(g.layer_indices) * g.spec.reference_bytes_per_token(mc.dtype) for g in kv_cfg.groups)
    ref_name = mc.dtype
    if any(isinstance(g.spec, MLAAttentionSpec) for g in kv_cfg.groups):  # against the expanded heads
        ref_name = f"multi-head (latent expanded to K and V per head) {mc.dtype}"
    logger.info(
        "KV cache: %d bytes/token over %d layers (%s); %s tokens per request at most (%.2f GiB)%s; "
        "max concurrency at max_model_len=%d: %.2fx (%.2fx without the sliding-window savings); "
        "%s KV: %.2fx the tokens of a %s KV cache",
        kv_cfg.bytes_per_token, kv_cfg.num_layers, kv_cfg.describe(),
        "unbounded" if capacity is None else capacity, kv_cfg.total_bytes / 2**30, layout, max_len,
        max_concurrency(kv_cfg, max_len, mnbt), flat, cc.kv_cache_dtype, ref_bpt / kv_cfg.bytes_per_token, ref_name,
    )
    if cc.kv_cache_dtype in LOSSY_KV_FORMATS:
        logger.warning("--kv-cache-dtype %s: %s", cc.kv_cache_dtype, LOSSY_KV_FORMATS[cc.kv_cache_dtype])
    return kv_cfg


def attach_event_recorders(manager: KVCacheManager) -> list[KVEventRecorder]:
    """A ``KVEventRecorder`` on the block pool of each full-attention KV cache group (the groups a
    prefix is matched in left to right; sliding-window and bounded-KV groups publish nothing)."""
    out = []
    for g in manager.groups:
        if type(g) is SingleTypeKVCacheManager:
            g.pool.kv_events = KVEventRecorder(g.block_size, g.group_id)
            out.append(g.pool.kv_events)
    return out



def _release(executor, publisher) -> None:
    """Stop an engine's executor (workers, tensors) and its KV event publisher."""
    try:
        executor.shutdown()
    finally:
        if publisher is not None:
            publisher.shutdown()

def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device allocation failure: ``torch.OutOfMemoryError`` in this
    process, or a worker's error whose message says so (multi-process executors re-raise a
    worker's failure as ``RuntimeError`` with its text)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("OutOfMemoryError" in msg or "CUDA out of memory" in msg)


def release_cached_device_memory() -> None:
    """Give the caching allocator's free blocks back to the device (after an OOM)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class EngineCore:
    """Owns the executor (and through it the model), the KV cache manager and the scheduler.

    Raises:
        ValueError: if the KV cache cannot hold one request of ``max_model_len`` tokens, or
            the attention backend cannot serve the KV cache format.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        from kvserve.kv_connector import prepare_kv_connector_config

        prepare_kv_connector_config(config)  # ports / ids resolved once, before the workers start
        # KV events: the sockets are opened first, so that a busy port fails before the model loads.
        self.kv_event_publisher = make_event_publisher(config.kv_events_config)
        t0 = time.perf_counter()
        try:
            self.executor = get_executor_class(config.parallel_config)(config)
        except BaseException:
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.shutdown()
            raise
        # An engine dropped without shutdown() (del, garbage collection, exit) still stops its
        # workers, threads and event publisher and releases its tensors. The finalizer holds the
        # executor and the publisher, not the engine, so it never keeps the engine alive.
        self._finalizer = weakref.finalize(self, _release, self.executor, self.kv_event_publisher)
        t1 = time.perf_counter()
        try:
            kv_cfg = plan_kv_cache(config, self.executor)
            self.executor.initialize_kv_cache(kv_cfg)
            self._startup_s = (t1 - t0, time.perf_counter() - t1)
        except BaseException:
            self._finalizer()
            raise
        self.kv_cache_config = kv_cfg
        cc = config.cache_config
        self.kv_cache_manager = KVCacheManager(kv_cfg, cc.enable_prefix_caching)
        self._kv_event_recorders = attach_event_recorders(self.kv_cache_manager) \
            if self.kv_event_publisher is not None else []
        hf = config.model_config.hf_config
        if cc.disable_hybrid_kv_cache_manager and getattr(hf, "sliding_window", None):
            logger.warning(
                "--disable-hybrid-kv-cache-manager with a sliding-window model (window %s): blocks "
                "outside the window are kept, so attention stays exact but saves no memory there",
                hf.sliding_window)
        from kvserve.kv_connector import KVConnectorRole, make_kv_connector
        from kvserve.structured_output.manager import StructuredOutputManager

        self.kv_connector = make_kv_connector(config, KVConnectorRole.SCHEDULER, kv_cfg)
        self.structured_output_manager = StructuredOutputManager(
            config.model_config, self._vocab_size(config))
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, config.speculative_config,
                                   connector=self.kv_connector,
                                   structured_output_manager=self.structured_output_manager)
        self.async_scheduling = config.async_scheduling
        # Async scheduling: the step launched last, whose tokens have not been read yet.
        self._in_flight: Optional[tuple[SchedulerOutput, object]] = None
        # Pipeline parallelism: up to pipeline_parallel_size micro-batches in flight, oldest first
        # (vLLM's batch queue); the scheduler skips requests whose step is in flight.
        self.max_concurrent_batches = config.parallel_config.pipeline_parallel_size
        self._batch_queue: Optional[collections.deque] = None
        if self.max_concurrent_batches > 1:
            self._batch_queue = collections.deque()
            self.scheduler.skip_in_flight = True
        # Dynamic speculation's measured step cost: (when the last step's result was in, its kind).
        self._step_clock: tuple[Optional[float], Optional[int]] = (None, None)
        # MoE models: tokens routed per expert since start (summed over layers), as last read.
        self.moe_expert_tokens: Optional[list[int]] = None

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
        return self.executor.model_runner

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Queue a request. Raises ValueError for a duplicate id or an invalid structured-output
        constraint (compiled here, with the model's vocabulary)."""
        if not self._finalizer.alive:
            raise RuntimeError("this engine was shut down (its memory is released); build a new one")
        if isinstance(request, EngineCoreRequest):
            request = Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                              request.arrival_time, request.priority, request.eos_token_id, request.cache_salt)
        ktp = request.sampling_params.extra_args and request.sampling_params.extra_args.get("kv_transfer_params")
        if ktp is not None and not isinstance(ktp, dict):
            raise ValueError("kv_transfer_params must be an object")
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
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._batch_queue)

    def has_kv_transfers(self) -> bool:
        """Whether KV transfers between engines are under way (blocks lent to a consumer, or
        pulls in progress): the loop must keep stepping (``step`` then only polls the workers)."""
        return self.scheduler.has_kv_transfers()

    def has_urgent_kv_work(self) -> bool:
        """Whether connector work waits for the next step's metadata (e.g. blocks to lend: a
        consumer may be connecting already); the loop must not idle then."""
        conn = self.kv_connector
        return conn is not None and conn.has_unsent_meta()

    def kv_transfer_info(self) -> Optional[dict]:
        """``{"kv_role", "engine_id", "kv_connector", "kv_layout"}`` with a transfer connector, else None."""
        conn = self.kv_connector
        return conn.transfer_info() if conn is not None else None

    def step(self) -> EngineCoreOutputs:
        """Schedule, run and update one step (``_step``); then publish the step's KV events.

        A step that runs out of device memory fails only its own requests (finish_reason
        ``"error"``, their blocks freed) and the engine goes on serving; other errors propagate,
        and so does an OOM with several ranks (the others may be left inside a collective).
        """
        try:
            out = self._step()
        except Exception as exc:  # noqa: BLE001 -- re-raised unless it is an out-of-memory error
            if not is_out_of_memory(exc) or self.config.parallel_config.world_size > 1:
                raise
            out = self._fail_step_requests(exc)
        if self._kv_event_recorders:
            self.publish_kv_events()
        return out

    def _fail_step_requests(self, exc: BaseException) -> EngineCoreOutputs:
        """End the requests of the step that raised ``exc`` (the running ones, and those of a
        step in flight) with ``FINISHED_ERROR``; waiting requests keep their place."""
        ids = [r.request_id for r in self.scheduler.running]
        if self._in_flight is not None:
            ids += [rid for rid in self._in_flight[0].num_scheduled_tokens if rid not in ids]
            self._in_flight = None
        failed = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        logger.error("a step ran out of device memory; failed its %d request(s) %s, the engine goes on: %s",
                     len(failed), [r.request_id for r in failed][:8], str(exc).splitlines()[0][:300])
        release_cached_device_memory()
        return EngineCoreOutputs(outputs=[
            EngineCoreOutput(r.request_id, [], finish_reason=r.finish_reason,
                             num_cached_tokens=r.num_cached_tokens,
                             first_scheduled_time=r.first_scheduled_time) for r in failed])

    def publish_kv_events(self) -> int:
        """Publish the KV events recorded since the last call as one ``KVEventBatch`` (nothing when
        there are none). Returns the number of events."""
        events = [e for r in self._kv_event_recorders for e in r.take()]
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return len(events)

    def kv_events_stats(self) -> Optional[dict]:
        """``{"published", "dropped"}`` KV events so far, or None when KV events are off."""
        return self.kv_event_publisher.stats() if self.kv_event_publisher is not None else None

    def profile(self, is_start: bool = True) -> Optional[list[dict]]:
        """Start (``is_start``) or stop ``torch.profiler`` on every worker, between steps. Stop
        returns each rank's summary (``WorkerProfiler.stop``). RuntimeError without
        ``KVSERVE_TORCH_PROFILER_DIR``."""
        if is_start:
            self.executor.collective_rpc("start_profile")
            return None
        return self.executor.collective_rpc("stop_profile")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block no request holds, in every KV cache group (an
        ``AllBlocksCleared`` event each). Returns False (and changes nothing) while requests hold blocks."""
        pools = [g.pool for g in self.kv_cache_manager.groups]
        if any(p.get_num_free_blocks() != p.num_usable_blocks for p in pools):
            return False
        for p in pools:
            p.reset_prefix_cache()
        if self._kv_event_recorders:
            self.publish_kv_events()
            self.kv_event_publisher.flush(1.0)  # rare: the stats sent next count the clear
        return True

    def _step(self) -> EngineCoreOutputs:
        """Schedule, run and update one step.

        With async scheduling the step scheduled and launched now is N+1, and the result
        returned is step N's: the host schedules and prepares N+1 while the device still
        runs N, so the device does not idle between steps. Requests whose sampling reads
        their own output history (penalties, min_tokens not reached, a grammar bitmask) need
        step N's token on the host first; while one is running, and while speculation is on
        (drafts follow step N's tokens), the engine runs steps one at a time.
        """
        if self._batch_queue is not None:
            return self._step_with_batch_queue()
        if not self.async_scheduling:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                if sched.kv_connector_metadata or self.scheduler.has_kv_transfers():
                    # e.g. a swap-out with nothing else to run, or a poll of KV transfers
                    return self._update(sched, self.executor.execute_model(sched).get())
                self._step_clock = (None, None)  # idle: the next interval is no step's cost
                return EngineCoreOutputs()
            return self._update(sched, self.executor.execute_model(sched).get())
        prev = self._in_flight
        self._in_flight = None
        if prev is not None and self._needs_host_tokens():
            return self._update(prev[0], prev[1].get())
        sched = self.scheduler.schedule()
        polled = None
        if sched.is_empty and (sched.kv_connector_metadata or self.scheduler.has_kv_transfers()):
            polled = self._update(sched, self.executor.execute_model(sched).get())
        elif not sched.is_empty:
            self._in_flight = (sched, self.executor.execute_model(sched))
        if prev is None:
            if self._in_flight is None:
                self._step_clock = (None, None)
            return polled or EngineCoreOutputs()
        res = self._update(prev[0], prev[1].get())
        if polled is not None:
            res.outputs[:0] = polled.outputs
            res.plain_req_ids[:0] = polled.plain_req_ids
            res.plain_token_ids[:0] = polled.plain_token_ids
        return res

    def _step_with_batch_queue(self) -> EngineCoreOutputs:
        """Pipeline parallelism: schedule and launch a micro-batch while fewer than
        ``max_concurrent_batches`` are in flight (each takes at most its share of the running
        requests, so the stages work on different micro-batches at once); return the oldest
        one's outputs when the queue is full or nothing more can be scheduled."""
        q, sch = self._batch_queue, self.scheduler
        if len(q) < self.max_concurrent_batches:
            sch.max_batch_requests = max(1, -(-len(sch.running) // self.max_concurrent_batches))
            sched = sch.schedule()
            if not sched.is_empty:
                q.append((sched, self.executor.execute_model(sched)))
                if len(q) < self.max_concurrent_batches:
                    return EngineCoreOutputs()
        if not q:
            return EngineCoreOutputs()
        sched, fut = q.popleft()
        return self._update(sched, fut.get())

    def _needs_host_tokens(self) -> bool:
        if self.scheduler.wants_drafts():  # speculation on for the next step: drafts need step N
            return True
        if not self.scheduler.num_output_readers:  # no request reads its own output: none to ask
            return False
        for r in self.scheduler.running:
            if r.num_pending_tokens:
                sp = r.sampling_params
                if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty \
                        or len(r.output_token_ids) < sp.min_tokens or r.structured_output is not None:
                    return True
        return False

    def _time_step(self, sched: SchedulerOutput) -> None:
        """Report a decode step's wall time to the dynamic speculation policy: the time since the
        previous step's result (with async scheduling, a step's share of the overlapped loop),
        for steps of the same kind as the previous one (a mode change's step is no steady cost)."""
        policy = self.scheduler.spec_policy
        now = time.perf_counter()
        last, last_kind = self._step_clock
        kind = decode_step_kind(sched)
        if last is not None and kind is not None and kind == last_kind:
            policy.observe_step(len(sched.num_scheduled_tokens), kind, now - last)
        self._step_clock = (now, kind)

    def _update(self, sched: SchedulerOutput, runner_out) -> EngineCoreOutputs:
        if self.scheduler.spec_policy is not None and sched.num_scheduled_tokens:
            self._time_step(sched)
        # Plain decode rows (one token, nothing else new) come back as two flat lists: no
        # EngineCoreOutput each, and the frontend only appends their tokens.
        plain_ids: list[str] = []
        plain_toks: list[int] = []
        updated = self.scheduler.update_from_output(sched, runner_out, (plain_ids, plain_toks))
        if getattr(runner_out, "moe_expert_tokens", None) is not None:
            self.moe_expert_tokens = runner_out.moe_expert_tokens
        outs = EngineCoreOutputs(num_prompt_tokens=sched.num_prompt_tokens, plain_req_ids=plain_ids,
                                 plain_token_ids=plain_toks)
        n_gen = len(plain_toks)
        append = outs.outputs.append
        running = RequestStatus.RUNNING
        # One output per request every step: positional fields (EngineCoreOutput's order), the
        # finish reason and prompt logprobs looked at only where they can be set (hot).
        for req, toks, lps in updated:
            n_gen += len(toks)
            sp = req.sampling_params
            status = req.status
            plps = None
            if sp.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                plps, req.prompt_logprobs_sent = [None, *req.prompt_logprobs], True  # the first token has none
            if status == running:
                finish_reason = kv_params = None
            else:
                finish_reason = req.finish_reason
                kv_params = req.kv_transfer_params if status.finished else None
            append(EngineCoreOutput(
                req.request_id, toks, lps if sp.logprobs is not None else None, finish_reason, req.stop_reason,
                req.num_cached_tokens, req.first_scheduled_time, req.first_token_time, req.finished_time,
                req.num_preemptions, plps, req.num_draft_tokens, req.num_accepted_tokens, kv_params))
        outs.num_generation_tokens = n_gen
        if self.has_urgent_kv_work() and self._in_flight is None:
            # Lend a finished request's blocks now: its consumer may connect before the next step.
            flush = SchedulerOutput(finished_req_ids=set())
            flush.kv_connector_metadata = self.kv_connector.build_connector_meta(flush)
            more = self._update(flush, self.executor.execute_model(flush).get())
            outs.outputs.extend(more.outputs)
            plain_ids.extend(more.plain_req_ids)
            plain_toks.extend(more.plain_token_ids)
        return outs

    def shutdown(self) -> None:
        """Stop the workers and release every tensor of the engine (KV cache, model, CUDA
        graphs, buffers); idempotent. Later ``add_request`` calls raise RuntimeError."""
        self._finalizer()


def decode_step_kind(sched: SchedulerOutput) -> Optional[int]:
    """A step's kind for the measured cost: its ``k`` when every request decodes one token plus
    drafts and some verify drafts, 0 for a pure decode step with speculation off, None else
    (prefill chunks; a step allowed drafts that none had: the first after speculation resumes)."""
    spec = sched.scheduled_spec_decode_tokens
    if not spec:  # no drafts (speculation off): one set operation, no per-request Python
        nst = sched.num_scheduled_tokens
        return 0 if sched.num_speculative_tokens == 0 and (not nst or set(nst.values()) == {1}) else None
    for rid, n in sched.num_scheduled_tokens.items():
        if n != 1 + len(spec.get(rid, ())):
            return None
    if spec:
        return int(sched.num_speculative_tokens or max(len(d) for d in spec.values()))
    return 0 if sched.num_speculative_tokens == 0 else None
