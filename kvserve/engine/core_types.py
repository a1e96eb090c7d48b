"""What crosses the line between a frontend and the engine core, as plain data.

The frontend (offline ``LLMEngine`` or the server's ``AsyncLLM``) sends
``EngineCoreRequest``s and receives ``EngineCoreOutputs`` per step; it keeps its own
per-request state (text, stop strings, ``n`` fan-in) and never sees the scheduler's
``Request``. ``EngineCoreOutput`` is a msgspec struct: the same record goes from the engine
core to the frontend in process (``LLM``) and over the process boundary
(``kvserve.engine.ipc.StepOutputs``, ``kvserve serve``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgspec

from kvserve.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """One (child) request for the engine core.

    Attributes:
        request_id: unique id (children of an ``n > 1`` request are ``"{id}#{k}"``).
        prompt_token_ids: the prompt, never empty.
        sampling_params: its own copy (``n == 1``).
        arrival_time: seconds since the epoch.
        priority: lower is served first under the priority policy.
        eos_token_id: the tokenizer's EOS id (None: none).
        cache_salt: prefix-cache namespace.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_id: Optional[int] = None
    cache_salt: Optional[str] = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request in one step.

    Attributes:
        request_id: the (child) request id.
        new_token_ids: tokens since the previous output (one per step; more with speculation;
            none in the output of a request the core refused).
        new_logprobs: per new token ``{token_id: (logprob, 1-based rank)}``, if asked.
        finish_reason: "stop" | "length" | "abort" | "error" once finished, else None ("error":
            the step that ran it failed, e.g. out of device memory).
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: prompt tokens served from the prefix cache (-1: not scheduled yet).
        first_scheduled_time / first_token_time / finished_time: engine-side timestamps (s).
        num_preemptions: how often it was preempted so far.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, in the request's first output:
            per prompt token ``{token_id: (logprob, rank)}`` (None for the first token).
        num_draft_tokens / num_accepted_tokens: speculative decoding, draft tokens verified /
            accepted for this request so far.
        kv_transfer_params: with a KV transfer connector, in a finished request's last output:
            what a consumer engine needs to pull its KV (``kvserve.kv_connector.p2p``), else None.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[dict[int, tuple[float, int]]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    num_cached_tokens: int = -1
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    prompt_logprobs: Optional[list[Optional[dict[int, tuple[float, int]]]]] = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    kv_transfer_params: Optional[dict[str, Any]] = None


@dataclass
class EngineCoreOutputs:
    """One step's outputs and the tokens it computed.

    ``outputs`` holds a full ``EngineCoreOutput`` per request that got tokens, except the plain
    decode rows: ``plain_req_ids[i]`` got the one token ``plain_token_ids[i]`` and nothing
    else changed for it since its previous output (it is running, past its first token, never
    preempted, asks for no logprobs and verified no drafts). A frontend appends the token and
    keeps every other field of the request's state as it was.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    plain_req_ids: list[str] = field(default_factory=list)
    plain_token_ids: list[int] = field(default_factory=list)
