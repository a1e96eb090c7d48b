"""Shared by the attention tests: random paged layouts for ragged batches."""

from __future__ import annotations

import torch


def random_block_tables(reqs: list[tuple[int, int]], bs: int,
                        gen: torch.Generator) -> tuple[torch.Tensor, list[int], int]:
    """Block tables for requests ``(cached, new)`` tokens with ``bs`` tokens per block: each
    request gets its own randomly placed blocks (block 0, the null block, is never used).

    Returns ``(bt int32 [len(reqs), max blocks], blocks per request, num_blocks)``, where
    ``num_blocks`` leaves one spare block beyond the null block.
    """
    nbs = [-(-(c + n) // bs) for c, n in reqs]
    num_blocks = sum(nbs) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    bt = torch.zeros(len(reqs), max(nbs), dtype=torch.int32)
    o = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = torch.tensor(perm[o:o + nb])
        o += nb
    return bt, nbs, num_blocks
