"""Dynamic speculation: how many draft tokens to verify per step, from the batch size and
the measured acceptance, with hysteresis.

Speculation trades compute for latency: a verification step computes ``1 + k`` tokens per
request. At small batches decode is memory-bound and the extra tokens are nearly free; as
the batch grows the step becomes compute-bound and rejected drafts cost real throughput
(vLLM #27379: a 1.8x slowdown at high load). The policy:

* **on/off by batch size**, with a band: speculation turns off when the running batch
  reaches ``max_batch`` and back on only when it falls to ``on_batch`` (3/4 of it), so a
  batch hovering at the threshold never flips every step (vLLM #49548's collapse);
* **k by acceptance**: an exponential moving average of the per-draft acceptance rate; k
  shrinks by one when it falls below ``min_acceptance`` and grows by one when it rises
  above ``min_acceptance + band``; k changes at most once per ``interval`` verified drafts.
  Below 1 it does not go: ``k = 1`` keeps measuring acceptance.
* **k by expected goodput** under a roofline cost: with the chain's per-draft acceptance
  probability ``a`` (an exponentially decayed estimate: accepted drafts over accepted drafts
  plus first rejections), ``k`` drafts give ``(1 - a^(k+1)) / (1 - a)`` tokens per step
  (Leviathan et al., arXiv:2211.17192); a step of ``B`` requests costs
  ``max(1, B (1 + k) / max_batched_tokens) + draft_cost * k`` decode steps (memory-bound
  until the verified tokens reach ``max_batched_tokens``, then compute-bound, plus the
  drafts). The policy takes the ``k`` (up to the acceptance rule's) of the best tokens per
  unit cost; it turns speculation off (``k = 0``) only when even ``k = 1`` would make the
  step compute-bound (``2 B > max_batched_tokens``) and does not pay there.

The scheduler asks ``num_speculative_tokens(batch_size)`` once per step and caps every
request's drafts at it, and feeds ``observe`` after each verification.
"""

from __future__ import annotations


class DynamicSpeculation:
    """k (0 = off) per step.

    Args:
        k_max: the configured ``num_speculative_tokens``.
        max_batch: running requests at which speculation turns off.
        min_acceptance: acceptance-rate EMA under which k shrinks.
        band: hysteresis width of the acceptance rule (k grows above ``min_acceptance + band``).
        on_fraction: speculation turns back on at ``max_batch * on_fraction`` running requests.
        interval: verified requests between two k changes.
        alpha: EMA weight of one verification.
        max_batched_tokens: verified tokens per step (``B x (1 + k)``) from which a step is
            compute-bound (``None``: never).
        draft_cost: the cost of one draft step relative to a target decode step.
    """

    def __init__(self, k_max: int, max_batch: int = 32, min_acceptance: float = 0.3, band: float = 0.2,
                 on_fraction: float = 0.75, interval: int = 16, alpha: float = 0.05,
                 max_batched_tokens: int | None = None, draft_cost: float = 0.0) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max = k_max
        self.k = k_max
        self.max_batch = max_batch
        self.on_batch = max(int(max_batch * on_fraction), 0)
        self.min_acceptance = min_acceptance
        self.band = band
        self.interval = interval
        self.alpha = alpha
        self.enabled = True
        self.acceptance = 1.0  # optimistic start: begin at k_max
        self._since_change = 0
        self.max_batched_tokens = max_batched_tokens
        self.draft_cost = draft_cost
        self._acc = 1.0  # decayed accepted drafts (chain acceptance estimate: acc / (acc + rej))
        self._rej = 0.0  # decayed first rejections

    @property
    def chain_acceptance(self) -> float:
        """Estimated probability that a draft is accepted given its predecessors were."""
        return self._acc / (self._acc + self._rej) if self._acc + self._rej > 0 else 1.0

    def goodput(self, k: int, batch_size: int) -> float:
        """Expected tokens per unit step cost with ``k`` drafts at ``batch_size`` (see the module doc)."""
        a = min(self.chain_acceptance, 1.0 - 1e-9)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        cost = 1.0 + self.draft_cost * k
        if self.max_batched_tokens:
            cost = max(1.0, batch_size * (1 + k) / self.max_batched_tokens) + self.draft_cost * k
        return tokens / cost

    def _choose(self, batch_size: int, on: bool) -> int:
        if not on:
            return 0
        best = max(range(1, self.k + 1), key=lambda k: (self.goodput(k, batch_size), -k))
        if (self.max_batched_tokens and 2 * batch_size > self.max_batched_tokens
                and self.goodput(best, batch_size) <= self.goodput(0, batch_size)):
            return 0  # compute-bound: verifying drafts costs more than it brings
        return best

    def num_speculative_tokens(self, batch_size: int) -> int:
        """Drafts per request for a step of ``batch_size`` running requests (0 = no speculation)."""
        if self.enabled and batch_size >= self.max_batch:
            self.enabled = False
        elif not self.enabled and batch_size <= self.on_batch:
            self.enabled = True
        return self._choose(batch_size, self.enabled)

    def peek(self, batch_size: int) -> int:
        """What ``num_speculative_tokens(batch_size)`` would return, without changing state."""
        on = self.enabled
        if on and batch_size >= self.max_batch:
            on = False
        elif not on and batch_size <= self.on_batch:
            on = True
        return self._choose(batch_size, on)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of ``num_draft_tokens`` drafts kept."""
        if num_draft_tokens <= 0:
            return
        keep = 1.0 - self.alpha
        self._acc = keep * self._acc + self.alpha * num_accepted
        self._rej = keep * self._rej + self.alpha * (1.0 if num_accepted < num_draft_tokens else 0.0)
        self.acceptance += self.alpha * (num_accepted / num_draft_tokens - self.acceptance)
        self._since_change += 1
        if self._since_change < self.interval:
            return
        if self.acceptance < self.min_acceptance and self.k > 1:
            self.k -= 1
            self._since_change = 0
        elif self.acceptance > self.min_acceptance + self.band and self.k < self.k_max:
            self.k += 1
            self._since_change = 0
