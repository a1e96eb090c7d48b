"""AsyncLLM: the frontend side of the engine for the API server.

Owns the tokenizer and the ``OutputProcessor`` (detokenization, stop strings, ``n``
fan-in) and talks to an ``EngineCore`` in a child process (``core_proc``) over zmq:

* ``generate(...)`` tokenizes and validates, fans ``n`` out into child requests
  ``"{id}#{k}"`` (seed + k), sends them, and yields ``RequestOutput``s as tokens arrive.
* one asyncio task reads ``StepOutputs`` and wakes the per-request waiters.
* if the child process dies, every waiter and every new call gets ``EngineDeadError`` at once.
* stall watchdog: the core sends ``StepOutputs`` after every step and a ``Heartbeat`` every
  0.5 s when idle; if nothing arrives for ``engine_stall_timeout`` seconds, the core is
  declared stalled (``EngineStalledError``, an ``EngineDeadError``) exactly as if it had died.
* per-request deadline: with ``max_request_duration`` a request still running that many
  seconds after its arrival is aborted (finish_reason "abort", the output so far kept).

Needs ``pyzmq`` and ``msgspec`` (server-only dependencies).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.input_processor import (
    PromptType,
    log_stats_line,
    make_child_requests,
    resolve_eos_token_id,
    tokenize_prompt,
    validate_request,
)
from kvserve.engine.output_processor import OutputProcessor, ParentState
from kvserve.engine.stat_logger import StatLogger, startup_line  # noqa: F401 - re-exported
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed) or the engine was shut down."""


class RequestFailedError(RuntimeError):
    """One request's engine step failed (e.g. out of device memory); the engine goes on."""


class EngineStalledError(EngineDeadError):
    """The engine core sent nothing (no step output, no heartbeat) for ``engine_stall_timeout`` s."""


#: Seconds between two checks of the stall watchdog.
STALL_CHECK_INTERVAL_S = 0.25


@dataclass
class _ChildTimes:
    last_token: Optional[float] = None
    first_token: Optional[float] = None
    recorded: bool = False


@dataclass
class _ReqState:
    parent: ParentState
    delta: bool
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: Optional[BaseException] = None
    sent_tokens: list[int] = field(default_factory=list)
    sent_logprobs: list[int] = field(default_factory=list)
    finish_sent: list[bool] = field(default_factory=list)
    times: list[_ChildTimes] = field(default_factory=list)


class AsyncLLM:
    """Async engine client. Build with ``await AsyncLLM.from_engine_args(args)``.

    Attributes (after start): ``tokenizer`` (transformers tokenizer or None),
    ``max_model_len`` (tokens, as the core sized it), ``vocab_size``, ``eos_token_id``,
    ``model_path``, ``proc`` (the child ``multiprocessing.Process``), ``errored``
    (the exception that killed the engine, or None), ``last_stats`` (latest scheduler stats).
    """

    def __init__(self, engine_args: EngineArgs, stat_logger: Optional[StatLogger] = None, *,
                 engine_stall_timeout: Optional[float] = None,
                 max_request_duration: Optional[float] = None, core_env: Optional[dict] = None) -> None:
        for name, v in (("engine_stall_timeout", engine_stall_timeout),
                        ("max_request_duration", max_request_duration)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 seconds (or None: off), got {v}")
        self.engine_args = engine_args
        self.core_env = dict(core_env or {})  # environment of the core process (a data-parallel core's GPUs)
        self.engine_stall_timeout = engine_stall_timeout
        self.max_request_duration = max_request_duration
        #: ``time.monotonic()`` of the last message from the core (any kind).
        self.last_heard = time.monotonic()
        self.config = None  # the resolved EngineConfig, once started
        self.stat_logger = stat_logger or StatLogger()
        self.tokenizer = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_id: Optional[int] = None
        self.model_path: Optional[str] = None
        #: With a KV transfer connector, once started: ``{"kv_role", "engine_id", "kv_connector",
        #: "kv_transport", "kv_layout"}`` (``GET /v1/kv_transfer``); None otherwise.
        self.kv_transfer_info: Optional[dict] = None
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self.errored: Optional[BaseException] = None
        self.last_stats = None
        self.output_processor: Optional[OutputProcessor] = None
        self._states: dict[str, _ReqState] = {}
        self._closing = False
        self._out_task: Optional[asyncio.Task] = None
        self._stall_task: Optional[asyncio.Task] = None
        self._refuse: Optional[BaseException] = None  # set by fail_requests
        self._addrs: tuple[str, str] = ("", "")
        self._log_interval = engine_args.log_stats_interval
        self._log_last = time.monotonic()
        self._log_tokens = [0, 0]

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def from_engine_args(cls, engine_args: EngineArgs, stat_logger: Optional[StatLogger] = None,
                               startup_timeout: float = 900.0, **kwargs) -> "AsyncLLM":
        """Start the engine-core process and load the tokenizer; returns when the core is ready.

        ``kwargs``: ``engine_stall_timeout`` / ``max_request_duration`` (seconds, None: off).

        Raises:
            ValueError / FileNotFoundError: bad flags or model (from the core or the frontend);
                ``data_parallel_size`` > 1 (that is ``DPAsyncLLM``).
            EngineDeadError: the core process died during start-up or did not get ready in time.
        """
        if getattr(engine_args, "data_parallel_size", 1) > 1:
            raise ValueError("AsyncLLM runs one engine core; for data_parallel_size > 1 use "
                             "kvserve.engine.dp_client.DPAsyncLLM (kvserve serve --data-parallel-size)")
        self = cls(engine_args, stat_logger, **kwargs)
        await self._start(startup_timeout)
        return self

    async def _start(self, startup_timeout: float) -> None:
        import zmq
        import zmq.asyncio

        from kvserve.engine import ipc
        from kvserve.engine.core_proc import run_engine_core
        from kvserve.model_loader import get_tokenizer

        args = self.engine_args
        # Resolved once, here; the engine core receives the result.
        config = await asyncio.to_thread(args.create_engine_config)
        self.config = config
        self.model_path, load_format = config.model_config.model, config.model_config.load_format
        in_addr, out_addr = self._addrs = ipc.make_ipc_paths()
        self._sync_ctx = zmq.Context()
        self._in_sock = self._sync_ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.SNDHWM, 0)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.bind(in_addr)
        self._async_ctx = zmq.asyncio.Context()
        self._out_sock = self._async_ctx.socket(zmq.PULL)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        self._out_sock.bind(out_addr)
        self._encoder = ipc.input_encoder()
        self._decoder = ipc.output_decoder()
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=run_engine_core, args=(config, in_addr, out_addr),
                               name="kvserve-engine-core", daemon=True)
        from kvserve.engine.core_env import environ_set

        with environ_set(self.core_env):  # spawn copies os.environ when it starts the child
            self.proc.start()
        tok_task = None
        tok_s = [0.0]
        t_start = time.perf_counter()

        def load_tokenizer():
            t0 = time.perf_counter()
            try:
                return get_tokenizer(self.model_path, load_format, args.tokenizer)
            finally:
                tok_s[0] = time.perf_counter() - t0

        if not args.skip_tokenizer_init:
            tok_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer))
        try:
            ready = await self._wait_ready(startup_timeout)
            t_core = time.perf_counter() - t_start
            if tok_task is not None:
                self.tokenizer = await tok_task
        except BaseException:
            await self.shutdown()
            raise
        logger.info("%s", startup_line(tok_s[0] if tok_task is not None else None, t_core, config))
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.num_blocks, self.block_size = ready.num_blocks, ready.block_size
        self.kv_transfer_info = ready.kv_transfer  # None without a KV transfer connector
        self.eos_token_id = resolve_eos_token_id(self.tokenizer, config.model_config.hf_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.proc.sentinel, self._on_proc_exit)
        self.last_heard = time.monotonic()
        self._out_task = asyncio.create_task(self._output_loop(), name="kvserve-output-loop")
        if self.engine_stall_timeout is not None:
            self._stall_task = asyncio.create_task(self._stall_watchdog(), name="kvserve-stall-watchdog")

    async def _wait_ready(self, timeout: float):
        from kvserve.engine import ipc

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._out_sock.poll(500):
                msg = self._decoder.decode(await self._out_sock.recv())
                if isinstance(msg, ipc.Ready):
                    return msg
                if isinstance(msg, ipc.StartupFailed):
                    exc_type = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(
                        msg.error_type, EngineDeadError)
                    raise exc_type(msg.message)
            elif not self.proc.is_alive():
                raise EngineDeadError(f"the engine core process exited during start-up "
                                      f"(exit code {self.proc.exitcode})")
        raise EngineDeadError(f"the engine core did not get ready within {timeout:.0f} s")

    def _on_proc_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if not self._closing:
            self.proc.join(0.1)
            self._fail(EngineDeadError(f"the engine core process died (exit code {self.proc.exitcode})"))

    async def _stall_watchdog(self) -> None:
        """Declare the core stalled after ``engine_stall_timeout`` s without a message."""
        timeout = self.engine_stall_timeout
        last_tick = time.monotonic()
        while self.errored is None and not self._closing:
            await asyncio.sleep(STALL_CHECK_INTERVAL_S)
            now = time.monotonic()
            late = now - last_tick > STALL_CHECK_INTERVAL_S + 1.0
            last_tick = now
            if late:  # our own loop was blocked: let the output loop read what is queued first
                continue
            silent = now - self.last_heard
            if silent > timeout:
                self._fail(EngineStalledError(
                    f"the engine core made no progress for {silent:.1f} s (--engine-stall-timeout "
                    f"{timeout:g}); {len(self._states)} requests were in flight"))
                return

    def fail_requests(self, exc: BaseException) -> int:
        """End every in-flight ``generate`` with ``exc`` (the engine keeps running); returns how many.

        Used at the shutdown deadline; their requests are aborted in the engine core, and
        from now on ``check_alive`` (so every new ``generate``) raises ``exc`` too.
        """
        self._refuse = exc
        n = 0
        for st in self._states.values():
            if st.error is None:
                st.error = exc
                st.event.set()
                n += 1
        return n

    def _fail(self, exc: BaseException) -> None:
        if self.errored is None:
            if not self._closing:
                logger.error("engine failed: %s", exc)
            self.errored = exc
        for st in self._states.values():
            st.error = self.errored
            st.event.set()

    @property
    def is_running(self) -> bool:
        """True while the engine core is alive and not shutting down."""
        return (self.errored is None and not self._closing and self.proc is not None
                and self.proc.is_alive())

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (Shutdown message, then SIGTERM, then SIGKILL) and close sockets.

        In-flight requests get ``EngineDeadError``. Safe to call twice. The core ignores
        SIGTERM (it must survive a process-group SIGTERM), so past ``timeout`` it gets SIGKILL;
        a stalled core gets SIGKILL at once.
        """
        if self._closing:
            return
        self._closing = True
        from kvserve.engine import ipc

        if self.proc is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.proc.sentinel)
            except (ValueError, OSError, RuntimeError):
                pass
            if self.proc.is_alive() and not isinstance(self.errored, EngineStalledError):
                self._send(ipc.Shutdown(), raise_dead=False)
                await asyncio.to_thread(self.proc.join, timeout)
            if self.proc.is_alive():
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 5)
        self._fail(EngineDeadError("the engine was shut down"))
        for task in (self._out_task, self._stall_task):
            if task is not None:
                task.cancel()
        for name in ("_in_sock", "_out_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        for name in ("_sync_ctx", "_async_ctx"):
            ctx = getattr(self, name, None)
            if ctx is not None:
                ctx.term()
        from kvserve.engine.ipc import cleanup_ipc_paths

        cleanup_ipc_paths(*self._addrs)

    # ------------------------------------------------------------------ IO
    def _send(self, msg, raise_dead: bool = True) -> None:
        import zmq

        try:
            self._in_sock.send(self._encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # no peer: the core is gone
            if raise_dead:
                err = EngineDeadError(f"cannot reach the engine core ({exc})")
                self._fail(err)
                raise err from exc

    async def _output_loop(self) -> None:
        try:
            while True:
                frame = await self._out_sock.recv(copy=False)
                self.last_heard = time.monotonic()
                msg = self._decoder.decode(frame.buffer)
                try:
                    self._process(msg)
                except Exception:  # never let one bad update kill the loop silently
                    logger.exception("error while processing engine outputs")
                    raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(EngineDeadError(f"the engine output loop failed: {exc!r}"))

    def _process(self, msg) -> None:
        from kvserve.engine.ipc import AbortRequests, StepOutputs

        if not isinstance(msg, StepOutputs):  # Heartbeat: only ``last_heard`` matters
            return
        now = time.time()
        op = self.output_processor
        updated = []
        applied = op.apply_outputs(msg.outputs)
        if msg.plain_req_ids:  # one new token each, nothing else new
            applied += [(req, 1) for req in op.apply_plain(msg.plain_req_ids, msg.plain_token_ids)]
        for req, num_new in applied:
            updated.append(req)
            if num_new:
                parent, seq = op.child_to_parent[req.request_id]
                times = self._states[parent.request_id].times[seq.index]
                if times.last_token is None:
                    self.stat_logger.on_first_token(now - req.arrival_time)
                    self.stat_logger.on_prefill_done(req.num_prompt_tokens, max(req.num_cached_tokens, 0))
                    times.first_token = now
                else:
                    self.stat_logger.on_inter_token((now - times.last_token) / num_new)
                times.last_token = now
        parents, stopped = op.process(updated, detokenize_all=True)
        if stopped:
            self._send(AbortRequests(stopped), raise_dead=False)
        for p in parents:
            st = self._states.get(p.request_id)
            if st is None:
                continue
            self._record_finished(st, now)
            if st.error is None and any(s.finish_reason == "error" for s in p.seqs):
                st.error = RequestFailedError(
                    f"request {p.request_id}: the engine step that ran it failed (out of device memory; "
                    "see the server log); other requests were not affected, retry it")
            st.event.set()
        self.last_stats = msg.stats
        self.stat_logger.on_step(msg.stats, msg.num_prompt_tokens, msg.num_generation_tokens)
        self._maybe_log(msg)

    def _record_finished(self, st: _ReqState, now: float) -> None:
        for seq, times in zip(st.parent.seqs, st.times):
            if seq.finish_reason is None or times.recorded:
                continue
            times.recorded = True
            req = seq.request
            queue = req.first_scheduled_time - req.arrival_time if req.first_scheduled_time else None
            kw = {"ttft_s": times.first_token - req.arrival_time} if times.first_token is not None else {}
            self.stat_logger.on_finished(seq.finish_reason, now - req.arrival_time, queue,
                                         req.num_prompt_tokens, req.num_output_tokens, **kw)

    def _maybe_log(self, msg) -> None:
        self._log_tokens[0] += msg.num_prompt_tokens
        self._log_tokens[1] += msg.num_generation_tokens
        now = time.monotonic()
        dt = now - self._log_last
        if self.engine_args.disable_log_stats or dt < self._log_interval:
            return
        s = msg.stats
        log_stats_line(self._log_tokens[0] / dt, self._log_tokens[1] / dt, s.num_running, s.num_waiting,
                       s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions,
                       s.prefix_cache_recompute_hits, s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts,
                       s.kv_tier, s.num_evicted_blocks)
        self._log_last, self._log_tokens = now, [0, 0]

    # ------------------------------------------------------------------ requests
    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if the engine cannot take requests."""
        if self.errored is not None:
            raise EngineDeadError(str(self.errored))
        if self._closing:
            raise EngineDeadError("the engine is shutting down")
        if self._refuse is not None:
            raise type(self._refuse)(str(self._refuse))

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """``(text or None, token ids)``; see ``input_processor.tokenize_prompt``."""
        return tokenize_prompt(self.tokenizer, prompt)

    def validate(self, ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError for a bad prompt or parameters; see ``input_processor.validate_request``."""
        validate_request(ids, params, priority, self.vocab_size, self.max_model_len, self.tokenizer is not None,
                         self.config.cache_config if self.config is not None else None)

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
        """Generate ``sampling_params.n`` completions of one prompt, yielding as tokens arrive.

        Args:
            prompt: text (tokenized here, with BOS) or token ids.
            request_id: unique id (default: a random one); children are ``"{id}#{k}"`` when n > 1.
            priority: lower is served first under ``--scheduling-policy priority``.
            delta: if True each yielded output holds only what is new since the previous one
                (text, token_ids, logprobs per completion; completions with nothing new are left
                out; ``finish_reason`` is set once); else each holds everything so far.
            prompt_text: the text to report as ``RequestOutput.prompt`` for token-id prompts.
            cache_salt: requests share prefix-cache blocks only with requests of the same salt.

        The last output has ``finished=True``. Leaving the iteration early (break, cancel,
        client disconnect) aborts the request in the engine and frees its blocks. Past
        ``max_request_duration`` seconds the request is aborted: its completions end with
        finish_reason "abort" and keep what they generated.

        Raises:
            ValueError: invalid prompt or parameters (nothing is queued then).
            EngineDeadError: the engine core died or is shutting down (raised at once).
        """
        self.check_alive()
        params = sampling_params or SamplingParams()
        text, ids = self.tokenize(prompt)
        self.validate(ids, params, priority)
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} already exists")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        st = self._add(request_id, text if text is not None else prompt_text, ids, params, priority, delta,
                       cache_salt)
        finished = False
        deadline = None if self.max_request_duration is None else time.monotonic() + self.max_request_duration
        try:
            while True:
                if deadline is None:
                    await st.event.wait()
                else:
                    try:
                        await asyncio.wait_for(st.event.wait(), max(deadline - time.monotonic(), 0.0))
                    except asyncio.TimeoutError:
                        logger.warning("request %s exceeded --max-request-duration %g s; aborted",
                                       request_id, self.max_request_duration)
                        deadline = None
                        self._abort_children(st.parent)
                        st.event.set()
                        continue
                st.event.clear()
                if st.error is not None:
                    raise st.error
                finished = st.parent.finished
                out = self._make_output(st)
                if out is not None:
                    yield out
                if finished:
                    return
        finally:
            if not finished and self.errored is None and not self._closing:
                self._abort_children(st.parent)
            self._states.pop(request_id, None)
            self.output_processor.remove(st.parent)

    def _add(self, request_id: str, text: Optional[str], ids: list[int], params: SamplingParams,
             priority: int, delta: bool, cache_salt: Optional[str] = None) -> _ReqState:
        from kvserve.engine.ipc import AddRequest, params_to_dict

        arrival = time.time()
        children = make_child_requests(request_id, ids, params, arrival, priority, self.eos_token_id,
                                       cache_salt)
        parent = ParentState(request_id, text, ids)
        self.output_processor.add(parent, children)
        n = params.n
        st = _ReqState(parent, delta, sent_tokens=[0] * n, sent_logprobs=[0] * n, finish_sent=[False] * n,
                       times=[_ChildTimes() for _ in range(n)])
        self._states[request_id] = st
        try:
            for c in children:
                self._send(AddRequest(c.request_id, c.prompt_token_ids, params_to_dict(c.sampling_params),
                                      arrival, priority, self.eos_token_id, cache_salt))
        except BaseException:
            self._states.pop(request_id, None)
            self.output_processor.remove(parent)
            raise
        return st

    def _make_output(self, st: _ReqState) -> Optional[RequestOutput]:
        op = self.output_processor
        if not st.delta:
            return op.make_output(st.parent)
        full = op.make_output(st.parent, since=list(zip(st.sent_tokens, st.sent_logprobs)))  # only what is new
        outs = []
        for seq, co in zip(st.parent.seqs, full.outputs):
            i = seq.index
            text = op.take_delta(st.parent, i)
            toks = co.token_ids
            st.sent_tokens[i] += len(toks)
            lps = co.logprobs
            if lps is not None:
                st.sent_logprobs[i] += len(lps)
            fin = None
            if co.finish_reason is not None and not st.finish_sent[i]:
                fin = co.finish_reason
                st.finish_sent[i] = True
            if not text and not toks and fin is None:
                continue
            outs.append(CompletionOutput(i, text, toks, fin, co.stop_reason if fin else None, lps,
                                         co.cumulative_logprob))
        if not outs and not full.finished:
            return None
        full.outputs = outs
        return full

    def _abort_children(self, parent: ParentState) -> None:
        from kvserve.engine.ipc import AbortRequests

        ids = [s.request.request_id for s in parent.seqs if s.finish_reason is None]
        for cid in ids:
            self.output_processor.abort(cid)
        if ids:
            self._send(AbortRequests(ids), raise_dead=False)
        st = self._states.get(parent.request_id)
        if st is not None:
            self._record_finished(st, time.time())

    def reset_prefix_cache(self) -> None:
        """Ask the engine core to forget the cached blocks no request holds (done between two steps;
        refused, with a warning in its log, while requests hold blocks). Raises EngineDeadError."""
        from kvserve.engine.ipc import ResetPrefixCache

        self._send(ResetPrefixCache())

    def profile(self, is_start: bool) -> None:
        """Start or stop ``torch.profiler`` on the engine core's workers (between two steps; errors go
        to the core's log). Raises EngineDeadError."""
        from kvserve.engine.ipc import Profile

        self._send(Profile(is_start))

    async def abort(self, request_id: str) -> None:
        """Abort a request (all its completions); its ``generate`` ends with finish_reason "abort".

        Unknown or finished ids are ignored.
        """
        st = self._states.get(request_id)
        if st is None:
            return
        self._abort_children(st.parent)
        st.event.set()

    def num_unfinished(self) -> int:
        """Requests (parents) this client is still waiting on."""
        return len(self._states)
