"""CPU thread settings for the processes that run torch ops.

Why: torch's OpenMP pool spin-waits at every parallel region's barrier (libgomp's default
wait policy). When another process takes one of the cores, one of our threads is descheduled
and the others spin until the scheduler gives it back, every op: on a 2-core machine
generation fell ~28x. Two settings fix it: a passive wait policy (waiting threads sleep), and
no more threads than the cores we can actually get (``--cpu-threads``).
"""

from __future__ import annotations

import logging
import os

from kvserve.config import resolve_cpu_threads

logger = logging.getLogger("kvserve")


def set_passive_wait_policy() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set one. libgomp reads it when it loads
    (at ``import torch``), so this helps the processes started after it (the engine core,
    workers) and this one only if torch is not imported yet."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def apply_cpu_threads(requested: int) -> int:
    """Set torch's intra-op thread count to ``requested`` (``DeviceConfig.cpu_threads``, resolved
    by ``kvserve.config.resolve_cpu_threads``; a hand-built config's 0 is resolved the same way);
    returns it."""
    import torch

    n = resolve_cpu_threads(requested)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    logger.debug("torch CPU threads: %d (OMP_WAIT_POLICY=%s)", n, os.environ.get("OMP_WAIT_POLICY", "unset"))
    return n
