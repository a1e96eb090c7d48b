"""Reading K/V tiles from the paged cache: the one place the Triton kernels touch its layout.

The decode and prefill kernels call these for every ``BLOCK_N`` keys: ``kv_row_offsets``
maps key positions through the block table to cache rows, ``load_k_tile`` /
``load_v_tile`` load the tiles and convert them to the ``tl.dot`` operand dtype. A new KV
storage format (quantized K/V with scales) changes these functions, not the kernels.
Layout: ``[2, num_blocks, block_size, num_kv_heads, row]`` (K and V halves passed as
separate pointers, same strides). Unquantized formats: ``row = head_dim`` elements of the
cache dtype. Quantized formats (``KV_FMT`` > 0, scheme in ``kvserve/attention/kv_quant.py``):
the cache is passed as bytes, a row is the codes then float16 scale (and minimum); the tile
is dequantized in registers (no dequantized copy of the cache exists).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: ``KV_FMT`` constexpr per ``--kv-cache-dtype`` (0: read and cast, no scales)
KV_FMT_CODES = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3, "int4": 4, "int2": 5}


def kernel_cache_args(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, int]:
    """The cache as the kernels take it (bytes for quantized formats) and its ``KV_FMT``."""
    from kvserve.attention.kv_quant import cache_format

    code = KV_FMT_CODES.get(cache_format(kv_cache, head_size).name, 0)
    return (kv_cache.view(torch.uint8) if code else kv_cache), code


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
def _scales(cache_ptr, row_off, n_mask, HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr, MASKED: tl.constexpr):
    """Per key ``[BLOCK_N]``: the float32 scale and minimum (0 for symmetric formats) stored
    after the codes of each row; masked keys get scale 0."""
    BITS: tl.constexpr = 4 if KV_FMT == 4 else (2 if KV_FMT == 5 else 8)
    sp = (cache_ptr + row_off + HEAD_DIM * BITS // 8).to(tl.pointer_type(tl.float16))
    if MASKED:
        s = tl.load(sp, mask=n_mask, other=0.0).to(tl.float32)
    else:
        s = tl.load(sp).to(tl.float32)
    if KV_FMT >= 4:
        if MASKED:
            z = tl.load(sp + 1, mask=n_mask, other=0.0).to(tl.float32)
        else:
            z = tl.load(sp + 1).to(tl.float32)
    else:
        z = s * 0.0
    return s, z


@triton.jit
def _codes(cache_ptr, off, d_idx, mask, KV_FMT: tl.constexpr, MASKED: tl.constexpr):
    """float32 codes at row starts ``off`` and channels ``d_idx`` (same 2-D shape)."""
    BITS: tl.constexpr = 4 if KV_FMT == 4 else (2 if KV_FMT == 5 else 8)
    if KV_FMT >= 4:
        PER: tl.constexpr = 8 // BITS
        if MASKED:
            raw = tl.load(cache_ptr + off + d_idx // PER, mask=mask, other=0)
        else:
            raw = tl.load(cache_ptr + off + d_idx // PER)
        q = (raw.to(tl.int32) >> ((d_idx % PER) * BITS)) & ((1 << BITS) - 1)
        x = q.to(tl.float32)
    else:
        if MASKED:
            raw = tl.load(cache_ptr + off + d_idx, mask=mask, other=0)
        else:
            raw = tl.load(cache_ptr + off + d_idx)
        if KV_FMT == 1:
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif KV_FMT == 2:
            x = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            x = raw.to(tl.int8, bitcast=True).to(tl.float32)
    return x


@triton.jit
def load_k_tile(k_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, in_dtype: tl.constexpr, KV_FMT: tl.constexpr = 0):
    """K transposed, ``[HEAD_DIM, BLOCK_N]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys are 0."""
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_FMT > 0:  # quantized: codes and per-row scales, dequantized here
        sc, zp = _scales(k_cache_ptr, row_off, n_mask, HEAD_DIM, KV_FMT, MASKED)
        x = _codes(k_cache_ptr, row_off[None, :], offs_d[:, None], n_mask[None, :], KV_FMT, MASKED)
        k = (x * sc[None, :] + zp[None, :]).to(in_dtype)
    else:
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
                WIDEN: tl.constexpr, in_dtype: tl.constexpr, KV_FMT: tl.constexpr = 0):
    """V, ``[BLOCK_N, HEAD_DIM]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys are 0."""
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_FMT > 0:
        sc, zp = _scales(v_cache_ptr, row_off, n_mask, HEAD_DIM, KV_FMT, MASKED)
        x = _codes(v_cache_ptr, row_off[:, None], offs_d[None, :], n_mask[:, None], KV_FMT, MASKED)
        v = (x * sc[:, None] + zp[:, None]).to(in_dtype)
    else:
        ptrs = v_cache_ptr + row_off[:, None] + offs_d[None, :] * stride_cd
        if MASKED:
            v = tl.load(ptrs, mask=n_mask[:, None], other=0.0).to(in_dtype)
        else:
            v = tl.load(ptrs).to(in_dtype)
    if WIDEN:
        v = v.to(tl.float32)
    return v
