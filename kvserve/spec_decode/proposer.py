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
