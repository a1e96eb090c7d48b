"""Request state as the scheduler and the model runner see it."""

from __future__ import annotations

import enum
import time
from typing import Optional

from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the step that ran it failed (e.g. out of GPU memory); other requests go on
    # Holds blocks whose KV a remote engine is sending (disaggregated prefill/decode).
    WAITING_FOR_REMOTE_KVS = -1

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    Phase-free: a request only knows ``num_tokens`` (prompt + output so far) and
    ``num_computed_tokens`` (tokens whose KV is in the cache). Each step the scheduler
    gives it some of the difference to compute.

    Attributes:
        request_id: unique string.
        prompt_token_ids: list[int], never empty.
        output_token_ids: list[int] sampled so far.
        num_computed_tokens: tokens whose KV is written in the paged cache, or will be by
            the steps scheduled so far.
        num_pending_tokens: output tokens sampled by scheduled steps whose ids have not come
            back to the host yet (0 without async scheduling, else at most 2).
        priority: lower value is served first under ``--scheduling-policy priority``.
        arrival_time: seconds (time.time()) when the request arrived.
        cache_salt: requests share prefix-cache blocks only with requests of the same salt.
        spec_token_ids: draft tokens proposed for the next step (verified with it).
        structured_output: the grammar matcher (``StructuredOutputRequest``) of a request
            with ``sampling_params.structured_outputs``, else None.
    """

    # Slots: the scheduler reads these per request every step; a plain instance dict of this
    # many attributes loses CPython's shared-key layout (more than 30 keys) and reads slower.
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority", "eos_token_id",
        "cache_salt", "output_token_ids", "all_token_ids", "num_computed_tokens", "num_pending_tokens", "status",
        "stop_reason", "num_preemptions", "num_draft_tokens", "num_accepted_tokens", "num_computed_at_preemption",
        "num_cached_tokens", "first_token_time", "first_scheduled_time", "finished_time", "spec_token_ids",
        "prompt_logprobs", "prompt_logprobs_sent", "plain_output", "reads_output", "block_hashes",
        "structured_output", "delay_cache_blocks", "kv_ready", "kv_transfer_params", "__weakref__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        eos_token_id: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt  # prefix-cache namespace: only equal salts share KV
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Speculative decoding: draft tokens this request verified / accepted (cumulative).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_computed_at_preemption = 0  # KV held when last preempted (recompute accounting)
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache (first schedule)
        self.first_token_time: Optional[float] = None
        self.first_scheduled_time: Optional[float] = None
        self.finished_time: Optional[float] = None
        self.spec_token_ids: list[int] = []
        # Prompt logprobs gathered so far (entry j: prompt token j + 1), and whether sent.
        self.prompt_logprobs: list[dict[int, tuple[float, int]]] = []
        self.prompt_logprobs_sent = False
        # Its outputs carry no logprobs of any kind: after the first token a running step's
        # update is its new token alone (``Scheduler.update_from_output``'s plain rows).
        self.plain_output = sampling_params.logprobs is None and sampling_params.prompt_logprobs is None
        # Its sampling reads its own output (penalties, min_tokens, a grammar); set on admission
        # to a scheduler (``Scheduler.add_request``).
        self.reads_output = False
        # Block hashes of the full blocks of all_token_ids (prefix cache keys).
        self.block_hashes: list[int] = []
        # Grammar matcher state (kvserve.structured_output) when the request is constrained.
        self.structured_output = None
        # KV transfer between engines (kvserve.kv_connector.p2p): blocks allocated and not
        # registered in the prefix cache until their KV landed; whether they hold the prompt
        # KV (admit without a lookup); the params handed to the client when it finished.
        self.delay_cache_blocks = False
        self.kv_ready = False
        self.kv_transfer_params: Optional[dict] = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return _FINISH_REASON.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
