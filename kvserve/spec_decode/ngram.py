"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``ngram`` method).

Pays off on input-grounded text (code editing, summaries that quote, extraction): the model
copies spans of its context and the lookup finds them. Costs no model call: per request,
one vectorized comparison over the sequence (numpy), then at most ``prompt_lookup_max``
narrowing passes over the candidate positions.
"""

from __future__ import annotations

import numpy as np

from kvserve.config import EngineConfig
from kvserve.spec_decode.proposer import Proposer


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Draft tokens for one sequence by prompt lookup.

    Finds the longest suffix of ``tokens`` of length ``n`` in ``[min_n, max_n]`` that also
    occurs earlier (the latest such occurrence wins ties: recent context is the better
    guess), and returns up to ``k`` tokens that followed it.

    Args:
        tokens: int ``[L]`` the sequence so far (prompt + output).
        min_n / max_n: n-gram sizes, ``1 <= min_n <= max_n``.
        k: most tokens to draft.

    Returns:
        int ``[<= k]`` draft tokens (empty when no n-gram of size ``>= min_n`` recurs).
    """
    L = len(tokens)
    if L < min_n + 1 or k <= 0:
        return tokens[:0]
    # Candidate end positions of an earlier occurrence: where the last token recurs.
    cand = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    if not len(cand):
        return tokens[:0]
    length = np.ones(len(cand), dtype=np.int64)
    alive = np.ones(len(cand), dtype=bool)
    for j in range(1, max_n):
        if L - 1 - j < 0:
            break
        idx = cand - j
        ok = alive & (idx >= 0)
        ok[ok] = tokens[idx[ok]] == tokens[L - 1 - j]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < min_n:
        return tokens[:0]
    end = int(cand[np.flatnonzero(length == best)[-1]])  # latest of the longest matches
    return tokens[end + 1: min(end + 1 + k, L)]


def suffix_match_lengths(token_ids: np.ndarray, rows: np.ndarray, lens: np.ndarray, max_n: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For several sequences at once, how far each earlier occurrence of a sequence's last token
    matches the sequence's end.

    The candidates are the positions ``e <= L_b - 2`` of row ``b`` holding its last token; a
    candidate's length is the largest ``n <= max_n`` with ``seq_b[e - n + 1: e + 1] ==
    seq_b[L_b - n:]``. The candidates of all rows are narrowed together: one gather and compare
    per ``n`` over the batch's surviving candidates (``ngram_propose``'s passes, batched).

    Args:
        token_ids: int ``[R, W']`` token rows (``W' >= max(lens)``); rows: int ``[B]`` rows to
            read; lens: int ``[B]`` their lengths; max_n: longest match counted.
    Returns:
        ``(T, cand_row, cand_end, length)``: the rows' tokens int ``[B, max(lens)]``, and per
        candidate (sorted by row, then position) its row in ``0..B-1``, its position and its
        match length (int64 ``[C]`` each, ``length >= 1``).
    """
    lens = np.asarray(lens, dtype=np.int64)
    B = len(lens)
    W = int(lens.max()) if B else 0
    T = token_ids[np.asarray(rows, dtype=np.int64)[:, None], np.arange(W)]  # [B, W]
    E = max(W - 1, 0)
    ar = np.arange(B)
    last = T[ar, np.maximum(lens - 1, 0)] if W else np.zeros(B, dtype=T.dtype)
    cb, ce = np.nonzero((np.arange(E)[None, :] < (lens - 1)[:, None]) & (T[:, :E] == last[:, None]))
    length = np.ones(len(cb), dtype=np.int64)
    live = np.arange(len(cb))
    for j in range(1, min(max_n, E)):
        e = ce[live] - j
        keep = e >= 0
        live, e = live[keep], e[keep]
        rb = cb[live]
        live = live[T[rb, e] == T[rb, lens[rb] - 1 - j]]  # the end's token j back (e - j >= 0: in range)
        if not len(live):
            break
        length[live] += 1
    return T, cb, ce, length


def _row_max(cand_row: np.ndarray, length: np.ndarray, B: int) -> np.ndarray:
    """int64 ``[B]``: each row's longest candidate match (0 for a row without candidates)."""
    best = np.zeros(B, dtype=np.int64)
    np.maximum.at(best, cand_row, length)
    return best


def ngram_propose_batch(token_ids: np.ndarray, rows: np.ndarray, lens: np.ndarray, min_n: int, max_n: int,
                        k: int) -> list[list[int]]:
    """``ngram_propose`` for several sequences at once: the same drafts, with a fixed number of
    numpy calls per n-gram size for the batch (``suffix_match_lengths``) instead of per sequence.

    Args:
        token_ids: int ``[R, W]`` token rows (the input batch's; ``W >= max(lens)``).
        rows: int ``[B]`` rows of ``token_ids`` to draft for; lens: int ``[B]`` their lengths.
        min_n / max_n: n-gram sizes, ``1 <= min_n <= max_n``; k: most tokens to draft.

    Returns:
        ``B`` lists of at most ``k`` draft tokens (empty where no n-gram of size ``>= min_n`` recurs).
    """
    B = len(rows)
    out: list[list[int]] = [[] for _ in range(B)]
    lens = np.asarray(lens, dtype=np.int64)
    if k <= 0 or B == 0 or int(lens.max()) < max(min_n + 1, 2):
        return out
    T, cb, ce, length = suffix_match_lengths(token_ids, rows, lens, max_n)
    best = _row_max(cb, length, B)
    hit = np.flatnonzero((length == best[cb]) & (best[cb] >= min_n) & (lens[cb] >= min_n + 1))
    if not len(hit):
        return out
    # the latest of the longest matches: candidates are sorted by row then position, so a row's
    # latest hit is the one followed by another row's (or none)
    hb = cb[hit]
    last = np.append(hb[1:] != hb[:-1], True)
    for b, end in zip(hb[last].tolist(), ce[hit[last]].tolist()):
        out[b] = T[b, end + 1: min(end + 1 + k, int(lens[b]))].tolist()
    return out


class NgramProposer(Proposer):
    """``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": n,
    "prompt_lookup_max": m}``: prompt lookup over each request's prompt and output so far.

    Defaults: ``prompt_lookup_min`` 2, ``prompt_lookup_max`` 5 (when only one is given, the
    other takes its value where that keeps ``min <= max``).
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        sc = config.speculative_config
        self.min_n = sc.prompt_lookup_min
        self.max_n = sc.prompt_lookup_max

    @property
    def idle(self) -> bool:
        return self.k <= 0  # stateless: nothing to do while off

    def propose(self, requests: list, batch) -> list[list[int]]:
        k = self.k
        if k <= 0:
            return [[] for _ in requests]
        if len(requests) == 1:  # one sequence: the candidate-only passes are cheaper than a dense row
            st = requests[0]
            toks = batch.token_ids[st.row, : batch.num_tokens[st.row]]
            return [ngram_propose(toks, self.min_n, self.max_n, k).tolist()]
        rows = np.fromiter((st.row for st in requests), dtype=np.int64, count=len(requests))
        return ngram_propose_batch(batch.token_ids, rows, batch.num_tokens[rows], self.min_n, self.max_n, k)
