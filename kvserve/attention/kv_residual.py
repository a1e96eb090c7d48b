"""The filling block in the compute dtype: a per-request residual of exact K/V (int4 / int2).

KIVI (Liu et al., arXiv:2402.02750) keeps each request's most recent tokens in full precision
and quantizes them only once a group is complete. Here the group is the KV block: a query
at position ``p`` reads the keys and values of its *own* block, positions
``[p // B * B, p]`` (``B`` = block size), exactly, and every earlier block through the
quantized cache. Measured on SmolLM2-135M (``benchmarks/kv_scheme_sim.py``), two thirds of
int4's perplexity loss came from that block. The rule depends only on positions, so a
prefill, a chunked prefill and token-by-token decoding compute the same thing; the
quantized pages are still written for every token (prefix sharing, tiers and transfers
move them unchanged); the residual only adds exact copies of the last blocks.

Layout. One layer's residual is ``[2, num_slots + 1, 2, B, Hkv, D]`` in the compute dtype:
K/V, the request's residual slot (``AttentionMetadata.residual_slots``; the last slot is a
scratch row that absorbs writes nobody reads), the block's parity ``(pos // B) % 2`` and the
slot ``pos % B`` in it. Two parities keep the previous block while the next one starts, so
a speculative-decoding step that crosses a block boundary and is then rolled back still
finds its filling block. Rows hold what the cache holds before quantization: ``k R`` / ``v R``
for rotated formats.

Semantics every backend implements when a layer passes ``kv_residual``: request ``i`` has
``ctx = seq_len - query_len`` cached tokens; a query at position ``p`` attends to key ``j <= p``
(and inside a sliding window, if any) with

- ``j // B == p // B`` (its own block): the exact row, from the residual
  (``[i's slot, (j // B) % 2, j % B]``) when ``j < ctx``, else from the step's new
  ``key`` / ``value`` row ``query_start_loc[i] + j - ctx``;
- otherwise: the dequantized cache row, as without a residual.

After attending, the backend writes the new rows into the residual (``store_residual``):
a new token is written when its position is in the last ``2 B`` positions of its request
(``residual_slot_mapping``), so no two tokens of a step hit the same row and the rows the
step's own queries read (positions below ``ctx``) are overwritten only after they were read.

A request whose first computed token does not start a block (a prefix-cache hit on a
partial block, KV loaded by a connector) has no residual rows for that block's cached
positions; the model runner fills them from the quantized pages (``fill_from_cache``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.attention.kv_quant import cache_format, dequantize, pages_to_rows


def residual_shape(num_slots: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Shape of one layer's residual for ``num_slots`` requests (plus the scratch slot)."""
    return (2, num_slots + 1, 2, block_size, num_kv_heads, head_size)


def residual_bytes_per_layer(num_slots: int, block_size: int, num_kv_heads: int, head_size: int,
                             element_size: int) -> int:
    """Bytes of one layer's residual (``residual_shape``) at ``element_size`` bytes per value."""
    return int(np.prod(residual_shape(num_slots, block_size, num_kv_heads, head_size))) * element_size


def residual_slot_mapping(positions: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray,
                          block_size: int, scratch_slot: int) -> np.ndarray:
    """Flat residual row (into ``[num_slots + 1, 2, B]``) of each new token, int64 ``[T]``.

    Args:
        positions: ``[T]`` absolute position of each new token.
        seq_lens: ``[T]`` its request's length after the step (cached + new tokens).
        slots: ``[T]`` its request's residual slot.
        block_size: ``B``; scratch_slot: the scratch slot's index (``num_slots``).

    A token is written only if ``pos >= seq_len - 2 B`` (the rest go to the scratch slot):
    then ``(parity, pos % B)`` is unique within the request.
    """
    positions = positions.astype(np.int64)
    keep = positions >= seq_lens.astype(np.int64) - 2 * block_size
    slot = np.where(keep, slots.astype(np.int64), scratch_slot)
    return (slot * 2 + (positions // block_size) % 2) * block_size + positions % block_size


def store_residual(key: torch.Tensor, value: torch.Tensor, kv_residual: torch.Tensor,
                   residual_slot_mapping: torch.Tensor) -> None:
    """Write the step's new rows ``key`` / ``value`` ``[T, Hkv, D]`` (cache basis, compute dtype)
    into ``kv_residual`` at ``residual_slot_mapping`` (``[T]`` int64). Graph-safe (no host sync);
    padding rows must map to the scratch slot."""
    t = residual_slot_mapping.shape[0]
    flat = kv_residual.view(2, -1, kv_residual.shape[-2], kv_residual.shape[-1])
    flat[0].index_copy_(0, residual_slot_mapping, key[:t].to(flat.dtype))
    flat[1].index_copy_(0, residual_slot_mapping, value[:t].to(flat.dtype))


def exact_rows(kv_residual: torch.Tensor, slot: int, start: int, ctx: int, new_key: torch.Tensor,
               new_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact K and V ``[seq_len - start, Hkv, D]`` of positions ``[start, seq_len)`` of one
    request: residual rows below ``ctx``, then its new rows (``new_key`` / ``new_value``
    ``[seq_len - ctx, Hkv, D]``). ``start`` is a block start with ``ctx - start < B``."""
    bs = kv_residual.shape[3]
    pos = torch.arange(start, ctx, device=kv_residual.device)
    rows = kv_residual[:, slot].reshape(2, 2 * bs, *kv_residual.shape[-2:])[:, pos % (2 * bs)]
    k = torch.cat([rows[0].to(new_key.dtype), new_key])
    v = torch.cat([rows[1].to(new_value.dtype), new_value])
    return k, v


def fill_from_cache(kv_residual: torch.Tensor, kv_cache: torch.Tensor, slot: int, block_id: int,
                    block_index: int, num_tokens: int) -> None:
    """Fill residual rows ``0 .. num_tokens - 1`` of block ``block_index`` (the parity it maps
    to) of ``slot`` from the cache's page ``block_id`` (dequantized): for a request whose
    filling block was not computed by it (a partial-block prefix hit, a connector load)."""
    if num_tokens <= 0:
        return
    d = kv_residual.shape[-1]
    fmt = cache_format(kv_cache, d)
    cache = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
    for half in range(2):
        page = cache[half, block_id : block_id + 1]
        if fmt.quantized:
            page = pages_to_rows(page, d, fmt)
        rows = dequantize(page.view(kv_cache.dtype)[0, :num_tokens], d, kv_residual.dtype, fmt)
        kv_residual[half, slot, block_index % 2, :num_tokens] = rows
