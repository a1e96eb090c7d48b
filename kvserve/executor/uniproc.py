"""``uni``: the worker runs in the engine-core process; a step is a method call."""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import KVCacheConfig, KVCacheSpec
from kvserve.core.sched_output import SchedulerOutput
from kvserve.executor.abstract import Executor, StepResult
from kvserve.worker.worker import Worker


class UniProcExecutor(Executor):
    """One in-process worker (the default for one rank)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config, rank=0)

    @property
    def model_runner(self):
        return self.worker.model_runner

    def get_kv_cache_spec(self) -> dict[int, KVCacheSpec]:
        return self.worker.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        return self.worker.determine_available_memory()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.worker.initialize_kv_cache(kv_cache_config)

    def execute_model(self, sched: SchedulerOutput) -> StepResult:
        return self.worker.execute_model(sched)

    def _call(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.shutdown()
