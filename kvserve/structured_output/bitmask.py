"""Apply a packed grammar bitmask to logits (worker side; plain torch, any device)."""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set ``logits[rows[i], t] = -inf`` for every token ``t`` that bit ``t`` of
    ``bitmask[i]`` disallows; in place.

    Args:
        logits: float ``[B, V]`` on any device.
        bitmask: int32 ``[len(rows), ceil(V' / 32)]`` (xgrammar's layout: bit ``t % 32`` of
            word ``t // 32`` is 1 when token ``t`` is allowed); tokens past ``32 * width``
            are disallowed.
        rows: the logits row of each bitmask row.
    """
    if not rows:
        return
    dev = logits.device
    V = logits.shape[1]
    bm = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))
    if dev.type != "cpu":
        bm = bm.pin_memory().to(dev, non_blocking=True)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    allowed = ((bm.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [n, 32 * width]
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    allowed = allowed[:, :V]
    idx = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    masked = logits.index_select(0, idx).masked_fill_(~allowed, _NEG_INF)
    logits.index_copy_(0, idx, masked)
