"""Steps of the prefill kernel (``prefill.py``) shared by its key loops: the online-softmax update,
the tree-verification mask, one step over the chunk's own keys from their contiguous K/V rows
(``NEW_KV``), the e4m3 operand helpers of the FP8 dots, and the block-table ids of a key tile
(``tile_pages``: prefetched one step ahead by the paged-prefix loop). Algorithm: FlashAttention-2
(Dao, arXiv:2307.08691)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tree_visible(pos, t_bits, t_start):
    """``[M, N]``: keys ``pos [N]`` the rows see under their ancestor bits ``t_bits [M]`` (int64):
    below ``t_start`` or past bit 63 always, else where bit ``pos - t_start`` is set."""
    rel = pos[None, :] - t_start
    bit = (t_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1
    return (rel < 0) | (rel > 63) | (bit != 0)


@triton.jit
def softmax_step(s, row_scale, m_i, l_i, ROW_VEC: tl.constexpr):
    """Online-softmax update for the logits ``row_scale * s`` (log2 units; ``s [M, N]`` fp32 with
    masked entries ``-inf``; ``row_scale > 0``, a scalar or ``[M]`` if ``ROW_VEC``). The scale is
    folded into the row maximum and the exponent's one FMA (as the FlashAttention-2 Triton
    tutorial), not a separate multiply of the tile. Returns ``(p, alpha, m_new, l_new)``."""
    if ROW_VEC:
        m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows fully masked so far
        p = tl.exp2(s * row_scale[:, None] - m_safe[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * row_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def attend_new(
    q, acc, m_i, l_i, j0, tok, q_len, nk_base, nv_base, stride_nkt, stride_nvt, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    WIDEN: tl.constexpr, in_dtype: tl.constexpr, TREE: tl.constexpr = False, t_bits=0, t_rel0=0,
):
    """One online-softmax step over the chunk's own keys ``j0 .. j0 + BLOCK_N - 1`` (0 = the
    chunk's first new token), read from the contiguous new K/V rows ``nk_base + j * stride_nkt``
    (no block table, never quantized). ``q [M, D]``: the query rows as computed (``in_dtype``,
    float32 if ``WIDEN``), unscaled; ``tok [M]``: each row's token in the chunk. ``MASKED``: the
    causal (``j <= tok``) and ``j < q_len`` masks, for the diagonal steps only."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    j = j0 + offs_n
    rows_k = j.to(tl.int64) * stride_nkt
    rows_v = j.to(tl.int64) * stride_nvt
    if MASKED:
        n_mask = j < q_len
        k = tl.load(nk_base + rows_k[None, :] + offs_d[:, None], mask=n_mask[None, :], other=0.0)
    else:
        k = tl.load(nk_base + rows_k[None, :] + offs_d[:, None])
    k = k.to(in_dtype)
    if WIDEN:
        k = k.to(tl.float32)
    qk = tl.dot(q, k, input_precision=DOT_PREC)
    if MASKED:
        valid = n_mask[None, :] & (j[None, :] <= tok[:, None])
        if TREE:  # chunk key j sits at tree index j + t_rel0
            valid = valid & tree_visible(j, t_bits, -t_rel0)
        qk = tl.where(valid, qk, float("-inf"))
    p, alpha, m_new, l_i = softmax_step(qk, qk_scale, m_i, l_i, False)  # log2 units
    if MASKED:
        v = tl.load(nv_base + rows_v[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        v = tl.load(nv_base + rows_v[:, None] + offs_d[None, :])
    v = v.to(in_dtype)
    if WIDEN:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(in_dtype).to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def round_e4m3(x):
    """``x`` (float32, ``|x| <= 448``) rounded to e4m3's grid (3 mantissa bits, normals from 2^-6,
    subnormal steps of 2^-9), kept in float32: the interpreter's e4m3 cast drops a rounding carry."""
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(x), 0.015625))) - 3.0)
    return tl.floor(x / step + 0.5) * step


@triton.jit
def e4m3_operand(x, EMU: tl.constexpr):
    """``x`` (float32, ``|x| <= 448``: scaled to e4m3's range by the caller) rounded to the nearest
    e4m3 value (relative error <= 2^-4 from 2^-6 up, absolute <= 2^-10 below) as an FP8 ``tl.dot``
    operand (``tl.float8e4nv``). ``EMU`` (the interpreter, whose e4m3 cast drops a rounding carry
    and whose FP8 dot is not exact): the same values as float32 (``round_e4m3``)."""
    if EMU:
        y = round_e4m3(x)
    else:
        y = x.to(tl.float8e4nv)
    return y


@triton.jit
def load_e4m3(cache_ptr, offs, mask, MASKED: tl.constexpr, F8_PTR: tl.constexpr = True):
    """e4m3 codes at byte offsets ``offs`` of the byte cache as ``tl.float8e4nv`` (masked: 0).
    ``F8_PTR``: loaded through an e4m3 pointer, so the asynchronous copy lands in shared memory
    as the dot's operand (a byte load bitcast in registers goes through registers and back)."""
    if F8_PTR:
        ptrs = cache_ptr.to(tl.pointer_type(tl.float8e4nv)) + offs
        if MASKED:
            x = tl.load(ptrs, mask=mask, other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        if MASKED:
            x = tl.load(cache_ptr + offs, mask=mask, other=0)
        else:
            x = tl.load(cache_ptr + offs)
        x = x.to(tl.float8e4nv, bitcast=True)
    return x


@triton.jit
def tile_pages(bt_row, n0, kv_end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCALES: tl.constexpr):
    """Block-table ids of keys ``n0 .. n0 + BLOCK_N - 1`` of one request: ``[BLOCK_N]`` int32, one per
    key (for ``kv_load.kv_row_offsets``' addresses), and with ``SCALES`` ``[NP]`` int32, one per page
    of the tile (``kv_load.kv_scale_words``; else 0). Keys and pages at or past ``kv_end`` read 0
    (page 0, never used unmasked). The paged-prefix loop loads the next tile's ids with this during
    the current step and carries them, so the K/V addresses of a step no longer hang off a load in
    the same iteration, which is what limited Triton's pipeliner to one K/V tile in flight."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pg = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < kv_end, other=0)
    pg_sc = 0
    if SCALES:
        NP: tl.constexpr = BLOCK_N // BLOCK_SIZE if BLOCK_N > BLOCK_SIZE else 1
        pidx = n0 // BLOCK_SIZE + tl.arange(0, NP)
        pg_sc = tl.load(bt_row + pidx, mask=pidx * BLOCK_SIZE < kv_end, other=0)
    return pg, pg_sc
