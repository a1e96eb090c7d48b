"""Paged decode attention (query length 1) with split-KV (Flash-Decoding).

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
inference") on top of the FlashAttention-2 online softmax (Dao, arXiv:2307.08691), over the
PagedAttention block layout (Kwon et al., arXiv:2309.06180).

Stage 1, ``_decode_split_kernel``, grid ``(num_decodes, num_kv_heads, num_splits)``: each
program owns one request, one KV head and one contiguous slice of that request's keys. The
G = num_heads // num_kv_heads query heads of the KV group are packed as the rows of a
``[G_PAD, D]`` tile (G_PAD = max(16, next_pow2(G)), so ``tl.dot`` has M >= 16 and each K/V
tile is read once for the whole group). Keys are visited ``BLOCK_N`` positions at a time;
each position's page comes from the block table, so BLOCK_N is independent of the cache
block size. Softmax runs online in fp32 (base 2, the scale folded into log2(e)); the
program writes its normalised partial output ``[G, D]`` (fp32) and its log-sum-exp
(base 2) per head into ``part_out [R, H, num_splits, D]`` / ``part_lse [R, H, num_splits]``.

Stage 2, ``_decode_reduce_kernel``, grid ``(num_decodes, num_heads)``: combines the splits,
``out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max)``. With one split, stage 1
writes the final output directly and stage 2 is skipped.

Splits: each request's key range ``[lo, seq_len)`` (``lo = seq_len - window`` with a sliding
window, rounded down to a multiple of BLOCK_N, the keys below ``lo`` masked: every step
starts at a multiple of BLOCK_N, which the scale loads of quantized caches rely on) is cut
into ``num_splits`` slices of equal length rounded up to BLOCK_N, so every split of a long
request has work; ``num_splits`` is chosen on the host from ``max_seq_len`` and the number
of (request, kv_head) programs (``choose_num_splits``) so that ~2 waves fill the SMs. It is a
runtime argument (only "one split or several" is a compile-time constant), so changing
``max_seq_len`` never recompiles; the reduce kernel compiles once per power-of-two bound.
Keys past ``seq_len`` are never loaded (masked loads), so stale or poisoned cache slots
are harmless.

Exact own block (``kv_residual``, ``kvserve/attention/kv_residual.py``; constexpr
``HAS_RESIDUAL``): every split reads cache keys only below the query's block start
``own = (seq_len - 1) // B * B``; the one split whose slice holds ``seq_len - 1`` first reads keys
``[own, seq_len)`` exactly, one tile of ``max(16, B)`` keys (``kv_exact.attend_exact``), so the
partition of the splits, and hence any ``num_splits``, is unchanged.

FP8 dots (e4m3 caches, ``DECODE_PATHS["fp8_dot"]`` or ``fp8_dot=True``; constexpr ``FP8_DOT``): the
K and V codes reach the MMAs as e4m3, unconverted; the scales are folded in, as FlashAttention-3's
FP8 forward (Shah et al., arXiv:2407.08608) does with per-tensor ones. Q K^T: each query row divided
by its largest magnitude, times 448 and rounded to e4m3 (prefill's ``FP8_QK``, ``e4m3_operand``);
the row's factor and each key's scale ``ks_j`` multiply the fp32 scores. P V: V's per-token scale
``s_j`` joins the logit as ``log2 s_j``, so the running maximum is that of ``p_j s_j`` and
``exp2(logit - max)`` in [0, 1] is ``p_j s_j`` up to the row's factor: times 448, rounded to e4m3,
it is the P operand (no per-tile maximum of the scales); the running sum adds those values
``/ s_j`` (unrounded), and the output is ``acc / (448 l)``. Triton emits e4m3 ``wgmma`` on sm_90
(not ``mma.sync``: that converts FP8 operands to float16 there) for 64 MMA rows and 4+ warps: the
keys (constexpr ``FP8_T``, ``DecodeConfig.fp8_keys_rows``: ``S^T = K q^T``, ``O^T += V^T P^T``, the
softmax over the query rows padded to 16, its reductions along axis 0) or the query rows padded to
64 (4x the softmax's element-wise work). Steps: ``decode_fp8.py``. The interpreter (``FP8_DOT`` 2)
rounds the same way in float32 and multiplies exactly.
With ``FP8_PV`` False (``fp8_pv=False``, ``DecodeConfig.fp8_pv``) only Q K^T is an e4m3 dot:
V's codes are converted to float16 and P V is the conversion path's float16 dot (V's scales on P;
float16 operands may be MN-major in shared memory, so V needs no transpose), and bound (1) below is
the whole error (plus float16's rounding of ``p_j s_j``, relative 2^-11, as on the conversion path).
Error bound (u = 2^-4, e4m3's unit roundoff with 3 mantissa bits; below 2^-6 the absolute error
is at most 2^-10): with the weights ``w`` of the exact softmax (sinks included in its
denominator), ``v_j = s_j c_j`` the cache's values, ``O = sum_j w_j v_j`` and ``n`` keys,
(1) the query's rounding moves every logit (natural units) by at most
``delta = scale * sum_i (u |q_i| + 2^-10 max|q| / 448) |k_ji|``, so
``|dO| <= (e^(2 delta) - 1) sum_j w_j |v_j - O|``; (2) P's rounding adds, against the rounded
query's weights ``w'``, ``|dO| <= u sum_j w'_j |v_j| + 2^-10 n max_j w'_j s_j`` (the second term:
entries of P below e4m3's normals, relative to each step's running maximum; with splits it holds
per split and so for the merge). Both per output element (tests/attention/test_decode_fp8_dot.py
checks them). The cache's own quantization error is not included (the conversion path has it too).

Learned attention sinks (gpt-oss; constexpr ``HAS_SINKS``): one extra logit per head in the
softmax denominator, with no value. With one split the running max / sum start from it; with
several the reduce kernel adds ``2^(sink - max)`` to the combined denominator once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.kv_format import KVCacheFormat
# the config table lives in decode_configs.py; its names stay importable from here
from kvserve.attention.triton.decode_configs import (DECODE_CONFIGS, DECODE_PATHS, FP8_DOT_CONFIGS,  # noqa: F401
                                                     DecodeConfig, _config, _num_sms, choose_num_splits,
                                                     configs_to_compile, decode_config, decode_warmup_configs,
                                                     programs_bucket, use_fp8_dot)
from kvserve.attention.triton.kv_load import (cache_strides, code_lanes, code_lanes_i8, kernel_cache_args,
                                               kv_row_offsets, kv_scale_index, load_code_bytes, load_code_bytes_t,
                                               kv_tile_offsets, load_k_tile, load_scales, load_v_tile, merge_lanes,
                                               online_softmax, prepare_query, pv_update, hadamard_rotate,
                                               scaled_scores, split_lanes, use_fast_cvt, use_lane_split, use_unpack)
from kvserve.attention.triton.kv_exact import attend_exact, residual_args
from kvserve.attention.triton.decode_fp8 import _fp8_step, _fp8_step_keys_rows
from kvserve.attention.triton.prefill import e4m3_operand

_LOG2E = 1.4426950408889634


# Ints that change from step to step are not specialized (Triton would compile a variant for
# values equal to 1 or divisible by 16, mid-serving).
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, window, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    res_k_ptr, res_v_ptr, new_k_ptr, new_v_ptr, res_slots_ptr,
    stride_rs, stride_rr, stride_rh, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    sinks_ptr, counter_ptr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr, KV_FMT: tl.constexpr = 0,
    FP16_DOT: tl.constexpr = False, FAST_CVT: tl.constexpr = False, LANE_SPLIT: tl.constexpr = False,
    ROTATE: tl.constexpr = False, HAS_RESIDUAL: tl.constexpr = False, EXACT_N: tl.constexpr = 16,
    UNPACK: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False, PAGE_TILE: tl.constexpr = False,
    FUSE_REDUCE: tl.constexpr = False, FP8_DOT: tl.constexpr = 0, FP8_T: tl.constexpr = False,
    FP8_PV: tl.constexpr = True, V_BYTES: tl.constexpr = False,
):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + req)
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None], other=0.0)
    # tl.dot operand dtype: K/V/P are cast to it (quantized codes: float16, exact)
    in_dtype: tl.constexpr = tl.float16 if FP16_DOT else q_ptr.dtype.element_ty
    if ROTATE:  # the cache holds K R, V R: attend with q R, rotate the output back (R symmetric)
        q = hadamard_rotate(q, HEAD_DIM, DOT_PREC, tl.float32 if WIDEN else q_ptr.dtype.element_ty)
    if HAS_RESIDUAL:  # the own block's exact keys meet q in the compute dtype (kv_exact)
        q_ex = q.to(tl.float32 if WIDEN else q_ptr.dtype.element_ty)
    # FP8_DOT (e4m3 codes; 2: the interpreter, e4m3 values widened to float32 and dots in ieee)
    q, q_scale, q_sum = prepare_query(q, qk_scale, KV_FMT, tl.float32 if FP8_DOT > 0 else in_dtype)
    op_dtype: tl.constexpr = tl.float32 if WIDEN else in_dtype  # WIDEN: interpreter only (numpy dot, no bf16)
    if FP8_DOT > 0:  # |q| <= 1 spread over e4m3's range and rounded to it (prefill's FP8_QK)
        q = e4m3_operand(q * 448.0, FP8_DOT == 2)
        q_scale = q_scale * (1.0 / 448.0)
    else:
        q = q.to(op_dtype)
    # LANE_SPLIT (4-/2-bit codes): lane i of every byte holds elements LANES * c + i, so
    # q . k = sum_i q[:, i::LANES] . lane_i: one dot per lane, no interleaving of the codes;
    # V likewise, one accumulator per lane, interleaved once at the end.
    BITS: tl.constexpr = 4 if KV_FMT == 4 else (2 if KV_FMT == 5 else 8)
    LANES: tl.constexpr = 8 // BITS if LANE_SPLIT else 1
    CL: tl.constexpr = HEAD_DIM // LANES
    CODE_SCALE: tl.constexpr = 256.0 if (KV_FMT == 1 and FAST_CVT) else 1.0  # _byte_codes: e4m3 / 256
    q_scale = q_scale * CODE_SCALE
    I8QK: tl.constexpr = UNPACK == 2 and CL >= 32  # int8 q . K (tl.dot int8 needs K >= 32)
    if I8QK:  # q / max|q| in [-1, 1] -> int8 codes of 1/127
        q = tl.floor(q.to(tl.float32) * 127.0 + 0.5).to(tl.int8)
        q_scale = q_scale * (1.0 / 127.0)
    if LANES > 1:
        q0, q1, q2, q3 = split_lanes(q, LANES)

    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    else:
        kv_lo = seq_len * 0
    # Steps start at multiples of BLOCK_N (kv_scale_index needs it); keys below kv_lo masked.
    kv_lo_a = (kv_lo // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo_a, num_splits), BLOCK_N) * BLOCK_N
    start = kv_lo_a + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_ch
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    if HAS_SINKS and DIRECT:  # the sink logit starts the running max and adds 1 to the sum (several
        # splits: the reduce kernel adds it once)
        m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(g_mask, 1.0, 0.0)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    acc0 = tl.zeros([G_PAD, CL], tl.float32)
    acc1 = tl.zeros([G_PAD, CL], tl.float32)
    acc2 = tl.zeros([G_PAD, CL], tl.float32)
    acc3 = tl.zeros([G_PAD, CL], tl.float32)
    acc_z = tl.zeros([G_PAD], tl.float32)  # sum_j p_j m_j (the V minima), the same for every channel
    end_q = end  # end of the keys read from the cache
    if HAS_RESIDUAL:
        # Keys [own, seq_len) (own: the query's block start) are read exact, by the one split
        # holding the query's position; every split stops its cache keys at own.
        p_last = seq_len - 1
        own = (p_last // BLOCK_SIZE) * BLOCK_SIZE
        end_q = tl.minimum(end, own)
        if (start <= p_last) & (p_last < end):
            rslot = tl.load(res_slots_ptr + req).to(tl.int64)
            acc, m_i, l_i = attend_exact(
                q_ex, acc, m_i, l_i, own, tl.maximum(own, kv_lo), seq_len, p_last + offs_g * 0, window, p_last,
                rslot, q_row, kvh, res_k_ptr, res_v_ptr, new_k_ptr, new_v_ptr, stride_rs, stride_rr, stride_rh,
                stride_nkt, stride_nkh, stride_nvt, stride_nvh, qk_scale,
                BLOCK_SIZE, HEAD_DIM, EXACT_N, USE_WINDOW, DOT_PREC, 1.0 / CODE_SCALE)
        if LANES > 1:  # the exact part joins the per-lane accumulators
            acc0, acc1, acc2, acc3 = split_lanes(acc, LANES)
    if FP8_T:  # keys as the MMA's rows: S^T = K q^T, O^T += V^T P^T (the GROUP query rows are its N)
        q_t = tl.trans(q)
        acc_t = tl.zeros([HEAD_DIM, G_PAD], tl.float32)
    for n0 in range(start, end_q, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end_q
        if USE_WINDOW:
            n_mask = n_mask & (pos >= kv_lo)
        if PAGE_TILE:  # one block-table entry per page of the tile
            row_off = kv_tile_offsets(bt_row, n0, end_q, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, BLOCK_N)
        else:
            row_off = kv_row_offsets(bt_row, pos, n_mask, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, True)
        if FP8_DOT == 0 and LANES == 1:
            k = load_k_tile(k_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM, True, WIDEN, in_dtype, KV_FMT,
                            FAST_CVT)
        if KV_FMT > 0:  # per-key scales, one vector load per page; the same entries for K and V
            sc_idx = kv_scale_index(bt_row, n0, end_q, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, BLOCK_N,
                                    HEAD_DIM, KV_FMT, True)
            ks, kz = load_scales(k_cache_ptr, sc_idx, n_mask, KV_FMT, BLOCK_N)
            vs, vz = load_scales(v_cache_ptr, sc_idx, n_mask, KV_FMT, BLOCK_N)
        else:
            ks, kz, vs, vz = qk_scale, qk_scale, qk_scale, qk_scale
        if FP8_DOT > 0:  # e4m3 codes straight to the MMAs (module docstring)
            if FP8_T:
                acc_t, m_i, l_i = _fp8_step_keys_rows(q_t, acc_t, m_i, l_i, k_cache_ptr, v_cache_ptr, row_off, n_mask,
                                                      q_scale, ks, vs, HEAD_DIM, FP8_DOT, FP8_PV)
            else:
                acc, m_i, l_i = _fp8_step(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, row_off, n_mask, q_scale, ks, vs,
                                          HEAD_DIM, FP8_DOT, FP8_PV)
        else:
            if LANES > 1:
                rk = load_code_bytes_t(k_cache_ptr, row_off, n_mask, CL, True, UNPACK > 0)  # [C, BLOCK_N]
                if I8QK:
                    k0, k1, k2, k3 = code_lanes_i8(rk, BITS)
                    qki = tl.dot(q0, k0, out_dtype=tl.int32)
                    qki = tl.dot(q1, k1, qki, out_dtype=tl.int32)
                    if LANES == 4:
                        qki = tl.dot(q2, k2, qki, out_dtype=tl.int32)
                        qki = tl.dot(q3, k3, qki, out_dtype=tl.int32)
                    qk = qki.to(tl.float32)
                else:
                    k0, k1, k2, k3 = code_lanes(rk, BITS, op_dtype, FAST_CVT, UNPACK)
                    qk = tl.dot(q0, k0, input_precision=DOT_PREC)
                    qk = tl.dot(q1, k1, qk, input_precision=DOT_PREC)
                    if LANES == 4:
                        qk = tl.dot(q2, k2, qk, input_precision=DOT_PREC)
                        qk = tl.dot(q3, k3, qk, input_precision=DOT_PREC)
                qk = qk * q_scale[:, None] * ks[None, :] + q_sum[:, None] * kz[None, :]
            else:
                qk = scaled_scores(q, k, q_scale, q_sum, ks, kz, DOT_PREC, KV_FMT)  # [G_PAD, BLOCK_N], log2 units
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            p, alpha, m_new, l_i = online_softmax(qk, m_i, l_i)
            if LANES > 1:
                rv = load_code_bytes(v_cache_ptr, row_off, n_mask, CL, True, UNPACK > 0)  # [BLOCK_N, C]
                pv = (p * vs[None, :]).to(in_dtype).to(op_dtype)
                v0, v1, v2, v3 = code_lanes(rv, BITS, op_dtype, FAST_CVT, UNPACK)
                acc0 = tl.dot(pv, v0, acc0 * alpha[:, None], input_precision=DOT_PREC)
                acc1 = tl.dot(pv, v1, acc1 * alpha[:, None], input_precision=DOT_PREC)
                if LANES == 4:
                    acc2 = tl.dot(pv, v2, acc2 * alpha[:, None], input_precision=DOT_PREC)
                    acc3 = tl.dot(pv, v3, acc3 * alpha[:, None], input_precision=DOT_PREC)
                acc_z = acc_z * alpha + tl.sum(p * vz[None, :], 1)
            else:
                v = load_v_tile(v_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM, True, WIDEN, in_dtype, KV_FMT,
                                FAST_CVT, V_BYTES)
                acc = pv_update(acc * alpha[:, None], p, v, vs, vz, DOT_PREC, KV_FMT, in_dtype)
            m_i = m_new

    if LANES > 1:
        acc = merge_lanes(acc0, acc1, acc2, acc3, LANES) + acc_z[:, None]
    if FP8_T:
        acc = tl.trans(acc_t)
    empty = l_i == 0.0
    OUT_SCALE: tl.constexpr = 1.0 / 448.0 if (FP8_DOT > 0 and FP8_PV) else CODE_SCALE
    o = acc * (OUT_SCALE / tl.where(empty, 1.0, l_i))[:, None]
    if ROTATE:  # linear, so each split's partial output may be rotated back before the reduce
        o = hadamard_rotate(o, HEAD_DIM, DOT_PREC, tl.float32 if WIDEN or not FP16_DOT else tl.bfloat16,
                            SPLIT=not WIDEN and FP16_DOT)
    if DIRECT:  # a single split: write the final output, no reduce pass
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        # part_out: [R, H, num_splits, D] fp32 contiguous; part_lse: [R, H, num_splits].
        prow = (req.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])
        tl.store(part_lse_ptr + prow, lse, mask=g_mask)
        if FUSE_REDUCE:  # the last split of this (request, KV head) to finish merges all of them
            tl.debug_barrier()  # every thread's partial stored before the (release) count
            cnt = counter_ptr + req * tl.num_programs(1) + kvh
            if tl.atomic_add(cnt, 1, sem="acq_rel") == num_splits - 1:
                _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, req, kvh, q_row, num_heads, num_splits,
                              stride_ot, stride_oh, stride_od, GROUP, HEAD_DIM, HAS_SINKS)
                tl.atomic_xchg(cnt, 0)  # ready for the next launch (CUDA graph replays)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, req, kvh, q_row, num_heads, num_splits,
                  stride_ot, stride_oh, stride_od, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HAS_SINKS: tl.constexpr, SC: tl.constexpr = 16):
    """``_decode_reduce_kernel`` for the ``GROUP`` heads of one (request, KV head), from inside the
    split kernel: per head, the splits ``SC`` at a time in index order (deterministic whichever
    program merges), the partials read past L1 (other programs wrote them)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, SC)
    for g in tl.static_range(GROUP):  # unrolled: the heads' loads are in flight together
        head = kvh * GROUP + g
        base = (req.to(tl.int64) * num_heads + head) * num_splits
        m = tl.max(tl.full([SC], float("-inf"), tl.float32), 0)
        for s0 in range(0, num_splits, SC):
            lse = tl.load(part_lse_ptr + base + s0 + offs_c, mask=s0 + offs_c < num_splits, other=float("-inf"),
                          cache_modifier=".cg")
            m = tl.maximum(m, tl.max(lse, 0))
        if HAS_SINKS:  # the head's sink logit (log2 units) joins the denominator once
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        denom = tl.sum(tl.zeros([SC], tl.float32), 0)
        for s0 in range(0, num_splits, SC):
            c_mask = s0 + offs_c < num_splits
            w = tl.exp2(tl.load(part_lse_ptr + base + s0 + offs_c, mask=c_mask, other=float("-inf"),
                                cache_modifier=".cg") - m)  # empty splits (lse = -inf) get weight 0
            o = tl.load(part_out_ptr + (base + s0 + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=c_mask[:, None], other=0.0, cache_modifier=".cg")
            acc += tl.sum(o * w[:, None], 0)
            denom += tl.sum(w, 0)
        if HAS_SINKS:
            denom += tl.exp2(sink - m)
        res = acc / tl.where(denom == 0.0, 1.0, denom)
        tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d * stride_od, res.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, num_splits,
    stride_ot, stride_oh, stride_od, sinks_ptr,
    HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    base = (req.to(tl.int64) * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:  # the head's sink logit (log2 units) joins the denominator once
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits (lse = -inf) get weight 0
    o = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom = denom + tl.exp2(sink - m)
    res = tl.sum(o * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d * stride_od,
             res.to(out_ptr.dtype.element_ty))


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTERS_MIN = 8192


def _split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The fused reduce's zeroed int32 counts, one per (request, KV head), shared by every launch
    on ``device`` (each merging program sets its count back to 0; launches on one stream never
    overlap). Allocated outside graph capture only (a buffer from a graph's pool would be reused);
    None when there is none of ``n`` entries: the caller then launches the reduce kernel."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        old = buf
        buf = torch.zeros(max(_COUNTERS_MIN, n), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
        if old is not None:  # captured graphs may still point at it
            _RETIRED.append(old)
    return buf


_RETIRED: list[torch.Tensor] = []


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_cvt: bool | None = None,
    lane_split: bool | None = None,
    unpack: str | None = None,
    rotate: bool = False,
    kv_format: KVCacheFormat | None = None,
    kv_residual: torch.Tensor | None = None,
    residual_slots: torch.Tensor | None = None,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    page_tile: bool | None = None,
    fuse_reduce: bool | None = None,
    fp8_dot: bool | None = None,
    fp8_keys_rows: bool | None = None,
    fp8_pv: bool | None = None,
    v_bytes: bool | None = None,
) -> torch.Tensor:
    """Attention for the first ``num_decodes`` requests (one query row each).

    Args:
        query: ``[num_tokens, num_heads, D]`` fp32/bf16/fp16; request ``i``'s row is
            ``query_start_loc[i]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, row]`` in ``kv_format`` (plain
            values are cast to the query dtype after loading).
        block_tables: ``[num_reqs, max_blocks]`` int32; seq_lens ``[num_reqs]`` int32
            (including the new token, already stored); query_start_loc ``[num_reqs + 1]``.
        max_seq_len: host int upper bound of ``seq_lens[:num_decodes]`` (picks num_splits).
        out: ``[num_tokens, num_heads, D]`` written at the decode rows (allocated if None).
        num_splits: override the heuristic (``choose_num_splits`` with the config's split rule).
        block_n / num_warps / num_stages / page_tile / fuse_reduce: override the launch config
            (``decode_config``: ``DECODE_CONFIGS``, else ``_config``; benchmarks sweep them).
        fast_cvt / lane_split: override the quantized-code paths (``CODE_PATHS``; benchmarks
            compare them): codes made float16 with integer ops instead of conversion
            instructions; 4-/2-bit codes multiplied one bit lane at a time (when a lane holds
            >= 16 bytes per row: ``tl.dot``'s minimum K).
        unpack: how the bit lanes are built (``CODE_PATHS["unpack"]``: "int32", "asm" or
            "asm_i8qk"; the asm paths on CUDA with 16-bit queries only, else "int32").
        kv_format: the cache's format (``KVCacheFormat``; selects ``KV_FMT``); None: plain
            values of the cache's own float dtype.
        rotate: the cache holds K and V rotated by ``R = H_D / sqrt(D)`` (int4/int2,
            ``kvserve/attention/kv_rotation.py``): the query is rotated in the kernel and the
            output rotated back, so ``query`` and ``out`` are in the model's basis.
        kv_residual: ``[2, num_slots + 1, 2, block_size, num_kv_heads, D]`` (compute dtype,
            contiguous): the exact own blocks (``kvserve/attention/kv_residual.py``); a query at
            ``p`` then reads keys ``[p // block_size * block_size, p]`` from it (``< p``, slot
            ``residual_slots[i]``, int32 ``[num_reqs]``) and from ``new_key`` / ``new_value``
            (``[num_tokens, num_kv_heads, D]``, the cache's basis: rotated when ``rotate``; row
            ``query_start_loc[i]`` for ``p``), the earlier keys from the cache.
        sinks: ``[num_heads]`` learned attention sinks (gpt-oss): one extra logit per head in the
            softmax denominator, no value (one split: the running max / sum start from it; several:
            the reduce kernel adds it).
        partials: ``(part_out [num_decodes, num_heads, S, D], part_lse [num_decodes, num_heads, S])``
            float32 contiguous: stage 1 writes each of its ``S`` splits' normalised output and
            log-sum-exp (base 2; -inf for an empty split) there, ``out`` is not written and
            stage 2 is skipped: the caller merges them with other partial states (cascade
            attention, ``kvserve/attention/triton/cascade.py``; sinks are then its to add).
        fp8_dot: path override (default ``DECODE_PATHS["fp8_dot"]``, which applies where it can):
            Q K^T and P V as FP8 tensor-core dots on the e4m3 codes (the module docstring gives
            the error bound). ValueError if True for a cache that is not ``fp8_e4m3``, with
            ``rotate`` or ``kv_residual``, with head_size < 32 or ``block_n`` < 32 on CUDA.
        fp8_keys_rows: the FP8-dot path's layout override (default the config's
            ``fp8_keys_rows``): the keys as the MMAs' rows (the softmax over GROUP query rows
            padded to 16) instead of the query rows padded to 64.
        fp8_pv: on the FP8-dot path, P V an e4m3 dot too (default the config's ``fp8_pv``);
            False: Q K^T only on the e4m3 codes, V's codes converted to float16 and P V a float16
            dot (only the query's rounding in the error bound). Ignored off the FP8-dot path.
        v_bytes: 8-bit caches on the conversion path (default the config's ``v_bytes``): V's codes
            read from shared memory as bytes straight into the P V operand layout and converted
            there, instead of a float16 copy through shared memory (``kv_load._code_rows``). Same
            values either way.

    Returns ``out``. No host synchronisation (CUDA-graph capturable for fixed host ints).
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_decodes == 0:
        return out
    _, num_heads, d = query.shape
    _, _, block_size, hkv, dk = kv_cache.shape
    assert num_heads % hkv == 0
    kv_cache, kv_fmt = kernel_cache_args(kv_cache, kv_format)  # bytes + format code when quantized
    assert d >= 16 and d & (d - 1) == 0, "head_size must be a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert block_size >= 2 or not kv_fmt, "quantized caches: scales are read as 4-byte words"
    group = num_heads // hkv
    interpret = query.device.type != "cuda"
    fp8_dot = use_fp8_dot(kv_fmt, d, not interpret, fp8_dot, plain=not rotate and kv_residual is None)
    fast_cvt = use_fast_cvt(kv_fmt, fast_cvt) and not fp8_dot
    lane_split = use_lane_split(kv_fmt, d, lane_split)
    unpack_code = use_unpack(kv_fmt, not interpret, query.dtype != torch.float32, unpack) if lane_split else 0
    cfg = decode_config(d, query.dtype, interpret, kv_fmt, lane_split, unpack_code, num_decodes, hkv,
                        _num_sms(query.device), fp8_dot)
    block_n, num_warps, num_stages = block_n or cfg.block_n, num_warps or cfg.num_warps, num_stages or cfg.num_stages
    if fp8_dot and not interpret and block_n < 32:
        raise ValueError(f"fp8_dot: block_n must be >= 32 on CUDA (the P V dot's K), got {block_n}")
    page_tile = cfg.page_tile if page_tile is None else page_tile
    fuse_reduce = cfg.fuse_reduce if fuse_reduce is None else fuse_reduce
    keys_rows = fp8_dot and bool(cfg.fp8_keys_rows if fp8_keys_rows is None else fp8_keys_rows)
    if num_splits is None:  # a window layer reads at most `window` keys per request
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_decodes, hkv, span, _num_sms(query.device), block_n, cfg.waves,
                                       cfg.max_splits)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride() == v_cache.stride()
    if partials is not None:
        part_out, part_lse = partials
        num_splits = part_out.shape[2]
    elif num_splits > 1:
        part_out = torch.empty((num_decodes, num_heads, num_splits, d), dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32,
                               device=query.device)
    else:
        part_out = part_lse = out  # unused
    window = sliding_window if sliding_window is not None else 0
    res_t, res_s = residual_args(kv_residual, residual_slots, new_key, new_value, query)
    counters = None
    if fuse_reduce and num_splits > 1 and partials is None:
        counters = _split_counters(query.device, num_decodes * hkv)
        fuse_reduce = counters is not None
    _decode_split_kernel[(num_decodes, hkv, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, part_out, part_lse,
        scale * _LOG2E, window, num_splits,
        query.stride(0), query.stride(1), query.stride(2),
        *cache_strides(k_cache, d, kv_fmt),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *res_t, *res_s,
        query if sinks is None else sinks, seq_lens if counters is None else counters,
        GROUP=group, HEAD_DIM=d,
        G_PAD=max(64 if fp8_dot and not keys_rows and not interpret else 16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DIRECT=num_splits == 1 and partials is None,
        USE_WINDOW=sliding_window is not None,
        DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN=query.dtype == torch.bfloat16 and query.device.type != "cuda", KV_FMT=kv_fmt,
        FP16_DOT=kv_fmt > 0 and query.dtype != torch.float32, FAST_CVT=fast_cvt, LANE_SPLIT=lane_split,
        ROTATE=rotate, HAS_RESIDUAL=kv_residual is not None,
        EXACT_N=max(16, triton.next_power_of_2(block_size)), UNPACK=unpack_code, HAS_SINKS=sinks is not None,
        PAGE_TILE=bool(page_tile), FUSE_REDUCE=bool(fuse_reduce) and counters is not None,
        FP8_DOT=(2 if interpret else 1) if fp8_dot else 0, FP8_T=keys_rows,
        FP8_PV=not fp8_dot or bool(cfg.fp8_pv if fp8_pv is None else fp8_pv),
        V_BYTES=bool(cfg.v_bytes if v_bytes is None else v_bytes),
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1 and partials is None and counters is None:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            part_out, part_lse, out, query_start_loc, num_splits,
            out.stride(0), out.stride(1), out.stride(2), query if sinks is None else sinks,
            HEAD_DIM=d, S_PAD=max(2, triton.next_power_of_2(num_splits)), HAS_SINKS=sinks is not None,
            num_warps=4 if d >= 128 else 2,
        )
    return out
