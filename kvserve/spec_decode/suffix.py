"""Suffix decoding: model-free drafts from the request's own context and from earlier outputs
(Oliaro et al., "SuffixDecoding", arXiv:2411.04975; vLLM's ``suffix`` method).

Two sources, each matched against the sequence's latest tokens (the pattern, at most
``suffix_decoding_max_tree_depth`` of them):

- the request's own prompt and output: every earlier position where the longest matching
  pattern occurs is a candidate; the draft follows, token by token, the continuation most of
  the surviving candidates share (a frequency-weighted walk, where prompt lookup takes only the
  latest occurrence);
- a global tree of the outputs of recent finished requests (at most
  ``suffix_decoding_max_cached_requests``, oldest evicted): a depth-limited suffix trie with
  counts, walked the same way. Agent loops, self-refinement and code edits repeat earlier
  outputs; this is where they pay.

A draft token is kept while its estimated probability (the product of the walk's branch
frequencies) is at least ``suffix_decoding_min_token_prob``, and a draft is at most
``suffix_decoding_max_spec_factor`` x the pattern length long (longer matches earn longer
drafts), and at most k. The source whose draft has the higher expected accepted length (the
sum of its token probabilities) wins. Drafts only change speed: verification keeps the output
identical to no speculation.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvserve.config import EngineConfig
from kvserve.spec_decode.ngram import suffix_match_lengths
from kvserve.spec_decode.proposer import Proposer

#: vLLM's keys and defaults.
DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
            "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


def _max_draft(match_len: int, k: int, factor: float) -> int:
    return min(k, max(1, int(factor * match_len)))


def local_suffix_propose(tokens: np.ndarray, max_depth: int, k: int, factor: float = 1.0,
                         min_prob: float = 0.1) -> tuple[list[int], float]:
    """Draft from the sequence's own earlier occurrences of its latest tokens.

    Args:
        tokens: int ``[L]`` the sequence so far (prompt + output).
        max_depth: longest pattern matched (tokens).
        k: most tokens to draft; factor: the draft is at most ``factor * pattern length``.
        min_prob: stop when a token's estimated probability falls below it.
    Returns:
        ``(draft, score)``: up to ``k`` tokens and their summed probabilities (0 for none).
    """
    L = len(tokens)
    if L < 2 or k <= 0:
        return [], 0.0
    cand = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])  # ends of earlier occurrences
    if not len(cand):
        return [], 0.0
    length = np.ones(len(cand), dtype=np.int64)
    alive = np.ones(len(cand), dtype=bool)
    for j in range(1, max_depth):
        idx = cand - j
        ok = alive & (idx >= 0)
        if L - 1 - j < 0:
            break
        ok[ok] = tokens[idx[ok]] == tokens[L - 1 - j]
        length += ok
        alive = ok
        if not alive.any():
            break
    match = int(length.max())
    return _walk(tokens, cand[length == match], match, k, factor, min_prob)


def _walk(tokens: np.ndarray, pos: np.ndarray, match: int, k: int, factor: float, min_prob: float
          ) -> tuple[list[int], float]:
    """The frequency-weighted walk after ``pos`` (every end of the longest pattern, ``match``
    tokens long): ``local_suffix_propose``'s draft and score."""
    L = len(tokens)
    draft, score, prob = [], 0.0, 1.0
    n = _max_draft(match, k, factor)
    for j in range(n):
        if len(pos) == 1:  # one occurrence left: the rest is its continuation, each token at `prob`
            if prob < min_prob:
                break
            start = int(pos[0]) + 1 + j
            for t in tokens[start: start + n - j].tolist():
                draft.append(t)
                score += prob
            break
        nxt = pos + 1 + j
        nxt = nxt[nxt < L]
        if not len(nxt):
            break
        cont = tokens[nxt]
        if len(nxt) <= 64:  # few occurrences: counting in Python beats np.unique's sort
            counts: dict[int, int] = {}
            for t in cont.tolist():
                counts[t] = counts.get(t, 0) + 1
            tok = min(counts, key=lambda t: (-counts[t], t))  # the most frequent, the smallest among ties
            count = counts[tok]
        else:
            vals, cnts = np.unique(cont, return_counts=True)
            best = int(cnts.argmax())
            tok, count = int(vals[best]), int(cnts[best])
        p = prob * count / len(nxt)
        if p < min_prob:
            break
        prob = p
        draft.append(tok)
        score += prob
        pos = nxt[cont == tok] - 1 - j
    return draft, score


def local_suffix_propose_batch(token_ids: np.ndarray, rows: np.ndarray, lens: np.ndarray, max_depth: int, k: int,
                               factor: float = 1.0, min_prob: float = 0.1) -> list[tuple[list[int], float]]:
    """``local_suffix_propose`` for several sequences at once (the same drafts and scores): the
    pattern matching is one 2-D pass per pattern length over the batch
    (``ngram.suffix_match_lengths``); only the short walks after the matches are per sequence.

    Args:
        token_ids: int ``[R, W]`` token rows (``W >= max(lens)``); rows: int ``[B]`` rows to
            draft for; lens: int ``[B]`` their lengths; the rest as ``local_suffix_propose``.
    Returns:
        ``B`` pairs ``(draft, score)``.
    """
    B = len(rows)
    out: list[tuple[list[int], float]] = [([], 0.0)] * B
    lens = np.asarray(lens, dtype=np.int64)
    if k <= 0 or B == 0 or int(lens.max()) < 2:
        return out
    T, cb, ce, length = suffix_match_lengths(token_ids, rows, lens, max_depth)
    if not len(cb):
        return out
    best = np.zeros(B, dtype=np.int64)
    np.maximum.at(best, cb, length)
    hit = length == best[cb]  # every occurrence of each row's longest pattern
    hb, he = cb[hit], ce[hit]
    bounds = np.flatnonzero(np.append(True, hb[1:] != hb[:-1]))  # each row's first hit
    ends = np.append(bounds[1:], len(hb)).tolist()
    for i, j, b in zip(bounds.tolist(), ends, hb[bounds].tolist()):
        out[b] = _walk(T[b, :lens[b]], he[i:j], int(best[b]), k, factor, min_prob)
    return out


class SuffixTree:
    """A depth-limited suffix trie over token sequences with occurrence counts.

    Each added sequence inserts all its suffixes, truncated to ``max_depth`` tokens; a node's
    count is how many inserted suffixes pass through it. ``remove`` undoes an ``add`` (counts
    fall, empty nodes are dropped), so the tree holds exactly the sequences added and not removed.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root: dict = {}  # token -> [count, children]

    def _update(self, seq: list[int], delta: int) -> None:
        for i in range(len(seq)):
            node = self.root
            for t in seq[i:i + self.max_depth]:
                entry = node.get(t)
                if entry is None:
                    entry = node[t] = [0, {}]
                entry[0] += delta
                if entry[0] <= 0:
                    del node[t]
                    break
                node = entry[1]

    def add(self, seq: list[int]) -> None:
        self._update(seq, 1)

    def remove(self, seq: list[int]) -> None:
        self._update(seq, -1)

    def propose(self, context: list[int], k: int, factor: float = 1.0, min_prob: float = 0.1
                ) -> tuple[list[int], float]:
        """Draft after the longest suffix of ``context`` (at most ``max_depth - 1`` tokens, so a
        continuation can follow) found in the tree: ``(draft, summed probabilities)``."""
        for m in range(min(len(context), self.max_depth - 1), 0, -1):
            node, total = self.root, 0
            for t in context[-m:]:
                entry = node.get(t)
                if entry is None:
                    node = None
                    break
                total, node = entry[0], entry[1]
            if not node:
                continue
            draft, score, prob = [], 0.0, 1.0
            for _ in range(_max_draft(m, k, factor)):
                if not node:
                    break
                t, (count, children) = max(node.items(), key=lambda kv: kv[1][0])
                p = prob * count / total
                if p < min_prob:
                    break
                prob = p
                draft.append(t)
                score += prob
                node, total = children, count
            return draft, score
        return [], 0.0


class SuffixProposer(Proposer):
    """``{"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1}`` (vLLM's keys and defaults).

    Raises ValueError for a key out of range.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        extra = config.speculative_config.extra
        opts = {key: extra.get(key, default) for key, default in DEFAULTS.items()}
        for key in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            v = opts[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if "depth" in key else 0):
                raise ValueError(f"{key} must be an integer >= {1 if 'depth' in key else 0}, got {v!r}")
        if not isinstance(opts["suffix_decoding_max_spec_factor"], (int, float)) or \
                opts["suffix_decoding_max_spec_factor"] <= 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, "
                             f"got {opts['suffix_decoding_max_spec_factor']!r}")
        p = opts["suffix_decoding_min_token_prob"]
        if not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got {p!r}")
        self.max_depth = opts["suffix_decoding_max_tree_depth"]
        self.max_cached = opts["suffix_decoding_max_cached_requests"]
        self.factor = float(opts["suffix_decoding_max_spec_factor"])
        self.min_prob = float(p)
        self.global_tree = SuffixTree(self.max_depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()  # request id -> output in the tree
        self._outputs: dict[str, list[int]] = {}  # running requests' outputs, added when they finish

    def propose(self, requests: list, batch) -> list[list[int]]:
        k = self.k
        if k <= 0:
            return [[] for _ in requests]
        if len(requests) == 1:  # one sequence: the candidate-only passes are cheaper than a dense row
            st = requests[0]
            local = [local_suffix_propose(batch.token_ids[st.row, : batch.num_tokens[st.row]], self.max_depth, k,
                                          self.factor, self.min_prob)]
        else:
            rows = np.fromiter((st.row for st in requests), dtype=np.int64, count=len(requests))
            local = local_suffix_propose_batch(batch.token_ids, rows, batch.num_tokens[rows], self.max_depth, k,
                                               self.factor, self.min_prob)
        out = []
        for st, (draft, score) in zip(requests, local):
            self._outputs[st.req_id] = st.output_token_ids
            if self.max_cached and self._cached:
                toks = batch.token_ids[st.row, : batch.num_tokens[st.row]]
                ctx = toks[-self.max_depth:].tolist()
                g_draft, g_score = self.global_tree.propose(ctx, k, self.factor, self.min_prob)
                if g_score > score:
                    draft = g_draft
            out.append(draft)
        return out

    def remove_requests(self, req_ids) -> None:
        """Finished (or preempted) requests: their outputs enter the global tree, the oldest
        cached outputs leave it past ``suffix_decoding_max_cached_requests``."""
        for rid in req_ids:
            output = self._outputs.pop(rid, None)
            if not output or not self.max_cached:
                continue
            old = self._cached.pop(rid, None)
            if old is not None:  # preempted earlier and cached then: replace
                self.global_tree.remove(old)
            seq = list(output)
            self.global_tree.add(seq)
            self._cached[rid] = seq
            while len(self._cached) > self.max_cached:
                _, evicted = self._cached.popitem(last=False)
                self.global_tree.remove(evicted)
