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

* **k by measured step cost** (once the engine reports step times through ``observe_step``):
  the roofline above calls a verification step about one plain step, but on a small,
  launch-bound model a k=4 verify + draft step can cost 2.5 plain steps (and steps with drafts
  run one at a time, without async scheduling's overlap). The policy keeps exponentially
  decayed seconds per decode step without drafts and with ``k`` drafts, per coarse batch-size
  bucket (powers of two), and picks the ``k`` of the most expected tokens per second,
  ``tokens(k, a) / seconds(k)``; speculation is off when no ``k`` beats ``1 / seconds(0)``
  (turning back on needs a ``margin`` better rate: no flapping). A ``k`` not measured yet in
  the bucket costs ``seconds(0) + (seconds(j) - seconds(0)) k / j`` for the nearest measured
  ``j``. Neither estimate goes stale: every ``probe_plain_every`` steps with drafts the policy
  runs ``probe_len`` steps without, and every ``probe_spec_every`` steps off it runs
  ``probe_len`` steps at ``k = 1`` (a missing estimate in the current bucket is probed after
  ``probe_warmup`` steps); while the choice holds, each probe doubles the interval (up to 8x),
  so a steady state pays well under 1% for them. Until both estimates of a bucket exist the roofline decides.
  Probes never override the batch band: above ``max_batch`` speculation stays off.

The scheduler asks ``num_speculative_tokens(batch_size)`` once per step and caps every
request's drafts at it, feeds ``observe`` after each verification, and the engine core feeds
``observe_step`` with each decode step's wall time.
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
        probe_plain_every: steps with drafts between two probes without (measured cost).
        probe_spec_every: steps off (by measured cost) between two probes at ``k = 1``.
        probe_len: steps per probe (the engine skips the first step after a mode change).
        probe_warmup: steps before a probe when the bucket lacks the other mode's estimate.
        cost_alpha: EMA weight of one step time.
        margin: relative tokens-per-second gain that turns speculation back on.
    """

    def __init__(self, k_max: int, max_batch: int = 32, min_acceptance: float = 0.3, band: float = 0.2,
                 on_fraction: float = 0.75, interval: int = 16, alpha: float = 0.05,
                 max_batched_tokens: int | None = None, draft_cost: float = 0.0, probe_plain_every: int = 64,
                 probe_spec_every: int = 128, probe_len: int = 4, probe_warmup: int = 8, cost_alpha: float = 0.2,
                 margin: float = 0.05) -> None:
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
        # Measured step cost (observe_step): bucket -> seconds per plain step / {k: seconds}.
        self.probe_plain_every, self.probe_spec_every = probe_plain_every, probe_spec_every
        self.probe_len, self.probe_warmup = max(probe_len, 1), probe_warmup
        self.cost_alpha, self.margin = cost_alpha, margin
        self.step_seconds: dict[int, float] = {}
        self.spec_step_seconds: dict[int, dict[int, float]] = {}
        self._timed = False  # observe_step was called: measured cost and probes apply
        self._measured_on = True  # the measured rule's last choice (turning on needs the margin)
        self._since_probe = 0  # steps in the current mode since the last probe / mode change
        self._probe_left = 0  # steps left in the running probe
        self._probe_k = 0  # the running probe's k (0: a plain probe)
        self._backoff = 1  # probe interval multiplier: doubles per probe that changes nothing
        self.max_backoff = 8
        self.num_probes = 0

    @staticmethod
    def bucket(batch_size: int) -> int:
        """The batch-size bucket of the cost estimates: 1, 2-3, 4-7, 8-15, ... -> 1, 2, 3, 4, ..."""
        return max(batch_size, 1).bit_length()

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        """One decode step's wall time (seconds; async steps: the time between two steps'
        results) with ``k`` drafts per request (0: none) for ``batch_size`` requests."""
        if seconds <= 0 or batch_size <= 0 or k < 0:
            return
        self._timed = True
        b, w = self.bucket(batch_size), self.cost_alpha
        if k == 0:
            old = self.step_seconds.get(b)
            self.step_seconds[b] = seconds if old is None else old + w * (seconds - old)
        else:
            d = self.spec_step_seconds.setdefault(b, {})
            old = d.get(k)
            d[k] = seconds if old is None else old + w * (seconds - old)

    def measured_seconds(self, k: int, batch_size: int) -> float | None:
        """Estimated seconds of a decode step with ``k`` drafts (None: not measured in the bucket)."""
        b = self.bucket(batch_size)
        t0 = self.step_seconds.get(b)
        if k == 0:
            return t0
        d = self.spec_step_seconds.get(b)
        if not d:
            return None
        if k in d:
            return d[k]
        if t0 is None:
            return None
        j = min(d, key=lambda j: (abs(j - k), j))
        return t0 + (d[j] - t0) * k / j

    def tokens_per_step(self, k: int) -> float:
        """Expected tokens per request of a step verifying ``k`` drafts: ``(1 - a^(k+1)) / (1 - a)``."""
        a = min(self.chain_acceptance, 1.0 - 1e-9)
        return (1 - a ** (k + 1)) / (1 - a)

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

    def _measured_choice(self, batch_size: int) -> int | None:
        """k by measured tokens per second (0: off); None while the bucket lacks an estimate."""
        t0 = self.measured_seconds(0, batch_size)
        if not self._timed or t0 is None or not self.spec_step_seconds.get(self.bucket(batch_size)):
            return None
        rates = {k: self.tokens_per_step(k) / max(self.measured_seconds(k, batch_size), 1e-12)
                 for k in range(1, self.k + 1)}
        best = max(rates, key=lambda k: (rates[k], -k))
        need = (1.0 if self._measured_on else 1.0 + self.margin) / t0
        return best if rates[best] > need else 0

    def _choose(self, batch_size: int, on: bool) -> int:
        if not on:
            return 0
        m = self._measured_choice(batch_size)
        if m is not None:
            return m
        best = max(range(1, self.k + 1), key=lambda k: (self.goodput(k, batch_size), -k))
        if (self.max_batched_tokens and 2 * batch_size > self.max_batched_tokens
                and self.goodput(best, batch_size) <= self.goodput(0, batch_size)):
            return 0  # compute-bound: verifying drafts costs more than it brings
        return best

    def _plan(self, batch_size: int, on: bool) -> tuple[int, str]:
        """This step's k and what it is: ``"rule"`` (the rules' choice), ``"probe"`` (inside a
        probe), ``"start"`` (a probe starts). Pure: ``num_speculative_tokens`` commits it."""
        k = self._choose(batch_size, on)
        if not on or not self._timed:
            return k, "rule"
        if self._probe_left > 0:
            return min(self._probe_k, self.k), "probe"
        b = self.bucket(batch_size)
        if k > 0:
            every = self.probe_plain_every * self._backoff if b in self.step_seconds else self.probe_warmup
            return (0, "start") if self._since_probe >= every else (k, "rule")
        every = self.probe_spec_every * self._backoff if self.spec_step_seconds.get(b) else self.probe_warmup
        return (1, "start") if self._since_probe >= every else (0, "rule")

    def _band(self, batch_size: int) -> bool:
        if self.enabled and batch_size >= self.max_batch:
            return False
        if not self.enabled and batch_size <= self.on_batch:
            return True
        return self.enabled

    def num_speculative_tokens(self, batch_size: int) -> int:
        """Drafts per request for a step of ``batch_size`` running requests (0 = no speculation)."""
        self.enabled = self._band(batch_size)
        k, kind = self._plan(batch_size, self.enabled)
        if kind == "start":
            self.num_probes += 1
            self._backoff = min(2 * self._backoff, self.max_backoff)
            self._probe_k, self._probe_left = k, self.probe_len - 1
            if not self._probe_left:
                self._since_probe = 0
        elif kind == "probe":
            self._probe_left -= 1
            if not self._probe_left:
                self._since_probe = 0
        else:
            on = k > 0
            if self._timed and self._measured_choice(batch_size) is not None:
                if on != self._measured_on:
                    self._since_probe, self._backoff = 0, 1
                self._measured_on = on
            self._since_probe += 1
        return k

    def peek(self, batch_size: int, measured: bool = True) -> int:
        """What ``num_speculative_tokens(batch_size)`` would return, without changing state;
        ``measured=False``: the acceptance rules' choice alone (no step times, no probes)."""
        if measured:
            return self._plan(batch_size, self._band(batch_size))[0]
        timed, self._timed = self._timed, False
        try:
            return self._choose(batch_size, self._band(batch_size))
        finally:
            self._timed = timed

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
