"""``kvserve router`` and ``kvserve launch``: an OpenAI-compatible router over kvserve workers.

Modules: ``policies`` (cache-aware / least-loaded / round-robin, pure), ``workers`` (pools,
circuit breakers), ``proxy`` (forwarding, P/D legs, retries, deadlines, mid-stream recovery),
``app`` (FastAPI app, health loop, admin routes, the ``router`` command), ``metrics``
(Prometheus), ``tracing`` (OpenTelemetry spans when configured), ``launch`` (``kvserve
launch``: workers + router as one supervised deployment). Guide: docs/disaggregation.md.
"""
