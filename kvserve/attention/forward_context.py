"""The forward context: the only way layers see the batch's attention metadata.

The model runner wraps every forward pass in ``with forward_context(meta, kv_caches):``;
each ``Attention`` layer reads its paged KV tensor and the metadata from here, so model
code stays free of batching details.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    """Flat varlen batch description for one forward pass.

    The batch is ``num_reqs`` requests whose new tokens are laid end to end
    (``num_tokens`` in all). Request ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; those rows are the last
    ``query_lens[i]`` tokens of a sequence of ``seq_lens[i]`` tokens (cached
    prefix + new tokens), so row ``j`` of request ``i`` sits at absolute position
    ``seq_lens[i] - query_lens[i] + j`` and attends causally to positions ``<=`` it.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, flat KV slot (``block_id * block_size + offset``)
            where each new token's K and V are written.
        block_tables: ``[num_reqs, max_blocks]`` int32 block ids per request (padded with 0).
        query_start_loc: ``[num_reqs + 1]`` int32 prefix sums of query lengths.
        seq_lens: ``[num_reqs]`` int32 total tokens per request after this step.
        query_lens_cpu / seq_lens_cpu: the same lengths as Python lists (no device sync).
        max_query_len / max_seq_len: maxima of those lists.
        num_decodes: the first ``num_decodes`` requests have query length 1 (the runner
            orders decodes first so backends can batch them).
        backend_cache: scratch for a backend's derived tensors (gather indices, masks),
            filled by the first layer and reused by the others. It describes this step
            only: an object refilled for another step needs a fresh (empty) dict.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    backend_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_size].
    kv_caches: list[torch.Tensor]


_CURRENT: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(
    attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor]
) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` and ``kv_caches`` visible to attention layers for one forward."""
    global _CURRENT
    prev = _CURRENT
    _CURRENT = ForwardContext(attn_metadata, kv_caches)
    try:
        yield _CURRENT
    finally:
        _CURRENT = prev


def get_forward_context() -> ForwardContext:
    """The active context. Raises RuntimeError outside ``forward_context``."""
    if _CURRENT is None:
        raise RuntimeError("attention layer called outside `with forward_context(...)`")
    return _CURRENT
