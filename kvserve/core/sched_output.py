"""A step as data: what the scheduler sends the workers, and what they send back.

``SchedulerOutput`` is a diff against what the workers already hold: requests they have
never seen (or that come back after preemption) arrive whole as ``NewRequestData``;
requests they hold arrive as a row of ``CachedRequestData`` (new block ids, the scheduler's
``num_computed_tokens``). Workers never see a ``Request``; they keep their own per-request
state (``kvserve.worker.input_batch``) and append the tokens they sample themselves. Block
operations that must run before the forward (prefix-cache copy-on-write today; swap and
transfer later) travel as ``BlockOp``s. Everything is plain data (lists, ints, strings,
``SamplingParams``) so a step pickles for worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvserve.sampling_params import SamplingParams

#: One list of block ids per KV cache group.
BlockIds = tuple[list[int], ...]


@dataclass
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption).

    Attributes:
        req_id: the request id.
        prompt_token_ids: the prompt.
        output_token_ids: tokens already generated (non-empty for a preempted request that
            resumes: they are recomputed as context).
        sampling_params: its parameters (the worker keeps seeds and penalty state).
        eos_token_id: for min_tokens suppression.
        block_ids: per KV cache group, all its block ids after this step's allocation.
        num_computed_tokens: tokens whose KV is already in the cache (prefix hits).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    block_ids: BlockIds
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Requests the workers already hold, one row each (parallel lists).

    Attributes:
        req_ids: the request ids.
        new_block_ids: per row, per group, block ids appended this step (None: none).
        num_computed_tokens: per row, the scheduler's count before this step (authoritative:
            a worker rolls back rejected draft tokens by reading it).
        new_token_ids: per row, known tokens the worker did not sample itself (empty on a
            single-model engine; for workers that do not sample, e.g. later pipeline ranks).
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Optional[BlockIds]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class BlockOp:
    """A block operation the worker runs before the step's forward.

    ``op == "copy"``: copy slots ``[0, num_tokens)`` of block ``src`` into the same slots of
    block ``dst`` in every layer of group ``group_id`` (prefix-cache copy-on-write).
    """

    op: str
    group_id: int
    src: int
    dst: int
    num_tokens: int


@dataclass
class SchedulerOutput:
    """One step for the workers.

    Attributes:
        scheduled_new_reqs: requests sent whole.
        scheduled_cached_reqs: requests sent as a diff.
        num_scheduled_tokens: request id -> tokens computed this step (draft tokens included);
            requests run in this dict's order.
        total_num_scheduled_tokens: their sum.
        scheduled_spec_decode_tokens: request id -> draft tokens verified this step (its last
            ``len(drafts)`` scheduled tokens).
        finished_req_ids: requests finished or aborted since the previous step: workers drop
            their state.
        preempted_req_ids: requests preempted while building this step, in order: workers
            drop their state (a preempted request comes back as a new request).
        block_ops: run before the forward, in order.
        num_prompt_tokens: of the scheduled tokens, how many are prompt (or recomputed
            context) rather than decode tokens (for the stats line; workers ignore it).
        kv_connector_metadata: the KV connector's transfers for this step (plain data,
            ``kvserve.kv_connector``), or None without a connector.
        structured_output_request_ids: request id -> its row of ``grammar_bitmask``, for the
            requests with a structured-output constraint that sample this step (empty: none).
        grammar_bitmask: int32 numpy ``[len(structured_output_request_ids), ceil(V / 32)]``
            (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed), or None.
        evicted_blocks: request id -> ``(group id, block-table column)`` entries that bounded-KV
            eviction (``kvserve.core.bounded_kv``) turned into the null block; workers null them
            in their block tables before this step (the blocks may be reused from this step on).
        num_speculative_tokens: with dynamic speculation, the drafts per request the
            scheduler takes now (0: speculation is off); proposers draft no more. None: k.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    block_ops: list[BlockOp] = field(default_factory=list)
    num_prompt_tokens: int = 0
    kv_connector_metadata: Optional[object] = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Optional[np.ndarray] = None
    num_speculative_tokens: Optional[int] = None
    evicted_blocks: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker half reports with a step (KV transfer between engines).

    Attributes:
        finished_sending: request ids whose lent blocks the producer may free now (the
            consumer released them, the lease expired, or the producer aborted).
        finished_recving: request ids whose remote KV pull ended (landed or failed).
        failed_recving: the subset of ``finished_recving`` that failed (their KV is not valid).
        stats: the worker's cumulative transfer counters (bytes, seconds, counts).
    """

    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)
    stats: Optional[dict] = None

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving)


@dataclass
class ModelRunnerOutput:
    """What a step returns to the scheduler.

    Attributes:
        sampled_token_ids: request id -> tokens it got this step, in order (one per step,
            ``1 + accepted drafts`` when drafts were verified); only requests that sampled.
        logprobs: request id -> per new token ``{token_id: (logprob, rank)}`` (if asked).
        draft_token_ids: request id -> draft tokens proposed for the next step.
        prompt_logprobs: request id -> ``(start, entries)`` for requests that asked for prompt
            logprobs and computed prompt positions ``start, start + 1, ...`` this step:
            ``entries[j]`` is ``{token_id: (logprob, rank)}`` for prompt token ``start + 1 + j``.
        kv_block_mass: h2o: request id -> group id -> ``{block-table column: attention mass}``
            summed over the step's queries, layers and heads (probabilities, so a step adds at most
            ``queries * layers * heads``).
        kv_connector_output: a KV connector's finished transfers (``KVConnectorOutput``), or None.
        moe_expert_tokens: mixture-of-experts models: tokens routed to each expert since start,
            summed over the layers (``kvserve.models.moe_stats``); None when not read this step.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, tuple[float, int]]]]] = field(default_factory=dict)
    kv_block_mass: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict)
    kv_connector_output: Optional[KVConnectorOutput] = None
    moe_expert_tokens: Optional[list[int]] = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()
