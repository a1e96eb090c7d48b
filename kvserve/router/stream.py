"""The streaming half of the router: relaying SSE, recovery by re-prefill, chunk re-wrapping.

``StreamRelay`` is mixed into ``proxy.Router`` (it uses its ``_leg``, ``_post``, ``pick``,
``failed``, ``_open_stream``, ``registry``, ``metrics`` and ``config``). The behaviour is
described in ``proxy``'s docstring and docs/disaggregation.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Optional

import httpx

from kvserve.router import tracing
from kvserve.router.common import RECOVERY_FIELDS, ClientError, LegFailed, RouterError, StreamState, n_choices
from kvserve.router.workers import Worker

logger = logging.getLogger("kvserve")


class StreamRelay:
    async def _recovery_leg(self, route, body, text, headers, deadline, pd, st: StreamState, exclude: set):
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
        except ClientError as exc:
            raise RouterError(502, f"re-prefill refused by the worker: {exc.content[:200]!r}") from None

    async def _recovered_text(self, w: Worker, obj: dict, st: StreamState, headers: dict, deadline: float) -> None:
        """On a re-prefilled leg, set the chunk's text to what one uninterrupted worker would have
        sent: the text of all generated ids (``POST /detokenize`` on ``w``) past what the client
        already got. This restores text the failed worker held back (a possible stop-string
        prefix, a UTF-8 character split over tokens), which the new worker, decoding only its
        own tokens, cannot know. A trailing partial character stays held until it completes;
        an EOS / stop token id adds no text; a stop string cuts the text as the worker would."""
        for ch in obj.get("choices") or []:
            ids = ch.get("token_ids")
            if ids is None or ch.get("index", 0) != 0:
                continue
            finish, stop_reason = ch.get("finish_reason"), ch.get("stop_reason")
            use = st.gen_ids + list(ids)
            if finish == "stop" and not isinstance(stop_reason, str) and ids:
                use = use[:-1]  # EOS or a stop_token_ids id: not part of the text
            try:
                resp = await self._post(w, "/detokenize", {"tokens": use}, headers,
                                        max(0.1, min(10.0, deadline - time.monotonic())), False)
                full = resp.json()["prompt"]
            except (LegFailed, ClientError, KeyError, ValueError) as exc:
                raise LegFailed(w, "stream", f"detokenize failed during recovery: {exc}") from None
            if isinstance(stop_reason, str) and stop_reason:
                cut = full.find(stop_reason, max(0, len(st.sent_text) - len(stop_reason) + 1))
                if cut >= 0:
                    full = full[:cut]
            if finish is None:
                while full.endswith("\ufffd"):
                    full = full[:-1]
            ch["text"] = full[len(st.sent_text):] if full.startswith(st.sent_text) else ch.get("text", "")

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
        except (LegFailed, ClientError, KeyError, ValueError) as exc:
            raise RouterError(503, f"cannot tokenize the prompt for recovery: {exc}") from None

    async def _chunks(self, w: Worker, resp: httpx.Response, deadline: float) -> AsyncIterator[Any]:
        """Parsed ``data:`` payloads (dicts, then the string ``[DONE]``); raises LegFailed on a cut
        stream, an error event, or no chunk within ``decode_first_token_timeout``."""
        it = resp.aiter_lines().__aiter__()
        gap = self.config.decode_first_token_timeout
        while True:
            t = min(gap, deadline - time.monotonic())
            if t <= 0:
                raise LegFailed(w, "timeout", "request deadline passed while streaming")
            try:
                line = await asyncio.wait_for(it.__anext__(), t)
            except StopAsyncIteration:
                raise LegFailed(w, "stream", "stream ended without [DONE]") from None
            except asyncio.TimeoutError:
                raise LegFailed(w, "timeout", f"no chunk within {t:.1f} s") from None
            except httpx.HTTPError as exc:
                raise LegFailed(w, "connect", f"stream broke: {type(exc).__name__}: {exc}") from None
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                yield data
                return
            try:
                obj = json.loads(data)
            except ValueError:
                raise LegFailed(w, "stream", f"bad SSE payload {data[:100]!r}") from None
            if isinstance(obj, dict) and "error" in obj:
                raise LegFailed(w, "stream", f"error event: {json.dumps(obj['error'])[:200]}")
            yield obj

    def _rewrite(self, route: str, obj: dict, st: StreamState, want_ids: bool, recovered: bool) -> Optional[dict]:
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
            if content:
                st.sent_text += content
            if ch.get("finish_reason") is not None:
                st.finished = True
            # Ids the client did not ask for are dropped, except from a worker without a
            # tokenizer (no text so far): its ids are the output, as when called directly.
            if not want_ids and (content or st.sent_text or not ids):
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

    async def _relay(self, route, body, text, headers, deadline, pd, st: StreamState, w: Worker, resp):
        """The client's SSE stream: relay, and on a worker failure restart or re-prefill elsewhere."""
        want_ids = bool(body.get("return_token_ids"))
        can_recover = n_choices(route, body) == 1
        outcome, done = None, False
        recovered, t0, first = False, time.monotonic(), True
        span = tracing.start_span("router.decode", tracing.parent_context(headers["traceparent"]), worker=w.url)
        exclude: set = set()
        try:
            while True:
                try:
                    try:
                        async for obj in self._chunks(w, resp, deadline):
                            if obj == "[DONE]":
                                done = True
                                yield "data: [DONE]\n\n"
                                return
                            if recovered:
                                await self._recovered_text(w, obj, st, headers, deadline)
                            out = self._rewrite(route, obj, st, want_ids, recovered)
                            if first and st.content_sent:
                                first = False
                                self.metrics.phase.labels("decode_first_token").observe(time.monotonic() - t0)
                                if st.prefill_done is not None:  # P/D: prefill answer -> first decode chunk
                                    self.metrics.phase.labels("transfer_wait").observe(
                                        time.monotonic() - st.prefill_done[0])
                                    tw = tracing.start_span("router.transfer_wait", tracing.context_of(span),
                                                            start_time=st.prefill_done[1], worker=w.url)
                                    tracing.end_span(tw)
                            if out is not None:
                                yield f"data: {json.dumps(out, ensure_ascii=False)}\n\n"
                        raise LegFailed(w, "stream", "stream ended")  # unreachable: _chunks raises
                    finally:
                        w.in_flight -= 1
                        await resp.aclose()
                except LegFailed as exc:
                    self.failed(exc)
                    exclude.add(w.url)
                if st.finished:  # the worker died after the last token: only [DONE] / usage lost
                    done = True
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
                            done = True
                            yield "data: [DONE]\n\n"
                            return
                        w, resp = got
                        recovered = True
                    else:
                        raise RouterError(502, "the worker failed mid-stream and the stream cannot be resumed "
                                               "(n > 1, or the worker sends no token ids)")
                except (RouterError, ClientError) as exc:
                    err = exc if isinstance(exc, RouterError) else RouterError(502, f"worker answered {exc.status}")
                    logger.error("stream failed: %s", err.message)
                    outcome = "failed"
                    yield f"data: {json.dumps(err.body())}\n\n"
                    done = True
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if outcome is None:  # no error event: "ok" once the client got [DONE], else it left early
                outcome = "ok" if done else "client_disconnect"
            self.metrics.requests.labels(route, outcome).inc()
            tracing.end_span(span, outcome=outcome, recovered=recovered)
            self.metrics.phase.labels("total").observe(time.monotonic() - t0)

    def _final_chunk(self, route: str, st: StreamState, reason: str) -> str:
        if route == "chat":
            ch = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason, "stop_reason": None}
            obj = {"id": st.id, "object": "chat.completion.chunk", "created": st.created, "model": st.model,
                   "choices": [ch]}
        else:
            ch = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason, "stop_reason": None}
            obj = {"id": st.id, "object": "text_completion", "created": st.created, "model": st.model,
                   "choices": [ch]}
        return f"data: {json.dumps(obj)}\n\n"
