"""``kvserve router``: the FastAPI app, health checks, admin routes, the command.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (forwarded, SSE streamed
through; see ``proxy``), ``GET /v1/models`` (from the first healthy worker), ``GET /health``
(200 when at least one worker per needed pool is routable, else 503), ``GET /metrics``
(``metrics``), admin: ``POST /add_worker?url=U&role=worker|prefill|prefill_long|decode``
(400 on a duplicate, an unknown role, or a P/D ``kv_layout`` mismatch), ``POST
/remove_worker?url=U`` (404 for an unknown worker; in-flight requests finish), ``GET
/workers``. Every response carries ``traceparent`` (the client's, or a new one).

Health checks: every ``--health-check-interval`` s, ``GET /health`` on each worker with a
``--health-check-timeout``; a failure marks it unroutable until a check passes. With
``--load-from-metrics`` the same round reads ``kvserve:num_requests_running`` + ``waiting``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.entrypoints.openai.tracing import install_log_filter, new_traceparent, parse_traceparent, trace_id_var
from kvserve.router import tracing
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import POLICIES
from kvserve.router.common import ClientError
from kvserve.router.proxy import Router, RouterConfig, RouterError
from kvserve.router.workers import ROLE_TO_POOL, Worker, WorkerRegistry
from kvserve.utils import internal_auth

logger = logging.getLogger("kvserve")


def check_layouts(registry: WorkerRegistry, new: Worker) -> None:
    """ValueError when ``new`` (prefill/decode) has a ``kv_layout`` different from a worker of the
    opposite side; a P/D worker without ``GET /v1/kv_transfer`` is refused too."""
    if new.pool == "worker":
        return
    if new.kv_info is None:
        raise ValueError(f"{new.url} has no GET /v1/kv_transfer: it cannot be a {new.pool} worker "
                         "(start it with --kv-transfer-config)")
    role = new.kv_info.get("kv_role")
    want = {"prefill": ("kv_producer", "kv_both"), "prefill_long": ("kv_producer", "kv_both"),
            "decode": ("kv_consumer", "kv_both")}[new.pool]
    if role not in want:
        raise ValueError(f"{new.url} has kv_role {role!r}; a {new.pool} worker needs {' or '.join(want)}")
    other = ("decode",) if new.pool != "decode" else ("prefill", "prefill_long")
    for w in registry.workers.values():
        if w.pool in other and w.kv_info is not None and w.kv_info.get("kv_layout") != new.kv_info.get("kv_layout"):
            raise ValueError(f"KV layout mismatch: {new.url} ({new.pool}) has {new.kv_info.get('kv_layout')}, "
                             f"{w.url} ({w.pool}) has {w.kv_info.get('kv_layout')}")


async def fetch_kv_info(client: httpx.AsyncClient, url: str, timeout: float = 5.0) -> Optional[dict]:
    """``GET /v1/kv_transfer`` (None on 404); raises httpx.HTTPError when unreachable."""
    r = await client.get(url + "/v1/kv_transfer", timeout=timeout)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def _metric_sum(text: str, names: tuple) -> int:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(names):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return int(total)


def internal_httpx_auth(secret: bytes) -> httpx.Auth:
    """An ``httpx.Auth`` adding ``x-kvserve-internal-auth`` (a fresh token per request sent,
    retries included; see ``kvserve.utils.internal_auth``)."""

    class _InternalAuth(httpx.Auth):
        def auth_flow(self, request):
            request.headers[internal_auth.HEADER] = internal_auth.request_token(secret, request.method,
                                                                                request.url.path)
            yield request

    return _InternalAuth()


class RouterApp:
    """Owns the registry, the forwarding core, the HTTP client and the health loop."""

    def __init__(self, config: RouterConfig, health_interval: float = 2.0, health_timeout: float = 2.0,
                 failure_threshold: int = 3, cooldown: float = 5.0, load_from_metrics: bool = False,
                 internal_secret: Optional[bytes] = None) -> None:
        self.config = config
        self.registry = WorkerRegistry(failure_threshold, cooldown)
        self.metrics = RouterMetrics()
        self.registry.on_remove.append(lambda url: None)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        # With an internal secret every call to a worker carries a fresh signed token.
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, connect=config.connect_timeout),
                                        auth=internal_httpx_auth(internal_secret) if internal_secret else None)
        self.router = Router(config, self.registry, self.metrics, self.client, internal_secret)
        self.health_interval, self.health_timeout = health_interval, health_timeout
        self.load_from_metrics = load_from_metrics
        self._task: Optional[asyncio.Task] = None

    async def add_worker(self, url: str, pool: str, validate: bool = True) -> Worker:
        """Register ``url`` in ``pool``; P/D workers are checked (``check_layouts``). ValueError."""
        url = WorkerRegistry.normalize(url)
        if self.registry.get(url) is not None:
            raise ValueError(f"worker {url} is already registered")
        probe = Worker(url, pool, None)  # type: ignore[arg-type]
        if validate:
            try:
                probe.kv_info = await fetch_kv_info(self.client, url)
            except httpx.HTTPError as exc:
                if pool != "worker":
                    raise ValueError(f"cannot reach {url}/v1/kv_transfer: {type(exc).__name__}") from None
            check_layouts(self.registry, probe)
        w = self.registry.add(url, pool)
        w.kv_info = probe.kv_info
        logger.info("worker added: %s (%s)", url, pool)
        return w

    def remove_worker(self, url: str) -> Worker:
        w = self.registry.remove(url)
        self.metrics.forget_worker(w.url, w.pool)
        logger.info("worker removed: %s (%s)", w.url, w.pool)
        return w

    async def check_one(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/health", timeout=self.health_timeout)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok != w.healthy:
            logger.info("worker %s is %s", w.url, "healthy" if ok else "unhealthy")
        w.healthy = ok
        if ok and self.load_from_metrics:
            try:
                r = await self.client.get(w.url + "/metrics", timeout=self.health_timeout)
                w.reported_load = _metric_sum(r.text, ("kvserve:num_requests_running{", "kvserve:num_requests_running ",
                                                       "kvserve:num_requests_waiting{", "kvserve:num_requests_waiting "))
            except httpx.HTTPError:
                pass

    async def health_loop(self) -> None:
        while True:
            ws = list(self.registry.workers.values())
            if ws:
                await asyncio.gather(*(self.check_one(w) for w in ws), return_exceptions=True)
            await asyncio.sleep(self.health_interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.health_loop(), name="router-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.router.kv_event_hub is not None:
            self.router.kv_event_hub.close()
        await self.client.aclose()

    def ready(self) -> bool:
        reg = self.registry
        if reg.mode() == "pd":
            return bool((reg.routable("prefill") or reg.routable("prefill_long")) and reg.routable("decode"))
        return bool(reg.routable("worker"))


def _err(exc: RouterError, tp: str) -> Response:
    return Response(json.dumps(exc.body()), status_code=exc.status, media_type="application/json",
                    headers={"traceparent": tp})


def build_app(ra: RouterApp) -> FastAPI:
    """The router's FastAPI app around ``ra`` (its health loop starts with the app)."""
    install_log_filter()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        ra.start()
        try:
            yield
        finally:
            await ra.close()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.router_app = ra

    async def forward(route: str, request: Request):
        got = request.headers.get("traceparent")
        parsed = parse_traceparent(got)
        tp = got.strip().lower() if parsed else new_traceparent()
        token = trace_id_var.set(parse_traceparent(tp)[0])
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as exc:
                raise RouterError(400, f"the request body is not valid JSON: {exc}")
            with tracing.span("router.request", tracing.parent_context(tp), route=route,
                              policy=ra.config.policy) as sp:
                up = tracing.current_traceparent(tp) if sp is not None else tp
                result = await ra.router.handle(route, body, up, request.headers.get("authorization"))
            if isinstance(result, tuple):
                status, data = result
                ra.metrics.requests.labels(route, "ok" if status == 200 else "client_error").inc()
                logger.info("%s -> %d", request.url.path, status)
                return JSONResponse(data, status_code=status, headers={"traceparent": tp})
            # The stream counts its own outcome (ok / failed / client_disconnect) when it ends.
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "traceparent": tp})
        except RouterError as exc:
            outcome = "no_worker" if exc.status == 503 else "timeout" if exc.status == 504 else "failed"
            if exc.status < 500:
                outcome = "client_error"
            ra.metrics.requests.labels(route, outcome).inc()
            logger.warning("%s -> %d: %s", request.url.path, exc.status, exc.message)
            return _err(exc, tp)
        except Exception as exc:  # noqa: BLE001 - the client gets an OpenAI-shaped 500
            if isinstance(exc, ClientError):
                ra.metrics.requests.labels(route, "client_error").inc()
                return Response(exc.content, status_code=exc.status, media_type="application/json",
                                headers={"traceparent": tp})
            logger.exception("router error")
            return _err(RouterError(500, f"router error: {type(exc).__name__}: {exc}"), tp)
        finally:
            trace_id_var.reset(token)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward("chat", request)

    @app.get("/v1/models")
    async def models(request: Request):
        auth = request.headers.get("authorization")
        for w in list(ra.registry.workers.values()):
            if not w.routable():
                continue
            try:
                r = await ra.client.get(w.url + "/v1/models", timeout=5.0,
                                        headers={"authorization": auth} if auth else None)
                if r.status_code == 200:
                    return JSONResponse(r.json())
            except httpx.HTTPError:
                continue
        return _err(RouterError(503, "no healthy worker to list models"), new_traceparent())

    @app.get("/health")
    async def health():
        return Response(status_code=200 if ra.ready() else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(ra.metrics.render(list(ra.registry.workers.values())), media_type=ra.metrics.content_type)

    @app.get("/workers")
    async def workers():
        return {"mode": ra.registry.mode(), "policy": ra.config.policy,
                "workers": [w.describe() for w in ra.registry.workers.values()]}

    @app.post("/add_worker")
    async def add_worker(url: str, role: str = "worker"):
        pool = ROLE_TO_POOL.get(role)
        if pool is None:
            return _err(RouterError(400, f"unknown role {role!r}; known: {', '.join(ROLE_TO_POOL)}"), new_traceparent())
        try:
            w = await ra.add_worker(url, pool)
        except ValueError as exc:
            return _err(RouterError(400, str(exc)), new_traceparent())
        return w.describe()

    @app.post("/remove_worker")
    async def remove_worker(url: str):
        try:
            w = ra.remove_worker(url)
        except ValueError as exc:
            return _err(RouterError(404, str(exc)), new_traceparent())
        return {"removed": w.url}

    return app


# --------------------------------------------------------------------------- the command

def register_router_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router", help="OpenAI-compatible router over kvserve workers (P/D or colocated).",
        description="Route OpenAI requests over prefill/decode worker pools (P/D disaggregation) or plain "
                    "replicas (--worker, colocated), with health checks, circuit breaking, retries and "
                    "mid-stream recovery. See docs/disaggregation.md.")
    add_router_args(p)
    p.set_defaults(func=run_router)
    return p


def add_router_args(p: argparse.ArgumentParser, workers: bool = True) -> None:
    p.add_argument("--host", default="127.0.0.1", help="Listen address (default: %(default)s).")
    p.add_argument("--port", type=int, default=8000, help="Listen port (default: %(default)s).")
    if workers:
        p.add_argument("--worker", action="append", default=[], metavar="URL", help="Colocated replica (repeatable).")
        p.add_argument("--prefill", action="append", default=[], metavar="URL", help="Prefill worker (repeatable).")
        p.add_argument("--prefill-long", action="append", default=[], metavar="URL",
                       help="Prefill worker for long prompts (repeatable; see --long-prompt-threshold).")
        p.add_argument("--decode", action="append", default=[], metavar="URL", help="Decode worker (repeatable).")
        p.add_argument("--kv-events-endpoint", action="append", default=[], metavar="URL=ENDPOINT[,REPLAY]",
                       help="kv_events: a worker's KV event endpoint and replay endpoint, e.g. "
                            "http://10.0.0.2:8000=tcp://10.0.0.2:5557,tcp://10.0.0.2:5558 (repeatable).")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="Routing policy (default: %(default)s).")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware: the prefix match must cover this fraction of the request (0..1) to win.")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="cache_aware: load imbalance when max - min in-flight requests exceeds this ...")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and max > this x min; then the least-loaded worker wins.")
    p.add_argument("--max-tree-chars", type=int, default=1 << 22,
                   help="cache_aware: bound of the prefix tree in characters (LRU eviction past it).")
    p.add_argument("--kv-events-stale-after", type=float, default=10.0, metavar="S",
                   help="kv_events: seconds a worker sent uncached blocks may publish no event before the "
                        "approximate cache_aware tree decides (its events count as stopped).")
    p.add_argument("--kv-events-topic", default="",
                   help="kv_events: the workers' event topic (--kv-events-config topic).")
    p.add_argument("--long-prompt-threshold", type=int, default=0, metavar="TOKENS",
                   help="Prompts of at least this many tokens (estimated as characters / 4) go to --prefill-long "
                        "(0: off).")
    p.add_argument("--prefill-timeout", type=float, default=60.0, metavar="S", help="Deadline of a prefill leg.")
    p.add_argument("--decode-first-token-timeout", type=float, default=60.0, metavar="S",
                   help="Deadline for a decode leg's first chunk, and for each gap between chunks.")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="Deadline of a whole request.")
    p.add_argument("--queue-timeout", type=float, default=30.0, metavar="S",
                   help="How long a request waits for a routable worker before 503.")
    p.add_argument("--max-attempts", type=int, default=4, help="Workers tried per leg (default: %(default)s).")
    p.add_argument("--health-check-interval", type=float, default=2.0, metavar="S")
    p.add_argument("--health-check-timeout", type=float, default=2.0, metavar="S")
    p.add_argument("--failure-threshold", type=int, default=3,
                   help="Consecutive failures that open a worker's circuit breaker.")
    p.add_argument("--cooldown", type=float, default=5.0, metavar="S", help="Seconds a circuit stays open.")
    p.add_argument("--load-from-metrics", action="store_true",
                   help="Add the workers' running + waiting requests (their /metrics) to the router's counts.")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="Export spans over OTLP (also OTEL_TRACES_EXPORTER=console).")
    p.add_argument("--internal-secret-file", default=None, metavar="PATH",
                   help="File holding the internal secret the workers expect (default: "
                        "$KVSERVE_INTERNAL_SECRET_FILE, else $KVSERVE_INTERNAL_SECRET, else none): every call to a "
                        "worker then carries a signed x-kvserve-internal-auth header. See docs/reliability.md.")
    p.add_argument("--uvicorn-log-level", default="warning")


def config_from_ns(ns) -> RouterConfig:
    return RouterConfig(policy=ns.policy, prefill_timeout=ns.prefill_timeout,
                        decode_first_token_timeout=ns.decode_first_token_timeout,
                        request_timeout=ns.request_timeout, queue_timeout=ns.queue_timeout,
                        max_attempts=ns.max_attempts, long_prompt_threshold=ns.long_prompt_threshold,
                        cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
                        balance_rel_threshold=ns.balance_rel_threshold, max_tree_chars=ns.max_tree_chars,
                        kv_events_endpoints=kv_events_endpoints(getattr(ns, "kv_events_endpoint", None) or []),
                        kv_events_stale_after=getattr(ns, "kv_events_stale_after", 10.0),
                        kv_events_topic=getattr(ns, "kv_events_topic", ""))


def kv_events_endpoints(specs: list[str]) -> dict:
    """``--kv-events-endpoint`` values -> {worker URL: (endpoint, replay endpoint)}. ValueError."""
    from kvserve.router.kv_events import parse_endpoint_spec

    out = {}
    for spec in specs:
        url, ep, replay = parse_endpoint_spec(spec)
        out[url] = (ep, replay)
    return out


async def serve_router(ns, pools: list[tuple[str, str]], sock=None) -> int:
    """Register ``pools`` ((url, pool) pairs; ValueError on a mismatch), then serve until SIGTERM/SIGINT."""
    import uvicorn

    ra = RouterApp(config_from_ns(ns), ns.health_check_interval, ns.health_check_timeout,
                   ns.failure_threshold, ns.cooldown, ns.load_from_metrics,
                   internal_auth.load_internal_secret(getattr(ns, "internal_secret_file", None)))
    try:
        for url, pool in pools:
            await ra.add_worker(url, pool)
    except ValueError:
        await ra.client.aclose()
        raise
    app = build_app(ra)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    logger.info("kvserve router on http://%s:%d: %s mode, policy %s, %d workers", ns.host, ns.port,
                ra.registry.mode(), ns.policy, len(pools))
    await server.serve(sockets=[sock] if sock is not None else None)
    return 0


def run_router(ns) -> int:
    """``kvserve router``. ValueError (exit 2) for a bad worker set."""
    from kvserve.logger import setup_logging

    setup_logging()
    pools = [(u, "worker") for u in ns.worker] + [(u, "prefill") for u in ns.prefill] + \
            [(u, "prefill_long") for u in ns.prefill_long] + [(u, "decode") for u in ns.decode]
    if not pools:
        raise ValueError("give --worker URL (colocated) or --prefill URL and --decode URL (P/D)")
    if ns.worker and (ns.prefill or ns.decode or ns.prefill_long):
        raise ValueError("--worker (colocated) cannot be mixed with --prefill/--decode (P/D)")
    if (ns.prefill or ns.prefill_long) and not ns.decode or ns.decode and not (ns.prefill or ns.prefill_long):
        raise ValueError("P/D mode needs at least one --prefill and one --decode worker")
    tracing.setup_tracing(ns.otlp_traces_endpoint)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import signal

    for s in (signal.SIGTERM, signal.SIGINT):
        # uvicorn re-raises the signal it handled after shutting down: exit 0, not -15.
        signal.signal(s, lambda *_: None)
    try:
        return asyncio.run(serve_router(ns, pools))
    except KeyboardInterrupt:
        return 130
