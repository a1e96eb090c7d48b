"""The proposer interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.config import EngineConfig


class Proposer(ABC):
    """Proposes draft tokens for requests after each step.

    Args:
        config: the engine config (``config.speculative_config`` holds k and the method's keys).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.speculative_config.num_speculative_tokens
        # Drafts the scheduler takes now (dynamic speculation; 0 = off): proposing more is waste.
        self.num_drafts_allowed = self.num_speculative_tokens

    @property
    def k(self) -> int:
        """Drafts to propose per request now: ``min(num_speculative_tokens, num_drafts_allowed)``."""
        return min(self.num_speculative_tokens, self.num_drafts_allowed)

    def remove_requests(self, req_ids) -> None:
        """Forget finished or preempted requests (free what the proposer holds for them)."""

    @abstractmethod
    def propose(self, requests: list, batch) -> list[list[int]]:
        """Drafts for each request (at most ``num_speculative_tokens``; ``[]``: none).

        Args:
            requests: ``kvserve.worker.input_batch.CachedRequestState`` of requests that just
                got tokens and may verify drafts; ``prompt_token_ids + output_token_ids`` are
                their whole sequence so far.
            batch: the worker's ``InputBatch`` (``token_ids[row, :num_tokens[row]]`` holds
                the same tokens as an array).
        """
