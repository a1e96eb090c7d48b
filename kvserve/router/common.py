"""Shared pieces of the router: configuration, errors, per-stream state, request helpers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from kvserve.router.workers import Worker

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


class LegFailed(Exception):
    """A worker failed this leg (``kind``: connect | status | stream | timeout)."""

    def __init__(self, worker: Worker, kind: str, message: str) -> None:
        super().__init__(f"{worker.url}: {message}")
        self.worker, self.kind = worker, kind


class ClientError(Exception):
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
    #: cache_aware: min matched fraction of the request, imbalance test (requests, ratio), tree bound (chars).
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1 << 22
    #: kv_events: worker URL -> (event endpoint, replay endpoint or None); seconds without events
    #: (after uncached blocks were sent) before the approximate fallback; the event topic.
    kv_events_endpoints: dict = field(default_factory=dict)
    kv_events_stale_after: float = 10.0
    kv_events_topic: str = ""


@dataclass
class StreamState:
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
    #: (monotonic s, epoch ns) when the prefill leg answered (P/D), for the transfer-wait phase.
    prefill_done: Optional[tuple[float, int]] = None
    #: Text of choice 0 the client got so far (recovered legs recompute text from all ids).
    sent_text: str = ""


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


def n_choices(route: str, body: dict) -> int:
    n = body.get("n") or 1
    p = body.get("prompt")
    if route == "completions" and isinstance(p, list) and p and not isinstance(p[0], int):
        n *= len(p)
    return int(n)


def json_or_error(exc: ClientError) -> dict:
    try:
        obj = json.loads(exc.content)
        if isinstance(obj, dict):
            return obj
    except ValueError:
        pass
    return RouterError(exc.status, exc.content.decode("utf-8", "replace")[:500]).body()
