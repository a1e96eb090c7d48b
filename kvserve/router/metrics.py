"""Prometheus metrics of ``kvserve router`` (own ``CollectorRegistry``; ``kvserve_router:`` prefix).

Counters (``_total`` in the text format):

* ``kvserve_router:requests`` (labels ``route``: completions | chat; ``outcome``: ok |
  client_error | no_worker | failed | timeout | client_disconnect; a stream is counted when it ends)
* ``kvserve_router:routing_decisions`` (``policy``, ``pool``, ``worker``, ``reason``)
* ``kvserve_router:cache_matched_chars`` / ``kvserve_router:cache_request_chars`` (cache-aware
  hit rate = matched / request characters; also the gauge ``kvserve_router:cache_hit_rate``)
* ``kvserve_router:reprefills`` (a stream continued on another worker after a failure; ``pool``)
* ``kvserve_router:retries`` (a leg re-sent to another worker before any output; ``phase``)
* ``kvserve_router:worker_failures`` (``worker``, ``kind``: connect | status | stream | timeout)

Gauges: ``kvserve_router:pool_in_flight`` and ``kvserve_router:pool_queue_depth`` (``pool``:
requests in flight at the router's workers / requests waiting in the router for a worker),
``kvserve_router:worker_healthy`` (``worker``, ``pool``: 1 or 0), ``kvserve_router:worker_circuit_open``.

Histograms (seconds): ``kvserve_router:phase_latency_seconds`` (``phase``: route | prefill |
transfer_wait | decode_first_token | total).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvserve_router:"
        self.requests = Counter(p + "requests", "Requests by route and outcome.", ["route", "outcome"], registry=r)
        self.decisions = Counter(p + "routing_decisions", "Routing decisions.",
                                 ["policy", "pool", "worker", "reason"], registry=r)
        self.matched_chars = Counter(p + "cache_matched_chars", "Cache-aware matched prefix characters.",
                                     registry=r)
        self.request_chars = Counter(p + "cache_request_chars", "Cache-aware request characters.", registry=r)
        self.hit_rate = Gauge(p + "cache_hit_rate", "Cache-aware matched / request characters so far.",
                              registry=r)
        self.reprefills = Counter(p + "reprefills", "Streams continued on another worker (re-prefill).",
                                  ["pool"], registry=r)
        self.retries = Counter(p + "retries", "Legs re-sent before any output.", ["phase"], registry=r)
        self.worker_failures = Counter(p + "worker_failures", "Worker failures seen by the router.",
                                       ["worker", "kind"], registry=r)
        self.pool_in_flight = Gauge(p + "pool_in_flight", "Requests in flight per pool.", ["pool"], registry=r)
        self.pool_queue = Gauge(p + "pool_queue_depth", "Requests waiting for a worker per pool.", ["pool"],
                                registry=r)
        self.worker_healthy = Gauge(p + "worker_healthy", "1 if the worker passed its last health check.",
                                    ["worker", "pool"], registry=r)
        self.worker_open = Gauge(p + "worker_circuit_open", "1 while the worker's circuit breaker is open.",
                                 ["worker", "pool"], registry=r)
        self.phase = Histogram(p + "phase_latency_seconds", "Latency per phase.", ["phase"], buckets=_BUCKETS,
                               registry=r)
        self._m = self._q = 0.0

    def cache(self, matched: int, total: int) -> None:
        self.matched_chars.inc(matched)
        self.request_chars.inc(total)
        self._m += matched
        self._q += total
        if self._q:
            self.hit_rate.set(self._m / self._q)

    def render(self, workers) -> bytes:
        """Exposition text; refreshes the per-worker and per-pool gauges from ``workers``."""
        pools: dict[str, int] = {}
        for w in workers:
            self.worker_healthy.labels(w.url, w.pool).set(1 if w.healthy else 0)
            self.worker_open.labels(w.url, w.pool).set(1 if w.breaker.state == "open" else 0)
            pools[w.pool] = pools.get(w.pool, 0) + w.in_flight
        for pool, n in pools.items():
            self.pool_in_flight.labels(pool).set(n)
        return generate_latest(self.registry)

    def forget_worker(self, url: str, pool: str) -> None:
        for g in (self.worker_healthy, self.worker_open):
            try:
                g.remove(url, pool)
            except KeyError:
                pass
