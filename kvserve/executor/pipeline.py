"""What executors do differently under pipeline parallelism (``--pipeline-parallel-size``).

- The step result comes from the first tensor-parallel rank of the last stage (the stage that
  samples): ``output_rank``.
- Each stage reports the KV cache specs of its own layers: the engine plans one cache over the
  union (``merge_kv_cache_specs``), with a byte budget that every stage can hold
  (``pipeline_kv_bytes``): the block count is the smallest over stages.
- Stages before the last never sample, so the tokens the last stage sampled travel to them
  with the next step (``TokenRelay`` fills ``CachedRequestData.new_token_ids``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from kvserve.config import ParallelConfig
from kvserve.core.kv_cache_spec import KVCacheConfig, KVCacheSpec, group_layers
from kvserve.core.sched_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput


def output_rank(pc: ParallelConfig) -> int:
    """The rank whose step results the engine reads: tensor-parallel rank 0 of the last stage."""
    return pc.world_size - pc.tensor_parallel_size


def merge_kv_cache_specs(per_rank: list[dict[int, KVCacheSpec]]) -> dict[int, KVCacheSpec]:
    """Every stage's layers in one dict, ordered by layer index (ranks of one stage agree)."""
    merged: dict[int, KVCacheSpec] = {}
    for specs in per_rank:
        merged.update(specs)
    return dict(sorted(merged.items()))


def pipeline_kv_bytes(specs_per_rank: list[dict[int, KVCacheSpec]], mem_per_rank: list[int]) -> int:
    """A KV byte budget for the whole model that every stage can hold.

    Stage ``s`` holds its own layers' share of each block; with ``mem_s`` bytes it holds
    ``mem_s // bytes_per_block(s)`` blocks. Returns ``min_s(blocks_s) * bytes_per_block(all)``:
    the planner then gives the whole model that many blocks (exact with one KV cache group;
    with several, their proportional split of it).
    """
    merged = merge_kv_cache_specs(specs_per_rank)
    total = KVCacheConfig(group_layers(merged)).bytes_per_block
    blocks = min(max(int(m), 0) // KVCacheConfig(group_layers(s)).bytes_per_block
                 for s, m in zip(specs_per_rank, mem_per_rank))
    return blocks * total


class TokenRelay:
    """The last stage's sampled tokens, handed to earlier stages with the next step that
    schedules their request (they append them to their own input batch)."""

    def __init__(self) -> None:
        self._undelivered: dict[str, list[int]] = {}

    def on_output(self, out: ModelRunnerOutput) -> None:
        for rid, toks in out.sampled_token_ids.items():
            self._undelivered.setdefault(rid, []).extend(toks)

    def for_earlier_stages(self, sched: SchedulerOutput) -> SchedulerOutput:
        """``sched`` with ``new_token_ids`` filled for the stages that do not sample (a shallow
        copy: the original goes to the last stage, which appended its tokens itself)."""
        for rid in list(sched.finished_req_ids) + list(sched.preempted_req_ids):
            self._undelivered.pop(rid, None)
        for new in sched.scheduled_new_reqs:  # arrives whole, output tokens included
            self._undelivered.pop(new.req_id, None)
        cached = sched.scheduled_cached_reqs
        if not any(rid in self._undelivered for rid in cached.req_ids):
            return sched
        toks = [self._undelivered.pop(rid, []) for rid in cached.req_ids]
        early = copy.copy(sched)
        early.scheduled_cached_reqs = replace(cached, new_token_ids=[list(a) + b for a, b in
                                                                     zip(cached.new_token_ids, toks)])
        return early
