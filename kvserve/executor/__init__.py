"""Executors: how the engine core reaches its workers.

- ``uni`` (``UniProcExecutor``): one worker in the engine-core process.
- ``mp`` (``MultiprocExecutor``): worker processes fed each step as serialized data over a
  local channel; results come back the same way (the default for several ranks).
- ``ray`` (``RayExecutor``): one Ray actor per rank, on the nodes of a Ray cluster.
"""

from __future__ import annotations

from kvserve.config import ParallelConfig
from kvserve.executor.abstract import Executor


def get_executor_class(parallel_config: ParallelConfig) -> type[Executor]:
    """The executor for ``--distributed-executor-backend``. Raises ValueError for unknown ones."""
    backend = parallel_config.distributed_executor_backend or "uni"
    if backend == "uni":
        from kvserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from kvserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from kvserve.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"unknown distributed_executor_backend {backend!r}; choose uni, mp or ray")


__all__ = ["Executor", "get_executor_class"]
