"""N-gram lookup, the speculative config's validation, the rejection sampler and the dynamic
policy on known inputs (no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.config import SpeculativeConfig
from kvserve.core.scheduler.spec_policy import DynamicSpeculation
from kvserve.spec_decode.ngram import ngram_propose
from kvserve.spec_decode.rejection_sampler import rejection_sample, verify


def _ng(seq, lo=1, hi=3, k=4):
    return ngram_propose(np.asarray(seq, dtype=np.int64), lo, hi, k).tolist()


def test_ngram_finds_the_longest_latest_match():
    # suffix [7, 8] occurs at 0 (followed by 1 2 3) and at 5 (followed by 4 5): the 3-gram
    # [9, 7, 8] only at 4..6 -> drafts 4, 5, ...
    seq = [7, 8, 1, 2, 3, 9, 7, 8, 4, 5, 6, 9, 7, 8]
    assert _ng(seq) == [4, 5, 6, 9]
    # k caps the drafts; the drafts never run past the sequence
    assert _ng(seq, k=2) == [4, 5]
    assert _ng([5, 6, 5], k=4) == [6, 5]
    # ties at the longest length: the latest occurrence wins
    assert _ng([1, 2, 1, 3, 1], hi=1) == [3, 1]


def test_ngram_respects_min_and_max():
    seq = [1, 2, 3, 9, 2, 3]
    assert _ng(seq, lo=2, hi=3) == [9, 2, 3]
    assert _ng(seq, lo=3, hi=3) == []  # [9?, 2, 3] does not recur as a 3-gram
    assert _ng([1, 2, 3, 4], lo=1) == []  # nothing recurs
    assert _ng([4], lo=1) == [] and _ng([], lo=1) == []
    assert _ng([1, 1, 1, 1], lo=1, hi=2, k=3) == [1]  # longest match ends right before the suffix


def test_speculative_config_validation():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (2, 5, 3)
    assert SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 1}).prompt_lookup_min == 1
    bad = [({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
           ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
           ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
           ({"method": "draft_model"}, "needs 'model'"),
           ({"method": "eagle", "num_speculative_tokens": 2}, "needs 'model'"),
           ({"num_speculative_tokens": 2}, "needs a 'method'"),
           ({"method": "ngram", "dynamic_max_batch": 0}, "dynamic_max_batch")]
    for d, msg in bad:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.from_dict(d)


def test_verify_known_answers():
    assert verify([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert verify([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert verify([5], [4, 1]) == [4]
    assert verify([], [3]) == [3]


def test_rejection_sample_known_answers():
    V = 4
    d = torch.tensor([[1, 2]])
    # target puts all mass on the drafts: always accepted, then the bonus token from p[2]
    p = torch.zeros(1, 3, V)
    p[0, 0, 1] = p[0, 1, 2] = p[0, 2, 3] = 1.0
    assert rejection_sample(d, None, p).tolist() == [[1, 2, 3]]
    # target gives the first draft probability 0: rejected, residual = p itself
    p2 = p.clone()
    p2[0, 0] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    assert rejection_sample(d, None, p2).tolist() == [[3, -1, -1]]
    # q == p: always accepted whatever they are
    q = torch.full((1, 2, V), 0.25)
    pq = torch.full((1, 3, V), 0.25)
    assert (rejection_sample(d, q, pq) >= 0).all()
    with pytest.raises(ValueError, match="shapes"):
        rejection_sample(d, None, p[:, :2])


@pytest.mark.parametrize("point", [True, False])
def test_rejection_sample_has_the_target_distribution(point):
    """Chi-square goodness of fit of the first emitted token against p (arXiv:2211.17192)."""
    g = torch.Generator().manual_seed(0)
    V, N = 6, 20000
    p = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.1, 0.05])
    q = torch.tensor([0.05, 0.1, 0.4, 0.05, 0.3, 0.1])
    if point:
        drafts = torch.full((N, 1), 2)  # a fixed proposal (n-gram-like)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, N, replacement=True, generator=g).unsqueeze(1)
        draft_probs = q.expand(N, 1, V)
    target = p.expand(N, 2, V)
    out = rejection_sample(drafts, draft_probs, target, generator=g)
    first = out[:, 0]
    counts = torch.bincount(first, minlength=V).numpy()
    stats = pytest.importorskip("scipy.stats")
    _, pval = stats.chisquare(counts, (p * N).numpy())
    assert pval > 1e-3, (counts, pval)
    # accepted drafts are followed by a bonus token from p too
    acc = out[:, 1] >= 0
    assert acc.float().mean().item() == pytest.approx(
        p[2].item() if point else torch.minimum(p, q).sum().item(), abs=0.02)


def test_dynamic_policy_hysteresis_on_batch_size():
    pol = DynamicSpeculation(k_max=4, max_batch=32)
    ks = [pol.num_speculative_tokens(b) for b in [1, 8, 31, 32, 31, 30, 25, 24, 25, 31, 32, 33]]
    # off at 32, stays off until the batch falls to 24, back on until it reaches 32 again
    assert ks == [4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 0, 0]
    # a batch oscillating around the threshold flips at most once
    pol = DynamicSpeculation(k_max=2, max_batch=32)
    seq = [pol.num_speculative_tokens(b) for b in [31, 33] * 20]
    assert sum(a != b for a, b in zip(seq, seq[1:])) == 1


def test_dynamic_policy_k_follows_acceptance_with_hysteresis():
    pol = DynamicSpeculation(k_max=4, max_batch=64, min_acceptance=0.3, band=0.2, interval=4, alpha=0.5)
    for _ in range(40):  # nothing accepted: k walks down to 1, never 0
        pol.observe(4, 0)
    assert pol.num_speculative_tokens(1) == 1
    ks = []
    for acc in [0.4] * 20:  # inside the band (0.3..0.5): k holds
        pol.observe(10, int(acc * 10))
        ks.append(pol.k)
    assert set(ks) == {1}
    for _ in range(40):  # all accepted: back up to k_max
        pol.observe(4, 4)
    assert pol.num_speculative_tokens(1) == 4


def test_suffix_local_draft_follows_the_most_frequent_continuation():
    from kvserve.spec_decode.suffix import local_suffix_propose

    seq = np.asarray([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], dtype=np.int64)
    # The longest recurring pattern is "1 2 3" (3 tokens; "5 1 2 3" never occurred), followed by
    # 9 twice and by 7 once: 9 with p = 2/3, then "1 2" on both 9-branches; at most 1.0 x 3 tokens.
    draft, score = local_suffix_propose(seq, max_depth=8, k=4, factor=1.0, min_prob=0.1)
    assert draft == [9, 1, 2] and score == pytest.approx(3 * 2 / 3)
    assert local_suffix_propose(seq, 8, 4, factor=0.34)[0] == [9]  # int(0.34 x 3) = 1 token
    # min_prob: a 2/3 branch is cut at 0.7.
    assert local_suffix_propose(seq, 8, 4, min_prob=0.7)[0] == []
    assert local_suffix_propose(np.asarray([4, 5, 6], dtype=np.int64), 8, 4) == ([], 0.0)


def test_suffix_tree_counts_add_and_remove_exactly():
    from kvserve.spec_decode.suffix import SuffixTree

    tree = SuffixTree(max_depth=4)
    tree.add([1, 2, 3, 4, 5])
    tree.add([1, 2, 3, 6])
    tree.add([1, 2, 3, 4, 7])
    draft, score = tree.propose([9, 1, 2, 3], k=3)
    assert draft[0] == 4 and score > 0  # 4 follows "1 2 3" twice of three
    tree.remove([1, 2, 3, 4, 5])
    tree.remove([1, 2, 3, 4, 7])
    assert tree.propose([1, 2, 3], k=3)[0] == [6]
    tree.remove([1, 2, 3, 6])
    assert tree.root == {} and tree.propose([1, 2, 3], k=3) == ([], 0.0)


def test_suffix_config_keys_are_checked():
    from types import SimpleNamespace

    from kvserve.spec_decode import get_proposer_class

    cls = get_proposer_class("suffix")
    for bad in ({"suffix_decoding_max_tree_depth": 0}, {"suffix_decoding_min_token_prob": 2},
                {"suffix_decoding_max_spec_factor": 0}, {"suffix_decoding_max_cached_requests": -1}):
        sc = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3, **bad})
        with pytest.raises(ValueError, match=next(iter(bad))):
            cls(SimpleNamespace(speculative_config=sc))
