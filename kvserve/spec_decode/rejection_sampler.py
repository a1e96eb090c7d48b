"""Lossless verification of draft tokens (Leviathan et al., arXiv:2211.17192; Chen et al.,
arXiv:2302.01318).

Speculative sampling accepts draft ``x ~ q`` with probability ``min(1, p(x) / q(x))`` and on
rejection samples from ``norm(max(p - q, 0))``; after ``k`` accepted drafts it samples one
more token from ``p``. Every emitted token is then distributed exactly as the target's
``p`` (given the tokens before it).

Our proposers (n-gram lookup, greedy draft models, greedy EAGLE chains) make *point*
proposals: ``q = δ(draft)``. The rule then reads: accept ``d`` with probability ``p(d)``,
else sample from ``p`` with ``d`` removed — which is exactly "sample ``t ~ p``; accept the
draft if ``t == d``, else emit ``t``". The engine uses that form (``verify``): each of a
request's ``1 + k`` positions is sampled by the ordinary sampler (temperature, top-k/p,
min-p, penalties, min_tokens, logprobs, seeds) as if the drafts before it were accepted,
and the drafts are kept while they equal the samples. At temperature 0 this is greedy
verification. Seeded requests replay their generator so that it advances once per *emitted*
token, as without speculation: a seeded request gives the same tokens with or without
speculation.

``rejection_sample`` is the general rule for proposers that sample their drafts from a
distribution ``q`` (kept for draft models run with temperature; tested against the
target distribution).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, islice
from typing import Optional

import torch

from kvserve.sample.metadata import GREEDY_EPS, get_generator


class DraftPosition:
    """A request seen at one of its draft positions: what the sampler reads
    (``kvserve.sample.metadata.SamplingRequest``) with the earlier drafts appended."""

    __slots__ = ("sampling_params", "prompt_token_ids", "output_token_ids", "eos_token_id", "generator")

    def __init__(self, state, output_token_ids: list[int]) -> None:
        self.sampling_params = state.sampling_params
        self.prompt_token_ids = state.prompt_token_ids
        self.output_token_ids = output_token_ids
        self.eos_token_id = state.eos_token_id
        self.generator = state.generator


class DraftedTokens(Sequence):
    """``base + drafts[:n]`` as a read-only sequence, without copying ``base``: a draft row's
    output tokens. The sampler reads them only for penalties (a copy then) and ``min_tokens``
    (the length), so most rows never materialize the list. ``base`` must not change while the
    view is in use (the step's sampler launch)."""

    __slots__ = ("_base", "_drafts", "_n")

    def __init__(self, base: list[int], drafts: list[int], n: int) -> None:
        self._base, self._drafts, self._n = base, drafts, n

    def __len__(self) -> int:
        return len(self._base) + self._n

    def __iter__(self):
        return chain(self._base, islice(self._drafts, self._n))

    def __getitem__(self, i):
        return list(self)[i] if isinstance(i, slice) or i < 0 or i >= len(self._base) else self._base[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, DraftedTokens)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


def draft_positions(states: list, drafts: list[list[int]], device: torch.device) -> list[DraftPosition]:
    """Sampler rows for requests verifying drafts: ``1 + len(d)`` rows per request, row ``j``
    as if ``d[:j]`` had been accepted (its output tokens a ``DraftedTokens`` view: no copy of
    the output per row). Seeded random requests get their generator created first so that all
    their rows draw from it, in order."""
    out = []
    for st, d in zip(states, drafts):
        sp = st.sampling_params
        if sp.seed is not None and sp.temperature >= GREEDY_EPS:
            get_generator(st, device)
        base = st.output_token_ids
        out.extend(DraftPosition(st, DraftedTokens(base, d, j)) for j in range(len(d) + 1))
    return out


def verify(drafts: list[int], samples: list[int]) -> list[int]:
    """Tokens a request gets for ``drafts`` ``[k]`` given the target's samples ``[k + 1]``
    (each drawn as if the drafts before it were accepted): the drafts while they equal the
    samples, then the sample at the first difference (or after the last draft)."""
    a = 0
    while a < len(drafts) and drafts[a] == samples[a]:
        a += 1
    return list(drafts[:a]) + [samples[a]]


def replay_generator(generator: torch.Generator, state: torch.Tensor, num_draws: int, vocab_size: int) -> None:
    """Reset ``generator`` to ``state`` and redo ``num_draws`` of the sampler's per-row draws
    (``kvserve.sample.sampler.exponential_race``: one float32 Exp(1) vector of the vocab size
    each), so it stands where it would after ``num_draws`` plain sampling steps."""
    generator.set_state(state)
    dev = generator.device
    for _ in range(num_draws):
        torch.empty(vocab_size, dtype=torch.float32, device=dev).exponential_(generator=generator)


def rejection_sample(draft_ids: torch.Tensor, draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Speculative sampling for a batch of draft chains (Leviathan et al., arXiv:2211.17192,
    Algorithm 1), vectorized over the batch.

    Args:
        draft_ids: long ``[B, k]`` drafted tokens.
        draft_probs: float ``[B, k, V]`` the draft distributions they were drawn from, or None
            for point proposals (``q = δ(draft)``: n-gram, greedy drafts).
        target_probs: float ``[B, k + 1, V]`` the target's (normalized) distributions at each
            position, position ``j`` conditioned on the drafts before it.
        generator: RNG for the uniforms and residual draws (default RNG when None).

    Returns:
        long ``[B, k + 1]``: the emitted tokens, ``-1`` past each row's end (row ``b`` emits
        ``accepted_b + 1`` tokens).

    Raises:
        ValueError: on mismatched shapes.
    """
    B, k = draft_ids.shape
    if target_probs.shape[:2] != (B, k + 1) or (draft_probs is not None and draft_probs.shape[:2] != (B, k)):
        raise ValueError(f"shapes: draft_ids {tuple(draft_ids.shape)}, target_probs {tuple(target_probs.shape)}, "
                         f"draft_probs {None if draft_probs is None else tuple(draft_probs.shape)}")
    dev = target_probs.device
    p = target_probs[:, :k].float()
    p_d = p.gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [B, k]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        q = torch.zeros_like(p).scatter_(2, draft_ids.unsqueeze(2), 1.0)
    else:
        q = draft_probs.float()
        q_d = q.gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    u = torch.rand(B, k, device=dev, generator=generator)
    accept = u * q_d < p_d  # u < p/q without dividing by q = 0
    # Accepted prefix length per row.
    num_acc = torch.cumprod(accept.to(torch.long), dim=1).sum(dim=1)  # [B]
    residual = (p - q).clamp_min(0)
    # A residual of all zeros only happens when p == q (then rejection has probability 0).
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    fallback = torch.cat([residual, target_probs[:, k:].float()], dim=1)  # [B, k + 1, V]
    rows = fallback[torch.arange(B, device=dev), num_acc]  # [B, V] where each row stops
    last = torch.multinomial(rows, 1, generator=generator).squeeze(1)
    out = torch.full((B, k + 1), -1, dtype=torch.long, device=dev)
    pos = torch.arange(k + 1, device=dev).unsqueeze(0)
    out[:, :k] = torch.where(pos[:, :k] < num_acc.unsqueeze(1), draft_ids, out[:, :k])
    out.scatter_(1, num_acc.unsqueeze(1), last.unsqueeze(1))
    return out
