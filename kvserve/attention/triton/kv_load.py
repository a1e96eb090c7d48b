"""Reading K/V tiles from the paged cache: the one place the Triton kernels touch its layout.

The decode and prefill kernels call these for every ``BLOCK_N`` keys: ``kv_row_offsets``
maps key positions through the block table to cache offsets, ``load_k_tile`` /
``load_v_tile`` load the tiles and convert them to the ``tl.dot`` operand dtype. A new KV
storage format changes these functions (and ``cache_strides``), not the kernels.

Unquantized formats: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` elements of
the cache dtype (K and V halves passed as separate pointers, same strides), read and cast.
Quantized formats (``KV_FMT`` > 0; scheme and page layout in ``kvserve/attention/kv_quant.py``):
the cache is passed as bytes; each block's page holds the codes of its ``[block_size,
num_kv_heads]`` rows (``C = head_dim * bits / 8`` bytes each, contiguous), then their
float16 scales (and minima). ``cache_strides`` passes the page stride and the *code*
strides (``num_kv_heads * C`` per slot, ``C`` per head); Triton specializes int arguments
divisible by 16, so when ``C`` and the page size are multiples of 16 the compiler can prove
every code row 16-byte aligned and load it as 16-byte vectors (no hint that could be
false). V's codes are loaded as ``[BLOCK_N, C]`` and K's, transposed, as ``[C, BLOCK_N]``:
both contiguous along the channel axis. They are unpacked in registers (int4/int2: shifts,
``tl.join``, ``tl.permute``, ``tl.reshape``; no per-element ``d // per_byte`` gather) and
scaled by one float16 scale (and minimum) per key, loaded as a ``[BLOCK_N]`` vector from
the page's scales region. No dequantized copy of the cache exists. (Compiled for sm_90 the
code tiles become 16-byte / 8-byte ``cp.async`` copies, pipelined: ``benchmarks/ptx_kv_loads.py``.)
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


def cache_strides(k_cache: torch.Tensor, head_size: int, kv_fmt: int) -> tuple[int, int, int, int]:
    """``(stride_cb, stride_co, stride_ch, stride_cd)`` of one half ``[num_blocks, block_size,
    num_kv_heads, row]`` of the cache as the kernels index it: element strides for unquantized
    formats; for quantized ones (bytes) the page stride and the strides of the codes region
    (``num_kv_heads * C`` per slot, ``C`` per head, 1 per byte)."""
    if not kv_fmt:
        return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3)
    _, bs, hkv, row = k_cache.shape
    c = head_size * _BITS[kv_fmt] // 8
    assert k_cache.stride()[1:] == (hkv * row, row, 1), "quantized pages must be contiguous"
    assert c % (row - c) == 0, "code bytes per row must be a multiple of the scale bytes"
    return k_cache.stride(0), hkv * c, c, 1


_BITS = {1: 8, 2: 8, 3: 8, 4: 4, 5: 2}


@triton.jit
def kv_row_offsets(bt_row, pos, n_mask, kv_head_off, stride_cb, stride_co,
                   BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr = 16,
                   KV_FMT: tl.constexpr = 0):
    """Offsets ``[BLOCK_N]`` (int64) of keys ``pos`` of one request and KV head: ``(row, scale)``.

    ``row``: the element offset of the row (quantized: byte offset of its codes); ``scale``:
    byte offset of its float16 scale in the page's scales region (quantized; else ``row``).
    ``bt_row`` points at the request's block-table row; ``n_mask`` (used when ``MASKED``)
    keeps positions past the valid range from reading the table (they read page 0).
    """
    if MASKED:
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
    page_off = page * stride_cb
    in_page = (pos % BLOCK_SIZE) * stride_co + kv_head_off
    if KV_FMT > 0:
        BITS: tl.constexpr = 4 if KV_FMT == 4 else (2 if KV_FMT == 5 else 8)
        SB: tl.constexpr = 4 if KV_FMT >= 4 else 2  # scale bytes per row
        RATIO: tl.constexpr = HEAD_DIM * BITS // 8 // SB  # code bytes per scale byte
        # in_page = (slot * Hkv + head) * C, so the row's scales are at in_page // RATIO.
        scale_off = page_off + BLOCK_SIZE * stride_co + in_page // RATIO
    else:
        scale_off = page_off + in_page
    return page_off + in_page, scale_off


@triton.jit
def _scales(cache_ptr, scale_off, n_mask, KV_FMT: tl.constexpr, MASKED: tl.constexpr):
    """Per key ``[BLOCK_N]``: the float32 scale and minimum (0 for symmetric formats) at byte
    offsets ``scale_off``; masked keys get scale 0."""
    sp = (cache_ptr + scale_off).to(tl.pointer_type(tl.float16))
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
def _dequant_rows(cache_ptr, row_off, scale_off, n_mask, HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr,
                  MASKED: tl.constexpr):
    """Rows ``[BLOCK_N, HEAD_DIM]`` float32 (the V tile): each key's codes (``C`` contiguous
    bytes at ``row_off``) unpacked and dequantized with its scale (and minimum)."""
    BITS: tl.constexpr = 4 if KV_FMT == 4 else (2 if KV_FMT == 5 else 8)
    CB: tl.constexpr = HEAD_DIM * BITS // 8
    offs_c = tl.arange(0, CB)
    ptrs = cache_ptr + row_off[:, None] + offs_c[None, :]
    if MASKED:
        raw = tl.load(ptrs, mask=n_mask[:, None], other=0)
    else:
        raw = tl.load(ptrs)
    sc, zp = _scales(cache_ptr, scale_off, n_mask, KV_FMT, MASKED)
    if KV_FMT == 4:  # element 2j in the low nibble of byte j, 2j + 1 in the high one
        r = raw.to(tl.int32)
        q = tl.reshape(tl.join(r & 15, r >> 4), [row_off.shape[0], HEAD_DIM])
        x = q.to(tl.float32)
    elif KV_FMT == 5:  # element 4j + i in bits 2i of byte j
        r = raw.to(tl.int32)
        q = tl.join(tl.join(r & 3, (r >> 4) & 3), tl.join((r >> 2) & 3, r >> 6))  # [.., CB, 2 (i//2), 2 (i%2)]
        x = tl.reshape(q, [row_off.shape[0], HEAD_DIM]).to(tl.float32)
    else:
        x = _byte_codes(raw, KV_FMT)
    return x * sc[:, None] + zp[:, None]


@triton.jit
def _byte_codes(raw, KV_FMT: tl.constexpr):
    """8-bit codes (uint8 tile) as float32: fp8 bit patterns converted in registers, or int8."""
    if KV_FMT == 1:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif KV_FMT == 2:
        x = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        x = raw.to(tl.int8, bitcast=True).to(tl.float32)
    return x


@triton.jit
def load_k_tile(k_cache_ptr, row_off, scale_off, n_mask, stride_cd, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, in_dtype: tl.constexpr, KV_FMT: tl.constexpr = 0):
    """K transposed, ``[HEAD_DIM, BLOCK_N]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys are 0."""
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_FMT > 0 and KV_FMT <= 3:  # 8-bit codes: loaded as [HEAD_DIM, BLOCK_N], contiguous along the channel axis
        ptrs = k_cache_ptr + row_off[None, :] + offs_d[:, None]
        if MASKED:
            raw = tl.load(ptrs, mask=n_mask[None, :], other=0)
        else:
            raw = tl.load(ptrs)
        sc, zp = _scales(k_cache_ptr, scale_off, n_mask, KV_FMT, MASKED)
        k = (_byte_codes(raw, KV_FMT) * sc[None, :]).to(in_dtype)
    elif KV_FMT > 0:  # packed codes: [C, BLOCK_N] bytes, contiguous along the channel axis, unpacked along it
        BITS: tl.constexpr = 4 if KV_FMT == 4 else 2
        offs_c = tl.arange(0, HEAD_DIM * BITS // 8)
        ptrs = k_cache_ptr + row_off[None, :] + offs_c[:, None]
        if MASKED:
            raw = tl.load(ptrs, mask=n_mask[None, :], other=0)
        else:
            raw = tl.load(ptrs)
        sc, zp = _scales(k_cache_ptr, scale_off, n_mask, KV_FMT, MASKED)
        r = raw.to(tl.int32)
        if KV_FMT == 4:
            q = tl.join(r & 15, r >> 4)  # [C, BLOCK_N, 2]: element 2c + i
            q = tl.reshape(tl.permute(q, (0, 2, 1)), [HEAD_DIM, row_off.shape[0]])
        else:
            q = tl.join(tl.join(r & 3, (r >> 4) & 3), tl.join((r >> 2) & 3, r >> 6))  # [C, N, 2 (i//2), 2 (i%2)]
            q = tl.reshape(tl.permute(q, (0, 2, 3, 1)), [HEAD_DIM, row_off.shape[0]])
        k = (q.to(tl.float32) * sc[None, :] + zp[None, :]).to(in_dtype)
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
def load_v_tile(v_cache_ptr, row_off, scale_off, n_mask, stride_cd, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                WIDEN: tl.constexpr, in_dtype: tl.constexpr, KV_FMT: tl.constexpr = 0):
    """V, ``[BLOCK_N, HEAD_DIM]`` in ``in_dtype`` (float32 if ``WIDEN``); masked keys are 0."""
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_FMT > 0:
        v = _dequant_rows(v_cache_ptr, row_off, scale_off, n_mask, HEAD_DIM, KV_FMT, MASKED).to(in_dtype)
    else:
        ptrs = v_cache_ptr + row_off[:, None] + offs_d[None, :] * stride_cd
        if MASKED:
            v = tl.load(ptrs, mask=n_mask[:, None], other=0.0).to(in_dtype)
        else:
            v = tl.load(ptrs).to(in_dtype)
    if WIDEN:
        v = v.to(tl.float32)
    return v
