"""The forward context: the step's attention metadata, set by one owner for one forward.

The model runner (or a CUDA graph runner it owns) wraps each forward pass in
``with forward_context(metadata):``; each ``Attention`` layer reads the metadata of its own
KV cache group from here. The KV cache tensors and the backend are not here: each layer holds
its own (``Attention.bind``), so two models in one process keep separate caches.
Contexts do not nest: entering one while another is active is a bug and raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from kvserve.attention.bounded import BoundedAttention


def to_device(x: np.ndarray | list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host array -> tensor on ``device``; on CUDA through pinned memory with ``non_blocking``.

    A copy from pageable memory may wait for the stream, which would stall the host behind
    the step in flight (async scheduling). Pinned buffers come from torch's caching host
    allocator, which keeps each one until its copy is done.
    """
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else torch.tensor(x, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class ResidualMetadata:
    """A step's exact-filling-block inputs (``kvserve/attention/kv_residual.py``).

    Attributes:
        slots: ``[num_reqs]`` int32 residual slot of each request (device).
        slot_mapping: ``[num_tokens]`` int64 flat residual row of each new token
            (``kv_residual.residual_slot_mapping``; padding and rows nobody reads go to the
            scratch slot) (device).
        slots_cpu: ``slots`` as a host list (the torch paths index with it; no device read).
        written_early: every request's new tokens stay within the block of its first new
            token and the next one (decode and verify steps), so a store may write the
            residual before attention reads it (``TritonBackend``).
    """

    slots: torch.Tensor
    slot_mapping: torch.Tensor
    slots_cpu: list[int]
    written_early: bool


@dataclass
class AttentionMetadata:
    """Flat varlen batch description for one forward pass (one KV cache group).

    The batch is ``num_reqs`` requests whose new tokens are laid end to end
    (``num_tokens`` in all). Request ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; those rows are the last
    ``query_lens[i]`` tokens of a sequence of ``seq_lens[i]`` tokens (cached
    prefix + new tokens), so row ``j`` of request ``i`` sits at absolute position
    ``seq_lens[i] - query_lens[i] + j`` and attends causally to positions ``<=`` it.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, flat KV slot (``block_id * block_size + offset``)
            where each new token's K and V are written (-1: not stored).
        block_tables: ``[num_reqs, max_blocks]`` int32 block ids per request (padded with 0).
        query_start_loc: ``[num_reqs + 1]`` int32 prefix sums of query lengths.
        seq_lens: ``[num_reqs]`` int32 total tokens per request after this step.
        query_lens_cpu / seq_lens_cpu: the same lengths as Python lists (no device sync).
        max_query_len / max_seq_len: maxima of those lists.
        num_decodes: the first ``num_decodes`` requests have query length 1 (the runner
            orders decodes first so backends can batch them).
        residual: for a group whose layers keep the filling block exact
            (``kvserve/attention/kv_residual.py``), the step's ``ResidualMetadata``; else None.
        bounded: for a bounded-KV group (StreamingLLM / H2O), the step's
            ``kvserve.attention.bounded.BoundedAttention`` (which blocks each request reads, its
            mask and sink-query rotation); else None.

    The metadata builder (``kvserve/attention/metadata.py``) fills the feature fields; a
    backend may subclass this for its own per-step data (``CpuAttentionMetadata``).
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
    residual: Optional[ResidualMetadata] = field(default=None, repr=False, compare=False)
    bounded: Optional[BoundedAttention] = field(default=None, repr=False, compare=False)
    # Tree verification (``kvserve/spec_decode/tree.py``): int64 ``[num_tokens]`` ancestor bits per
    # query row, bit ``j`` = key at position ``tree_start[i] + j``; keys from ``tree_start[i]`` on are
    # seen only where the row's bit is set (-1: all, plain causal). ``tree_start``: int32 ``[num_reqs]``.
    tree_mask: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    tree_start: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardContext:
    """Per KV cache group, the step's metadata (None while capturing graph pieces)."""

    attn_metadata: Optional[list[AttentionMetadata]]


_CURRENT: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(
    attn_metadata: Union[AttentionMetadata, Sequence[AttentionMetadata], None],
) -> Iterator[ForwardContext]:
    """Make the step's metadata (one per KV cache group, or one for a single group) visible
    to attention layers for one forward. Raises RuntimeError if a context is active."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("forward_context is already set: contexts do not nest")
    if isinstance(attn_metadata, AttentionMetadata):
        attn_metadata = [attn_metadata]
    elif attn_metadata is not None:
        attn_metadata = list(attn_metadata)
    _CURRENT = ForwardContext(attn_metadata)
    try:
        yield _CURRENT
    finally:
        _CURRENT = None


def get_forward_context() -> ForwardContext:
    """The active context. Raises RuntimeError outside ``forward_context``."""
    if _CURRENT is None:
        raise RuntimeError("attention layer called outside `with forward_context(...)`")
    return _CURRENT
