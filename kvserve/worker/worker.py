"""A worker: one device, one model runner; what an executor drives (in-process or as a process).

Every call takes plain data (``EngineConfig``, ``KVCacheConfig``, ``SchedulerOutput``) and
returns plain data, so the same worker serves the in-process executor and worker processes.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import KVCacheConfig, KVCacheSpec
from kvserve.core.sched_output import SchedulerOutput
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.runner_output import AsyncModelRunnerOutput

logger = logging.getLogger("kvserve")


class Worker:
    """Loads the model for ``rank`` and executes steps.

    Args:
        config: the resolved engine config.
        rank: this worker's rank (0 with one worker).
        distributed_init_method: the tensor-parallel rendezvous (``tcp://host:port``); needed
            when ``config.parallel_config.world_size > 1``.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: Optional[str] = None) -> None:
        self.config = config
        self.rank = rank
        world = config.parallel_config.world_size
        if config.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if world > 1:
            from kvserve.distributed import init_distributed

            if config.device == "cpu":  # ranks share the cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            init_distributed(rank, world, distributed_init_method, "nccl" if config.device == "cuda" else "gloo",
                             pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
                             custom_all_reduce=not config.parallel_config.disable_custom_all_reduce)
        from kvserve.distributed import set_expert_parallel

        set_expert_parallel(getattr(config.parallel_config, "enable_expert_parallel", False))  # before the model
        self.model_runner = ModelRunner(config)
        spec = config.speculative_config
        if spec is not None:
            from kvserve.spec_decode import get_proposer_class

            self.model_runner.proposer = get_proposer_class(spec.method)(config)
            self.model_runner.proposer.bind_target(self.model_runner.model)  # EAGLE: shares its layers

    def get_kv_cache_spec(self) -> dict[int, KVCacheSpec]:
        """Per attention layer, its KV cache spec."""
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache."""
        return self.model_runner.determine_available_memory()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, sched: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch a step; ``.get()`` on the result waits for its tokens."""
        return self.model_runner.execute_model_async(sched)

    def start_profile(self) -> None:
        """Start ``torch.profiler`` on this rank (``KVSERVE_TORCH_PROFILER_DIR``; RuntimeError without it)."""
        from kvserve.worker.profiler import WorkerProfiler

        if getattr(self, "_profiler", None) is None:
            self._profiler = WorkerProfiler(self.rank)
        self._profiler.start()

    def stop_profile(self) -> dict:
        """Stop it; writes the trace and kernel table, returns ``WorkerProfiler.stop``'s summary."""
        if getattr(self, "_profiler", None) is None:
            raise RuntimeError("the profiler is not running")
        return self._profiler.stop()

    def shutdown(self) -> None:
        """Finish the KV connector's pending transfers (block files included) and stop its
        threads, then release the runner's tensors (``ModelRunner.release``); idempotent."""
        conn = self.model_runner.kv_connector
        if conn is not None:
            conn.shutdown()
        self.model_runner.release()
