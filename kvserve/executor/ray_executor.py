"""``ray``: one Ray actor per tensor-parallel rank, on the nodes of a Ray cluster.

Connects to the cluster named by ``RAY_ADDRESS`` (``ray start --head`` elsewhere), or
starts a local one. A placement group reserves one bundle per rank (``{"GPU": 1}`` on
CUDA, ``{"CPU": 1}`` on the CPU), packed onto as few nodes as fit, so ranks may sit on
several machines; the ranks meet through ``torch.distributed`` at rank 0's node address.
Steps travel as the same serialized ``SchedulerOutput`` the other executors use; each
rank runs every step and rank 0's result comes back. A dead or failed actor makes every
wait raise RuntimeError (no hang); a cluster without room for the ranks is a ValueError
at start-up.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_spec import KVCacheConfig, KVCacheSpec
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.executor.abstract import Executor
from kvserve.executor.pipeline import TokenRelay, merge_kv_cache_specs, output_rank, pipeline_kv_bytes

logger = logging.getLogger("kvserve")

#: Seconds to wait for the placement group (the cluster's free resources);
#: ``KVSERVE_RAY_PLACEMENT_TIMEOUT`` overrides it.
PLACEMENT_TIMEOUT_S = float(os.environ.get("KVSERVE_RAY_PLACEMENT_TIMEOUT", 60))
#: Seconds between liveness checks while waiting for a step.
POLL_S = 1.0


class RayWorkerWrapper:
    """The actor body: builds a ``Worker`` once every rank is placed, then runs its calls."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker = None
        self.out_rank = 0

    def node_ip_and_free_port(self) -> tuple[str, int]:
        import ray

        from kvserve.executor.multiproc import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_worker(self, config: EngineConfig, init_method: str) -> None:
        from kvserve.logger import setup_logging
        from kvserve.worker.worker import Worker

        setup_logging()
        self.worker = Worker(config, self.rank, init_method)
        self.out_rank = output_rank(config.parallel_config)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def execute_model(self, sched: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        out = self.worker.execute_model(sched).get()
        return out if self.rank == self.out_rank else None


class _RayStep:
    __slots__ = ("executor", "refs")

    def __init__(self, executor: "RayExecutor", refs: list) -> None:
        self.executor, self.refs = executor, refs

    def get(self) -> ModelRunnerOutput:
        out = self.executor._wait(self.refs)[self.executor._out_rank]
        if self.executor._relay is not None:
            self.executor._relay.on_output(out)
        return out


class RayExecutor(Executor):
    """``world_size`` Ray actors, one per rank."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install ray") from e
        self.world_size = config.parallel_config.world_size
        self._pp = config.parallel_config.pipeline_parallel_size
        self._out_rank = output_rank(config.parallel_config)
        self._relay = TokenRelay() if self._pp > 1 else None
        self._started_ray = False
        if not ray.is_initialized():
            pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {"PYTHONPATH": os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p)}
            for k in ("HF_HUB_OFFLINE", "OMP_NUM_THREADS"):
                if k in os.environ:
                    env[k] = os.environ[k]
            address = os.environ.get("RAY_ADDRESS")
            local = {} if address else {"include_dashboard": False, "num_cpus": max(self.world_size, os.cpu_count() or 1)}
            ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False, **local)
            self._started_ray = True
        gpu = config.device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle)] * self.world_size, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as e:
            have = ray.cluster_resources()
            self.shutdown()
            raise ValueError(f"the Ray cluster cannot place {self.world_size} ranks of {bundle} "
                             f"within {PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {have})") from e
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RayWorkerWrapper)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=r)).remote(r)
            for r in range(self.world_size)]
        try:
            ip, port = ray.get(self.actors[0].node_ip_and_free_port.remote())
            self._wait([a.init_worker.remote(config, f"tcp://{ip}:{port}") for a in self.actors])
        except BaseException:
            self.shutdown()
            raise
        self._pending: list = []  # refs of ranks > 0, checked for errors as steps complete

    # ---- waiting ----------------------------------------------------------------------
    def _wait(self, refs: list) -> list:
        """Results of ``refs`` in order; raises RuntimeError when an actor died or failed,
        re-raising a worker's ValueError / FileNotFoundError as itself."""
        import ray

        try:
            pending = list(refs)
            while pending:  # poll, so one rank's death is seen while the others hang in a collective
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
                ray.get(ready)
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, (ValueError, FileNotFoundError)):
                raise type(cause)(str(cause).splitlines()[-1]) from None
            raise RuntimeError(f"a Ray worker failed: {e}") from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a Ray worker died: {e}") from None

    def _call(self, method: str, *args: Any) -> list[Any]:
        return self._wait([a.call.remote(method, *args) for a in self.actors])

    # ---- Executor ----------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[int, KVCacheSpec]:
        return merge_kv_cache_specs(self._call("get_kv_cache_spec"))  # pipeline stages: their own layers

    def determine_available_memory(self) -> int:
        mem = self._call("determine_available_memory")
        if self._pp == 1:
            return min(mem)
        return pipeline_kv_bytes(self._call("get_kv_cache_spec"), mem)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._call("initialize_kv_cache", kv_cache_config)

    def execute_model(self, sched: SchedulerOutput) -> _RayStep:
        import ray

        ref = ray.put(sched)  # serialized once for every rank
        early = ref
        if self._relay is not None:  # pipeline stages before the last get the last one's tokens
            e = self._relay.for_earlier_stages(sched)
            early = ref if e is sched else ray.put(e)
        refs = [a.execute_model.remote(early if r < self._out_rank else ref) for r, a in enumerate(self.actors)]
        return _RayStep(self, refs)

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []
        if getattr(self, "_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
