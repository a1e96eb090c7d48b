"""Workers of ``kvserve router``: pools, health, circuit breakers, in-flight counts.

Pools: ``worker`` (colocated replicas), ``prefill`` (short prompts), ``prefill_long`` (prompts
of at least ``--long-prompt-threshold`` tokens; falls back to ``prefill`` when empty, and
back), ``decode``. A worker is routable when its last health check passed (or none ran yet),
it is not draining, and its circuit breaker lets a request through.

Circuit breaker: ``failure_threshold`` consecutive failures (connection errors, 5xx, stream
cut short, timeouts) open it for ``cooldown_s`` seconds; then one probe request is let
through (half-open): success closes it, failure opens it again for another cooldown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

POOLS = ("worker", "prefill", "prefill_long", "decode")
#: ``/add_worker?role=`` values -> pool.
ROLE_TO_POOL = {"worker": "worker", "regular": "worker", "colocated": "worker", "prefill": "prefill",
                "prefill_long": "prefill_long", "decode": "decode"}


class CircuitBreaker:
    """Closed -> (``failure_threshold`` consecutive failures) -> open for ``cooldown_s`` s ->
    half-open (one probe) -> closed on success / open on failure. ``clock``: seconds."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold, self.cooldown_s, self.clock = failure_threshold, cooldown_s, clock
        self.failures = 0
        self.opened_at: Optional[float] = None
        self.probing = False

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open``."""
        if self.opened_at is None:
            return "closed"
        if self.probing or self.clock() - self.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allows(self) -> bool:
        """Whether a request may go (without taking the half-open probe slot)."""
        st = self.state
        return st == "closed" or (st == "half_open" and not self.probing)

    def acquire(self) -> bool:
        """Take a slot for one request: True when closed, or for the single half-open probe."""
        st = self.state
        if st == "closed":
            return True
        if st == "half_open" and not self.probing:
            self.probing = True
            return True
        return False

    def record_success(self) -> None:
        self.failures, self.opened_at, self.probing = 0, None, False

    def record_failure(self) -> None:
        self.failures += 1
        if self.probing or self.failures >= self.failure_threshold:
            self.opened_at, self.probing = self.clock(), False


@dataclass
class Worker:
    """One upstream ``kvserve serve`` (or any OpenAI-compatible server)."""

    url: str
    pool: str
    breaker: CircuitBreaker
    healthy: bool = True
    in_flight: int = 0
    #: running + waiting from the worker's /metrics (``--load-from-metrics``), else 0.
    reported_load: int = 0
    #: ``GET /v1/kv_transfer`` (None: the worker has no such route: colocated only).
    kv_info: Optional[dict] = None
    #: False once the worker rejected ``return_token_ids`` on chat (older workers).
    chat_token_ids: bool = True
    last_error: str = ""
    added_at: float = field(default_factory=time.time)

    @property
    def load(self) -> int:
        return self.in_flight + self.reported_load

    def routable(self) -> bool:
        return self.healthy and self.breaker.allows()

    def describe(self) -> dict:
        return {"url": self.url, "pool": self.pool, "healthy": self.healthy, "circuit": self.breaker.state,
                "in_flight": self.in_flight, "reported_load": self.reported_load,
                "kv_role": (self.kv_info or {}).get("kv_role"), "last_error": self.last_error}


class WorkerRegistry:
    """The pools. Raises ValueError for an unknown pool, a duplicate URL or an unknown URL."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0) -> None:
        self.failure_threshold, self.cooldown_s = failure_threshold, cooldown_s
        self.workers: dict[str, Worker] = {}
        self.on_remove: list[Callable[[str], None]] = []

    @staticmethod
    def normalize(url: str) -> str:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        return url

    def add(self, url: str, pool: str) -> Worker:
        if pool not in POOLS:
            raise ValueError(f"unknown pool {pool!r}; known: {', '.join(POOLS)}")
        url = self.normalize(url)
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered (pool {self.workers[url].pool})")
        w = Worker(url, pool, CircuitBreaker(self.failure_threshold, self.cooldown_s))
        self.workers[url] = w
        return w

    def remove(self, url: str) -> Worker:
        url = self.normalize(url)
        w = self.workers.pop(url, None)
        if w is None:
            raise ValueError(f"no worker {url}")
        for cb in self.on_remove:
            cb(url)
        return w

    def get(self, url: str) -> Optional[Worker]:
        return self.workers.get(self.normalize(url))

    def pool(self, name: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.pool == name]

    def routable(self, name: str, exclude: frozenset = frozenset()) -> list[Worker]:
        return [w for w in self.pool(name) if w.url not in exclude and w.routable()]

    def mode(self) -> str:
        """``pd`` when any prefill or decode worker is registered, else ``colocated``."""
        return "pd" if any(w.pool != "worker" for w in self.workers.values()) else "colocated"
