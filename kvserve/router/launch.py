"""``kvserve launch``: a small deployment on one machine, workers + router, from one command.

``kvserve launch --prefill N --decode M [MODEL] [--host H] [--port P] [engine flags]`` starts N
producer and M consumer ``kvserve serve`` processes on free loopback ports (``--kv-transfer-config``
with ``P2PKVConnector``, ``kv_role`` ``kv_producer`` / ``kv_consumer``, ``kv_port`` 0), waits for
their ``/health``, checks ``GET /v1/kv_transfer`` on each (roles, equal ``kv_layout`` on both sides:
a clear error otherwise) and then serves the router on ``--port``. ``--replicas K`` (alone, or
with ``--prefill 0 --decode 0``) starts K plain replicas behind the router (colocated mode). Unknown flags go to
every worker (engine flags). ``--kv-transport tcp|nixl`` picks the P/D workers' KV transport.

GPUs: on a host with several GPUs each worker gets its own (``--worker-gpus``, default ``auto``:
the GPUs ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi -L`` lists; ``tensor_parallel_size``
consecutive GPUs per worker, round robin when there are more workers than GPU sets). A
worker's own GPUs come first in its ``CUDA_VISIBLE_DEVICES`` and the others follow, so it
computes on its own GPU while the rest stay visible: UCX's CUDA IPC (the NIXL transport) opens
a peer's memory only on a device the process can see.

Stopping: SIGTERM or SIGINT stops the router, then each worker gets SIGTERM (its process
group, so its engine core too) and SIGKILL after ``--grace`` seconds. A worker also gets
SIGTERM if the launcher dies any other way (Linux parent-death signal). A worker that exits
during start-up fails the launch (its log's tail is printed). ``--restart-failed`` restarts a
worker that exits while serving, on the same port. Worker logs: ``--log-dir`` (one file per
worker), else the launcher's own stdout/stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from kvserve.engine.arg_utils import add_engine_args
from kvserve.utils.internal_auth import HEADER as INTERNAL_HEADER, load_internal_secret, request_token
from kvserve.utils.processes import die_with_parent, free_port, stop_process_group

logger = logging.getLogger("kvserve")


def kv_transfer_config(role: str, transport: str = "tcp") -> str:
    """The ``--kv-transfer-config`` JSON of a P/D worker (``role``: kv_producer | kv_consumer;
    ``transport``: tcp | nixl, the P2P connector's ``transport``)."""
    return json.dumps({"kv_connector": "P2PKVConnector", "kv_role": role,
                       "kv_connector_extra_config": {"kv_port": 0, "transport": transport}})


def kv_events_args(children: list["Child"]) -> list[str]:
    """kv_events policy: give each worker its own event + replay ports (``--kv-events-config``,
    appended to its flags, so it overrides one passed to launch) and return the router's
    ``--kv-events-endpoint`` values."""
    out = []
    for c in children:
        pub, replay = free_port(), free_port()
        # "*" binds (vLLM's rule: a wildcard host binds, a named host connects).
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
               "replay_endpoint": f"tcp://*:{replay}"}
        c.args = [*c.args, "--kv-events-config", json.dumps(cfg)]
        out.append(f"{c.url}=tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}")
    return out


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set (empty: none), else the
    indices ``nvidia-smi -L`` lists (none without the tool or a driver)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")] \
        if out.returncode == 0 else []


def assign_gpus(num_workers: int, gpus: list[str], per_worker: int = 1) -> list[Optional[str]]:
    """``CUDA_VISIBLE_DEVICES`` for each of ``num_workers`` workers: worker ``i`` owns the ``per_worker``
    GPUs of set ``i mod (len(gpus) // per_worker)``, listed first, then every other GPU (still
    visible for CUDA IPC). None for every worker with fewer than ``per_worker`` GPUs (or one
    set and one worker: nothing to choose), so workers inherit the environment.

    >>> assign_gpus(2, ["0", "1"])
    ['0,1', '1,0']
    >>> assign_gpus(3, ["0", "1", "2", "3"], per_worker=2)
    ['0,1,2,3', '2,3,0,1', '0,1,2,3']
    """
    if per_worker < 1:
        raise ValueError(f"GPUs per worker must be >= 1, got {per_worker}")
    sets = len(gpus) // per_worker
    if sets == 0 or (sets == 1 and num_workers <= 1):
        return [None] * num_workers
    out = []
    for i in range(num_workers):
        k = (i % sets) * per_worker
        own = gpus[k:k + per_worker]
        out.append(",".join(own + [g for g in gpus if g not in own]))
    return out


def parse_worker_gpus(spec: str) -> list[str]:
    """``--worker-gpus``: ``auto`` (``visible_gpus()``), ``none`` (no assignment) or a list ``0,1``."""
    if spec == "auto":
        return visible_gpus()
    if spec == "none":
        return []
    gpus = [g.strip() for g in spec.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--worker-gpus must be auto, none or distinct GPU indices like 0,1; got {spec!r}")
    return gpus


class Child:
    """One ``kvserve serve`` subprocess (own process group)."""

    def __init__(self, name: str, pool: str, args: list[str], port: int, log_dir: Optional[str],
                 gpus: Optional[str] = None) -> None:
        self.name, self.pool, self.args, self.port, self.gpus = name, pool, args, port, gpus
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{name}.log") if log_dir else None
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0

    def start(self) -> None:
        out = open(self.log_path, "a") if self.log_path else None
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(self.port), *self.args]
        env = None if self.gpus is None else dict(os.environ, CUDA_VISIBLE_DEVICES=self.gpus)
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                     start_new_session=True, preexec_fn=die_with_parent)
        if out:
            out.close()

    def tail(self) -> str:
        if not self.log_path:
            return "(see the output above)"
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def stop(self, grace: float) -> None:
        stop_process_group(self.proc, grace)


def wait_healthy(children: list[Child], timeout: float) -> None:
    """Block until every child answers 200 on /health; RuntimeError on an exit or the timeout."""
    import httpx

    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        for c in list(pending):
            if c.proc.poll() is not None:
                raise RuntimeError(f"worker {c.name} exited with {c.proc.returncode} during start-up:\n{c.tail()}")
            try:
                if httpx.get(c.url + "/health", timeout=2).status_code == 200:
                    pending.remove(c)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers not healthy within {timeout:.0f} s: {', '.join(c.name for c in pending)}")
        if pending:
            time.sleep(0.5)


def validate_pd(children: list[Child], secret: Optional[bytes] = None) -> None:
    """Every P/D worker has /v1/kv_transfer with its role, and one kv_layout overall (ValueError).
    ``secret``: the internal secret the workers expect (the call is signed with it)."""
    import httpx

    layouts = {}
    for c in children:
        headers = {INTERNAL_HEADER: request_token(secret, "GET", "/v1/kv_transfer")} if secret else None
        r = httpx.get(c.url + "/v1/kv_transfer", timeout=10, headers=headers)
        if r.status_code == 404:
            raise ValueError(f"worker {c.name} has no /v1/kv_transfer: this kvserve build has no KV transfer "
                             "(P2PKVConnector); use --prefill 0 --decode 0 --replicas K for colocated mode")
        info = r.json()
        want = "kv_producer" if c.pool == "prefill" else "kv_consumer"
        if info.get("kv_role") not in (want, "kv_both"):
            raise ValueError(f"worker {c.name} reports kv_role {info.get('kv_role')!r}, expected {want}")
        layouts[c.name] = info.get("kv_layout")
    if len({json.dumps(v, sort_keys=True) for v in layouts.values()}) > 1:
        raise ValueError(f"KV layouts differ between workers: {layouts}")


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    from kvserve.router.app import add_router_args

    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="Prefill (producer) workers (default: 1, or 0 with --replicas).")
    p.add_argument("--decode", type=int, default=None, metavar="M",
                   help="Decode (consumer) workers (default: 1, or 0 with --replicas).")
    p.add_argument("--replicas", type=int, default=0, metavar="K",
                   help="Colocated replicas: K plain workers behind the router (--prefill / --decode then default to 0).")
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--grace", type=float, default=10.0, metavar="S", help="SIGTERM -> SIGKILL delay for workers.")
    p.add_argument("--log-dir", default=None, help="One log file per worker here (default: inherit stdout).")
    p.add_argument("--restart-failed", action="store_true", help="Restart a worker that exits while serving.")
    p.add_argument("--kv-transport", choices=("tcp", "nixl"), default="tcp",
                   help="P/D: how decode workers pull the KV (P2PKVConnector's transport; default: %(default)s).")
    p.add_argument("--worker-gpus", default="auto", metavar="auto|none|LIST",
                   help="GPUs shared out among the workers, tensor_parallel_size each (auto: CUDA_VISIBLE_DEVICES "
                        "or nvidia-smi's list; none: every worker inherits the environment).")
    add_router_args(p, workers=False)


def worker_argv(argv: list[str]) -> list[str]:
    """``argv`` (after ``launch``) without the launcher's own flags: MODEL and the engine flags,
    verbatim, for every worker."""
    own = argparse.ArgumentParser(add_help=False)
    _add_launch_args(own)
    takes_value = {o: a.nargs != 0 for a in own._actions for o in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if name in takes_value:
            i += 1 if ("=" in tok or not takes_value[name]) else 2
            continue
        out.append(tok)
        i += 1
    return out


def register_launch_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "launch", help="Start prefill/decode workers (or replicas) and the router on one machine.",
        description="Start --prefill N producer and --decode M consumer `kvserve serve` workers (or --replicas K "
                    "plain ones with --prefill 0 --decode 0) on free ports, check them, and serve the router on "
                    "--port. Other flags are passed to every worker. SIGTERM/SIGINT stops everything.")
    _add_launch_args(p)
    add_engine_args(p)  # MODEL and the engine flags: validated here, passed verbatim to every worker
    p.set_defaults(func=run_launch)
    return p


def resolve_worker_counts(ns) -> bool:
    """Fill in ``ns.prefill`` / ``ns.decode`` (default 1 each, 0 each with ``--replicas K`` alone) and
    check the counts; returns True for P/D, False for colocated replicas. Raises ValueError."""
    if min(ns.prefill or 0, ns.decode or 0, ns.replicas) < 0:
        raise ValueError("--prefill, --decode and --replicas must be >= 0")
    if ns.replicas and ns.prefill is None and ns.decode is None:
        ns.prefill = ns.decode = 0  # `--replicas K` alone: colocated mode
    ns.prefill = 1 if ns.prefill is None else ns.prefill
    ns.decode = 1 if ns.decode is None else ns.decode
    pd = ns.prefill > 0 or ns.decode > 0
    if pd and (ns.prefill == 0 or ns.decode == 0):
        raise ValueError("P/D needs --prefill >= 1 and --decode >= 1 (or --replicas K for colocated mode)")
    if pd and ns.replicas:
        raise ValueError("--replicas is for colocated mode (no --prefill / --decode, or both 0)")
    if not pd and ns.replicas == 0:
        raise ValueError("give --replicas K with --prefill 0 --decode 0")
    return pd


def run_launch(ns, extra: Optional[list[str]] = None) -> int:
    """``kvserve launch``. ``extra``: the workers' MODEL and engine flags (default: from ``ns.argv``).
    ValueError (exit 2) for bad counts or a failed validation."""
    from kvserve.logger import setup_logging

    setup_logging()
    if extra is None:
        argv = list(getattr(ns, "argv", None) or [])
        extra = worker_argv(argv[argv.index("launch") + 1:] if "launch" in argv else argv)
    pd = resolve_worker_counts(ns)
    if ns.log_dir:
        os.makedirs(ns.log_dir, exist_ok=True)
    if getattr(ns, "internal_secret_file", None):  # the workers (children) read the same file
        os.environ["KVSERVE_INTERNAL_SECRET_FILE"] = ns.internal_secret_file
    secret = load_internal_secret()  # ValueError before any worker starts
    base = ["--disable-access-log", "--uvicorn-log-level", "warning"] + extra
    if pd:
        specs = [(f"prefill{i}", "prefill", ["--kv-transfer-config", kv_transfer_config("kv_producer", ns.kv_transport)])
                 for i in range(ns.prefill)]
        specs += [(f"decode{i}", "decode", ["--kv-transfer-config", kv_transfer_config("kv_consumer", ns.kv_transport)])
                  for i in range(ns.decode)]
    else:
        specs = [(f"replica{i}", "worker", []) for i in range(ns.replicas)]
    gpus = assign_gpus(len(specs), parse_worker_gpus(ns.worker_gpus), getattr(ns, "tensor_parallel_size", 1) or 1)
    children = [Child(name, pool, base + flags, free_port(), ns.log_dir, g)
                for (name, pool, flags), g in zip(specs, gpus)]
    if getattr(ns, "policy", None) == "kv_events":
        ns.kv_events_endpoint = kv_events_args(children)
    stopping = threading.Event()

    def stop_all() -> None:
        stopping.set()
        for c in children:
            if c.proc is not None and c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for c in children:
            c.stop(ns.grace)

    prev = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum, frame):  # during start-up: stop the children, then leave
        raise KeyboardInterrupt

    try:
        for s in prev:
            signal.signal(s, on_signal)
        for c in children:
            c.start()
            logger.info("started %s (pid %d) on %s%s", c.name, c.proc.pid, c.url,
                        f" (CUDA_VISIBLE_DEVICES={c.gpus})" if c.gpus is not None else "")
        wait_healthy(children, ns.startup_timeout)
        if pd:
            validate_pd(children, secret)
        for s in prev:
            # uvicorn handles SIGTERM/SIGINT while serving, then re-raises the signal under the
            # handler it found: a no-op here, so that the workers are stopped below and we exit 0.
            signal.signal(s, lambda *_: None)
        if ns.restart_failed:
            threading.Thread(target=_supervise, args=(children, stopping), daemon=True).start()
        import asyncio

        from kvserve.router import tracing
        from kvserve.router.app import serve_router

        tracing.setup_tracing(ns.otlp_traces_endpoint)
        return asyncio.run(serve_router(ns, [(c.url, c.pool) for c in children]))
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        stop_all()
        logger.info("all workers stopped")


def _supervise(children: list[Child], stopping: threading.Event) -> None:
    while not stopping.wait(1.0):
        for c in children:
            if c.proc is not None and c.proc.poll() is not None and not stopping.is_set():
                logger.warning("worker %s exited (%s); restarting on port %d", c.name, c.proc.returncode, c.port)
                c.restarts += 1
                c.start()
                logger.info("started %s (pid %d) on %s again", c.name, c.proc.pid, c.url)
