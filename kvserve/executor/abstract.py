"""The executor interface between the engine core and its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import KVCacheConfig, KVCacheSpec
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


class StepResult(Protocol):
    """A launched step: ``get()`` blocks until its ``ModelRunnerOutput`` is on the host."""

    def get(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    """Drives the workers. Steps may be launched before the previous one's ``get()``
    (async scheduling); results come back in launch order.

    Raises (from the constructor): ValueError / FileNotFoundError for a bad model or flags,
    RuntimeError when a worker fails to start.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @property
    def model_runner(self):
        """The in-process model runner (``uni``: the worker runs in this process); None where
        the workers run in other processes."""
        return None

    @abstractmethod
    def get_kv_cache_spec(self) -> dict[int, KVCacheSpec]:
        """Per attention layer, its KV cache spec (equal on every rank)."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes each worker can give the KV cache (the smallest over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate and bind the caches, warm up, capture graphs."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> StepResult:
        """Launch one step."""

    def collective_rpc(self, method: str, *args) -> list:
        """Call ``Worker.<method>(*args)`` on every rank between steps; the results in rank order."""
        call = getattr(self, "_call", None)
        if call is None:
            raise NotImplementedError(f"{type(self).__name__} has no worker calls")
        return call(method, *args)

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
