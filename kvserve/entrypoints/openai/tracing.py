"""W3C trace context on the API server: ``traceparent`` in, trace id in the logs, echoed out.

``TraceMiddleware`` (pure ASGI, registered by ``build_app``): for a request carrying a valid
``traceparent`` header (``00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>``) it sets
the ``trace_id`` context variable for the request's task, logs one INFO line
``trace_id=... POST /v1/completions -> 200 (0.123 s)`` when the response ends, and echoes
the header in the response. Requests without the header cost one dict lookup. An invalid
header is ignored (W3C: restart the trace), never an error.

``TraceIdFilter`` (installed on the ``kvserve`` logger's handlers by ``install_log_filter``)
prefixes every log record emitted inside such a request with ``[trace_id=...]``, so every
line about the request carries the id (streaming responses included: the body generator runs
in the request's context).
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import time
from typing import Optional

#: The current request's W3C trace id (32 lowercase hex), or None outside traced requests.
trace_id_var: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("kvserve_trace_id", default=None)

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
logger = logging.getLogger("kvserve")


def parse_traceparent(value: Optional[str]) -> Optional[tuple[str, str, str]]:
    """``(trace_id, parent_id, flags)`` of a valid header, else None (all-zero ids are invalid)."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff" or set(m.group(2)) == {"0"} or set(m.group(3)) == {"0"}:
        return None
    return m.group(2), m.group(3), m.group(4)


def new_traceparent(trace_id: Optional[str] = None, sampled: bool = True) -> str:
    """A fresh ``traceparent`` (new span id; new trace id unless given)."""
    tid = trace_id or os.urandom(16).hex()
    return f"00-{tid}-{os.urandom(8).hex()}-{'01' if sampled else '00'}"


class TraceIdFilter(logging.Filter):
    """Prefixes records emitted inside a traced request with ``[trace_id=...]`` (once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        tid = trace_id_var.get()
        record.trace_id = tid or ""
        if tid and not getattr(record, "_trace_prefixed", False):
            record.msg = f"[trace_id={tid}] {record.msg}"
            record._trace_prefixed = True
        return True


def install_log_filter(log: logging.Logger = logger) -> None:
    """Add ``TraceIdFilter`` to ``log``'s handlers (idempotent)."""
    for h in log.handlers:
        if not any(isinstance(f, TraceIdFilter) for f in h.filters):
            h.addFilter(TraceIdFilter())


class TraceMiddleware:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app) -> None:
        self.app = app
        install_log_filter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = None
        for k, v in scope.get("headers") or ():
            if k == b"traceparent":
                raw = v.decode("latin-1")
                break
        parsed = parse_traceparent(raw)
        if parsed is None:
            return await self.app(scope, receive, send)
        token = trace_id_var.set(parsed[0])
        t0, status = time.monotonic(), [0]
        echo = raw.strip().lower().encode()

        async def send_with_header(msg) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                msg = dict(msg, headers=[*msg.get("headers", []), (b"traceparent", echo)])
            await send(msg)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            logger.info("%s %s -> %s (%.3f s)", scope.get("method"), scope.get("path"), status[0],
                        time.monotonic() - t0)
            trace_id_var.reset(token)
