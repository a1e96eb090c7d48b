"""Results returned by the offline API, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# One entry per generated token: token id -> (logprob, 1-based rank).
SampleLogprobs = list[dict[int, tuple[float, int]]]


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: which of the ``n`` completions.
        text: detokenized output (stop strings removed).
        token_ids: generated token ids.
        finish_reason: "stop", "length", "abort", "error" (its step failed, e.g. out of device
            memory), or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per generated token, top-n (plus the sampled token) logprobs, if asked.
        cumulative_logprob: sum of the sampled tokens' logprobs, if logprobs were asked.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps in seconds since the epoch (time.time())."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified for this request
    num_accepted_tokens: int = 0  # ... and accepted

    @property
    def spec_acceptance_rate(self) -> Optional[float]:
        """Accepted / verified draft tokens (None without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A prompt and its completions.

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``): per prompt token
    ``{token_id: (logprob, rank)}`` (the prompt token itself and the top alternatives; None
    for the first token), as vLLM returns it. ``kv_transfer_params``: with a KV transfer
    connector (disaggregated prefill/decode), a finished prefill's params for the decode
    engine (vLLM's field), else None.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = field(default=None)
    kv_transfer_params: Optional[dict] = field(default=None)
