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

    def propose(self, requests: list, batch) -> list[list[int]]:
        k = self.k
        if k <= 0:
            return [[] for _ in requests]
        out = []
        for st in requests:
            toks = batch.token_ids[st.row, : batch.num_tokens[st.row]]
            out.append(ngram_propose(toks, self.min_n, self.max_n, k).tolist())
        return out
