"""The speculative step's batched host paths equal the general ones: the n-gram and suffix
lookups over a whole batch, and the draft rows' output-token views (no model)."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.sample.metadata import build_sampling_metadata
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.ngram import ngram_propose, ngram_propose_batch
from kvserve.spec_decode.rejection_sampler import DraftedTokens, DraftPosition, draft_positions
from kvserve.spec_decode.suffix import local_suffix_propose, local_suffix_propose_batch


def _random_batches(seed: int, n: int):
    """Token rows over tiny vocabularies (many repeats), random lengths (0 included), rows in any order."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        B, W, V = int(rng.integers(1, 9)), int(rng.integers(1, 60)), int(rng.integers(2, 8))
        tokens = rng.integers(0, V, (B + 3, W + 5))
        yield rng, tokens, rng.permutation(B + 3)[:B], rng.integers(0, W + 1, B)


def test_ngram_batch_equals_per_sequence_lookup():
    for rng, tokens, rows, lens in _random_batches(0, 400):
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 4)), int(rng.integers(0, 6))
        want = [ngram_propose(tokens[r, :n], lo, hi, k).tolist() for r, n in zip(rows, lens)]
        assert ngram_propose_batch(tokens, rows, lens, lo, hi, k) == want


def _suffix_reference(tokens, max_depth, k, factor, min_prob):
    """The local suffix lookup written plainly: every earlier end of the longest pattern, then
    the most frequent continuation (smallest token among ties), token by token."""
    tokens = tokens.tolist()
    L = len(tokens)
    if L < 2 or k <= 0:
        return [], 0.0
    best, pos = 0, []
    for e in range(L - 1):
        n = 0
        while n < max_depth and e - n >= 0 and tokens[e - n] == tokens[L - 1 - n]:
            n += 1
        if n > best:
            best, pos = n, [e]
        elif n == best and n:
            pos.append(e)
    if not best:
        return [], 0.0
    draft, score, prob = [], 0.0, 1.0
    for j in range(min(k, max(1, int(factor * best)))):
        nxt = [p + 1 + j for p in pos if p + 1 + j < L]
        if not nxt:
            break
        counts: dict[int, int] = {}
        for p in nxt:
            counts[tokens[p]] = counts.get(tokens[p], 0) + 1
        tok = min(counts, key=lambda t: (-counts[t], t))
        p = prob * np.int64(counts[tok]) / len(nxt)
        if p < min_prob:
            break
        prob = p
        draft.append(tok)
        score += prob
        pos = [q - 1 - j for q in nxt if tokens[q] == tok]
    return draft, score


def test_suffix_batch_and_single_equal_the_plain_lookup():
    for rng, tokens, rows, lens in _random_batches(1, 300):
        depth, k = int(rng.integers(1, 9)), int(rng.integers(0, 6))
        factor, min_prob = float(rng.choice([0.5, 1.0, 2.0])), float(rng.choice([0.0, 0.1, 0.3, 1.0]))
        want = [_suffix_reference(tokens[r, :n], depth, k, factor, min_prob) for r, n in zip(rows, lens)]
        assert [local_suffix_propose(tokens[r, :n], depth, k, factor, min_prob) for r, n in zip(rows, lens)] == want
        assert local_suffix_propose_batch(tokens, rows, lens, depth, k, factor, min_prob) == want


class _State:
    def __init__(self, output, sp):
        self.sampling_params, self.prompt_token_ids, self.output_token_ids = sp, [5, 6, 7], output
        self.eos_token_id, self.generator = 2, None


def test_draft_rows_read_as_copied_lists():
    base, d = [3, 1, 4], [1, 5, 9]
    for n in range(4):
        v = DraftedTokens(base, d, n)
        want = base + d[:n]
        assert list(v) == want and len(v) == len(want) and v == want
        assert [v[i] for i in range(len(want))] == want and v[-1] == want[-1] and v[1:] == want[1:]
    # the sampler's metadata (penalties copy the tokens, min_tokens reads the length) is unchanged
    sps = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
           SamplingParams(temperature=0.0, min_tokens=6, ignore_eos=False)]
    states = [_State([9, 8], sps[0]), _State([4, 4, 4, 4], sps[1])]
    drafts = [[1, 2], [3, 2, 1]]
    rows = draft_positions(states, drafts, torch.device("cpu"))
    copied = [DraftPosition(st, list(st.output_token_ids) + d[:j]) for st, d in zip(states, drafts)
              for j in range(len(d) + 1)]
    assert [list(r.output_token_ids) for r in rows] == [r.output_token_ids for r in copied]
    got, want = build_sampling_metadata(rows, 16, "cpu"), build_sampling_metadata(copied, 16, "cpu")
    for name in ("output_ids", "prompt_ids", "min_tokens_rows", "min_tokens_cols"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
