"""Shutdown with an enforced deadline, signals, and the server's exit status.

The first SIGTERM or SIGINT starts a drain: new requests get 503, ``/health`` turns 503, and
requests in flight get up to ``--shutdown-timeout`` seconds to finish. At the deadline, or at
once on a second signal, the requests still running are ended cleanly: streams get an
OpenAI-style error event and ``data: [DONE]``, non-streaming requests a 503 JSON body. After
``FLUSH_S`` for those responses to reach their clients, uvicorn stops and the engine core is
told to stop (SIGKILL if it does not within what is left of the deadline). A timer thread is
the backstop: whatever is stuck, the process exits ``HARD_EXIT_GRACE_S`` after the deadline.

Exit status: ``EXIT_OK`` after a clean drain, ``EXIT_INTERRUPTED`` if the shutdown cut
requests short, ``EXIT_ENGINE_FAILED`` if the engine core died or stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from typing import Optional

import uvicorn

from kvserve.engine.async_client import EngineDeadError

logger = logging.getLogger("kvserve")

EXIT_OK = 0
#: The engine core died or stalled (a supervisor should restart the server).
EXIT_ENGINE_FAILED = 1
#: The shutdown deadline (or a second signal) ended requests that were still running.
EXIT_INTERRUPTED = 3
#: Seconds the responses ended at the deadline get to reach their clients.
FLUSH_S = 0.5
#: The process exits this long after the deadline whatever is stuck (os._exit).
HARD_EXIT_GRACE_S = 1.8
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ServerShutdownError(EngineDeadError):
    """The server shut down before the request finished (-> 503, or an error event in a stream)."""


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` that drains on the first signal and enforces the deadline.

    Args:
        config: uvicorn's config.
        app_state: the app's ``state`` (``draining``: bool, ``inflight``: requests in flight).
        engine: the ``AsyncLLM`` (``fail_requests``, ``proc``).
        shutdown_timeout: seconds from the first signal to the deadline.

    After ``serve()``: ``interrupted`` (requests were ended at the deadline), ``deadline``
    (``time.monotonic()`` of the deadline, or None without a signal).
    """

    def __init__(self, config: uvicorn.Config, app_state, engine, shutdown_timeout: float) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
        super().__init__(config)
        self.app_state, self.engine, self.shutdown_timeout = app_state, engine, shutdown_timeout
        self.interrupted = False
        self.deadline: Optional[float] = None
        self.num_signals = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._skip: Optional[asyncio.Event] = None
        self._backstop: Optional[threading.Timer] = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._skip = asyncio.Event()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises captured signals after serving, which would kill us before the
        # engine is stopped and the exit status is chosen; install ours without that.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.num_signals += 1
        if self._loop is None:  # before serving: nothing to drain
            self.should_exit = True
            return
        if self.num_signals == 1:
            self.deadline = time.monotonic() + self.shutdown_timeout
            logger.info("signal %d: draining (new requests get 503); in-flight requests get %.0f s", sig,
                        self.shutdown_timeout)
            self.app_state.draining = True
            self._arm_backstop(self.deadline)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        else:
            logger.warning("signal %d again: ending in-flight requests now", sig)
            self.deadline = min(self.deadline or time.monotonic(), time.monotonic())
            self._arm_backstop(self.deadline)
            self._loop.call_soon_threadsafe(self._skip.set)

    def _arm_backstop(self, deadline: float) -> None:
        if self._backstop is not None:
            self._backstop.cancel()
        delay = max(deadline - time.monotonic(), 0.0) + HARD_EXIT_GRACE_S
        self._backstop = threading.Timer(delay, self._hard_exit)
        self._backstop.daemon = True
        self._backstop.start()

    def cancel_backstop(self) -> None:
        if self._backstop is not None:
            self._backstop.cancel()

    def _hard_exit(self) -> None:
        logger.error("shutdown: still running %.1f s past the deadline; exiting now", HARD_EXIT_GRACE_S)
        proc = getattr(self.engine, "proc", None)
        if proc is not None and proc.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
        logging.shutdown()
        os._exit(EXIT_INTERRUPTED if self.interrupted or self.app_state.inflight else EXIT_OK)

    async def _drain(self) -> None:
        st = self.app_state
        while st.inflight > 0 and not self._skip.is_set():
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._skip.wait(), min(left, 0.05))
        if st.inflight > 0:
            n = self.engine.fail_requests(ServerShutdownError(
                "the server shut down before this request finished"))
            self.interrupted = True
            logger.warning("shutdown deadline: ended %d engine requests (%d HTTP requests in flight)", n,
                           st.inflight)
            flush_end = time.monotonic() + FLUSH_S
            while st.inflight > 0 and time.monotonic() < flush_end:
                await asyncio.sleep(0.02)
        self.should_exit = True

    def time_left(self, floor: float = 0.2) -> float:
        """Seconds until the hard exit (for stopping the engine), at least ``floor``; 10 without a signal."""
        if self.deadline is None:
            return 10.0
        return max(self.deadline + HARD_EXIT_GRACE_S - 0.3 - time.monotonic(), floor)
