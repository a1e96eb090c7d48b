"""``mp``: worker processes that receive each step as serialized data.

The executor binds one zmq PUSH socket per worker (``ipc://`` on this host) and one PULL
socket for replies. A message is a pickled tuple: ``("call", method, args)`` for set-up
calls (every rank replies ``("result", rank, value)``), ``("step", SchedulerOutput)`` for a
step (rank 0 replies ``("step", rank, ModelRunnerOutput)``; under pipeline parallelism the
first rank of the last stage, ``kvserve.executor.pipeline``), ``("shutdown",)``. A worker
launches step N+1 before it sends step N's result when N+1 is already queued, so async
scheduling overlaps host and device work as it does in-process. A worker that fails
replies ``("error", rank, text)`` and exits; a worker that dies is noticed within a second
and every wait then raises ``RuntimeError`` (the engine never hangs on a dead worker).
Workers exit when the engine-core process dies.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import time
import traceback
from typing import Any, Optional

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import KVCacheConfig, KVCacheSpec
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.executor.abstract import Executor
from kvserve.executor.pipeline import TokenRelay, merge_kv_cache_specs, output_rank, pipeline_kv_bytes

logger = logging.getLogger("kvserve")

#: Worker calls whose RuntimeError goes back to the caller instead of ending the worker.
RECOVERABLE_CALLS = frozenset({"start_profile", "stop_profile"})


class CallError:
    """A recoverable worker call's error, sent back as its result."""

    def __init__(self, message: str) -> None:
        self.message = message


#: Seconds between liveness checks while waiting.
POLL_S = 1.0
#: Seconds a worker gets to load its model and report ready.
STARTUP_TIMEOUT_S = 900.0


class _StepFuture:
    __slots__ = ("executor", "result", "done")

    def __init__(self, executor: "MultiprocExecutor") -> None:
        self.executor = executor
        self.result: Optional[ModelRunnerOutput] = None
        self.done = False

    def get(self) -> ModelRunnerOutput:
        while not self.done:
            self.executor._receive_step()
        return self.result


class MultiprocExecutor(Executor):
    """``world_size`` worker processes (spawned), one per rank."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        import zmq

        from kvserve.engine.ipc_paths import make_ipc_paths

        self.world_size = config.parallel_config.world_size
        self._pp = config.parallel_config.pipeline_parallel_size
        self._out_rank = output_rank(config.parallel_config)
        self._relay = TokenRelay() if self._pp > 1 else None
        self._ctx = zmq.Context()
        base = make_ipc_paths(self.world_size + 1)
        self._addrs = base
        self._in_socks = []
        for addr in base[:-1]:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(addr)
            self._in_socks.append(s)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(base[-1])
        self._pending: collections.deque[_StepFuture] = collections.deque()
        self._closed = False
        self.failed: Optional[str] = None
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs = [WorkerProcess(rank, base[rank], base[-1]) for rank in range(self.world_size)]
        try:
            self._send_all(("init", config, init_method))
            self._gather("ready", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    # ---- messaging ---------------------------------------------------------------------
    def _send_all(self, msg: tuple, block: bool = True, early: Optional[tuple] = None) -> None:
        """Send ``msg`` to every rank (``early``, when given, to the pipeline stages before the
        last instead). A PUSH socket whose worker is gone blocks forever, so
        wait for it in slices and raise RuntimeError when a worker died (or drop the message
        when ``block`` is false)."""
        import zmq

        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        early_data = pickle.dumps(early, protocol=pickle.HIGHEST_PROTOCOL) if early is not None else data
        for r, s in enumerate(self._in_socks):
            payload = early_data if r < self._out_rank else data
            while True:
                try:
                    s.send(payload, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if not block:
                        break
                    if not s.poll(int(POLL_S * 1000), zmq.POLLOUT):
                        self._check_alive()

    def _recv(self, timeout: Optional[float] = None) -> tuple:
        """The next reply; raises RuntimeError when a worker died or failed."""
        if self.failed:
            raise RuntimeError(self.failed)
        waited = 0.0
        while not self._out.poll(int(POLL_S * 1000)):
            self._check_alive()
            waited += POLL_S
            if timeout is not None and waited >= timeout:
                self.failed = f"workers did not answer within {timeout:.0f} s"
                raise RuntimeError(self.failed)
        msg = pickle.loads(self._out.recv())
        if msg[0] == "error":
            # A rank's collective or send/recv fails when a peer was killed: name that rank
            # (a rank that reported its own error exits with 0).
            for _ in range(5):
                if any(p.exitcode not in (None, 0) for p in self.procs):
                    self._check_alive()
                time.sleep(0.1)
            self.failed = f"worker {msg[1]} failed: {msg[2]}"
            raise _worker_error(msg[2], self.failed)
        return msg

    def _check_alive(self) -> None:
        dead = sorted((p for p in self.procs if not p.is_alive()), key=lambda p: p.exitcode == 0)  # killed first
        if dead:
            self.failed = f"worker process {dead[0].name} died (exit code {dead[0].exitcode})"
            raise RuntimeError(self.failed)

    def _gather(self, kind: str, timeout: Optional[float] = None) -> list[Any]:
        """One ``kind`` reply per rank, in rank order."""
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            msg = self._recv(timeout)
            if msg[0] != kind:
                raise RuntimeError(f"unexpected worker message {msg[0]!r} while waiting for {kind!r}")
            got[msg[1]] = msg[2] if len(msg) > 2 else None
        return [got[r] for r in range(self.world_size)]

    def _call(self, method: str, *args: Any) -> list[Any]:
        if self._pending:
            raise RuntimeError("set-up call while steps are in flight")
        self._send_all(("call", method, args))
        res = self._gather("result")
        err = next((r for r in res if isinstance(r, CallError)), None)
        if err is not None:
            raise RuntimeError(err.message)
        return res

    def _receive_step(self) -> None:
        msg = self._recv()
        if msg[0] != "step":
            raise RuntimeError(f"unexpected worker message {msg[0]!r} while waiting for a step")
        fut = self._pending.popleft()
        fut.result, fut.done = msg[2], True
        if self._relay is not None:
            self._relay.on_output(msg[2])

    # ---- Executor ----------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[int, KVCacheSpec]:
        return merge_kv_cache_specs(self._call("get_kv_cache_spec"))  # pipeline stages: their own layers

    def determine_available_memory(self) -> int:
        mem = self._call("determine_available_memory")
        if self._pp == 1:
            return min(mem)
        return pipeline_kv_bytes(self._call("get_kv_cache_spec"), mem)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._call("initialize_kv_cache", kv_cache_config)

    def execute_model(self, sched: SchedulerOutput) -> _StepFuture:
        fut = _StepFuture(self)
        early = ("step", self._relay.for_earlier_stages(sched)) if self._relay is not None else None
        self._send_all(("step", sched), early=early)
        self._pending.append(fut)
        return fut

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send_all(("shutdown",), block=False)
        for p in self.procs:
            p.join(5)
            if p.is_alive():  # workers ignore SIGTERM
                p.kill()
                p.join(5)
        for s in self._in_socks:
            s.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        from kvserve.engine.ipc_paths import cleanup_ipc_paths

        cleanup_ipc_paths(*self._addrs)


def _worker_error(text: str, message: str) -> Exception:
    """Re-raise a worker's start-up ValueError / FileNotFoundError as itself."""
    for cls in (ValueError, FileNotFoundError):
        if text.startswith(cls.__name__ + ":"):
            return cls(text.split(":", 1)[1].strip())
    return RuntimeError(message)


class WorkerProcess:
    """One worker as a plain child process (``python -c ...``): unlike ``multiprocessing``, it
    may be started from the server's daemonic engine-core process. The config arrives as
    the first message on its input socket."""

    def __init__(self, rank: int, in_addr: str, out_addr: str) -> None:
        import subprocess
        import sys

        self.name = f"kvserve-worker-{rank}"
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        code = "import sys; from kvserve.executor.multiproc import run_worker; run_worker(*sys.argv[1:])"
        self._p = subprocess.Popen([sys.executable, "-c", code, str(rank), in_addr, out_addr], env=env)
        self.pid = self._p.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self._p.poll()

    def is_alive(self) -> bool:
        return self._p.poll() is None

    def join(self, timeout: Optional[float] = None) -> None:
        import subprocess

        try:
            self._p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._p.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._p.kill()


def free_port() -> int:
    """A TCP port free on the loopback interface now (for the tensor-parallel rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(rank: str, in_addr: str, out_addr: str) -> None:
    """Entry point of a worker process: receive ``("init", config, init_method)``, build the
    ``Worker``, then serve calls and steps."""
    import zmq

    from kvserve.logger import setup_logging

    setup_logging()
    # The parent decides when workers stop: a process-group SIGTERM/SIGINT must not kill them
    # mid-drain (the API server drains, then the engine core shuts its executor down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(out_addr)
    ppid = os.getppid()
    rank = int(rank)

    def send(msg: tuple) -> None:
        out.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def fail(exc: BaseException) -> None:
        logger.error("worker %d failed:\n%s", rank, traceback.format_exc())
        send(("error", rank, f"{type(exc).__name__}: {exc}"))

    try:
        from kvserve.worker.worker import Worker

        while not inp.poll(int(POLL_S * 1000)):
            if os.getppid() != ppid:
                return _close(inp, out, ctx)
        kind, config, init_method = pickle.loads(inp.recv())
        worker = Worker(config, rank, init_method)
    except BaseException as exc:
        fail(exc)
        return _close(inp, out, ctx)
    send(("ready", rank))
    from kvserve.executor.pipeline import output_rank

    out_rank = output_rank(config.parallel_config)
    pending = None  # a launched step whose result is not sent yet

    def flush() -> None:
        result = pending.get()
        if rank == out_rank:  # the other ranks finish their steps but send nothing back
            send(("step", rank, result))

    try:
        while True:
            if pending is not None and not inp.poll(0):
                flush()
                pending = None
                continue
            if not inp.poll(int(POLL_S * 1000)):
                if os.getppid() != ppid:
                    return  # the engine core died
                continue
            msg = pickle.loads(inp.recv())
            if msg[0] == "step":
                handle = worker.execute_model(msg[1])
                if pending is not None:
                    flush()
                pending = handle
            elif msg[0] == "call":
                if pending is not None:
                    flush()
                    pending = None
                try:
                    res = getattr(worker, msg[1])(*msg[2])
                except RuntimeError as exc:
                    if msg[1] not in RECOVERABLE_CALLS:
                        raise
                    res = CallError(str(exc))  # the worker stays up: the caller gets the error
                send(("result", rank, res))
            elif msg[0] == "shutdown":
                worker.shutdown()
                return
    except BaseException as exc:
        fail(exc)
    finally:
        _close(inp, out, ctx)


def _close(inp, out, ctx) -> None:
    inp.close(linger=0)
    out.close()
    ctx.term()
