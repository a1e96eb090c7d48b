"""Batched token sampler (vLLM semantics), on whatever device the logits live on.

Pipeline for a batch of logits ``[B, V]`` (row ``i`` belongs to ``requests[i]``):

1. logprobs (if any row asked): ``log_softmax`` of the RAW logits, top-n + sampled token.
2. penalties on the raw logits: CTRL repetition penalty (arXiv:1909.05858), then OpenAI's
   frequency and presence penalties over output tokens.
3. min_tokens: EOS / stop ids set to ``-inf`` while a row is below ``min_tokens``.
4. greedy rows: argmax. Random rows: temperature, top-k, top-p (nucleus, Holtzman et al.
   arXiv:1904.09751), min-p (Nguyen et al. arXiv:2407.01082), then an exponential race
   ``argmax(p / q)``, ``q ~ Exp(1)``, which draws from ``p`` (also used by vLLM).

No Python loop touches vocabulary entries; per-request loops only build metadata (and draw
the noise of seeded rows from their own generators, so that a seeded row does not depend on
the rest of the batch). Results come to the host in one device→host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.sample.metadata import SamplingMetadata, SamplingRequest, build_sampling_metadata

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    Attributes:
        sampled_token_ids: ``[B]`` host ints, one per row.
        logprobs: ``[B]``; ``None`` for rows that did not ask, else
            ``{token_id: (logprob, rank)}`` for the top-``logprobs`` tokens and the sampled
            token. ``logprob`` is ``log_softmax`` of the raw logits; ``rank`` is 1-based
            (1 = most likely), as in vLLM.
    """

    sampled_token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None]


# ----------------------------------------------------------------------------- penalties


def token_counts(ids: Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-row occurrence counts ``[B, V]`` (``dtype``) of padded ids ``[B, L]`` (long, pad =
    ``vocab_size``), built with ``scatter_add`` on the ids' device."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=dtype, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor | None,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
) -> Tensor:
    """Return penalized logits (out of place).

    Args:
        logits: float ``[B, V]``.
        prompt_mask: bool ``[B, V]``, token appears in the prompt (``None``: no prompt term).
        output_counts: float ``[B, V]``, occurrences of each token in the output so far.
        repetition_penalty: float ``[B]``, ``r > 0``; CTRL (Keskar et al., arXiv:1909.05858):
            for tokens in prompt or output, ``logit / r`` if ``logit > 0`` else ``logit * r``.
        frequency_penalty: float ``[B]``, ``f``: ``logit -= f * count``.
        presence_penalty: float ``[B]``, ``p``: ``logit -= p * (count > 0)``.
    """
    in_output = output_counts > 0
    seen = in_output if prompt_mask is None else (in_output | prompt_mask)
    r = repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    logits = logits - presence_penalty.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


# ----------------------------------------------------------------------------- filtering


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, max_top_k: int | None = None
) -> Tensor:
    """Mask to ``-inf`` the logits outside top-k and the nucleus (out of place).

    Args:
        logits: float ``[R, V]`` (already divided by the temperature).
        top_k: long ``[R]`` in ``[1, V]`` (``V`` keeps all), or ``None``.
        top_p: float ``[R]`` in ``(0, 1]``, or ``None``. Nucleus sampling (Holtzman et al.,
            arXiv:1904.09751): after top-k, keep the smallest prefix of the tokens sorted by
            probability whose mass is ``>= top_p``; the top token is always kept and
            ``top_p == 1`` keeps everything.
        max_top_k: host int ``>= top_k.max()``; lets top-k alone use ``topk`` instead of a
            full sort (ties at the k-th value are then all kept), and top-k with top-p sort
            only the top ``max_top_k`` when it is below ``V`` (every row has a top-k).
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    if top_p is None:
        # Top-k only: threshold at each row's k-th largest logit (ties at it are kept).
        return _apply_top_k_only(logits, top_k, V if max_top_k is None else max_top_k)
    if top_k is not None and max_top_k is not None and max_top_k < V:
        # Every row has a top-k: the nucleus lies within the top k_max, so topk(k_max) replaces
        # the full-vocabulary sort (same result up to the order of exactly tied logits).
        sorted_logits, sorted_idx = logits.topk(max(1, max_top_k), dim=-1)
        return _top_p_over_sorted(logits, sorted_logits, sorted_idx, top_k, top_p)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    return _top_p_over_sorted(logits, sorted_logits, sorted_idx, top_k, top_p)


def _top_p_over_sorted(logits: Tensor, sorted_logits: Tensor, sorted_idx: Tensor, top_k: Tensor | None,
                       top_p: Tensor) -> Tensor:
    """Top-k then top-p on descending ``sorted_logits`` ``[R, W]`` (``W <= V``, indices into
    ``logits`` in ``sorted_idx``); entries of ``logits`` not among them come out ``-inf``."""
    W = sorted_logits.shape[-1]
    if top_k is not None:
        pos = torch.arange(W, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(pos.unsqueeze(0) >= top_k.unsqueeze(1), _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumulative sum
    threshold = torch.where(top_p >= 1.0, torch.full_like(top_p, float("inf")), top_p)
    drop = mass_before >= threshold.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    out = torch.empty_like(logits) if W == logits.shape[-1] else torch.full_like(logits, _NEG_INF)
    return out.scatter_(1, sorted_idx, sorted_logits)


def _apply_top_k_only(logits: Tensor, top_k: Tensor, k_max: int) -> Tensor:
    """Top-k without a full sort: ``topk(k_max)`` then the k-th value per row (host ``k_max``
    must be ``>= top_k.max()``)."""
    V = logits.shape[-1]
    k_max = max(1, min(k_max, V))
    top_vals = logits.topk(k_max, dim=-1).values  # [R, k_max], descending
    kth = top_vals.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))
    kth = torch.where(top_k.unsqueeze(1) >= V, torch.full_like(kth, _NEG_INF), kth)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Min-p (Nguyen et al., arXiv:2407.01082): zero the probabilities ``p < min_p * p_max``.

    Args:
        probs: float ``[R, V]`` (need not be normalized: the rule is scale-invariant).
        min_p: float ``[R]`` in ``[0, 1]``.
    """
    p_max = probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < min_p.unsqueeze(1) * p_max, 0.0)


def exponential_race(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """Draw one token per row from (unnormalized) ``probs`` ``[R, V]``: ``argmax(p / q)``
    with ``q ~ Exp(1)`` i.i.d., which selects token ``j`` with probability ``p_j / sum(p)``.

    Rows listed in ``generators`` draw their ``q`` from their own generator, into a fresh
    ``[V]`` tensor, so the draw depends only on that generator (not on the batch). Other
    rows share one batched draw from the default RNG. Returns long ``[R]``.
    """
    R, V = probs.shape
    if len(generators) < R:
        q = torch.empty_like(probs).exponential_()
    else:
        q = torch.empty_like(probs)
    for row, g in generators.items():
        q[row] = torch.empty(V, dtype=probs.dtype, device=probs.device).exponential_(generator=g)
    # q == 0 would give 0/0 = nan (argmax picks nan); clamping keeps zero-prob tokens at 0.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


# ----------------------------------------------------------------------------- sampler


class Sampler:
    """Samples one token per row, batched on the logits' device (CPU or CUDA)."""

    def __call__(self, logits: Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        """Sample the next token of each request.

        Args:
            logits: float32 ``[B, V]`` (other float dtypes are upcast); row ``i`` belongs
                to ``requests[i]``. Not modified.
            requests: ``B`` requests; their ``sampling_params``, ``prompt_token_ids``,
                ``output_token_ids`` and ``eos_token_id`` are read, and seeded requests get
                ``request.generator`` created lazily.

        Returns:
            ``SamplerOutput`` (see there); one device→host copy per call.
        """
        _, packed, md = self.launch(logits, requests)
        return self.unpack(packed.tolist(), md)

    def launch(self, logits: Tensor, requests: list[SamplingRequest],
               all_plain_greedy: bool = False) -> tuple[Tensor, Tensor, SamplingMetadata]:
        """The device part of ``__call__``, with no host sync. ``all_plain_greedy``: the caller
        knows every request samples by a plain argmax (``build_sampling_metadata``).

        Returns ``(sampled, packed, md)``: sampled ids long ``[B]`` on the device, the tensor
        whose host copy ``unpack`` reads (the ids, with logprobs packed in when asked), and
        the batch's sampling metadata.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (logits.shape, len(requests))
        md = build_sampling_metadata(requests, logits.shape[1], logits.device, all_plain_greedy)
        sampled = self.sample(logits, md)
        return sampled, self._pack(logits, sampled, md), md

    def sample(self, logits: Tensor, md: SamplingMetadata) -> Tensor:
        """Device part of the step: long ``[B]`` sampled ids (no host sync)."""
        logits = self.process_logits(logits.float(), md)
        if md.all_greedy:
            return logits.argmax(dim=-1)
        rand_logits = logits if md.all_random else logits.index_select(0, md.random_idx)
        rand_sampled = self.sample_random(rand_logits, md)
        if md.all_random:
            return rand_sampled
        return logits.argmax(dim=-1).index_copy(0, md.random_idx, rand_sampled)

    @staticmethod
    def process_logits(logits: Tensor, md: SamplingMetadata) -> Tensor:
        """Penalties, then min_tokens suppression; float ``[B, V]`` out of place."""
        V = logits.shape[1]
        if not md.no_penalties:
            counts = token_counts(md.output_ids, V, logits.dtype)
            prompt_mask = None
            if md.prompt_ids is not None:
                prompt_mask = torch.zeros(md.batch_size, V + 1, dtype=torch.bool, device=logits.device)
                prompt_mask.scatter_(1, md.prompt_ids, True)
                prompt_mask = prompt_mask[:, :V]
            logits = apply_penalties(
                logits, prompt_mask, counts, md.repetition_penalty, md.frequency_penalty, md.presence_penalty
            )
        if md.min_tokens_rows is not None:
            logits = logits.index_put(
                (md.min_tokens_rows, md.min_tokens_cols), torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device)
            )
        return logits

    @staticmethod
    def sample_random(logits: Tensor, md: SamplingMetadata) -> Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race; long ``[R]``."""
        logits = logits / md.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k or None)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            probs = apply_min_p(probs, md.min_p)
        return exponential_race(probs, md.generators)

    @staticmethod
    def _pack(raw_logits: Tensor, sampled: Tensor, md: SamplingMetadata) -> Tensor:
        """Gather logprobs on the device and pack them with the ids into one float64 tensor
        (ids are exact in float64), so the host copy is one transfer; just the ids without
        logprobs."""
        if md.logprobs_idx is None:
            return sampled
        K = md.max_num_logprobs
        lp = torch.log_softmax(raw_logits.index_select(0, md.logprobs_idx).float(), dim=-1)  # [L, V]
        tok = sampled.index_select(0, md.logprobs_idx).unsqueeze(1)  # [L, 1]
        tok_lp = lp.gather(1, tok)  # [L, 1]
        tok_rank = (lp > tok_lp).sum(dim=-1, keepdim=True) + 1
        parts = [tok_lp.double(), tok_rank.double()]
        if K > 0:
            top_vals, top_ids = lp.topk(K, dim=-1)
            parts += [top_vals.double(), top_ids.double()]
        return torch.cat([sampled.double(), torch.cat(parts, dim=1).flatten()])

    @staticmethod
    def unpack(packed: list, md: SamplingMetadata) -> SamplerOutput:
        """Host side: ``packed`` is ``_pack``'s tensor as a list."""
        B = md.batch_size
        if md.logprobs_idx is None:
            return SamplerOutput(packed, [None] * B)
        K = md.max_num_logprobs
        ids = [int(x) for x in packed[:B]]
        out: list[dict[int, tuple[float, int]] | None] = [None] * B
        width = 2 + 2 * K
        for j, (row, n) in enumerate(zip(md.logprobs_rows, md.num_logprobs)):
            base = B + j * width
            rec = packed[base : base + width]
            d: dict[int, tuple[float, int]] = {}
            for r in range(n):
                d[int(rec[2 + K + r])] = (rec[2 + r], r + 1)
            d.setdefault(ids[row], (rec[0], int(rec[1])))
            out[row] = d
        return SamplerOutput(ids, out)

