"""The engine-core process: ``EngineCore`` behind two zmq sockets.

Started by ``AsyncLLM`` with multiprocessing *spawn*; ``run_engine_core`` is the target.
The loop:

1. If no request is unfinished, block on the input socket (waking every
   ``HEARTBEAT_INTERVAL_S`` to send a ``Heartbeat`` and to check that the parent process
   still lives); else poll it without blocking.
2. Drain every queued message: ``AddRequest`` -> ``EngineCore.add_request``,
   ``AbortRequests`` -> ``EngineCore.abort_requests`` (frees blocks now), ``Shutdown``.
3. If there is work, run one ``EngineCore.step()``.
4. Send one ``StepOutputs`` (new tokens per request, finish reasons, timings, scheduler
   stats) whenever a step ran or messages were handled, so gauges stay fresh after aborts.

Signals: the core ignores SIGTERM and SIGINT. Only its parent (the API server) decides when
it stops, with a ``Shutdown`` message (or SIGKILL past its deadline), so a SIGTERM to the
whole process group (systemd's ``KillMode=control-group``, ``kill -TERM -PGID``, Ctrl-C)
drains exactly like a SIGTERM to the server's PID. If the parent dies, the kernel sends the
core SIGKILL (``PR_SET_PDEATHSIG``), even while it loads the model; where that is not
available the loop notices within ``HEARTBEAT_INTERVAL_S`` (after the current step) and exits.
The process ends with ``os._exit`` after its clean-up, so no atexit hook or stray thread
can keep it alive.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

logger = logging.getLogger("kvserve")

#: Seconds between heartbeats of an idle core; also how long the idle loop blocks before it
#: checks that its parent still lives.
HEARTBEAT_INTERVAL_S = 0.5
IDLE_POLL_S = HEARTBEAT_INTERVAL_S


class EngineCoreProc:
    """Runs ``EngineCore`` against an input PULL and an output PUSH socket.

    Args:
        core: an ``EngineCore`` (anything with add_request / abort_requests / step /
            has_unfinished_requests / has_kv_transfers / has_urgent_kv_work /
            scheduler.get_stats).
        input_addr / output_addr: zmq addresses the frontend has bound.
    """

    def __init__(self, core: Any, input_addr: str, output_addr: str, ctx=None) -> None:
        import zmq

        from kvserve.engine import ipc

        self.core = core
        self.ctx = ctx or zmq.Context()
        self.in_sock = self.ctx.socket(zmq.PULL)
        self.in_sock.connect(input_addr)
        self.out_sock = self.ctx.socket(zmq.PUSH)
        self.out_sock.setsockopt(zmq.LINGER, 2000)
        self.out_sock.setsockopt(zmq.SNDHWM, 0)  # never block on a slow frontend
        self.out_sock.connect(output_addr)
        self.decoder = ipc.input_decoder()
        self.encoder = ipc.input_encoder()
        #: EngineCoreOutputs (finish_reason "abort") of AddRequests the core refused, sent next.
        self.rejected: list = []
        self.running = True
        self._ppid = os.getppid()
        self.num_steps = 0
        self._last_sent = time.monotonic()

    def send(self, msg) -> None:
        self.out_sock.send(self.encoder.encode(msg), copy=False)
        self._last_sent = time.monotonic()

    def _handle(self, msg) -> None:
        from kvserve.engine import ipc
        from kvserve.engine.core_types import EngineCoreOutput, EngineCoreRequest

        if isinstance(msg, ipc.AddRequest):
            try:
                params = ipc.params_from_dict(msg.sampling_params)
                self.core.add_request(EngineCoreRequest(
                    msg.request_id, msg.prompt_token_ids, params, msg.arrival_time, msg.priority,
                    msg.eos_token_id, msg.cache_salt))
            except Exception:  # one bad request must not take the engine down: abort it
                logger.exception("engine core: rejected request %s", msg.request_id)
                self.rejected.append(EngineCoreOutput(msg.request_id, [], finish_reason="abort"))
        elif isinstance(msg, ipc.AbortRequests):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, ipc.Shutdown):
            self.running = False
        elif isinstance(msg, ipc.ResetPrefixCache):
            if not self.core.reset_prefix_cache():
                logger.warning("reset_prefix_cache: requests hold KV blocks; nothing was reset")
        elif isinstance(msg, ipc.Profile):
            try:  # a profiler error (no KVSERVE_TORCH_PROFILER_DIR, steps in flight) is logged, not fatal
                res = self.core.profile(msg.is_start)
                if res is not None:
                    logger.info("profile written to %s: %s", os.environ.get("KVSERVE_TORCH_PROFILER_DIR"),
                                ", ".join(f"rank {r['rank']} {r['device_ms']} device ms" for r in res))
            except RuntimeError as exc:
                logger.error("%s_profile: %s", "start" if msg.is_start else "stop", exc)

    def _drain(self, block: bool) -> int:
        """Handle every queued input message; returns how many. Blocks up to IDLE_POLL_S if asked."""
        import zmq

        n = 0
        if block and not self.in_sock.poll(int(IDLE_POLL_S * 1000)):
            return 0
        while True:
            try:
                frame = self.in_sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
            self._handle(self.decoder.decode(frame.buffer))
            n += 1

    def _kv_events_stats(self):
        """The KV event publisher's counters (None when off, or for a core without one)."""
        f = getattr(self.core, "kv_events_stats", None)
        return f() if f is not None else None

    def _stats(self):
        from kvserve.engine.ipc import SchedulerStatsMsg

        s = self.core.scheduler.get_stats()
        return SchedulerStatsMsg(s.num_running, s.num_waiting, float(s.kv_cache_usage), s.num_preemptions,
                                 s.prefix_cache_queries, s.prefix_cache_hits, s.prefix_cache_recompute_hits,
                                 s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                                 list(s.num_accepted_tokens_per_pos),
                                 s.num_recomputed_tokens, s.kv_connector_stats,
                                 s.num_evicted_blocks, s.num_evicted_tokens, kv_events=self._kv_events_stats(),
                                 moe_expert_tokens=getattr(self.core, "moe_expert_tokens", None))

    def run_once(self, block: bool = True) -> bool:
        """One loop iteration; returns False when the loop should stop."""
        from kvserve.engine.ipc import Heartbeat, StepOutputs

        idle = not self.core.has_unfinished_requests() and not self.core.has_urgent_kv_work()
        handled = self._drain(block=block and idle)
        if not self.running:
            return False
        if os.getppid() != self._ppid:
            logger.error("engine core: the API server process died; exiting")
            return False
        outputs, n_prompt, n_gen = self.rejected, 0, 0
        plain_ids: list[str] = []
        plain_toks: list[int] = []
        self.rejected = []
        stepped = False
        # With KV transfers between engines under way, step (a poll of the workers) every turn.
        if self.core.has_unfinished_requests() or self.core.has_kv_transfers():
            res = self.core.step()
            stepped = True
            self.num_steps += 1
            n_prompt, n_gen = res.num_prompt_tokens, res.num_generation_tokens
            outputs.extend(res.outputs)
            plain_ids, plain_toks = res.plain_req_ids, res.plain_token_ids
        if stepped or handled:
            self.send(StepOutputs(outputs, self._stats(), n_prompt, n_gen, time.time(), plain_ids, plain_toks))
        elif time.monotonic() - self._last_sent >= HEARTBEAT_INTERVAL_S:
            self.send(Heartbeat(time.time(), self.num_steps))
        return True

    def run(self) -> None:
        while self.run_once():
            pass

    def close(self) -> None:
        self.in_sock.close(linger=0)
        self.out_sock.close()
        self.ctx.term()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``).

    Covers what the loop's parent check cannot: a parent that dies while the model loads or
    a step hangs. (The signal follows the parent *thread* that started us: the API server
    starts the core from its event-loop thread, which lives as long as the server.)
    Returns False where unsupported (not Linux); the loop's ``getppid`` check remains.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def run_engine_core(config, input_addr: str, output_addr: str) -> None:
    """Entry point of the spawned engine-core process.

    Builds ``EngineCore`` from the frontend's resolved ``EngineConfig`` (resolved once,
    there), sends ``Ready`` (or ``StartupFailed`` and exits with status 1), then loops until
    ``Shutdown`` or the parent's death; SIGTERM and SIGINT are ignored (see the module
    docstring). Ends the process with ``os._exit`` (0, or 1 after an error in the loop).
    """
    import zmq

    from kvserve.engine import ipc
    from kvserve.logger import setup_logging

    setup_logging()
    # A group-wide SIGTERM / Ctrl-C also reaches us: the API server drains, then tells us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    ctx = zmq.Context()
    enc = ipc.input_encoder()
    try:
        from kvserve.engine.engine_core import EngineCore

        core = EngineCore(config)
    except Exception as exc:  # report why, then exit
        logger.exception("engine core failed to start")
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 5000)
        s.connect(output_addr)
        s.send(enc.encode(ipc.StartupFailed(type(exc).__name__, str(exc))))
        s.close()
        ctx.term()
        raise SystemExit(1)
    proc = EngineCoreProc(core, input_addr, output_addr, ctx)
    cfg = core.config
    proc.send(ipc.Ready(cfg.scheduler_config.max_model_len, cfg.model_config.hf_config.vocab_size,
                        cfg.cache_config.num_blocks, cfg.cache_config.block_size, os.getpid(),
                        core.kv_transfer_info()))
    logger.info("engine core ready (pid %d; start-up: %s)", os.getpid(), core.startup_breakdown())
    status = 0
    try:
        proc.run()
    except BaseException:  # noqa: BLE001 - logged; the frontend sees the exit code
        logger.exception("engine core loop failed")
        status = 1
    finally:
        try:
            core.shutdown()
            proc.close()
        finally:
            logging.shutdown()
            os._exit(status)
