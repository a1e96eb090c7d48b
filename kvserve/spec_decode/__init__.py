"""Speculative decoding: proposers of draft tokens, found by ``--speculative-config`` method.

A proposer runs in the worker after a step's tokens are on the host and proposes up to
``num_speculative_tokens`` drafts per request; the scheduler gives each such request
``1 + k`` tokens in the next step, and the model runner verifies them
(``kvserve.worker.runner_output``), rolling back rejected ones.
"""

from __future__ import annotations

import importlib

from kvserve.spec_decode.proposer import Proposer

#: method name -> "module:Class"; ``register_proposer`` adds more.
PROPOSERS: dict[str, str] = {
    "ngram": "kvserve.spec_decode.ngram:NgramProposer",
    "suffix": "kvserve.spec_decode.suffix:SuffixProposer",
    "draft_model": "kvserve.spec_decode.draft_model:DraftModelProposer",
    "eagle": "kvserve.spec_decode.eagle:EagleProposer",
    "eagle3": "kvserve.spec_decode.eagle:EagleProposer",
    "deepseek_mtp": "kvserve.spec_decode.deepseek_mtp:DeepseekMTPProposer",
}


def register_proposer(name: str, target: str | type) -> None:
    """Make ``--speculative-config '{"method": name}'`` use ``target`` (a Proposer class or
    its "module:Class" path)."""
    PROPOSERS[name] = target


def get_proposer_class(method: str) -> type[Proposer]:
    """The proposer class for ``method``: a registered name or a "module:Class" path.

    Raises ValueError for an unknown method.
    """
    target = PROPOSERS.get(method, method if ":" in method else None)
    if target is None:
        raise ValueError(f"unknown speculative decoding method {method!r}; registered: {sorted(PROPOSERS)} "
                         f"(or give a 'module:Class' path to a Proposer)")
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load proposer {method!r}: {exc}") from None
    if not (isinstance(target, type) and issubclass(target, Proposer)):
        raise ValueError(f"{method!r} is not a Proposer")
    return target


__all__ = ["Proposer", "PROPOSERS", "register_proposer", "get_proposer_class"]
