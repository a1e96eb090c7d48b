"""Request forwarding of ``kvserve router``: routing, P/D legs, retries, deadlines, recovery.

Colocated mode (``worker`` pool): the request goes to one worker as is. P/D mode: the
prefill leg (the client's body with ``max_tokens: 1``, ``stream: false``,
``kv_transfer_params: {"do_remote_decode": true}``) goes to a prefill worker (``prefill_long``
for prompts of at least ``long_prompt_threshold`` estimated tokens = characters / 4); its
response's ``kv_transfer_params`` go with the client's body to a decode worker, which streams
the whole output.

Failures (``RouterConfig`` holds the deadlines, in seconds):

* before any output (connection refused/reset, 5xx, 429, a phase deadline): the leg is
  re-sent to another worker (``retries``), up to ``max_attempts`` workers per leg;
* a stream that breaks after output (connection error, end without ``[DONE]``, an error
  event, no chunk within ``decode_first_token_timeout``): the router re-prefills on a healthy
  worker with ``POST /v1/completions`` whose prompt is the prompt's token ids + the ids
  generated so far and whose ``max_tokens`` is what is left; its chunks are re-wrapped in
  the client's route format (chat chunks for chat). The router asks workers for
  ``return_token_ids`` to know the ids (and strips them unless the client asked); the
  prompt's ids come from the first chunk's ``prompt_token_ids`` or, when a worker does not
  send them, from ``POST /tokenize`` on the recovering worker. Recovery needs ``n == 1``
  and token ids in every content chunk; otherwise the client gets an SSE error event.
* no routable worker for ``queue_timeout`` s: 503 (or an SSE error event once streaming).

4xx answers of a worker (bad parameters) are the client's: passed through, never retried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import httpx

from kvserve.router import tracing
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import Candidate, make_policy
from kvserve.router.workers import Worker, WorkerRegistry

logger = logging.getLogger("kvserve")

#: Fields copied into a re-prefill request (sampling and output options of both routes).
RECOVERY_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "skip_special_tokens", "spaces_between_special_tokens", "stream_options", "priority",
                   "cache_salt", "user")
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class RouterError(Exception):
    """An OpenAI-shaped error answered by the router (``status``: HTTP status)."""

    def __init__(self, status: int, message: str, type_: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type_ or ("invalid_request_error" if status < 500 else "service_unavailable")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.status}}


class _LegFailed(Exception):
    """A worker failed this leg (``kind``: connect | status | stream | timeout)."""

    def __init__(self, worker: Worker, kind: str, message: str) -> None:
        super().__init__(f"{worker.url}: {message}")
        self.worker, self.kind = worker, kind


class _ClientError(Exception):
    """A worker's 4xx: the client's fault, returned as is."""

    def __init__(self, status: int, content: bytes) -> None:
        super().__init__(status)
        self.status, self.content = status, content


@dataclass
class RouterConfig:
    """Deadlines in seconds; ``long_prompt_threshold`` in estimated tokens (0: one prefill pool)."""

    policy: str = "cache_aware"
    prefill_timeout: float = 60.0
    decode_first_token_timeout: float = 60.0
    request_timeout: float = 600.0
    queue_timeout: float = 30.0
    connect_timeout: float = 5.0
    max_attempts: int = 4
    long_prompt_threshold: int = 0


@dataclass
class _Stream:
    """What a streaming request has produced so far (one choice)."""

    prompt_ids: Optional[list[int]] = None
    gen_ids: list[int] = field(default_factory=list)
    ids_ok: bool = True
    content_sent: bool = False
    role_sent: bool = False
    finished: bool = False
    id: Optional[str] = None
    created: Optional[int] = None
    model: Optional[str] = None


def routing_text(route: str, body: dict) -> str:
    """The text the cache-aware policy keys on: the prompt, or the chat messages' contents."""
    if route == "chat":
        parts = []
        for m in body.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            parts.append(f"<{m.get('role', '') if isinstance(m, dict) else ''}>{c or ''}")
        return "".join(parts)
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and isinstance(p[0], int):
        return " ".join(map(str, p))
    return json.dumps(p)[:100000]


def _n_choices(route: str, body: dict) -> int:
    n = body.get("n") or 1
    p = body.get("prompt")
    if route == "completions" and isinstance(p, list) and p and not isinstance(p[0], int):
        n *= len(p)
    return int(n)


class Router:
    """The forwarding core: ``handle(route, body, traceparent)`` -> ``(status, dict)`` or an SSE iterator."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.config, self.registry, self.metrics, self.client = config, registry, metrics, client
        self.policies = {pool: make_policy(config.policy) for pool in ("worker", "prefill", "prefill_long", "decode")}
        registry.on_remove.append(lambda url: [p.remove_worker(url) for p in self.policies.values()])
        self.queued = {pool: 0 for pool in self.policies}

    # ------------------------------------------------------------------ routing

    async def pick(self, pool: str, text: str, exclude: set, deadline: float) -> Worker:
        """A routable worker of ``pool`` (waiting up to ``queue_timeout`` for one); RouterError(503)."""
        reg, t0 = self.registry, time.monotonic()
        limit = min(deadline, t0 + self.config.queue_timeout)
        queued = False
        try:
            while True:
                pools = [pool]
                if pool in ("prefill", "prefill_long"):
                    pools.append("prefill_long" if pool == "prefill" else "prefill")
                for p in pools:
                    ws = reg.routable(p, frozenset(exclude)) or reg.routable(p)
                    if not ws:
                        continue
                    policy = self.policies[p]
                    d = policy.choose(text, [Candidate(w.url, w.load) for w in ws])
                    w = reg.get(d.url)
                    if w is None or not w.breaker.acquire():
                        continue
                    self.metrics.decisions.labels(policy.name, p, w.url, d.reason).inc()
                    if policy.name == "cache_aware":
                        self.metrics.cache(d.matched_chars, len(text))
                    self.metrics.phase.labels("route").observe(time.monotonic() - t0)
                    logger.info("route %s -> %s (%s, matched %d/%d chars)", p, w.url, d.reason, d.matched_chars,
                                len(text))
                    return w
                if time.monotonic() >= limit:
                    known = [w.url for w in reg.pool(pool)]
                    raise RouterError(503, f"no healthy {pool} worker could serve the request "
                                           f"(registered: {', '.join(known) or 'none'})")
                if not queued:
                    queued = True
                    self.queued[pool] += 1
                    self.metrics.pool_queue.labels(pool).set(self.queued[pool])
                await asyncio.sleep(0.05)
        finally:
            if queued:
                self.queued[pool] -= 1
                self.metrics.pool_queue.labels(pool).set(self.queued[pool])

    def failed(self, exc: _LegFailed) -> None:
        w = exc.worker
        w.breaker.record_failure()
        w.last_error = str(exc)
        if exc.kind == "connect":
            w.healthy = False  # until a health check passes
        self.metrics.worker_failures.labels(w.url, exc.kind).inc()
        logger.warning("worker failure (%s): %s; circuit %s", exc.kind, exc, w.breaker.state)

    # ------------------------------------------------------------------ one upstream call

    async def _post(self, w: Worker, path: str, body: dict, headers: dict, timeout: float,
                    stream: bool) -> httpx.Response:
        """Send; returns a 200 response (streaming: headers read, body open). Raises _LegFailed/_ClientError."""
        req = self.client.build_request("POST", w.url + path, json=body, headers=headers,
                                        timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout))
        try:
            resp = await asyncio.wait_for(self.client.send(req, stream=True), timeout)
        except asyncio.TimeoutError:
            raise _LegFailed(w, "timeout", f"no response headers within {timeout:.1f} s") from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise _LegFailed(w, "connect", f"{type(exc).__name__}: {exc}") from None
        except httpx.TimeoutException as exc:
            raise _LegFailed(w, "timeout", f"{type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            raise _LegFailed(w, "connect", f"{type(exc).__name__}: {exc}") from None
        if resp.status_code == 200:
            if not stream:
                try:
                    await asyncio.wait_for(resp.aread(), max(0.1, timeout))
                except (asyncio.TimeoutError, httpx.HTTPError) as exc:
                    await resp.aclose()
                    raise _LegFailed(w, "stream", f"body not read: {type(exc).__name__}") from None
            return resp
        try:
            content = await asyncio.wait_for(resp.aread(), 5.0)
        except (asyncio.TimeoutError, httpx.HTTPError):
            content = b""
        finally:
            await resp.aclose()
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
            raise _ClientError(resp.status_code, content)
        raise _LegFailed(w, "status", f"HTTP {resp.status_code}: {content[:200]!r}")

    def _with_ids(self, route: str, body: dict, w: Worker) -> dict:
        if route == "completions" or w.chat_token_ids:
            return dict(body, return_token_ids=True)
        return dict(body)

    async def _leg(self, pool: str, route: str, body: dict, text: str, headers: dict, deadline: float,
                   timeout: float, stream: bool, phase: str, want_ids: bool = True,
                   exclude: Optional[set] = None) -> tuple[Worker, httpx.Response]:
        """One leg with retries over ``pool``; returns (worker, 200 response); the worker's in_flight
        is incremented (the caller decrements). Raises RouterError / _ClientError."""
        exclude = set() if exclude is None else exclude
        last = None
        for attempt in range(self.config.max_attempts):
            w = await self.pick(pool, text, exclude, deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            w.in_flight += 1
            b = self._with_ids(route, body, w) if want_ids else body
            try:
                try:
                    resp = await self._post(w, ROUTES[route] if route in ROUTES else route, b, headers,
                                            min(timeout, left), stream)
                except _ClientError as exc:
                    if b.get("return_token_ids") and not body.get("return_token_ids") \
                            and b"return_token_ids" in exc.content:
                        w.chat_token_ids = False  # an older worker: no ids on chat
                        resp = await self._post(w, ROUTES[route], body, headers, min(timeout, left), stream)
                    else:
                        raise
                w.breaker.record_success()
                return w, resp
            except _LegFailed as exc:
                w.in_flight -= 1
                self.failed(exc)
                exclude.add(w.url)
                last = exc
                self.metrics.retries.labels(phase).inc()
            except BaseException:
                w.in_flight -= 1
                w.breaker.record_success()  # a client error is not the worker's failure
                raise
        if time.monotonic() >= deadline:
            raise RouterError(504, f"the request deadline passed during {phase} ({last})", "timeout")
        raise RouterError(503, f"{phase} failed on {self.config.max_attempts} workers; last: {last}")

    # ------------------------------------------------------------------ P/D

    def _prefill_pool(self, text: str) -> str:
        th = self.config.long_prompt_threshold
        return "prefill_long" if th > 0 and len(text) / 4 >= th else "prefill"

    async def _prefill(self, route: str, body: dict, text: str, headers: dict, deadline: float) -> tuple[dict, Any]:
        """The prefill leg; returns (kv_transfer_params, prompt_token_ids or None)."""
        pb = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream_options")}
        pb.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        t0 = time.monotonic()
        for _ in range(self.config.max_attempts):
            w, resp = await self._leg(self._prefill_pool(text), route, pb, text, headers, deadline,
                                      self.config.prefill_timeout, False, "prefill")
            w.in_flight -= 1
            try:
                data = resp.json()
                kv = data["kv_transfer_params"]
                if not isinstance(kv, dict):
                    raise TypeError("kv_transfer_params is not an object")
            except (ValueError, KeyError, TypeError) as exc:
                self.failed(_LegFailed(w, "status", f"prefill response without kv_transfer_params ({exc})"))
                continue
            self.metrics.phase.labels("prefill").observe(time.monotonic() - t0)
            ch = (data.get("choices") or [{}])[0]
            return kv, ch.get("prompt_token_ids") or data.get("prompt_token_ids")
        raise RouterError(503, "no prefill worker returned kv_transfer_params")

    # ------------------------------------------------------------------ entry

    async def handle(self, route: str, body: dict, traceparent: str):
        """Returns ``(status, json_dict)`` or an async iterator of SSE strings. Raises RouterError."""
        if not isinstance(body, dict):
            raise RouterError(400, "the request body must be a JSON object")
        cfg, t0 = self.config, time.monotonic()
        deadline = t0 + cfg.request_timeout
        text = routing_text(route, body)
        headers = {"traceparent": traceparent}
        pd = self.registry.mode() == "pd"
        stream = bool(body.get("stream"))
        if not stream:
            return await self._unary(route, body, text, headers, deadline, pd)
        st = _Stream()
        if route == "completions" and isinstance(body.get("prompt"), list) and body["prompt"] \
                and isinstance(body["prompt"][0], int):
            st.prompt_ids = list(body["prompt"])
        w, resp = await self._open_stream(route, body, text, headers, deadline, pd, st)
        return self._relay(route, body, text, headers, deadline, pd, st, w, resp)

    async def _unary(self, route, body, text, headers, deadline, pd) -> tuple[int, dict]:
        last = None
        for _ in range(self.config.max_attempts):
            b = body
            if pd:
                kv, _ = await self._prefill(route, body, text, headers, deadline)
                b = dict(body, kv_transfer_params=kv)
            try:
                w, resp = await self._leg("decode" if pd else "worker", route, b, text, headers, deadline,
                                          self.config.request_timeout, False, "decode", want_ids=False)
            except _ClientError as exc:
                return exc.status, _json_or_error(exc)
            w.in_flight -= 1
            try:
                return 200, resp.json()
            except ValueError as exc:
                last = exc
                self.failed(_LegFailed(w, "stream", "response is not JSON"))
        raise RouterError(503, f"no worker returned a valid response ({last})")

    async def _open_stream(self, route, body, text, headers, deadline, pd, st: _Stream,
                           exclude: Optional[set] = None):
        b = body
        if pd:
            kv, pids = await self._prefill(route, body, text, headers, deadline)
            if pids and st.prompt_ids is None:
                st.prompt_ids = list(pids)
            b = dict(body, kv_transfer_params=kv)
        return await self._leg("decode" if pd else "worker", route, b, text, headers, deadline,
                               self.config.decode_first_token_timeout, True, "decode", exclude=exclude)

    async def _recovery_leg(self, route, body, text, headers, deadline, pd, st: _Stream, exclude: set):
        """Re-prefill prompt + generated ids on a healthy worker; returns (worker, response) or None
        when nothing is left to generate."""
        pool = "decode" if pd else "worker"
        if route == "chat":
            orig = body.get("max_completion_tokens") or body.get("max_tokens")
        else:
            orig = body.get("max_tokens", 16)
        left = None if orig is None else int(orig) - len(st.gen_ids)
        if left is not None and left <= 0:
            return None
        rb = {k: body[k] for k in RECOVERY_FIELDS if k in body}
        if body.get("min_tokens"):
            rb["min_tokens"] = max(0, int(body["min_tokens"]) - len(st.gen_ids))
        if left is not None:
            rb["max_tokens"] = left
        rb.update(stream=True, return_token_ids=True)
        if st.prompt_ids is None:
            ws = self.registry.routable(pool, frozenset(exclude)) or self.registry.routable(pool)
            if not ws:
                ws = [await self.pick(pool, text, exclude, deadline)]
            st.prompt_ids = await self._tokenize(ws[0], route, body, headers, deadline)
        rb["prompt"] = st.prompt_ids + st.gen_ids
        try:
            return await self._leg(pool, "completions", rb, text, headers, deadline,
                                   self.config.decode_first_token_timeout, True, "recovery", exclude=exclude)
        except _ClientError as exc:
            raise RouterError(502, f"re-prefill refused by the worker: {exc.content[:200]!r}") from None

    async def _tokenize(self, w: Worker, route, body, headers, deadline) -> list[int]:
        if route == "chat":
            tb = {"messages": body.get("messages"), "add_generation_prompt": body.get("add_generation_prompt", True)}
        else:
            tb = {"prompt": body.get("prompt")}
        if body.get("model"):
            tb["model"] = body["model"]
        try:
            resp = await self._post(w, "/tokenize", tb, headers, max(0.1, min(30.0, deadline - time.monotonic())),
                                    False)
            return list(resp.json()["tokens"])
        except (_LegFailed, _ClientError, KeyError, ValueError) as exc:
            raise RouterError(503, f"cannot tokenize the prompt for recovery: {exc}") from None

    async def _chunks(self, w: Worker, resp: httpx.Response, deadline: float) -> AsyncIterator[Any]:
        """Parsed ``data:`` payloads (dicts, then the string ``[DONE]``); raises _LegFailed on a cut
        stream, an error event, or no chunk within ``decode_first_token_timeout``."""
        it = resp.aiter_lines().__aiter__()
        gap = self.config.decode_first_token_timeout
        while True:
            t = min(gap, deadline - time.monotonic())
            if t <= 0:
                raise _LegFailed(w, "timeout", "request deadline passed while streaming")
            try:
                line = await asyncio.wait_for(it.__anext__(), t)
            except StopAsyncIteration:
                raise _LegFailed(w, "stream", "stream ended without [DONE]") from None
            except asyncio.TimeoutError:
                raise _LegFailed(w, "timeout", f"no chunk within {t:.1f} s") from None
            except httpx.HTTPError as exc:
                raise _LegFailed(w, "connect", f"stream broke: {type(exc).__name__}: {exc}") from None
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                yield data
                return
            try:
                obj = json.loads(data)
            except ValueError:
                raise _LegFailed(w, "stream", f"bad SSE payload {data[:100]!r}") from None
            if isinstance(obj, dict) and "error" in obj:
                raise _LegFailed(w, "stream", f"error event: {json.dumps(obj['error'])[:200]}")
            yield obj

    def _rewrite(self, route: str, obj: dict, st: _Stream, want_ids: bool, recovered: bool) -> Optional[dict]:
        """Record ids from a worker chunk; return the chunk the client gets (None: drop it)."""
        if st.id is None:
            st.id, st.created, st.model = obj.get("id"), obj.get("created"), obj.get("model")
        choices = obj.get("choices") or []
        if not choices:  # the usage chunk
            if recovered and isinstance(obj.get("usage"), dict) and st.prompt_ids is not None:
                n_p, n_g = len(st.prompt_ids), len(st.gen_ids)
                obj["usage"] = dict(obj["usage"], prompt_tokens=n_p, completion_tokens=n_g, total_tokens=n_p + n_g)
            obj.update(id=st.id, created=st.created, model=st.model)
            return obj
        for ch in choices:
            ids = ch.get("token_ids")
            pids = ch.get("prompt_token_ids") or obj.get("prompt_token_ids")
            if pids and st.prompt_ids is None and not recovered:
                st.prompt_ids = list(pids)
            content = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            if ids is not None:
                st.gen_ids.extend(ids)
            elif content:
                st.ids_ok = False
            if content or ids:
                st.content_sent = True
            if ch.get("finish_reason") is not None:
                st.finished = True
            if not want_ids:
                ch.pop("token_ids", None)
                ch.pop("prompt_token_ids", None)
                obj.pop("prompt_token_ids", None)
        if recovered and route == "chat":
            out = []
            for ch in choices:
                if not ch.get("text") and ch.get("finish_reason") is None and not want_ids:
                    continue
                c = {"index": ch.get("index", 0), "delta": {"content": ch["text"]} if ch.get("text") else {},
                     "logprobs": None, "finish_reason": ch.get("finish_reason"), "stop_reason": ch.get("stop_reason")}
                if want_ids and "token_ids" in ch:
                    c["token_ids"] = ch["token_ids"]
                out.append(c)
            if not out:
                return None
            obj = {"id": st.id, "object": "chat.completion.chunk", "created": st.created, "model": st.model,
                   "choices": out, **({"usage": None} if "usage" in obj else {})}
            return obj
        if route == "chat":
            for ch in choices:
                if (ch.get("delta") or {}).get("role"):
                    if st.role_sent:
                        ch["delta"] = {k: v for k, v in ch["delta"].items() if k != "role"}
                        if not ch["delta"].get("content") and ch.get("finish_reason") is None:
                            return None
                    st.role_sent = True
        obj.update(id=st.id, created=st.created, model=st.model)
        return obj

    async def _relay(self, route, body, text, headers, deadline, pd, st: _Stream, w: Worker, resp):
        """The client's SSE stream: relay, and on a worker failure restart or re-prefill elsewhere."""
        want_ids = bool(body.get("return_token_ids"))
        can_recover = _n_choices(route, body) == 1
        recovered, t0, first = False, time.monotonic(), True
        span = tracing.start_span("router.decode", tracing.parent_context(headers["traceparent"]), worker=w.url)
        exclude: set = set()
        try:
            while True:
                try:
                    try:
                        async for obj in self._chunks(w, resp, deadline):
                            if obj == "[DONE]":
                                yield "data: [DONE]\n\n"
                                return
                            out = self._rewrite(route, obj, st, want_ids, recovered)
                            if first and st.content_sent:
                                first = False
                                self.metrics.phase.labels("decode_first_token").observe(time.monotonic() - t0)
                            if out is not None:
                                yield f"data: {json.dumps(out, ensure_ascii=False)}\n\n"
                        raise _LegFailed(w, "stream", "stream ended")  # unreachable: _chunks raises
                    finally:
                        w.in_flight -= 1
                        await resp.aclose()
                except _LegFailed as exc:
                    self.failed(exc)
                    exclude.add(w.url)
                if st.finished:  # the worker died after the last token: only [DONE] / usage lost
                    yield "data: [DONE]\n\n"
                    return
                try:
                    if not st.content_sent:  # nothing generated yet: start over elsewhere
                        self.metrics.retries.labels("decode").inc()
                        w, resp = await self._open_stream(route, body, text, headers, deadline, pd, st, exclude)
                    elif can_recover and st.ids_ok:
                        logger.warning("re-prefilling after %d generated tokens", len(st.gen_ids))
                        self.metrics.reprefills.labels("decode" if pd else "worker").inc()
                        got = await self._recovery_leg(route, body, text, headers, deadline, pd, st, exclude)
                        if got is None:  # max_tokens reached exactly when the worker died
                            yield self._final_chunk(route, st, "length")
                            yield "data: [DONE]\n\n"
                            return
                        w, resp = got
                        recovered = True
                    else:
                        raise RouterError(502, "the worker failed mid-stream and the stream cannot be resumed "
                                               "(n > 1, or the worker sends no token ids)")
                except (RouterError, _ClientError) as exc:
                    err = exc if isinstance(exc, RouterError) else RouterError(502, f"worker answered {exc.status}")
                    logger.error("stream failed: %s", err.message)
                    self.metrics.requests.labels(route, "failed").inc()
                    yield f"data: {json.dumps(err.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            tracing.end_span(span, outcome="done" if st.finished else "ended", recovered=recovered)
            self.metrics.phase.labels("total").observe(time.monotonic() - t0)

    def _final_chunk(self, route: str, st: _Stream, reason: str) -> str:
        if route == "chat":
            ch = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason, "stop_reason": None}
            obj = {"id": st.id, "object": "chat.completion.chunk", "created": st.created, "model": st.model,
                   "choices": [ch]}
        else:
            ch = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason, "stop_reason": None}
            obj = {"id": st.id, "object": "text_completion", "created": st.created, "model": st.model,
                   "choices": [ch]}
        return f"data: {json.dumps(obj)}\n\n"


def _json_or_error(exc: _ClientError) -> dict:
    try:
        obj = json.loads(exc.content)
        if isinstance(obj, dict):
            return obj
    except ValueError:
        pass
    return RouterError(exc.status, exc.content.decode("utf-8", "replace")[:500]).body()
