"""The request path of ``kvserve bench serve``: an async streaming OpenAI-API client.

Only the standard library and ``httpx`` are used here (no kvserve imports), so it measures
any OpenAI-compatible server. Every request streams (``stream=true`` with
``stream_options.include_usage``) and fixes ``max_tokens`` with ``ignore_eos`` so that the
output lengths are the workload's.

Per request (seconds, ``time.perf_counter``):

* ``ttft``: from sending the request to the first chunk that carries output text.
* ``itl``: every gap between consecutive output-carrying chunks.
* ``e2el``: from sending the request to the end of the stream.
* ``tpot``: ``(e2el - ttft) / (output_tokens - 1)`` (None for one-token outputs).

``output_tokens`` is the server's ``usage.completion_tokens`` when it sends usage, else the
number of output-carrying chunks. A chunk carries output when it has text, or, from a
server without a tokenizer, ``token_ids``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)

Prompt = Union[str, list[int]]


@dataclass
class RequestResult:
    """Measurements of one streamed request (times in seconds).

    Attributes:
        success: the stream completed with HTTP 200 and no error event.
        error: the error text when not ``success``.
        prompt_tokens: ``usage.prompt_tokens`` from the server, else the client's estimate.
        output_tokens: ``usage.completion_tokens``, else the count of output chunks.
        ttft, e2el, itl: see the module docstring.
        start: ``perf_counter`` time the request was sent.
        text: the generated text (the next turn's history in multi-turn chats).
    """

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first (seconds); None for < 2 output tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def build_payload(
    endpoint: str, model: str, prompt: Optional[Prompt], messages: Optional[list[dict]],
    max_tokens: int, extra_body: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The JSON body of one streamed request (greedy, ``ignore_eos``, fixed ``max_tokens``)."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT_COMPLETIONS:
        if messages is None:
            if not isinstance(prompt, str):
                raise ValueError("/v1/chat/completions needs text prompts (token-id prompts need /v1/completions)")
            messages = [{"role": "user", "content": prompt}]
        body["messages"] = messages
    else:
        if prompt is None:
            raise ValueError("/v1/completions needs a prompt")
        body["prompt"] = prompt
    if extra_body:
        body.update(extra_body)
    return body


def _chunk_text(endpoint: str, obj: dict) -> Optional[str]:
    """Output text of one stream chunk, or None when it carries none (role/usage chunks).
    A chunk with no text but non-empty ``token_ids`` (a server without a tokenizer, e.g.
    ``kvserve serve --skip-tokenizer-init``, or vLLM's ``return_token_ids``) is output too: ``""``."""
    choices = obj.get("choices") or []
    if not choices:
        return None
    ch = choices[0]
    if endpoint == CHAT_COMPLETIONS:
        text = (ch.get("delta") or {}).get("content")
    else:
        text = ch.get("text")
    if text:
        return text
    return "" if ch.get("token_ids") else None


async def send_request(
    client: Any, url: str, endpoint: str, payload: dict[str, Any], prompt_tokens_estimate: int = 0,
    headers: Optional[dict[str, str]] = None,
) -> RequestResult:
    """POST ``payload`` to ``url`` with ``client`` (an ``httpx.AsyncClient``), read the SSE
    stream and time it. Never raises for server or network errors: they give
    ``success=False`` with ``error`` set."""
    res = RequestResult(prompt_tokens=prompt_tokens_estimate)
    pieces: list[str] = []
    chunks = 0
    usage: Optional[dict] = None
    last = None
    res.start = start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {body[:200]}"
                res.e2el = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    res.e2el = now - start
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                text = _chunk_text(endpoint, obj)
                if text is None:
                    continue
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                pieces.append(text)
        res.e2el = time.perf_counter() - start
    except Exception as exc:  # network errors, bad JSON: a failed request, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
        res.e2el = time.perf_counter() - start
        return res
    if chunks == 0:
        res.error = "no output in the stream"
        return res
    res.text = "".join(pieces)
    res.output_tokens = int(usage.get("completion_tokens") or chunks) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        res.prompt_tokens = int(usage["prompt_tokens"])
    res.success = True
    return res


# --------------------------------------------------------------------------- arrivals

def arrival_gaps(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` inter-arrival gaps (seconds) of a gamma renewal process with mean ``1/request_rate``.

    ``burstiness`` is the gamma shape: 1 gives a Poisson process (exponential gaps), < 1
    burstier, > 1 more regular. ``request_rate=inf`` gives all zeros (everything at once).
    The first gap is drawn too, so the first request is not always at t=0.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)  # mean = shape * scale = 1 / rate
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


# --------------------------------------------------------------------------- load driver

#: One unit of work: an async callable given a "send" function; returns its request results.
#: A single-turn request is one call of ``send``; a chat session awaits each turn in turn.
Session = Callable[[Callable[..., Awaitable[RequestResult]]], Awaitable[list[RequestResult]]]


async def run_sessions(
    sessions: Sequence[Session], send: Callable[..., Awaitable[RequestResult]], *,
    request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
    max_concurrency: Optional[int] = None, on_done: Optional[Callable[[RequestResult], None]] = None,
) -> tuple[list[list[RequestResult]], float]:
    """Start ``sessions`` at gamma/Poisson arrival times and run them concurrently.

    ``send(*args)`` performs one request; at most ``max_concurrency`` of them are in flight
    at once (requests wait for a slot; their latency is counted from when they are sent).
    Returns the per-session results (in ``sessions`` order) and the wall time in seconds
    from the start to the last completion.
    """
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited_send(*args, **kwargs) -> RequestResult:
        if sem is None:
            r = await send(*args, **kwargs)
        else:
            async with sem:
                r = await send(*args, **kwargs)
        if on_done is not None:
            on_done(r)
        return r

    gaps = arrival_gaps(len(sessions), request_rate, burstiness, seed)
    t0 = time.perf_counter()
    tasks = []
    t_next = 0.0
    for sess, gap in zip(sessions, gaps):
        t_next += gap
        delay = t0 + t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(sess(limited_send)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0
