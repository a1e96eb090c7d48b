"""The proposer interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.config import EngineConfig


class Proposer(ABC):
    """Proposes draft tokens for requests after each step.

    Every optional capability is declared here with its default (callers never probe for it);
    a proposer overrides what it needs.

    Args:
        config: the engine config (``config.speculative_config`` holds k and the method's keys).

    Attributes:
        uses_hidden_states: the proposer drafts from the target's hidden states: the runner
            hands each step's to ``record_hidden_states`` (EAGLE).
        supports_tree_drafts: the proposer drafts trees with ``speculative_eagle_topk > 1``.
    """

    uses_hidden_states: bool = False
    #: drafts trees (``draft_tree``) when ``speculative_eagle_topk > 1``; others refuse it at start-up
    supports_tree_drafts: bool = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.speculative_config.speculative_eagle_topk > 1 and not self.supports_tree_drafts:
            raise ValueError(f"speculative_eagle_topk > 1 (tree drafts): method "
                             f"{config.speculative_config.method!r} drafts chains only (use eagle or eagle3)")
        self.num_speculative_tokens = config.speculative_config.num_speculative_tokens
        # Drafts the scheduler takes now (dynamic speculation; 0 = off): proposing more is waste.
        self.num_drafts_allowed = config.speculative_config.max_draft_tokens

    @property
    def k(self) -> int:
        """Drafts to propose per request now: ``min(num_speculative_tokens, num_drafts_allowed)``."""
        return min(self.num_speculative_tokens, self.num_drafts_allowed)

    @property
    def wants_hidden_states(self) -> bool:
        """Whether the runner hands over this step's target states: ``uses_hidden_states`` and
        speculation on (``k > 0``). A step without (dynamic speculation off) runs the plain
        target forward: no EAGLE-3 mid-layer states are kept."""
        return self.uses_hidden_states and self.k > 0

    @property
    def idle(self) -> bool:
        """Whether a ``propose`` now would draft nothing and change nothing (speculation off and
        nothing left to release): the runner then skips the call. False unless a proposer says
        so: one that keeps per-request state may need the calls while off."""
        return False

    @property
    def needs_eager_target(self) -> bool:
        """Whether the target must run without CUDA graphs (the proposer reads states the
        graphs do not return, e.g. EAGLE-3's mid-layer ones)."""
        return False

    def bind_target(self, target) -> None:
        """Called once the target model is loaded (``target``: its ``nn.Module``), before the KV
        cache is sized: a proposer that shares the target's layers (EAGLE) builds itself here."""

    def capture_cuda_graphs(self) -> None:
        """Called by the model runner when it captures the target's CUDA graphs (CUDA, not
        ``--enforce-eager``), after the KV cache is bound: a proposer that runs a model of its
        own captures it here (EAGLE's draft steps)."""

    def release_cuda_graphs(self) -> None:
        """Drop the graphs ``capture_cuda_graphs`` made (the runner's ``release``)."""

    def record_hidden_states(self, req_ids, starts, query_lens, hidden, row_start) -> None:
        """With ``uses_hidden_states``: one step's target hidden states. Request ``req_ids[i]``
        computed positions ``starts[i] .. starts[i] + query_lens[i] - 1`` in rows
        ``row_start[i] ..`` of ``hidden`` (``[num_tokens, hidden_size]``)."""

    def draft_tree(self, req_id: str, drafts: list[int]) -> list[int] | None:
        """Parent indices ``[len(drafts)]`` (-1: the root) when ``drafts`` (a prefix of this
        proposer's last proposal for ``req_id``) form a tree (``kvserve/spec_decode/tree.py``);
        None for a chain."""
        return None

    def tree_accepted(self, req_id: str, root_pos: int, rows: list[int]) -> None:
        """After a tree's verification: the target states recorded for positions ``root_pos ..``
        were in chunk-row order; the accepted ones are rows ``rows`` (root first), in order."""

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
