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
import logging
import time
from typing import Optional

import httpx

from kvserve.router import tracing
from kvserve.router.common import (  # noqa: F401 - RouterConfig, RouterError: this module's API
    ROUTES,
    ClientError,
    LegFailed,
    RouterConfig,
    RouterError,
    StreamState,
    json_or_error,
    routing_text,
)
from kvserve.router.kv_events import KVEventHub, KVEventsPolicy, RoutingText
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import Candidate, make_policy
from kvserve.router.stream import StreamRelay
from kvserve.router.workers import Worker, WorkerRegistry

logger = logging.getLogger("kvserve")

class Router(StreamRelay):
    """The forwarding core: ``handle(route, body, traceparent)`` -> ``(status, dict)`` or an SSE iterator."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics,
                 client: httpx.AsyncClient, internal_secret: Optional[bytes] = None) -> None:
        self.config, self.registry, self.metrics, self.client = config, registry, metrics, client
        kw = {}
        if config.policy in ("cache_aware", "kv_events"):
            kw = dict(cache_threshold=config.cache_threshold, balance_abs=config.balance_abs_threshold,
                      balance_rel=config.balance_rel_threshold, max_tree_chars=config.max_tree_chars)
        self.kv_event_hub = None
        if config.policy == "kv_events":
            eps = {WorkerRegistry.normalize(u): ep for u, ep in config.kv_events_endpoints.items()}
            self.kv_event_hub = KVEventHub(eps, config.kv_events_topic, internal_secret)
            self.policies = {pool: KVEventsPolicy(self.kv_event_hub, config.kv_events_stale_after, **kw)
                             for pool in ("worker", "prefill", "prefill_long", "decode")}
        else:
            self.policies = {pool: make_policy(config.policy, **kw)
                             for pool in ("worker", "prefill", "prefill_long", "decode")}
        registry.on_remove.append(lambda url: [p.remove_worker(url) for p in self.policies.values()])
        self.queued = {pool: 0 for pool in self.policies}

    # ------------------------------------------------------------------ routing

    async def pick(self, pool: str, text: str, exclude: set, deadline: float, salt: Optional[str] = None) -> Worker:
        """A routable worker of ``pool`` (waiting up to ``queue_timeout`` for one); RouterError(503).
        ``salt``: the request's ``cache_salt`` (cache-aware placement keeps salts apart)."""
        with tracing.span("router.route", pool=pool, policy=self.config.policy) as sp:
            w = await self._pick(pool, text, exclude, deadline, salt)
            if sp is not None:
                sp.set_attribute("kvserve.worker", w.url)
            return w

    async def _pick(self, pool: str, text: str, exclude: set, deadline: float, salt: Optional[str] = None) -> Worker:
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
                    d = policy.choose(text, [Candidate(w.url, w.load) for w in ws], salt)
                    w = reg.get(d.url)
                    if w is None or not w.breaker.acquire():
                        continue
                    self.metrics.decisions.labels(policy.name, p, w.url, d.reason).inc()
                    if policy.name == "cache_aware":
                        self.metrics.cache(d.matched_chars, len(text))
                    self.metrics.phase.labels("route").observe(time.monotonic() - t0)
                    ids = getattr(text, "token_ids", None)
                    if policy.name == "kv_events" and ids and not d.reason.startswith("fallback"):
                        logger.info("route %s -> %s (%s, matched %d/%d tokens)", p, w.url, d.reason, d.matched_chars,
                                    len(ids))
                    else:
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

    def failed(self, exc: LegFailed) -> None:
        w = exc.worker
        w.breaker.record_failure()
        w.last_error = str(exc)
        if exc.kind == "connect":
            w.healthy = False  # until a health check passes
        self.metrics.worker_failures.labels(w.url, exc.kind).inc()
        logger.warning("worker failure (%s): %s; circuit %s", exc.kind, exc, w.breaker.state)

    # ------------------------------------------------------------------ one upstream call

    @staticmethod
    async def _watched(coro, w: Worker, timeout: float):
        """``coro``'s result within ``timeout`` s (asyncio.TimeoutError), given up early (LegFailed
        "timeout") once the worker fails a health check: a hung worker costs one check interval."""
        task = asyncio.ensure_future(coro)
        end = time.monotonic() + timeout
        try:
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise asyncio.TimeoutError
                done, _ = await asyncio.wait({task}, timeout=min(0.25, left))
                if done:
                    return task.result()
                if not w.healthy:
                    raise LegFailed(w, "timeout", "the worker stopped answering its health checks")
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - cancelled on purpose
                    pass

    async def _post(self, w: Worker, path: str, body: dict, headers: dict, timeout: float,
                    stream: bool) -> httpx.Response:
        """Send; returns a 200 response (streaming: headers read, body open). Raises LegFailed/ClientError."""
        req = self.client.build_request("POST", w.url + path, json=body, headers=headers,
                                        timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout))
        try:
            resp = await self._watched(self.client.send(req, stream=True), w, timeout)
        except asyncio.TimeoutError:
            raise LegFailed(w, "timeout", f"no response headers within {timeout:.1f} s") from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise LegFailed(w, "connect", f"{type(exc).__name__}: {exc}") from None
        except httpx.TimeoutException as exc:
            raise LegFailed(w, "timeout", f"{type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            raise LegFailed(w, "connect", f"{type(exc).__name__}: {exc}") from None
        if resp.status_code == 200:
            if not stream:
                try:
                    await self._watched(resp.aread(), w, max(0.1, timeout))
                except (asyncio.TimeoutError, httpx.HTTPError, LegFailed) as exc:
                    await resp.aclose()
                    raise LegFailed(w, "stream", f"body not read: {type(exc).__name__}") from None
            return resp
        try:
            content = await asyncio.wait_for(resp.aread(), 5.0)
        except (asyncio.TimeoutError, httpx.HTTPError):
            content = b""
        finally:
            await resp.aclose()
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
            raise ClientError(resp.status_code, content)
        raise LegFailed(w, "status", f"HTTP {resp.status_code}: {content[:200]!r}")

    def _with_ids(self, route: str, body: dict, w: Worker) -> dict:
        if route == "completions" or w.chat_token_ids:
            return dict(body, return_token_ids=True)
        return dict(body)

    async def _leg(self, pool: str, route: str, body: dict, text: str, headers: dict, deadline: float,
                   timeout: float, stream: bool, phase: str, want_ids: bool = True,
                   exclude: Optional[set] = None) -> tuple[Worker, httpx.Response]:
        """One leg with retries over ``pool``; returns (worker, 200 response); the worker's in_flight
        is incremented (the caller decrements). Raises RouterError / ClientError."""
        exclude = set() if exclude is None else exclude
        last = None
        for attempt in range(self.config.max_attempts):
            salt = body.get("cache_salt")
            w = await self.pick(pool, text, exclude, deadline, salt if isinstance(salt, str) else None)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            w.in_flight += 1
            b = self._with_ids(route, body, w) if want_ids else body
            try:
                try:
                    resp = await self._post(w, ROUTES[route] if route in ROUTES else route, b, headers,
                                            min(timeout, left), stream)
                except ClientError as exc:
                    if b.get("return_token_ids") and not body.get("return_token_ids") \
                            and b"return_token_ids" in exc.content:
                        w.chat_token_ids = False  # an older worker: no ids on chat
                        resp = await self._post(w, ROUTES[route], body, headers, min(timeout, left), stream)
                    else:
                        raise
                w.breaker.record_success()
                return w, resp
            except LegFailed as exc:
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

    async def _prefill(self, route: str, body: dict, text: str, headers: dict, deadline: float) -> tuple:
        """The prefill leg; returns (kv_transfer_params, prompt_token_ids or None, (monotonic s, epoch ns)
        when it answered)."""
        pb = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream_options")}
        pb.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        t0 = time.monotonic()
        for _ in range(self.config.max_attempts):
            with tracing.span("router.prefill", tracing.parent_context(headers["traceparent"]),
                              pool=self._prefill_pool(text)):
                w, resp = await self._leg(self._prefill_pool(text), route, pb, text, headers, deadline,
                                          self.config.prefill_timeout, False, "prefill")
            w.in_flight -= 1
            try:
                data = resp.json()
                kv = data["kv_transfer_params"]
                if not isinstance(kv, dict):
                    raise TypeError("kv_transfer_params is not an object")
            except (ValueError, KeyError, TypeError) as exc:
                self.failed(LegFailed(w, "status", f"prefill response without kv_transfer_params ({exc})"))
                continue
            self.metrics.phase.labels("prefill").observe(time.monotonic() - t0)
            ch = (data.get("choices") or [{}])[0]
            return kv, ch.get("prompt_token_ids") or data.get("prompt_token_ids"), (time.monotonic(), time.time_ns())
        raise RouterError(503, "no prefill worker returned kv_transfer_params")

    async def _routing_ids(self, route: str, body: dict, headers: dict, pool: str) -> Optional[list[int]]:
        """The prompt's token ids for the kv_events policy: a completions prompt of ids as is, else a
        routable worker's ``POST /tokenize`` (its tokenizer and chat template); None on any failure."""
        p = body.get("prompt")
        if route == "completions" and isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return list(p)
        if route == "chat":
            req = {"messages": body.get("messages"), "add_generation_prompt": body.get("add_generation_prompt", True)}
        elif isinstance(p, str):
            req = {"prompt": p}
        else:
            return None  # a batch of prompts: the approximate policy decides
        if body.get("model") is not None:
            req["model"] = body["model"]
        ws = self.registry.routable(pool)
        if not ws:
            return None
        w = min(ws, key=lambda w: w.load)
        try:
            resp = await self.client.post(f"{w.url}/tokenize", json=req, headers=headers,
                                          timeout=self.config.connect_timeout)
            ids = resp.json().get("tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.debug("kv_events: /tokenize on %s failed: %s", w.url, exc)
            return None
        return ids if isinstance(ids, list) else None

    # ------------------------------------------------------------------ entry

    async def handle(self, route: str, body: dict, traceparent: str, authorization: Optional[str] = None):
        """Returns ``(status, json_dict)`` or an async iterator of SSE strings. Raises RouterError."""
        if not isinstance(body, dict):
            raise RouterError(400, "the request body must be a JSON object")
        cfg, t0 = self.config, time.monotonic()
        deadline = t0 + cfg.request_timeout
        text = routing_text(route, body)
        headers = {"traceparent": traceparent}
        if authorization:  # the client's API key goes to the workers as is
            headers["authorization"] = authorization
        pd = self.registry.mode() == "pd"
        if self.kv_event_hub is not None and self.kv_event_hub.indexes:
            text = RoutingText(text, await self._routing_ids(route, body, headers, "prefill" if pd else "worker"),
                               body.get("cache_salt"))
        stream = bool(body.get("stream"))
        if not stream:
            return await self._unary(route, body, text, headers, deadline, pd)
        st = StreamState()
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
                kv, _, _ = await self._prefill(route, body, text, headers, deadline)
                b = dict(body, kv_transfer_params=kv)
            try:
                w, resp = await self._leg("decode" if pd else "worker", route, b, text, headers, deadline,
                                          self.config.request_timeout, False, "decode", want_ids=False)
            except ClientError as exc:
                return exc.status, json_or_error(exc)
            w.in_flight -= 1
            try:
                return 200, resp.json()
            except ValueError as exc:
                last = exc
                self.failed(LegFailed(w, "stream", "response is not JSON"))
        raise RouterError(503, f"no worker returned a valid response ({last})")

    async def _open_stream(self, route, body, text, headers, deadline, pd, st: StreamState,
                           exclude: Optional[set] = None):
        b = body
        if pd:
            kv, pids, st.prefill_done = await self._prefill(route, body, text, headers, deadline)
            if pids and st.prompt_ids is None:
                st.prompt_ids = list(pids)
            b = dict(body, kv_transfer_params=kv)
        return await self._leg("decode" if pd else "worker", route, b, text, headers, deadline,
                               self.config.decode_first_token_timeout, True, "decode", exclude=exclude)
