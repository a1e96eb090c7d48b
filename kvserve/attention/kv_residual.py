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

Layout. One layer's residual is ``[2, num_slots + 1, 2, B, Hkv, D]`` in the compute dtype
(``KVCacheView.residual``): K/V, the request's residual slot (``ResidualMetadata.slots``; the last slot is a
scratch row that absorbs writes nobody reads), the block's parity ``(pos // B) % 2`` and the
slot ``pos % B`` in it. Two parities keep the previous block while the next one starts, so
a speculative-decoding step that crosses a block boundary and is then rolled back still
finds its filling block. Rows hold what the cache holds before quantization: ``k R`` / ``v R``
for rotated formats.

Semantics every backend implements when a layer's view has a residual and the step's
metadata a ``ResidualMetadata``: request ``i`` has
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
positions; ``ExactFillingBlocks`` (owned by the attention metadata builder) fills them from the
quantized pages (``fill_from_cache``), hands each step its slots, and grows the residuals
when the input batch outgrows them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvserve.attention.forward_context import ResidualMetadata, to_device
from kvserve.attention.kv_format import KVCacheFormat, KVCacheView
# One definition for the allocator here and for `kvserve plan-kv`.
from kvserve.core.kv_capacity import residual_bytes_per_layer, residual_shape  # noqa: F401

logger = logging.getLogger("kvserve")


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


def written_early(query_lens: list[int], seq_lens: list[int], block_size: int) -> bool:
    """Whether a store may write the step's exact rows before attention reads the residual:
    a request's writes then overwrite no row its queries read (those below ``ctx``, in the
    parity of ``ctx``'s block) as long as its tokens stay within ``ctx``'s block and the next
    one (decode and verify steps, every CUDA-graph step). Host lists only."""
    return all(s - 1 < (s - q) // block_size * block_size + 2 * block_size for q, s in zip(query_lens, seq_lens))


def fill_from_cache(kv_residual: torch.Tensor, kv_cache: torch.Tensor, fmt: KVCacheFormat, slot: int,
                    block_id: int, block_index: int, num_tokens: int) -> None:
    """Fill residual rows ``0 .. num_tokens - 1`` of block ``block_index`` (the parity it maps
    to) of ``slot`` from page ``block_id`` of ``kv_cache`` (format ``fmt``, dequantized): for a
    request whose filling block was not computed by it (a partial-block prefix hit, a connector load)."""
    if num_tokens <= 0:
        return
    for half in range(2):
        rows = fmt.load_blocks(kv_cache, half, torch.tensor([block_id], device=kv_cache.device), kv_residual.dtype)
        kv_residual[half, slot, block_index % 2, :num_tokens] = rows[0, :num_tokens]


class ExactFillingBlocks:
    """The residuals of every layer whose format keeps the filling block exact, one slot per
    input-batch row (plus the scratch slot), and each step's slot inputs.

    Args:
        layers: ``(KV cache group id, view)`` of each such layer; their ``residual`` is bound here.
        num_slots: slots to start with (``--max-num-seqs``).
        block_size: tokens per block; dtype / device: of the residuals (the compute dtype).
    """

    def __init__(self, layers: list[tuple[int, KVCacheView]], num_slots: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layers = layers
        self.num_slots = num_slots
        self.block_size = block_size
        total = 0
        for _, view in layers:
            view.residual = torch.zeros(residual_shape(num_slots, block_size, view.num_kv_heads,
                                                       view.format.head_size), dtype=dtype, device=device)
            total += view.residual.numel() * view.residual.element_size()
        if layers:
            logger.info("KV cache: the filling block of each of %d requests kept exact in %s (%s): %.1f MiB",
                        num_slots, str(dtype).removeprefix("torch."), layers[0][1].format.name, total / 2**20)
        self.slots = np.zeros(0, dtype=np.int64)  # this step's, per request
        self.slot_mapping = np.zeros(0, dtype=np.int64)  # this step's, per token
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None  # CUDA-graph buffers
        self._moved = False  # grown since the last step_inputs

    @property
    def scratch_row(self) -> int:
        """The flat residual row padding tokens write (the scratch slot's first)."""
        return self.num_slots * 2 * self.block_size

    def grow(self, num_slots: int) -> None:
        """Reallocate every layer's residual with ``num_slots`` slots, contents kept (the
        input batch grew past ``--max-num-seqs``). CUDA graphs holding the old addresses
        must be captured again."""
        logger.warning("input batch grew to %d rows: exact filling blocks grow from %d slots", num_slots,
                       self.num_slots)
        old = self.num_slots
        for _, view in self.layers:
            r = view.residual
            new = torch.zeros(residual_shape(num_slots, *r.shape[3:]), dtype=r.dtype, device=r.device)
            new[:, :old] = r[:, :old]
            view.residual = new
        self.num_slots = num_slots
        self._static = None
        self._moved = True

    def fill(self, new_reqs, states: dict) -> None:
        """A request that joins with a cached prefix ending inside a block (a partial prefix
        hit, KV loaded by a connector) did not compute that block's first tokens: their exact
        rows come from its dequantized page (``fill_from_cache``). ``new_reqs``: the step's
        ``NewRequestData``; ``states``: request id -> its input-batch state (``.row``: its slot)."""
        bs = self.block_size
        for new in new_reqs:
            n = new.num_computed_tokens % bs
            if not n or new.req_id not in states:
                continue
            b = new.num_computed_tokens // bs
            for gid, view in self.layers:
                if b < len(new.block_ids[gid]):
                    fill_from_cache(view.residual, view.cache, view.format, states[new.req_id].row,
                                    new.block_ids[gid][b], b, n)

    def step_inputs(self, slots: np.ndarray, positions: np.ndarray, query_lens: np.ndarray,
                    seq_lens: np.ndarray, max_rows: int) -> bool:
        """Set this step's ``slots`` (each request's input-batch row) and ``slot_mapping``;
        grows the residuals to ``max_rows`` slots when a row is past them. Returns whether the
        residuals moved (grew) since the last call: CUDA graphs must then be captured again."""
        if len(slots) and int(slots.max()) >= self.num_slots:
            self.grow(max_rows)
        grew, self._moved = self._moved, False
        req_idx = np.repeat(np.arange(len(slots)), query_lens)
        self.slots = slots
        self.slot_mapping = residual_slot_mapping(positions, seq_lens[req_idx], slots[req_idx], self.block_size,
                                                  self.num_slots)
        return grew

    def metadata(self, query_lens: list[int], seq_lens: list[int], device: torch.device,
                 pad_to: int | None = None) -> ResidualMetadata:
        """This step's ``ResidualMetadata``; ``pad_to`` pads the token rows with the scratch row."""
        rmap = self.slot_mapping
        if pad_to is not None and pad_to > len(rmap):  # padding rows write the scratch slot
            rmap = np.concatenate([rmap, np.full(pad_to - len(rmap), self.scratch_row, dtype=np.int64)])
        return ResidualMetadata(to_device(self.slots.astype(np.int32), device), to_device(rmap, device),
                                self.slots.tolist(), written_early(query_lens, seq_lens, self.block_size))

    # ---- CUDA graphs: static inputs ------------------------------------------------------
    def prepare_for_capture(self, max_reqs: int, max_tokens: int, device: torch.device) -> None:
        """Static slot buffers the captured graphs read (padding: the scratch slot)."""
        self._static = (torch.full((max_reqs,), self.num_slots, dtype=torch.int32, device=device),
                        torch.full((max_tokens,), self.scratch_row, dtype=torch.long, device=device))

    def capture_metadata(self, bs: int, t: int, query_lens: list[int], seq_lens: list[int]) -> ResidualMetadata:
        slots, rmap = self._static
        return ResidualMetadata(slots[:bs], rmap[:t], [self.num_slots] * bs,
                                written_early(query_lens, seq_lens, self.block_size))

    def prepare_for_replay(self, bs: int, t: int, dst: np.ndarray) -> list[tuple[torch.Tensor, np.ndarray]]:
        """(static buffer, host values) pairs for a replay at ``bs`` rows / ``t`` tokens; token
        ``i`` of the step sits at row ``dst[i]``."""
        slots, rmap = self._static
        s = np.full(bs, self.num_slots, dtype=np.int64)
        s[:len(self.slots)] = self.slots
        m = np.full(t, self.scratch_row, dtype=np.int64)
        m[dst] = self.slot_mapping
        return [(slots[:bs], s), (rmap[:t], m)]
