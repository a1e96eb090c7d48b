"""The dynamic speculation policy's goodput choice of k on scripted acceptance and batch
sizes (hand-computed expectations), and its config keys' validation."""

from __future__ import annotations

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.core.scheduler.spec_policy import DynamicSpeculation


def _policy(acc: int, n: int = 5, **kw) -> DynamicSpeculation:
    """A policy (k_max 6) whose chain acceptance has converged to ``acc / (acc + 1)``: every
    verification keeps ``acc`` of ``n`` drafts."""
    pol = DynamicSpeculation(k_max=6, max_batch=1000, min_acceptance=0.0, band=0.0, alpha=0.5, **kw)
    for _ in range(60):
        pol.observe(n, acc)
    return pol


def test_chain_acceptance_counts_first_rejections():
    pol = _policy(4)
    assert pol.chain_acceptance == pytest.approx(0.8, abs=1e-6)
    pol.observe(3, 3)  # all accepted: no rejection seen
    assert pol.chain_acceptance > 0.8


def test_k_maximizes_tokens_per_cost():
    # a = 0.8: tokens (1 - a^(k+1)) / (1 - a) = 1.8, 2.44, 2.95, 3.36, ...
    pol = _policy(4, draft_cost=0.3)
    # memory-bound: cost 1 + 0.3 k -> 1.385, 1.525, 1.554, 1.528, ... -> k = 3
    assert pol.num_speculative_tokens(1) == 3
    pol = _policy(4, draft_cost=0.3, max_batched_tokens=64)
    assert pol.num_speculative_tokens(16) == 3  # 16 x 4 = 64 tokens: still memory-bound
    assert pol.num_speculative_tokens(24) == 2  # k=3 would be 96 tokens: cost 1.5 + 0.9
    assert pol.num_speculative_tokens(40) == 1  # 2 x 40 > 64, but 1.8 / 1.55 > 1: still pays
    assert pol.num_speculative_tokens(64) == 0  # compute-bound: off
    assert pol.peek(64) == 0 and pol.peek(8) == 3
    # free drafts and no compute bound: as many as the acceptance rule allows
    assert _policy(4).num_speculative_tokens(1) == 6


def test_low_acceptance_turns_off_only_when_compute_bound():
    pol = _policy(1, n=4, draft_cost=0.3, max_batched_tokens=64)  # a = 0.5
    assert pol.num_speculative_tokens(40) == 0  # 1.5 / 1.55 < 1
    assert pol.num_speculative_tokens(8) == 1  # memory-bound: k >= 1 keeps measuring
    pol = _policy(0, n=4, max_batched_tokens=64)  # nothing accepted: the shortest draft
    assert pol.num_speculative_tokens(1) == 1


def test_config_keys():
    c = SpeculativeConfig.from_dict({"method": "ngram", "dynamic_max_batched_tokens": 128, "dynamic_draft_cost": 0.2})
    assert (c.dynamic_max_batched_tokens, c.dynamic_draft_cost) == (128, 0.2) and not c.extra
    assert SpeculativeConfig.from_dict({"method": "ngram"}).dynamic_max_batched_tokens == 256
    for d, msg in [({"dynamic_max_batched_tokens": 1}, "dynamic_max_batched_tokens"),
                   ({"dynamic_draft_cost": -1}, "dynamic_draft_cost")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.from_dict({"method": "ngram", **d})
