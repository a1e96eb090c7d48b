"""Varlen prefill / extend attention over a paged prefix plus the causal new tokens.

Algorithm: FlashAttention-2 (Dao, arXiv:2307.08691) forward — tiled QK^T, online softmax
in fp32, rescaled accumulator, one normalisation at the end — reading K/V from the
PagedAttention block layout (Kwon et al., arXiv:2309.06180) through the block table. The
store kernel has already written the new tokens' K/V, so prefix and new keys are read the
same way (this also covers chunked prefill: a chunk over a cached prefix).

Grid: ``(num_prefill_reqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads)``. A program owns
``BLOCK_Q`` consecutive query tokens of one request and all G = num_heads // num_kv_heads
query heads of one KV group, packed as ``BLOCK_M = BLOCK_Q * G`` rows (row r is token
``r // G``, head ``r % G``), so every K/V tile is loaded once per group (GQA packing).
Query token ``t`` of a request with ``q_len`` new tokens and ``seq_len`` total sits at
position ``seq_len - q_len + t`` and sees keys at positions ``<=`` it (and ``> pos - window``
with a sliding window). The program walks keys ``[kv_lo, kv_hi)`` ``BLOCK_N`` at a time,
where ``kv_hi`` is one past its last token's position and ``kv_lo`` is 0 or the window
start of its first token; keys at or past ``seq_len`` are never loaded. Without a window,
the ``BLOCK_N`` steps wholly below the tile's first position run without masks (as the
FlashAttention-2 Triton tutorial's off-diagonal stage); only the diagonal steps are masked.
Q tiles are launched last-first (the last tiles of a causal prompt see the most keys).

The chunk's own keys from its K/V rows (constexpr ``NEW_KV``; no window, no residual): keys at
positions ``>= ctx`` are read from the step's contiguous ``new_key`` / ``new_value`` rows in the
query dtype (no block table; for a quantized cache no codes and no scales: exact), with the
causal mask on the diagonal steps only; then the cached prefix ``[0, ctx)`` from the pages with
no causal mask (only ``kv_hi = ctx`` bounds its last step). The softmax scale (and a quantized
path's per-row query factor) is folded into the running maximum and one FMA per score
(``prefill_steps.softmax_step``).

Exact own blocks (``kv_residual``, ``kvserve/attention/kv_residual.py``; constexpr
``HAS_RESIDUAL``): a row at ``p`` reads cache keys below ``p // B * B`` only, then one extra masked
pass over keys ``[first row's block start, last row's position]`` reads its own block's keys
from the residual or the new rows (``kv_exact.attend_exact``).

Tree verification (speculative decoding with tree drafts, ``kvserve/spec_decode/tree.py``;
constexpr ``TREE``): each query row carries int64 ancestor bits; keys at positions ``>= tree_start``
of its request are seen only where bit ``pos - tree_start`` is set (SpecInfer's tree attention,
arXiv:2305.09781). Every step over those keys is masked; off, the path costs nothing.

FP8 tensor-core dots on an e4m3 prefix (``PREFILL_PATHS``; constexprs ``FP8_QK`` / ``FP8_PV``): Q K^T
on the K codes with the query rounded to e4m3 per row, P V on the V codes with P times the key
scales spread per row over e4m3's range (FlashAttention-3, Shah et al., arXiv:2407.08608).
``round_e4m3`` is the shared e4m3 rounding for the interpreter's emulation of both.

Learned attention sinks (gpt-oss; constexpr ``HAS_SINKS``): each head's sink logit is one more
term of its softmax denominator with no value, so the running max starts at the sink (in
log2 units) and the running sum at 1 instead of ``-inf`` and 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.attention.kv_format import KVCacheFormat
from kvserve.attention.triton.kv_load import (cache_strides, kernel_cache_args, kv_row_offsets, kv_scale_index,
                                               kv_scale_words, kv_tile_offsets, load_k_tile, load_scales, load_v_tile,
                                               prepare_query, pv_update, scaled_scores, use_fast_cvt)
from kvserve.attention.triton.kv_exact import attend_exact, residual_args
from kvserve.attention.triton.prefill_steps import (attend_new, e4m3_operand, load_e4m3 as _load_e4m3,  # noqa: F401
                                                    round_e4m3, softmax_step, tile_pages, tree_visible)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    q, acc, m_i, l_i, n0, kv_min, kv_hi, q_pos, window, bt_row, k_cache_ptr, v_cache_ptr, kv_head_off,
    stride_cb, stride_co, stride_cd, q_scale, q_sum,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr,
    in_dtype: tl.constexpr, KV_FMT: tl.constexpr = 0, FAST_CVT: tl.constexpr = False, q_lim=0,
    RESIDUAL: tl.constexpr = False, TREE: tl.constexpr = False, t_bits=0, t_start=0,
    FP8_QK: tl.constexpr = 0, FP8_PV: tl.constexpr = 0, PAGE_TILES: tl.constexpr = False,
    PRE_IDS: tl.constexpr = False, pg=0, pg_sc=0,
):
    """One online-softmax step over keys ``[n0, n0 + BLOCK_N)``; ``MASKED`` applies the
    causal / window / ``kv_hi`` masks (off for tiles every row sees in full). ``n0`` is a
    multiple of ``BLOCK_N``; ``q_scale`` / ``q_sum``: ``kv_load.prepare_query``. ``RESIDUAL``:
    a row sees cache keys below ``q_lim [M]`` (its own block's start) instead of up to ``q_pos``.
    ``FP8_QK`` (e4m3 codes): K is the codes as stored (``tl.float8e4nv``, no conversion) and
    ``q`` the query rounded to e4m3 per row: Q K^T is an FP8 tensor-core dot (2: the same values
    widened to float32, for the interpreter). ``FP8_PV`` (e4m3 codes): P V as an e4m3 dot on the V
    codes as stored, P times the keys' scales rounded to e4m3 after each row is spread over e4m3's
    range (FlashAttention-3's FP8 recipe, Shah et al., arXiv:2407.08608; row factor on the product).
    ``PAGE_TILES``: the block table read once per page of the tile, not once per key. ``PRE_IDS``
    (unmasked steps): the tile's block-table ids ``pg`` / ``pg_sc`` given (``tile_pages``), not loaded;
    16-bit and ``FP8_QK`` K tiles are then loaded ``[BLOCK_N, D]`` as V and transposed, so the ids
    are needed in one register layout (sm_90: no second id load, no spill)."""
    offs_n = tl.arange(0, BLOCK_N)
    pos = n0 + offs_n
    n_mask = pos < kv_hi
    if USE_WINDOW:  # n0 is rounded down: never load keys below the tile's window (freed blocks)
        n_mask = n_mask & (pos >= kv_min)
    if PRE_IDS:  # ids loaded a step ahead by the caller
        row_off = pg.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head_off
    elif PAGE_TILES:  # n0 is a multiple of BLOCK_N; keys past kv_hi read page 0 and are masked
        row_off = kv_tile_offsets(bt_row, n0, kv_hi, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, BLOCK_N)
    else:
        row_off = kv_row_offsets(bt_row, pos, n_mask, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, MASKED)
    K_DTYPE: tl.constexpr = tl.float8e4nv if FP8_QK > 0 else in_dtype
    # [D, BLOCK_N]
    if PRE_IDS and (FP8_QK == 1 or KV_FMT == 0):  # [BLOCK_N, D] as V, transposed: the ids in V's layout only
        if FP8_QK == 1:
            k = tl.trans(_load_e4m3(k_cache_ptr, row_off[:, None] + tl.arange(0, HEAD_DIM)[None, :], n_mask[:, None],
                                    False))
        else:
            k = tl.trans(tl.load(k_cache_ptr + row_off[:, None] + tl.arange(0, HEAD_DIM)[None, :] * stride_cd))
            k = k.to(in_dtype)
            if WIDEN:
                k = k.to(tl.float32)
    elif FP8_QK == 1:
        k = _load_e4m3(k_cache_ptr, row_off[None, :] + tl.arange(0, HEAD_DIM)[:, None], n_mask[None, :], MASKED)
    else:
        k = load_k_tile(k_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM, MASKED, WIDEN, K_DTYPE, KV_FMT, FAST_CVT)
    if FP8_QK == 2:  # interpreter: its FP8 dot is not exact; the same e4m3 values widened instead
        k = k.to(tl.float32)
    if KV_FMT > 0:  # per-key scales (one vector load per page), the same entries for K and V
        if PRE_IDS:
            sc_idx = kv_scale_words(pg_sc, n0, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                                    KV_FMT)
        else:
            sc_idx = kv_scale_index(bt_row, n0, kv_hi, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, BLOCK_N,
                                    HEAD_DIM, KV_FMT, MASKED)
        ks, kz = load_scales(k_cache_ptr, sc_idx, n_mask, KV_FMT, BLOCK_N)
        vs, vz = load_scales(v_cache_ptr, sc_idx, n_mask, KV_FMT, BLOCK_N)
    else:
        ks, kz, vs, vz = q_scale, q_scale, q_scale, q_scale
    # per-key scales (8-bit formats) on the columns; the row factor folded into the softmax step
    ROW_VEC: tl.constexpr = KV_FMT > 0 and KV_FMT <= 3
    if KV_FMT >= 4:  # asymmetric codes: the minimum's term too (kv_load.scaled_scores), in log2 units
        qk = scaled_scores(q, k, q_scale, q_sum, ks, kz, DOT_PREC, KV_FMT)
        row_scale = 1.0
    elif ROW_VEC:
        if FP8_QK == 1:
            qk = tl.dot(q, k) * ks[None, :]
        else:
            qk = tl.dot(q, k, input_precision=DOT_PREC) * ks[None, :]
        row_scale = q_scale
    else:
        qk = tl.dot(q, k, input_precision=DOT_PREC)
        row_scale = q_scale
    if MASKED:
        if RESIDUAL:
            valid = n_mask[None, :] & (pos[None, :] < q_lim[:, None])
        else:
            valid = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            valid = valid & (pos[None, :] > q_pos[:, None] - window)
        if TREE:
            valid = valid & tree_visible(pos, t_bits, t_start)
        qk = tl.where(valid, qk, float("-inf"))
    p, alpha, m_new, l_i = softmax_step(qk, row_scale, m_i, l_i, ROW_VEC)
    if FP8_PV > 0:  # [BLOCK_N, D] e4m3 codes as stored, not converted
        # bytes bitcast in registers: the copy stays asynchronous (pipelined); an e4m3 pointer would make
        # it a plain load, since fp8 wgmma takes B contiguous along the keys and V's rows must be transposed
        v = _load_e4m3(v_cache_ptr, row_off[:, None] + tl.arange(0, HEAD_DIM)[None, :], n_mask[:, None], MASKED,
                       False)
        pv = p * vs[None, :]  # <= the row's largest key scale; masked keys have scale 0
        r = tl.max(pv, 1)
        r = tl.where(r > 0.0, r, 1.0)
        pv = pv * (448.0 / r)[:, None]  # each row's largest term at e4m3's maximum
        if FP8_PV == 2:  # interpreter: the same e4m3 values in float32
            d = tl.dot(round_e4m3(pv), v.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(pv.to(tl.float8e4nv), v)
        acc = acc * alpha[:, None] + d * (r * (1.0 / 448.0))[:, None]
    else:  # [BLOCK_N, D]
        v = load_v_tile(v_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM, MASKED, WIDEN, in_dtype, KV_FMT,
                        FAST_CVT)
        acc = pv_update(acc * alpha[:, None], p, v, vs, vz, DOT_PREC, KV_FMT, in_dtype)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["window", "req_offset", "stride_bt"])  # per-step ints
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, window, req_offset,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    res_k_ptr, res_v_ptr, new_k_ptr, new_v_ptr, res_slots_ptr,
    stride_rs, stride_rr, stride_rh, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    sinks_ptr, tree_mask_ptr, tree_start_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr, KV_FMT: tl.constexpr = 0,
    FP16_DOT: tl.constexpr = False, FAST_CVT: tl.constexpr = False, HAS_RESIDUAL: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False, NEW_KV: tl.constexpr = False, TREE: tl.constexpr = False,
    FP8_QK: tl.constexpr = 0, FP8_PV: tl.constexpr = 0, PAGE_TILES: tl.constexpr = False,
    PREFIX_STAGES: tl.constexpr = 0, PREFETCH_IDS: tl.constexpr = False,
):
    req = tl.program_id(0) + req_offset
    # the last tiles see the most keys: launched first, so the short ones fill the tail of the grid
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # cached prefix length

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    t0 = tile * BLOCK_Q
    tok = t0 + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx + tok
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_mask[:, None], other=0.0)
    live = t0 < q_len
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the head's sink logit (log2 units) starts the running max, adding 2^0 = 1 to the sum
        m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(row_mask, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    t_bits = 0
    t_start = 0
    if TREE:  # ancestor bits per row; keys from t_start on are masked by them
        t_bits = tl.load(tree_mask_ptr + q_rows, mask=row_mask, other=-1).to(tl.int64)
        t_start = tl.load(tree_start_ptr + req)
    if NEW_KV:  # the chunk's own keys first, from its contiguous K/V rows in the query dtype
        q_dtype: tl.constexpr = q_ptr.dtype.element_ty
        q_new = q.to(tl.float32) if WIDEN else q
        nk_base = new_k_ptr + q_start.to(tl.int64) * stride_nkt + kvh * stride_nkh
        nv_base = new_v_ptr + q_start.to(tl.int64) * stride_nvt + kvh * stride_nvh
        own_full = tl.where(live, (t0 // BLOCK_N) * BLOCK_N, 0)  # keys every row of the tile sees
        if TREE:  # no chunk key is seen by every row
            own_full = 0
        own_hi = tl.where(live, tl.minimum(t0 + BLOCK_Q, q_len), 0)
        for j0 in range(0, own_full, BLOCK_N):
            acc, m_i, l_i = attend_new(q_new, acc, m_i, l_i, j0, tok, q_len, nk_base, nv_base, stride_nkt,
                                        stride_nvt, qk_scale, HEAD_DIM, BLOCK_N, False, DOT_PREC, WIDEN, q_dtype)
        for j0 in range(own_full, own_hi, BLOCK_N):
            acc, m_i, l_i = attend_new(q_new, acc, m_i, l_i, j0, tok, q_len, nk_base, nv_base, stride_nkt,
                                        stride_nvt, qk_scale, HEAD_DIM, BLOCK_N, True, DOT_PREC, WIDEN, q_dtype,
                                        TREE, t_bits, ctx - t_start)
    # tl.dot operand dtype: K/V/P cast to it (quantized codes: float16, exact)
    in_dtype: tl.constexpr = tl.float16 if FP16_DOT else q_ptr.dtype.element_ty
    q, q_scale, q_sum = prepare_query(q, qk_scale, KV_FMT, in_dtype)
    if FP8_QK > 0:  # the row-normalised query (|q| <= 1) spread over e4m3's range (max 448) and rounded to it
        q_scale = q_scale * (1.0 / 448.0)
        q = e4m3_operand(q.to(tl.float32) * 448.0, FP8_QK == 2)
    CODE_SCALE: tl.constexpr = 256.0 if (KV_FMT == 1 and FAST_CVT) else 1.0  # kv_load._byte_codes: e4m3 / 256
    q_scale = q_scale * CODE_SCALE
    if WIDEN:  # interpreter only: its numpy dot cannot multiply bf16
        q = q.to(tl.float32)
    if NEW_KV and CODE_SCALE != 1.0:  # the accumulator is kept in code units (times CODE_SCALE at the end)
        acc = acc * (1.0 / CODE_SCALE)

    # Keys this tile can see: [kv_lo, kv_hi), empty when the tile is past q_len. Without a
    # window, keys below ctx + t0 (the tile's first position) are seen by every row: those
    # whole BLOCK_N steps skip the masks; the rest (diagonal / window) are masked.
    kv_hi = tl.where(live, tl.minimum(ctx + t0 + BLOCK_Q, seq_len), 0)
    if NEW_KV:  # the cache holds only the prefix still to read: keys [0, ctx), no causal mask needed
        kv_hi = tl.where(live, ctx, 0)
    if USE_WINDOW:  # from a multiple of BLOCK_N (kv_scale_index); the window mask hides the rest
        kv_min = tl.maximum(ctx + t0 - window + 1, 0)
        kv_lo = (kv_min // BLOCK_N) * BLOCK_N
        full_end = kv_lo
    else:
        kv_lo = seq_len * 0
        kv_min = kv_lo
        full_end = tl.where(live, ((ctx + t0) // BLOCK_N) * BLOCK_N, 0)
        if NEW_KV:
            full_end = (kv_hi // BLOCK_N) * BLOCK_N
    if TREE:  # steps from the tree's first key on are masked
        full_end = tl.minimum(full_end, (tl.maximum(t_start, 0) // BLOCK_N) * BLOCK_N)
    kv_hi_q = kv_hi  # end of the keys read from the cache
    q_lim = q_pos
    if HAS_RESIDUAL:  # cache keys stop at each row's own block; those blocks are read exact below
        own0 = ((ctx + t0) // BLOCK_SIZE) * BLOCK_SIZE  # the first row's block start
        kv_hi_q = tl.where(live, ((kv_hi - 1) // BLOCK_SIZE) * BLOCK_SIZE, 0)
        q_lim = (q_pos // BLOCK_SIZE) * BLOCK_SIZE
        if not USE_WINDOW:
            full_end = tl.where(live, (own0 // BLOCK_N) * BLOCK_N, 0)

    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_ch
    if PREFETCH_IDS:  # tile i+1's block-table ids loaded during step i and carried: K/V addresses off no load
        pg, pg_sc = tile_pages(bt_row, kv_lo, full_end, BLOCK_SIZE, BLOCK_N, KV_FMT > 0)
        for n0 in range(kv_lo, full_end, BLOCK_N):
            pg_nxt, pg_sc_nxt = tile_pages(bt_row, n0 + BLOCK_N, full_end, BLOCK_SIZE, BLOCK_N, KV_FMT > 0)
            acc, m_i, l_i = _attend_block(
                q, acc, m_i, l_i, n0, kv_min, kv_hi, q_pos, window, bt_row, k_cache_ptr, v_cache_ptr,
                kv_head_off, stride_cb, stride_co, stride_cd, q_scale, q_sum,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, USE_WINDOW, DOT_PREC, WIDEN, in_dtype, KV_FMT, FAST_CVT,
                q_lim, False, False, 0, 0, FP8_QK, FP8_PV, False, True, pg, pg_sc)
            pg = pg_nxt
            pg_sc = pg_sc_nxt
    elif PREFIX_STAGES > 0:  # the pipeliner spends a stage on the block-table load: one more keeps K/V 2 steps ahead
        for n0 in tl.range(kv_lo, full_end, BLOCK_N, num_stages=PREFIX_STAGES):
            acc, m_i, l_i = _attend_block(
                q, acc, m_i, l_i, n0, kv_min, kv_hi, q_pos, window, bt_row, k_cache_ptr, v_cache_ptr,
                kv_head_off, stride_cb, stride_co, stride_cd, q_scale, q_sum,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, USE_WINDOW, DOT_PREC, WIDEN, in_dtype, KV_FMT, FAST_CVT,
                q_lim, False, False, 0, 0, FP8_QK, FP8_PV, PAGE_TILES)
    else:
        for n0 in range(kv_lo, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                q, acc, m_i, l_i, n0, kv_min, kv_hi, q_pos, window, bt_row, k_cache_ptr, v_cache_ptr,
                kv_head_off, stride_cb, stride_co, stride_cd, q_scale, q_sum,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, USE_WINDOW, DOT_PREC, WIDEN, in_dtype, KV_FMT, FAST_CVT,
                q_lim, False, False, 0, 0, FP8_QK, FP8_PV, PAGE_TILES)
    for n0 in range(full_end, kv_hi_q, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, n0, kv_min, kv_hi_q, q_pos, window, bt_row, k_cache_ptr, v_cache_ptr,
            kv_head_off, stride_cb, stride_co, stride_cd, q_scale, q_sum,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, USE_WINDOW, DOT_PREC, WIDEN, in_dtype, KV_FMT, FAST_CVT,
            q_lim, HAS_RESIDUAL, TREE, t_bits, t_start, FP8_QK, FP8_PV, PAGE_TILES)
    if HAS_RESIDUAL:  # keys [own0, kv_hi) exact (kv_exact), against q reloaded in the compute dtype
        q_ex = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                       + offs_d[None, :] * stride_qd, mask=row_mask[:, None], other=0.0)
        if WIDEN:
            q_ex = q_ex.to(tl.float32)
        rslot = tl.load(res_slots_ptr + req).to(tl.int64)
        ex_lo = tl.maximum(own0, kv_min)
        for n0 in range(ex_lo, kv_hi, BLOCK_N):
            acc, m_i, l_i = attend_exact(
                q_ex, acc, m_i, l_i, n0, ex_lo, kv_hi, q_pos, window, ctx, rslot, q_start.to(tl.int64), kvh,
                res_k_ptr, res_v_ptr, new_k_ptr, new_v_ptr, stride_rs, stride_rr, stride_rh,
                stride_nkt, stride_nkh, stride_nvt, stride_nvh, qk_scale,
                BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_WINDOW, DOT_PREC, 1.0 / CODE_SCALE)

    o = acc * (CODE_SCALE / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def new_kv_args(new_key: torch.Tensor, new_value: torch.Tensor | None, query: torch.Tensor, hkv: int):
    """The kernel's residual-slot arguments carrying the chunk's own K/V (``NEW_KV``): new K and V
    in the new-row pointers and strides, ``query`` for the residual ones (never read).

    Raises ValueError unless both are ``[num_tokens, num_kv_heads, D]`` of the query's dtype."""
    want = (query.shape[0], hkv, query.shape[2])
    for name, t in (("new_key", new_key), ("new_value", new_value)):
        if t is None or tuple(t.shape) != want or t.dtype != query.dtype:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"{name} must be {list(want)} of {query.dtype} (the chunk's own K/V), got {got}")
    new_key = new_key if new_key.stride(-1) == 1 else new_key.contiguous()
    new_value = new_value if new_value.stride(-1) == 1 else new_value.contiguous()
    return ((query, query, new_key, new_value, query),
            (0, 0, 0, new_key.stride(0), new_key.stride(1), new_value.stride(0), new_value.stride(1)))


#: Tile configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` on CUDA per (operand kind, head_dim
#: class): "16bit" (bf16/fp16 query over a 16-bit cache), "fp8" (e4m3/e5m2 codes), "int" (int8/4/2
#: codes). Measured at the 8B attention shape on an H200 (``benchmarks/gpu_prefill.py --parts sweep``,
#: best of the sweep per KV dtype): bf16 (128, 128, 8, 3) 16.4 ms at 32K in one chunk (67% of the
#: measured matmul peak) against 21.1 ms for (128, 64, 8, 2), and (128, 64, 8, 3) 17.7 ms. A third
#: stage lets the pipeliner issue the block-table load a step ahead of the K/V loads it feeds; fp8
#: takes it too (not yet measured: ``--sweep-set quick`` times it against the two-stage config), but
#: keeps 64 keys a step (converting a 128-key tile of codes in registers would spill at 242 regs).
PREFILL_CONFIGS = {
    ("16bit", "d<=128"): (128, 128, 8, 3),  # H200 32K: 16.6 ms (66% of the matmul peak) whole, 22.7 chunked
    ("16bit", "d256"): (64, 32, 4, 2),
    ("fp8", "d<=128"): (128, 128, 8, 3),  # H200 32K: 17.3 ms whole / 32.4 chunked vs 17.6 / 34.8 at 128 x 64
    ("fp8", "d256"): (64, 32, 4, 2),
    ("int", "d<=128"): (128, 64, 8, 2),
    ("int", "d256"): (64, 32, 4, 2),
}

#: Defaults of the prefill kernel's optional paths, read at each launch (a module dict so a
#: benchmark can switch them for a whole engine run; ``prefill_attention``'s arguments override):
#: ``fp8_qk``: e4m3 caches compute Q K^T as an FP8 tensor-core dot (the query rounded to e4m3 per
#: row, the per-token key scales on the score columns; about 2^-4 relative error per query element
#: on top of the cache's own; on by default on the GPU since the K codes load straight into the
#: dot's operand: H200, 32K, 8B layer, the chunked pattern 26.7 vs 32.4 ms and whole prompts 17.2 vs
#: 17.5 ms against the converted path, `gpu_prefill.py` sweep of 2026-11-29; the interpreter keeps
#: the exact path unless asked). ``fp8_pv``: e4m3 caches compute P V as an
#: FP8 dot on the V codes (P times the key scales, each row spread over e4m3's range and rounded:
#: at most 2^-4 relative error per term, so ``|error| <= 2^-4 (P |V|) / l`` per output element).
#: ``page_tiles``: the paged keys' block-table entries read once per page of a tile, not per key.
#: (The two FP8 paths: the cached prefix only; the chunk's own keys are read exact in the query dtype.)
#: ``prefix_stages``: software-pipeline stages of the paged-prefix loop (0: the config's). Triton's
#: pipeliner splits a loop's stages between the block-table load and the K/V loads it feeds
#: (``(num_stages - 1) // 2`` steps of latency each), so at 3 stages the prefix keeps one K/V tile
#: in flight where the chunk's own keys keep two; 5 gives it two (sm_90 GPU IR:
#: ``benchmarks/ptx_prefill.py``). Dropped where its third K/V buffer would not fit shared memory.
#: ``prefetch_ids``: the unmasked prefix loop loads tile i+1's block-table ids during step i and
#: carries them (``prefill_steps.tile_pages``), so the pipeliner sees no load feeding the K/V
#: addresses and keeps the own keys' depth (3 stages: 2 K/V tiles in flight in 3 buffers). On by default
#: on the GPU: 12-19% faster prefix chunks on an H200, bf16 and FP8 (docs/benchmarks/long-context.md).
PREFILL_PATHS = {"fp8_qk": True, "fp8_pv": False, "page_tiles": False, "prefix_stages": 0, "prefetch_ids": True}


def _operand_kind(kv_fmt: int) -> str:
    return "16bit" if kv_fmt == 0 else ("fp8" if kv_fmt in (1, 2) else "int")


@functools.lru_cache(maxsize=None)
def _max_shared_bytes(device_index: int) -> int:
    """Shared memory one block may use on this GPU (opt-in maximum); 0 if torch does not say."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


@functools.lru_cache(maxsize=None)
def _fp8_dots(device_index: int) -> bool:
    """Whether this GPU has e4m3 tensor-core dots (sm_89 and later)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _config(head_dim: int, dtype: torch.dtype, group: int, interpret: bool, kv_fmt: int = 0,
            device_index: int | None = None):
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for the packed tile (``PREFILL_CONFIGS``).
    A config whose Q tile plus ``num_stages`` K/V tiles (16-bit) would not fit the GPU's shared
    memory (e.g. 164 KB on an A100) falls back to (128, 64, 8, 2)."""
    if interpret:
        bm, bn, warps, stages = 16, 16, 1, 1
    elif dtype == torch.float32:  # fp32 operands: 4 bytes each, no tensor cores ("ieee")
        bm, bn, warps, stages = (32, 16, 4, 2) if head_dim <= 128 else (16, 16, 4, 1)
    else:
        bm, bn, warps, stages = PREFILL_CONFIGS[(_operand_kind(kv_fmt), "d256" if head_dim >= 256 else "d<=128")]
        limit = _max_shared_bytes(device_index) if device_index is not None else 0
        if limit and (bm + 2 * stages * bn) * head_dim * 2 > limit:
            bm, bn, warps, stages = 128, 64, 8, 2
    bm = max(bm, triton.next_power_of_2(group))
    return bm, bn, warps, stages


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    req_offset: int,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    kv_format: KVCacheFormat | None = None,
    kv_residual: torch.Tensor | None = None,
    residual_slots: torch.Tensor | None = None,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tree_mask: torch.Tensor | None = None,
    tree_start: torch.Tensor | None = None,
    fp8_qk: bool | None = None,
    fp8_pv: bool | None = None,
    page_tiles: bool | None = None,
    prefix_stages: int | None = None,
    prefetch_ids: bool | None = None,
) -> torch.Tensor:
    """Causal attention for requests ``req_offset .. req_offset + num_reqs - 1``.

    Args:
        query: ``[num_tokens, num_heads, D]`` fp32/bf16/fp16; request ``i`` owns rows
            ``query_start_loc[i]:query_start_loc[i+1]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, D]`` with the new tokens already
            stored; any float dtype (cast to the query dtype after loading).
        block_tables: ``[R, max_blocks]`` int32; seq_lens ``[R]`` int32; query_start_loc
            ``[R + 1]`` int32.
        max_query_len: host int upper bound of the query lengths (sizes the grid).
        out: ``[num_tokens, num_heads, D]``, written at these requests' rows (allocated if None).
        block_m / block_n: tile overrides (rows of the packed tile, keys per step).
        kv_format: the cache's format (``KVCacheFormat``; selects ``KV_FMT``); None: plain
            values of the cache's own float dtype.
        kv_residual / residual_slots / new_key / new_value: the exact own blocks
            (``kvserve/attention/kv_residual.py``; shapes as ``decode_attention``): a query at
            ``p`` reads cache keys below ``p // block_size * block_size`` and the rest of its
            block from the residual (keys below the request's cached length) or from the new
            rows (``new_key[query_start_loc[i] + j - ctx]``, in the cache's basis).
            Without ``kv_residual`` (and without a sliding window), ``new_key`` / ``new_value``
            ``[num_tokens, num_kv_heads, D]`` in the query dtype are the chunk's own K/V as
            computed: keys at positions ``>= seq_len - q_len`` are read from them (contiguous
            rows, no block table, never quantized) and only the cached prefix from the pages.
            With a sliding window they are ignored (every key is read from the cache).
        sinks: ``[num_heads]`` learned attention sinks (gpt-oss), one extra logit per head in
            each row's softmax denominator (no value): the running max and sum start from it.
        num_warps / num_stages: launch overrides (benchmark sweeps; default ``_config``).
        tree_mask / tree_start: tree verification (``AttentionMetadata.tree_mask``): int64
            ``[num_tokens]`` ancestor bits per query row and int32 ``[R]`` the position of bit 0
            per request; keys at or past ``tree_start`` are seen where the row's bit is set.
            Not with a sliding window or exact own blocks (ValueError).
        fp8_qk: path override (default ``PREFILL_PATHS``): Q K^T as an FP8 dot; e4m3 caches only
            (not with ``kv_residual``, with the integer-built e4m3 codes of
            ``kv_load.CODE_PATHS["fast_cvt"]``, or on GPUs before sm_89: the converted path instead).
        fp8_pv / page_tiles: path overrides (default ``PREFILL_PATHS``): P V as an FP8 dot (as
            ``fp8_qk``: e4m3 caches only); block-table entries read once per page of a key tile.
        prefix_stages: path override (default ``PREFILL_PATHS``): pipeline stages of the unmasked
            paged-prefix loop (0: the launch's ``num_stages``).
        prefetch_ids: path override (default ``PREFILL_PATHS``): the unmasked paged-prefix loop
            loads the next key tile's block-table ids one step ahead (``tile_pages``); same
            keys, same arithmetic, so the same output. Takes precedence over ``page_tiles`` /
            ``prefix_stages`` in that loop.

    Returns ``out``. No host synchronisation.
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_reqs == 0 or max_query_len == 0:
        return out
    _, num_heads, d = query.shape
    _, _, block_size, hkv, dk = kv_cache.shape
    assert num_heads % hkv == 0
    kv_cache, kv_fmt = kernel_cache_args(kv_cache, kv_format)  # bytes + format code when quantized
    assert d >= 16 and d & (d - 1) == 0, "head_size must be a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    group = num_heads // hkv
    on_cuda = query.device.type == "cuda"
    bm, bn, cfg_warps, cfg_stages = _config(d, query.dtype, group, not on_cuda, kv_fmt,
                                            query.device.index if on_cuda else None)
    bm = block_m or bm
    bn = block_n or bn
    assert bm >= 16 and bn >= 16 and bm >= group
    block_q = bm // group
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride() == v_cache.stride()
    window = sliding_window if sliding_window is not None else 0
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), hkv)
    new_kv = kv_residual is None and new_key is not None and sliding_window is None
    tree = tree_mask is not None
    if tree and (sliding_window is not None or kv_residual is not None or tree_start is None):
        raise ValueError("tree_mask needs tree_start and no sliding window or exact own blocks")
    if new_kv:
        res_t, res_s = new_kv_args(new_key, new_value, query, hkv)
    else:
        res_t, res_s = residual_args(kv_residual, residual_slots, new_key, new_value, query)
    fast_cvt = use_fast_cvt(kv_fmt)
    # the default FP8 Q K^T applies on the GPU only: the interpreter keeps the exact path unless asked
    fp8_qk = (PREFILL_PATHS["fp8_qk"] and on_cuda) if fp8_qk is None else fp8_qk
    # Hopper's FP8 dot takes K >= 32: smaller heads keep the converted path
    fp8_ok = kv_fmt == 1 and kv_residual is None and not fast_cvt and (not on_cuda or _fp8_dots(query.device.index))
    fp8_qk = (1 if on_cuda else 2) if (fp8_qk and fp8_ok and (d >= 32 or not on_cuda)) else 0
    fp8_pv = PREFILL_PATHS["fp8_pv"] if fp8_pv is None else fp8_pv
    fp8_pv = (1 if on_cuda else 2) if (fp8_pv and fp8_ok and (bn >= 32 or not on_cuda)) else 0  # keys: the dot's K
    page_tiles = PREFILL_PATHS["page_tiles"] if page_tiles is None else page_tiles
    # on the GPU by default (2 prefix K/V tiles in flight); the interpreter keeps the plain loop unless asked
    prefetch_ids = bool((PREFILL_PATHS["prefetch_ids"] and on_cuda) if prefetch_ids is None else prefetch_ids)
    prefix_stages = int(PREFILL_PATHS["prefix_stages"] if prefix_stages is None else prefix_stages)
    limit = _max_shared_bytes(query.device.index) if on_cuda else 0
    bufs = (prefix_stages - 1) // 2 + 1  # K/V buffers the pipeliner allocates (see PREFILL_PATHS)
    if limit and (bm + 2 * bufs * bn) * d * 2 + 2048 > limit:
        prefix_stages = 0
    _prefill_kernel[grid](
        query, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        scale * _LOG2E, window, req_offset,
        query.stride(0), query.stride(1), query.stride(2),
        *cache_strides(k_cache, d, kv_fmt),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *res_t, *res_s,
        query if sinks is None else sinks,
        tree_mask if tree else query, tree_start if tree else seq_lens,
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_M=bm, BLOCK_Q=block_q, BLOCK_N=bn,
        USE_WINDOW=sliding_window is not None,
        DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN=query.dtype == torch.bfloat16 and query.device.type != "cuda", KV_FMT=kv_fmt,
        FP16_DOT=kv_fmt > 0 and query.dtype != torch.float32, FAST_CVT=fast_cvt,
        HAS_RESIDUAL=kv_residual is not None, HAS_SINKS=sinks is not None, NEW_KV=new_kv, TREE=tree,
        FP8_QK=fp8_qk, FP8_PV=fp8_pv, PAGE_TILES=bool(page_tiles), PREFIX_STAGES=prefix_stages,
        PREFETCH_IDS=prefetch_ids,
        num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages,
    )
    return out
