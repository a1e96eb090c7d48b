"""Router spans through OpenTelemetry, only when an exporter is configured.

``setup_tracing(endpoint)`` turns tracing on when ``--otlp-traces-endpoint URL`` is given
(OTLP over HTTP or gRPC: needs ``opentelemetry-exporter-otlp``; ImportError names it) or the
environment has ``OTEL_TRACES_EXPORTER=console`` (spans printed as JSON on stdout, for tests).
Otherwise ``span()`` is a no-op context manager: no SDK import, no per-request work.

Spans per request: ``router.request`` (the whole request; child of the client's
``traceparent``), and per phase ``router.route`` (queue + policy), ``router.prefill``,
``router.transfer_wait`` (prefill response to the decode worker's first chunk),
``router.decode``, ``router.recovery`` (a re-prefill after a worker failure). Attributes:
``kvserve.worker``, ``kvserve.pool``, ``kvserve.policy``, ``kvserve.outcome``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

_tracer = None


def setup_tracing(endpoint: Optional[str] = None, service_name: str = "kvserve-router") -> bool:
    """Configure the global tracer; returns whether tracing is on."""
    global _tracer
    console = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console"
    if not endpoint and not console:
        _tracer = None
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if console:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if endpoint:
        try:
            if endpoint.startswith(("http://", "https://")) and "4317" not in endpoint:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ImportError("--otlp-traces-endpoint needs the opentelemetry-exporter-otlp package "
                              f"(pip install opentelemetry-exporter-otlp): {exc}") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("kvserve.router")
    return True


def enabled() -> bool:
    return _tracer is not None


def parent_context(traceparent: str):
    """The OpenTelemetry context of a ``traceparent`` header (None when tracing is off)."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


@contextlib.contextmanager
def span(name: str, context=None, **attributes):
    """A span named ``name`` (no-op when tracing is off); yields the span or None."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, context=context) as sp:
        for k, v in attributes.items():
            if v is not None:
                sp.set_attribute(f"kvserve.{k}", v)
        yield sp


def current_traceparent(fallback: str) -> str:
    """The ``traceparent`` to send upstream: the current span's when tracing is on, else ``fallback``."""
    if _tracer is None:
        return fallback
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return fallback
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def start_span(name: str, context=None, start_time: Optional[int] = None, **attributes):
    """A started (not current) span, or None when tracing is off; end it with ``end_span``.
    For phases that cross ``yield``s of a streaming body (no context variable is touched).
    ``start_time``: epoch nanoseconds (default: now)."""
    if _tracer is None:
        return None
    sp = _tracer.start_span(name, context=context, start_time=start_time)
    for k, v in attributes.items():
        if v is not None:
            sp.set_attribute(f"kvserve.{k}", v)
    return sp


def end_span(sp, **attributes) -> None:
    if sp is None:
        return
    for k, v in attributes.items():
        if v is not None:
            sp.set_attribute(f"kvserve.{k}", v)
    sp.end()


def context_of(sp):
    """A context whose parent is ``sp`` (for child spans), or None."""
    if sp is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(sp)
