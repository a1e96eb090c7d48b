"""The OpenAI-compatible HTTP server: FastAPI app, error mapping, auth, graceful shutdown.

``build_app(engine, ...)`` makes the app around a started ``AsyncLLM``; ``run_server(ns)``
is ``kvserve serve``: it starts the engine-core process, then uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200, or 503 when the engine is dead or the server drains),
``GET /version``, ``GET /metrics`` (Prometheus text), ``POST /tokenize``, ``POST /detokenize``.
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
parameters (FastAPI's 422 validation errors included) and context overflow, 401 for a
missing/wrong ``--api-key`` (``/v1`` routes only), 404 for an unknown model, 503 when the
engine is dead or the server is shutting down.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import time
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_client import AsyncLLM, EngineDeadError
from kvserve.entrypoints.openai import protocol as P
from kvserve.entrypoints.openai.serving import APIError, OpenAIServingChat, OpenAIServingCompletion

logger = logging.getLogger("kvserve")


def _json_error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class _GateMiddleware:
    """ASGI middleware: API-key check on /v1, 503 while draining, in-flight request count."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        st = self.state
        err = None
        if st.draining and path != "/metrics":
            err = APIError(503, "the server is shutting down")
        elif st.api_key and path.startswith("/v1"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), st.api_key.encode()):
                err = APIError(401, "Incorrect or missing API key.", type_="authentication_error")
        if err is not None:
            return await _json_error(err)(scope, receive, send)
        st.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            st.inflight -= 1


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: Optional[str] = None,
              stat_logger: Any = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (already started) under ``served_model_names``.

    ``stat_logger``: a ``PrometheusStatLogger`` for ``/metrics`` (404 there if None).
    ``app.state`` holds ``engine``, ``draining`` (bool) and ``inflight`` (requests being served).
    """
    from kvserve import __version__

    app = FastAPI(title="kvserve", version=__version__)
    state = app.state
    state.engine, state.api_key, state.stat_logger = engine, api_key, stat_logger
    state.draining, state.inflight = False, 0
    completion = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names)
    app.add_middleware(_GateMiddleware, state=state)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        parts, param = [], None
        for e in errs[:3]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
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
            ids = completion.chat_prompt_ids(request.messages, request.add_generation_prompt)
        elif request.prompt is not None:
            ids = tok.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", "prompt")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_model_len}

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


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains: new requests get 503, in-flight ones
    get up to ``drain_timeout`` seconds, then the server stops. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, app_state, drain_timeout: float) -> None:
        super().__init__(config)
        self.app_state, self.drain_timeout = app_state, drain_timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.app_state.draining or self._loop is None:
            self.force_exit = self.app_state.draining
            self.should_exit = True
            return
        logger.info("signal %d: draining (new requests get 503), up to %.0f s", sig, self.drain_timeout)
        self.app_state.draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.app_state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.app_state.inflight:
            logger.warning("drain timeout: %d requests still in flight", self.app_state.inflight)
        self.should_exit = True


def default_model_name(model: Optional[str]) -> str:
    """The served name when ``--served-model-name`` is not given."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model


async def serve_async(ns: argparse.Namespace) -> None:
    """Start the engine, then serve until SIGTERM/SIGINT; then drain and stop the engine."""
    from kvserve.config import EngineArgs
    from kvserve.entrypoints.cli import engine_args_from_namespace
    from kvserve.metrics.prometheus import PrometheusStatLogger

    names = ns.served_model_name or [default_model_name(ns.model)]
    stat_logger = PrometheusStatLogger(names[0])
    engine_args = EngineArgs(**engine_args_from_namespace(ns))
    engine = await AsyncLLM.from_engine_args(engine_args, stat_logger)
    try:
        app = build_app(engine, names, ns.api_key or os.environ.get("KVSERVE_API_KEY"), stat_logger)
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                access_log=not ns.disable_access_log, timeout_keep_alive=5)
        server = _DrainingServer(config, app.state, ns.shutdown_timeout)
        await server.serve()
    finally:
        await engine.shutdown()
        logger.info("engine stopped")


def run_server(ns: argparse.Namespace) -> int:
    """``kvserve serve``. Returns 0 after a clean shutdown."""
    from kvserve.engine.llm import _setup_logging

    _setup_logging()
    try:
        asyncio.run(serve_async(ns))
    except KeyboardInterrupt:
        pass
    return 0
