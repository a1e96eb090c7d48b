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


def _timed(acc: int, n: int, plain: float, spec: dict, batch: int = 16, **kw) -> DynamicSpeculation:
    """A policy (k_max 4) with converged acceptance ``acc / (acc + 1)`` and scripted step
    times: ``plain`` seconds without drafts, ``spec[k]`` with ``k`` drafts, at ``batch``."""
    pol = DynamicSpeculation(k_max=4, max_batch=1000, min_acceptance=0.0, band=0.0, alpha=0.5, **kw)
    for _ in range(60):
        pol.observe(n, acc)
    for _ in range(5):
        pol.observe_step(batch, 0, plain)
        for k, t in spec.items():
            pol.observe_step(batch, k, t)
    return pol


def _run(pol: DynamicSpeculation, batch: int, steps: int) -> list[int]:
    ks = []
    for _ in range(steps):
        k = pol.peek(batch)
        assert pol.num_speculative_tokens(batch) == k  # peek predicts the step exactly
        ks.append(k)
    return ks


def test_measured_cost_drafting_slower_than_plain_turns_off():
    # a = 0.5 (tokens 1.5 at k=1, 1.94 at k=4); a k=4 step costs 2.5 plain steps, k=1 1.6
    pol = _timed(1, 4, 1.0, {4: 2.5, 1: 1.6})
    assert pol.measured_seconds(2, 16) == pytest.approx(1.0 + 0.6 * 2 / 1)  # nearest measured k: 1
    assert pol.num_speculative_tokens(16) == 0
    # the roofline alone would draft here (memory-bound, free drafts)
    assert _policy(1, n=4).num_speculative_tokens(16) > 0
    # another bucket (batch 2) has no estimates yet: the roofline decides there
    assert pol.peek(2) == 4


def test_measured_cost_drafting_faster_turns_on_and_picks_k():
    pol = _timed(4, 5, 1.0, {4: 1.2})  # a = 0.8: k=4 gives 3.36 tokens for 1.2 steps
    assert pol.num_speculative_tokens(16) == 4
    # a k=4 step costs 3 plain steps; extrapolated 1 + 0.5 k: tokens / cost 1.2, 1.22, 1.18, 1.12
    pol = _timed(4, 5, 1.0, {4: 3.0})
    assert pol.num_speculative_tokens(16) == 2
    # off -> on needs the margin: 1.03x better stays off, 1.2x turns on
    pol = _timed(1, 4, 1.0, {1: 2.0})
    assert pol.num_speculative_tokens(16) == 0
    for _ in range(30):
        pol.observe_step(16, 1, 1.5 / 1.03)
    assert pol.num_speculative_tokens(16) == 0
    for _ in range(30):
        pol.observe_step(16, 1, 1.5 / 1.2)
    assert pol.num_speculative_tokens(16) == 1


def test_probes_refresh_both_estimates():
    pol = _timed(4, 5, 1.0, {4: 1.2}, probe_plain_every=10, probe_spec_every=20, probe_len=3)
    ks = _run(pol, 16, 36)  # on: 10 steps at k=4, a 3-step plain probe, 20 more (backoff), probe
    assert ks == [4] * 10 + [0] * 3 + [4] * 20 + [0] * 3 and pol.num_probes == 2
    pol = _timed(1, 4, 1.0, {4: 2.5, 1: 1.6}, probe_plain_every=10, probe_spec_every=20, probe_len=3)
    ks = _run(pol, 16, 66)  # off: after 20 steps a 3-step probe at k=1, then after 40
    assert ks == [0] * 20 + [1] * 3 + [0] * 40 + [1] * 3
    # a bucket missing the other mode's estimate is probed after probe_warmup steps
    pol = _timed(4, 5, 1.0, {4: 1.2}, probe_warmup=5, probe_len=2)
    pol.observe_step(40, 4, 1.0)  # bucket 32-63: spec measured only
    assert _run(pol, 40, 8) == [4] * 5 + [0] * 2 + [4]


def test_no_step_times_or_band_off_means_no_probes():
    pol = _policy(4, probe_plain_every=3, probe_warmup=1)
    assert _run(pol, 1, 10) == [6] * 10 and pol.num_probes == 0  # the engine never timed a step
    pol = _timed(4, 5, 1.0, {4: 1.2}, probe_spec_every=2, probe_warmup=1)
    pol.max_batch, pol.on_batch = 32, 24
    assert _run(pol, 64, 10) == [0] * 10 and pol.num_probes == 0  # the batch band is a hard off


def test_peek_predicts_every_step_under_random_load():
    """The engine overlaps a step only when ``peek`` says it has no drafts: ``peek`` must equal
    the next ``num_speculative_tokens`` through band changes, probes and cost updates."""
    import random

    rng = random.Random(0)
    pol = DynamicSpeculation(k_max=4, max_batch=40, probe_plain_every=7, probe_spec_every=11, probe_warmup=3)
    for _ in range(2000):
        b = rng.choice([1, 2, 5, 9, 17, 30, 35, 41, 64])
        k = pol.peek(b)
        assert pol.num_speculative_tokens(b) == k
        if k:
            pol.observe(k, rng.randint(0, k))
        pol.observe_step(b, k, rng.uniform(0.5, 1.5) * (1 + 0.4 * k))
    assert pol.num_probes > 10 and pol.step_seconds and pol.spec_step_seconds
