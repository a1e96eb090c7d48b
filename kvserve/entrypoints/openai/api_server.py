"""The OpenAI-compatible HTTP server: FastAPI app, error mapping, auth, graceful shutdown.

``build_app(engine, ...)`` makes the app around a started ``AsyncLLM``; ``run_server(ns)``
is ``kvserve serve``: it starts the engine-core process, then uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200, or 503 when the engine is dead or the server drains),
``GET /version``, ``GET /metrics`` (Prometheus text), ``POST /tokenize``, ``POST /detokenize``,
``GET /v1/kv_transfer`` (the KV transfer role, engine id and ``kv_layout``; nulls without one).
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
parameters (FastAPI's 422 validation errors and unparsable bodies included) and context
overflow (and a ``Host`` header outside ``--allowed-hosts``), 401 for a missing/wrong
``--api-key`` (every route but ``/health``, ``/ping``,
``/version`` and, unless ``--protect-metrics``, ``/metrics``; also for a missing/invalid
``x-kvserve-internal-auth`` token when an internal secret is configured), 404 for an unknown model, 413
for a body over ``--max-request-body-bytes``, 429 (with ``Retry-After``) past
``--max-waiting-requests``, 503 when the engine is dead or the server is shutting down.
If the engine-core process dies or stalls (``--engine-stall-timeout``), the server answers
503 for ``ENGINE_DEAD_EXIT_DELAY_S`` seconds, then exits with status 1 so that a supervisor
restarts it. Shutdown (deadline, signals, exit status): ``lifecycle``; off-loop tokenization:
``tokenization``; the ``Host`` allow-list: ``hosts``. Operator guide: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import socket
import time
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_client import AsyncLLM, EngineDeadError
from kvserve.entrypoints.openai import protocol as P
from kvserve.entrypoints.openai.hosts import default_allowed_hosts, host_allowed
from kvserve.entrypoints.openai.lifecycle import EXIT_ENGINE_FAILED, EXIT_INTERRUPTED, EXIT_OK, GracefulServer
from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.serving import Admission, OpenAIServingChat, OpenAIServingCompletion
from kvserve.entrypoints.openai.tokenization import DEFAULT_MAX_CONCURRENCY, TokenizerPool
from kvserve.entrypoints.openai.tracing import TraceMiddleware
from kvserve.utils.internal_auth import ENV_SECRET_FILE, HEADER as INTERNAL_HEADER, TokenVerifier, load_internal_secret

logger = logging.getLogger("kvserve")

#: Defaults of the limits (flags of ``kvserve serve``).
DEFAULT_MAX_N = 16
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
#: Seconds the server keeps answering 503 after the engine died, before it exits with 1.
ENGINE_DEAD_EXIT_DELAY_S = 5.0
#: Paths that never need the API key (``/metrics`` too unless ``protect_metrics``).
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})


def _json_error(err: APIError) -> Response:
    # ASCII JSON: a message that quotes the client's input may hold a lone surrogate, which
    # UTF-8 cannot encode (JSONResponse would raise and drop the connection).
    return Response(json.dumps(err.body()), status_code=err.status, headers=err.headers,
                    media_type="application/json")


class _BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes", None)


class _GateMiddleware:
    """ASGI middleware: ``Host`` allow-list, 503 while draining, API key (deny by default),
    body-size limit, in-flight request count."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        st = self.state
        err = None
        headers = dict(scope.get("headers") or [])
        open_path = path in OPEN_PATHS or (path == "/metrics" and not st.protect_metrics)
        if not open_path and not host_allowed(headers.get(b"host", b"").decode("latin-1"), st.allowed_hosts):
            err = APIError(400, "the Host header is not allowed on this server (see --allowed-hosts)")
        elif st.draining and path != "/metrics":
            err = APIError(503, "the server is shutting down")
        elif st.api_key and not open_path:
            auth = headers.get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, st.api_key_bytes):
                err = APIError(401, "Incorrect or missing API key.", type_="authentication_error")
        if err is None and st.internal_verifier is not None and not open_path:
            token = headers.get(INTERNAL_HEADER.encode(), b"").decode("latin-1")
            if not st.internal_verifier.verify(token, scope.get("method", ""), path):
                client = scope.get("client") or ("?", 0)
                logger.warning("refused %s %s from %s: missing or invalid %s (this worker takes calls from its "
                               "router only)", scope.get("method"), path, client[0], INTERNAL_HEADER)
                err = APIError(401, "missing or invalid internal authentication", type_="authentication_error")
        limit = st.max_body_bytes
        if err is None and limit is not None and limit >= 0:
            cl = headers.get(b"content-length")
            try:
                too_big = cl is not None and int(cl) > limit
            except ValueError:
                too_big = False
                err = APIError(400, "invalid Content-Length header")
            if too_big:
                err = _BodyTooLarge(limit)
            elif cl is None and scope.get("method") in ("POST", "PUT", "PATCH"):
                # Chunked body: read it here (up to the limit) so that an oversized one is a
                # clean 413, not a parse error, then replay it to the app.
                receive, too_big = await self._buffered(receive, limit)
                if too_big:
                    err = _BodyTooLarge(limit)
            else:
                receive = self._limited(receive, limit)
        if err is not None:
            return await _json_error(err)(scope, receive, send)
        st.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            st.inflight -= 1

    @staticmethod
    async def _buffered(receive, limit: int):
        chunks, seen = [], 0
        while True:
            msg = await receive()
            if msg.get("type") != "http.request":  # disconnect: let the app see it
                chunks.append(msg)
                break
            seen += len(msg.get("body", b""))
            if seen > limit:
                return receive, True
            chunks.append(msg)
            if not msg.get("more_body", False):
                break

        async def replay():
            if chunks:
                return chunks.pop(0)
            return await receive()

        return replay, False

    @staticmethod
    def _limited(receive, limit: int):
        seen = 0

        async def wrapped():
            nonlocal seen
            msg = await receive()
            if msg.get("type") == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:  # chunked body with no Content-Length
                    raise _BodyTooLarge(limit)
            return msg

        return wrapped


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: Optional[str] = None,
              stat_logger: Any = None, *, max_waiting_requests: Optional[int] = None,
              max_n: int = DEFAULT_MAX_N, max_request_body_bytes: Optional[int] = DEFAULT_MAX_REQUEST_BODY_BYTES,
              protect_metrics: bool = False, allowed_hosts: Optional[list[str]] = None,
              default_max_tokens: Optional[int] = None,
              max_tokenize_concurrency: int = DEFAULT_MAX_CONCURRENCY, enable_auto_tool_choice: bool = False,
              tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
              generation_defaults: Optional[dict] = None, internal_secret: Optional[bytes] = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (already started) under ``served_model_names``.

    ``stat_logger``: a ``PrometheusStatLogger`` for ``/metrics`` (404 there if None).
    ``max_waiting_requests``: engine sequences admitted beyond ``max_num_seqs`` before new
    requests get 429 (None: 4 x max_num_seqs; negative: unbounded).
    ``max_n``: largest ``n`` (400 past it). ``max_request_body_bytes``: 413 past it (None or
    negative: unbounded). ``protect_metrics``: ``/metrics`` needs the API key too.
    ``allowed_hosts``: ``Host`` patterns (see ``hosts``; None: ``*`` with a key, else loopback).
    ``default_max_tokens``: cap on a chat completion's tokens when the client gives no
    ``max_tokens`` (None: the rest of the context, as vLLM).
    ``max_tokenize_concurrency``: tokenizations running at once, off the event loop.
    ``tool_call_parser`` / ``reasoning_parser``: parser names (ValueError listing the known ones).
    ``generation_defaults``: request-field defaults (``generation_config.load_generation_defaults``).
    ``internal_secret``: every route but the open ones also needs an ``x-kvserve-internal-auth``
    token made with this secret (the router's; ``kvserve.utils.internal_auth``), else 401.
    ``app.state`` holds ``engine``, ``draining`` (bool), ``inflight`` (requests being served),
    ``admission`` (the ``Admission`` gate) and ``tokenizer_pool``.
    """
    from kvserve import __version__

    from kvserve.entrypoints.openai.json_body import MsgspecJSONRoute

    app = FastAPI(title="kvserve", version=__version__)
    app.router.route_class = MsgspecJSONRoute  # request JSON parsed by msgspec (see json_body)
    state = app.state
    state.engine, state.api_key, state.stat_logger = engine, api_key, stat_logger
    state.api_key_bytes = api_key.encode() if api_key else b""
    state.internal_verifier = TokenVerifier(internal_secret) if internal_secret else None
    state.protect_metrics, state.max_body_bytes = protect_metrics, max_request_body_bytes
    state.draining, state.inflight = False, 0
    state.allowed_hosts = allowed_hosts if allowed_hosts is not None else default_allowed_hosts(api_key)
    if default_max_tokens is not None and default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {default_max_tokens}")
    state.tokenizer_pool = pool = TokenizerPool(engine.tokenizer, engine.max_model_len, max_tokenize_concurrency)
    max_num_seqs = (getattr(engine.engine_args, "max_num_seqs", 256) or 256) * getattr(engine, "data_parallel_size", 1)
    if max_waiting_requests is None:
        max_waiting_requests = 4 * max_num_seqs
    state.admission = admission = Admission(max_num_seqs, max_waiting_requests)
    completion = OpenAIServingCompletion(engine, served_model_names, admission, max_n)
    chat = OpenAIServingChat(engine, served_model_names, admission, max_n)
    for serving in (completion, chat):
        serving.tokenizer_pool, serving.default_max_tokens = pool, default_max_tokens
    chat.enable_auto_tool_choice, chat.tool_call_parser = enable_auto_tool_choice, tool_call_parser
    if tool_call_parser is not None:
        from kvserve.entrypoints.openai.tool_parsers import get_tool_parser

        get_tool_parser(tool_call_parser)  # ValueError naming the choices, at start-up
    if reasoning_parser is not None:
        from kvserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser

        chat.reasoning_parser = get_reasoning_parser(reasoning_parser)
    gen = dict(generation_defaults or {})
    for serving in (completion, chat):
        serving.generation_defaults = {k: v for k, v in gen.items() if k != "max_tokens"}
        if default_max_tokens is None and "max_tokens" in gen:
            serving.default_max_tokens = gen["max_tokens"]
    if stat_logger is not None and hasattr(stat_logger, "attach_frontend"):
        stat_logger.attach_frontend(lambda: admission.admitted, lambda: admission.rejected,
                                    engine.num_unfinished)
    app.add_middleware(_GateMiddleware, state=state)
    app.add_middleware(TraceMiddleware)  # outermost: traceparent -> log lines, echoed (see tracing)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        body_err = body_format_error(errs, request.headers.get("content-type"))
        if body_err is not None:
            return _json_error(body_err)
        parts, param = [], None
        for e in errs[:3]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            msg = e.get("msg")
            if e.get("type") == "extra_forbidden":
                msg = "unknown or unsupported field (kvserve rejects fields it does not implement)"
            parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
        return _json_error(APIError(400, "; ".join(parts) or "invalid request", param))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _json_error(exc)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return _json_error(APIError.from_exception(exc))

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError):
        return _json_error(APIError.from_exception(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _json_error(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return _json_error(APIError.from_exception(exc))

    def _respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def create_completion(request: P.CompletionRequest, raw_request: Request):
        return _respond(await completion.create(request, raw_request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: P.ChatCompletionRequest, raw_request: Request):
        return _respond(await chat.create(request, raw_request.is_disconnected))

    @app.get("/v1/models")
    async def list_models():
        data = [{"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                 "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len}
                for name in served_model_names]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id not in served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return {"id": model_id, "object": "model", "created": created, "owned_by": "kvserve",
                "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/kv_transfer")
    async def kv_transfer():
        """This worker's KV transfer role and layout, for a router's compatibility check."""
        info = engine.kv_transfer_info or {}
        return {"kv_role": info.get("kv_role"), "engine_id": info.get("engine_id"),
                "kv_connector": info.get("kv_connector"), "kv_transport": info.get("kv_transport"),
                "kv_layout": info.get("kv_layout")}

    @app.get("/ping")
    @app.get("/health")
    async def health():
        ok = engine.is_running and not state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        if stat_logger is None:
            raise APIError(404, "metrics are disabled")
        return Response(stat_logger.render(), media_type=stat_logger.content_type)

    @app.post("/tokenize")
    async def tokenize(request: P.TokenizeRequest):
        completion.check_model(request.model)
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "the server runs without a tokenizer")
        if request.messages is not None:
            ids = await pool.chat_prompt_ids(completion, request.messages, request.add_generation_prompt)
        elif request.prompt is not None:
            ids = await pool.encode(request.prompt, request.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", "prompt")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's route: the engine forgets the cached blocks no request holds, between two steps."""
        engine.reset_prefix_cache()
        return Response(status_code=200)

    if os.environ.get("KVSERVE_TORCH_PROFILER_DIR"):  # vLLM's routes, there only when profiling is on
        @app.post("/start_profile")
        async def start_profile():
            engine.profile(True)
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile():
            engine.profile(False)
            return Response(status_code=200)

    @app.post("/detokenize")
    async def detokenize(request: P.DetokenizeRequest):
        completion.check_model(request.model)
        if engine.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer")
        bad = [t for t in request.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})", "tokens")
        return {"prompt": engine.tokenizer.decode(request.tokens)}

    return app


def body_format_error(errors: list[dict], content_type: Optional[str]) -> Optional[APIError]:
    """A 400 that says how to fix a body that is not JSON (``param`` null): a malformed body
    (FastAPI's ``json_invalid`` error, with the decoder's message and character position) or a
    body sent without ``Content-Type: application/json`` (FastAPI then validates the raw
    bytes). None for other validation errors."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        loc = [x for x in first.get("loc", ()) if x != "body"]
        why = (first.get("ctx") or {}).get("error") or "JSON decode error"
        where = f" at character {loc[0]}" if loc else ""
        return APIError(400, f"the request body is not valid JSON: {why}{where}")
    ct = (content_type or "").split(";", 1)[0].strip().lower()
    if ct != "application/json" and not ct.endswith("+json"):
        got = f"got Content-Type {content_type!r}" if content_type else "no Content-Type header was sent"
        return APIError(400, f"the request body must be JSON sent with the header `Content-Type: application/json` "
                             f"({got})")
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a busy port fails in
    milliseconds. Raises OSError("cannot listen on HOST:PORT: ...")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def default_model_name(model: Optional[str]) -> str:
    """The served name when ``--served-model-name`` is not given."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model


def ready_line(model_name: str, host: str, port: int) -> str:
    """``"kvserve ready: serving NAME at http://HOST:PORT/v1"`` (IPv6 hosts in brackets; a
    wildcard bind address shown as itself: the server answers on every interface)."""
    shown = f"[{host}]" if ":" in host else host
    return f"kvserve ready: serving {model_name} at http://{shown}:{port}/v1"


def check_parsers_and_generation_config(ns: argparse.Namespace) -> None:
    """Start-up checks of ``--tool-call-parser``, ``--reasoning-parser`` and ``--generation-config``:
    ValueError naming the flag and the choices."""
    from kvserve.entrypoints.openai.generation_config import check_generation_config
    from kvserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
    from kvserve.entrypoints.openai.tool_parsers import get_tool_parser

    if getattr(ns, "tool_call_parser", None):
        get_tool_parser(ns.tool_call_parser)
    if getattr(ns, "reasoning_parser", None):
        get_reasoning_parser(ns.reasoning_parser)
    check_generation_config(getattr(ns, "generation_config", None))


async def serve_async(ns: argparse.Namespace) -> int:
    """Start the engine, then serve until SIGTERM/SIGINT (see ``lifecycle``) or engine failure.

    Returns the exit status: ``EXIT_OK``, ``EXIT_INTERRUPTED`` (the shutdown deadline ended
    requests) or ``EXIT_ENGINE_FAILED`` (the engine core died or stalled).
    """
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.entrypoints.openai.hosts import parse_allowed_hosts
    from kvserve.metrics.prometheus import PrometheusStatLogger

    names = ns.served_model_name or [default_model_name(ns.model)]
    sock = bind_socket(ns.host, ns.port)
    api_key = ns.api_key or os.environ.get("KVSERVE_API_KEY")
    secret_file = getattr(ns, "internal_secret_file", None)
    internal_secret = load_internal_secret(secret_file)
    if secret_file:  # the engine's KV connector (maybe in another process) reads the same file
        os.environ[ENV_SECRET_FILE] = secret_file
    if ns.api_key:
        logger.warning("--api-key on the command line is readable by every local user (ps, /proc); "
                       "set $KVSERVE_API_KEY instead")
    allowed_hosts = parse_allowed_hosts(getattr(ns, "allowed_hosts", None))
    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(api_key, ns.host)
    dp = int(getattr(ns, "data_parallel_size", 1) or 1)
    stat_logger = PrometheusStatLogger(names[0], engine=0 if dp > 1 else None)  # engine="i" series with DP
    check_parsers_and_generation_config(ns)  # before the (slow) engine start
    engine_args = EngineArgs(**EngineArgs.from_cli_args(ns))
    stall = getattr(ns, "engine_stall_timeout", None)
    duration = getattr(ns, "max_request_duration", None)
    client: Any = AsyncLLM
    if dp > 1:  # N engine cores behind this server
        from kvserve.engine.dp_client import DPAsyncLLM as client
    engine = await client.from_engine_args(engine_args, stat_logger,
                                           engine_stall_timeout=stall if stall and stall > 0 else None,
                                           max_request_duration=duration if duration and duration > 0 else None)
    for i, core in enumerate(getattr(engine, "cores", None) or [engine]):
        (stat_logger.for_engine(i) if dp > 1 else stat_logger).set_engine_info(engine.config, core.num_blocks)
    from kvserve.entrypoints.openai.generation_config import load_generation_defaults

    gen_defaults = load_generation_defaults(getattr(ns, "generation_config", "auto"), engine.model_path)
    if gen_defaults:
        logger.info("default sampling from the model's generation_config.json (--generation-config %s): %s; "
                    "a request's own fields win", getattr(ns, "generation_config", "auto"), gen_defaults)
    engine_died = False
    server = None
    try:
        app = build_app(engine, names, api_key, stat_logger,
                        max_waiting_requests=getattr(ns, "max_waiting_requests", None),
                        max_n=getattr(ns, "max_n", DEFAULT_MAX_N),
                        max_request_body_bytes=getattr(ns, "max_request_body_bytes",
                                                       DEFAULT_MAX_REQUEST_BODY_BYTES),
                        protect_metrics=getattr(ns, "protect_metrics", False),
                        allowed_hosts=allowed_hosts,
                        default_max_tokens=getattr(ns, "default_max_tokens", None),
                        max_tokenize_concurrency=getattr(ns, "max_tokenize_concurrency", DEFAULT_MAX_CONCURRENCY),
                        enable_auto_tool_choice=getattr(ns, "enable_auto_tool_choice", False),
                        tool_call_parser=getattr(ns, "tool_call_parser", None),
                        reasoning_parser=getattr(ns, "reasoning_parser", None),
                        generation_defaults=gen_defaults, internal_secret=internal_secret)
        # lifespan="off": the app has no startup/shutdown hooks (the engine is started above), and
        # an idle lifespan task would be cancelled at exit with a spurious traceback.
        # timeout_graceful_shutdown: uvicorn's own wait for connections, once we decided to stop.
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                access_log=not ns.disable_access_log, timeout_keep_alive=5, lifespan="off",
                                timeout_graceful_shutdown=1)
        server = GracefulServer(config, app.state, engine, ns.shutdown_timeout)

        async def watchdog() -> None:
            """Exit (status 1) once the engine core is dead or stalled, after a short 503 window."""
            nonlocal engine_died
            while engine.errored is None or engine._closing:
                await asyncio.sleep(0.1)
            engine_died = True
            logger.error("the engine core failed (%s); the server exits in %.0f s", engine.errored,
                         ENGINE_DEAD_EXIT_DELAY_S)
            await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
            server.should_exit = True

        async def announce_ready() -> None:
            """One line once uvicorn accepts connections: where to send requests."""
            while not server.started:
                await asyncio.sleep(0.05)
            logger.info("%s", ready_line(names[0], ns.host, ns.port))

        wd = asyncio.create_task(watchdog(), name="kvserve-engine-watchdog")
        ready = asyncio.create_task(announce_ready(), name="kvserve-ready-line")
        try:
            await server.serve(sockets=[sock])
        finally:
            wd.cancel()
            ready.cancel()
    finally:
        sock.close()
        await engine.shutdown(timeout=server.time_left() if server is not None else 10.0)
        if server is not None:
            server.cancel_backstop()
            server.app_state.tokenizer_pool.close()
        logger.info("engine stopped")
    if engine_died:
        return EXIT_ENGINE_FAILED
    return EXIT_INTERRUPTED if server.interrupted else EXIT_OK


def run_server(ns: argparse.Namespace) -> int:
    """``kvserve serve``. Returns 0 after a clean shutdown, 1 if the engine core died or stalled,
    3 if the shutdown deadline ended requests (see ``lifecycle``)."""
    from kvserve.logger import setup_logging

    setup_logging()
    try:
        return asyncio.run(serve_async(ns))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as exc:
        if "cannot listen on" not in str(exc):
            raise
        logger.error("%s", exc.strerror or exc)
        return 1
    except SystemExit as exc:
        return int(exc.code or 0)
