"""Reading K/V tiles from the paged cache: the one place the Triton kernels touch its layout.

The decode and prefill kernels call these for every ``BLOCK_N`` keys: ``kv_row_offsets``
maps key positions through the block table to cache rows, ``load_k_tile`` /
``load_v_tile`` load the tiles and convert them to the ``tl.dot`` operand dtype. A new KV
storage format (quantized K/V with scales) changes these functions, not the kernels.
Layout: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K and V halves passed as
separate pointers, same strides).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_row_offsets(bt_row, pos, n_mask, kv_head_off, stride_cb, stride_co,
                   BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Element offsets ``[BLOCK_N]`` (int64) of keys ``pos`` of one request and KV head.

    ``bt_row`` points at the request's block-table row; ``n_mask`` (used when ``MASKED``)
    keeps positions past the valid range from reading the table (they read page 0).
    """
    if MASKED:
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
    return page * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head_off


@triton.jit
def load_k_tile(k_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, in_dtype: tl.constexpr):
    """K transposed, ``[HEAD_DIM, BLOCK_N]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys are 0."""
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = k_cache_ptr + row_off[None, :] + offs_d[:, None] * stride_cd
    if MASKED:
        k = tl.load(ptrs, mask=n_mask[None, :], other=0.0).to(in_dtype)
    else:
        k = tl.load(ptrs).to(in_dtype)
    if WIDEN:  # interpreter only: its numpy dot cannot multiply bf16
        k = k.to(tl.float32)
    return k


@triton.jit
def load_v_tile(v_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, in_dtype: tl.constexpr):
    """V, ``[BLOCK_N, HEAD_DIM]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys are 0."""
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = v_cache_ptr + row_off[:, None] + offs_d[None, :] * stride_cd
    if MASKED:
        v = tl.load(ptrs, mask=n_mask[:, None], other=0.0).to(in_dtype)
    else:
        v = tl.load(ptrs).to(in_dtype)
    if WIDEN:
        v = v.to(tl.float32)
    return v
