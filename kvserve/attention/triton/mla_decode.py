"""Triton: MLA decode over paged latent rows, split-K over the context (Flash-Decoding).

The absorbed decode of ``kvserve/attention/mla.py``: every query head ``h`` of a request
attends to the request's latent rows ``row = [c (L values), k_pe (R values)]`` with the query
``[q_lat_h, q_pe_h]`` (an MQA of one KV "head" of width ``L + R``) and averages ``c``. The
memory-bound quantity is the latent read, so one program owns ``BLOCK_H`` heads (the M
dimension of ``tl.dot``; all the heads of a request when ``H <= BLOCK_H``) of one request and
one slice of its context, and reads each row of the slice once for all of them.

Stage 1, ``_mla_decode_split_kernel``, grid ``(head blocks x column blocks, num_splits, B)``
(the programs that read the same rows are launched next to each other, so a row read by
several of them comes from L2): keys ``BLOCK_N`` at a time (each position's page from the block
table), scores ``q_lat . c + q_pe . k_pe`` via two ``tl.dot``, online softmax in float32
(base 2, the scale folded into log2 e), ``acc += p c[:, cols]``; writes the split's normalized
``[BLOCK_H, BLOCK_V]`` and its log-sum-exp. ``BLOCK_V < L`` splits the 512-wide accumulator
over ``L / BLOCK_V`` programs that each compute the full scores (fewer registers per program,
more programs). ``SWAP`` computes the transposed products instead (``K q^T``: the positions are
the M dimension, which lets few heads use the wide MMA shapes). Split ``s`` of a request of
``n`` tokens covers ``[s * chunk, (s + 1) * chunk)``, ``chunk = ceil(n / num_splits)`` rounded
up to ``BLOCK_N``; splits past the end write ``lse = -inf``.

FP8 latent (``mla_fp8_e4m3``): the e4m3 codes are converted to the query's dtype (or to fp16,
``f16``) in registers and the row's scale is applied to the scores and to ``p``
(``sum_n p_n s_n c_n``) rather than to the ``[BLOCK_N, L]`` tile.

Stage 2, ``_mla_decode_reduce_kernel``, grid ``(B, H)``: ``out = sum_s 2^(lse_s - m) o_s /
sum_s 2^(lse_s - m)``, the splits in a fixed order (deterministic).

Tiles: ``MLA_DECODE_CONFIGS`` keyed by (heads, latent dtype), from the H200 sweep of
``benchmarks/gpu_mla.py --parts kernel``. Split count (runtime, not specialized): from the
batch, the programs per split and ``max_seq_len``, so that the SMs hold ``ctas_per_sm`` programs
each in waves as full as possible; under a CUDA graph it is fixed by the captured batch and
``max_seq_len`` (every replay uses the captured launch), and keys past each request's
``seq_len`` are never read.

Algorithm: Flash-Decoding (Dao et al., 2023) with the FlashAttention-2 online softmax
(arXiv:2307.08691) over PagedAttention blocks (arXiv:2309.06180), for MLA's absorbed form
(DeepSeek-V2, arXiv:2405.04434).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_NUM_SMS: dict[int, int] = {}


@dataclass(frozen=True)
class MLADecodeConfig:
    """One tile configuration of the split kernel.

    block_h: heads per program (>= 16, the MMA's minimum); block_n: positions per step;
    block_v: output columns per program (``L`` or a power-of-two divisor of it); num_warps,
    num_stages: Triton's; swap: compute ``K q^T`` (positions as M); ctas_per_sm: the programs
    an SM is expected to hold at once (sizes the split count); f16: FP8 latent only, convert
    the e4m3 codes to fp16 (one instruction per pair) and run the products in fp16, the query
    divided per head by ``max(1, amax / 2^14)`` to stay in fp16's range (its scale goes back
    on the scores).
    """

    block_h: int
    block_n: int
    block_v: int = 512
    num_warps: int = 8
    num_stages: int = 2
    swap: bool = False
    ctas_per_sm: int = 1
    f16: bool = False


# (heads per rank, latent) -> tiles, heads rounded up to 16 / 32 / 64 / 128; latent "bf16" (any
# 16-bit) or "fp8". The best tiles of the last H200 sweep at batch 64 x 8K (figures: that sweep's
# kernel); `benchmarks/gpu_mla.py --parts kernel` (part mla-kernel) records the next `best` per case.
MLA_DECODE_CONFIGS: dict[tuple[int, str], MLADecodeConfig] = {
    # H200, 2026-11-28 (part mla-kernel, docs/benchmarks/mla.md): 16 heads bf16 2,394 GB/s of latent
    # (0.56 of the copy's read + write rate; the previous tiles 1,386), fp8 836 (616); 128 heads
    # 844 / 274 GB/s, compute-bound (204 / 129 TFLOP/s)
    (16, "bf16"): MLADecodeConfig(16, 32, 512, 4, 2, swap=False, ctas_per_sm=2),
    (32, "bf16"): MLADecodeConfig(32, 64, 512, 8, 3),
    (64, "bf16"): MLADecodeConfig(64, 64, 512, 8, 3),
    (128, "bf16"): MLADecodeConfig(64, 64, 512, 8, 2, swap=False, ctas_per_sm=1),
    (16, "fp8"): MLADecodeConfig(16, 32, 512, 4, 3, swap=True, ctas_per_sm=3, f16=True),
    (32, "fp8"): MLADecodeConfig(32, 64, 512, 8, 3),
    (64, "fp8"): MLADecodeConfig(64, 64, 512, 8, 3),
    (128, "fp8"): MLADecodeConfig(64, 64, 512, 8, 3, swap=False, ctas_per_sm=1),
}


def decode_config(num_heads: int, fp8: bool, device: torch.device) -> MLADecodeConfig:
    """The table's tiles for ``num_heads`` heads (rounded up to a power of two, 16..128) and the
    latent dtype; small tiles on the CPU (the interpreter runs tiny test shapes)."""
    if device.type != "cuda":
        return MLADecodeConfig(block_h=16, block_n=16, block_v=512, num_warps=4, num_stages=1)
    key = (min(max(16, triton.next_power_of_2(num_heads)), 128), "fp8" if fp8 else "bf16")
    return MLA_DECODE_CONFIGS[key]


@triton.jit
def _scores(q_lat, q_pe, c, kpe, SWAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """``[BLOCK_H, BLOCK_N]`` (or ``[BLOCK_N, BLOCK_H]`` with SWAP; then q_lat, q_pe are
    given transposed) float32 scores."""
    if SWAP:
        qk = tl.dot(c, q_lat, input_precision=DOT_PREC)
        qk = tl.dot(kpe, q_pe, qk, input_precision=DOT_PREC)
    else:
        qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PREC)
        qk = tl.dot(q_pe, tl.trans(kpe), qk, input_precision=DOT_PREC)
    return qk


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _mla_decode_split_kernel(
    q_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
    num_heads, num_splits, stride_bt, block_size, qk_scale_log2,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, NUM_CB: tl.constexpr, ROW: tl.constexpr, FP8: tl.constexpr,
    SWAP: tl.constexpr, F16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid // NUM_CB
    cb = pid % NUM_CB
    s = tl.program_id(1)
    b = tl.program_id(2)
    row_w = L + R  # the query's row
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_v = cb * BLOCK_V + tl.arange(0, BLOCK_V)
    lmask = offs_l < L
    rmask = offs_r < R
    vmask = offs_v < L
    q_row = q_ptr + (b * num_heads + heads) * row_w
    if SWAP:  # [BLOCK_L, BLOCK_H], [BLOCK_R, BLOCK_H]
        q_lat = tl.load(q_row[None, :] + offs_l[:, None], mask=hmask[None, :] & lmask[:, None], other=0.0)
        q_pe = tl.load(q_row[None, :] + L + offs_r[:, None], mask=hmask[None, :] & rmask[:, None], other=0.0)
        acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    else:  # [BLOCK_H, BLOCK_L], [BLOCK_H, BLOCK_R]
        q_lat = tl.load(q_row[:, None] + offs_l[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
        q_pe = tl.load(q_row[:, None] + L + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
        acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    if F16:  # FP8 rows as fp16 (one conversion instruction): the query divided into fp16's range
        if SWAP:
            qa = tl.maximum(tl.max(tl.abs(q_lat.to(tl.float32)), 0), tl.max(tl.abs(q_pe.to(tl.float32)), 0))
            qs = tl.where(qa > 16384.0, qa / 16384.0, 1.0)  # [BLOCK_H]
            q_lat = (q_lat.to(tl.float32) / qs[None, :]).to(tl.float16)
            q_pe = (q_pe.to(tl.float32) / qs[None, :]).to(tl.float16)
        else:
            qa = tl.maximum(tl.max(tl.abs(q_lat.to(tl.float32)), 1), tl.max(tl.abs(q_pe.to(tl.float32)), 1))
            qs = tl.where(qa > 16384.0, qa / 16384.0, 1.0)
            q_lat = (q_lat.to(tl.float32) / qs[:, None]).to(tl.float16)
            q_pe = (q_pe.to(tl.float32) / qs[:, None]).to(tl.float16)

    seq_len = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = s * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        nmask = pos < hi
        page = tl.load(bt_ptr + b * stride_bt + pos // block_size, mask=nmask, other=0).to(tl.int64)
        row = cache_ptr + (page * block_size + pos % block_size) * ROW
        c = tl.load(row[:, None] + offs_l[None, :], mask=nmask[:, None] & lmask[None, :], other=0)
        kpe = tl.load(row[:, None] + L + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0)
        if BLOCK_V != BLOCK_L:  # this program's columns (the same rows: an L1/L2 hit)
            v = tl.load(row[:, None] + offs_v[None, :], mask=nmask[:, None] & vmask[None, :], other=0)
        if FP8:  # e4m3 codes (exact in 16 bits), then the row's fp16 scale (two bytes, little-endian)
            b0 = tl.load(row + L + R, mask=nmask, other=0).to(tl.int32)
            b1 = tl.load(row + L + R + 1, mask=nmask, other=0).to(tl.int32)
            sc = (b0 | (b1 << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            sc_log2 = sc * qk_scale_log2
            c = c.to(tl.float8e4nv, bitcast=True).to(q_lat.dtype)
            kpe = kpe.to(tl.float8e4nv, bitcast=True).to(q_lat.dtype)
            if BLOCK_V != BLOCK_L:
                v = v.to(tl.float8e4nv, bitcast=True).to(q_lat.dtype)
        else:
            c = c.to(q_lat.dtype)
            kpe = kpe.to(q_lat.dtype)
            if BLOCK_V != BLOCK_L:
                v = v.to(q_lat.dtype)
        if BLOCK_V == BLOCK_L:
            v = c
        qk = _scores(q_lat, q_pe, c, kpe, SWAP, DOT_PREC)
        if SWAP:  # [BLOCK_N, BLOCK_H]
            if FP8:
                qk = qk * sc_log2[:, None]
            else:
                qk = qk * qk_scale_log2
            if F16:
                qk = qk * qs[None, :]
            qk = tl.where(nmask[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            if FP8:
                p = p * sc[:, None]
            acc = tl.dot(tl.trans(v), p.to(v.dtype), acc * alpha[None, :], input_precision=DOT_PREC)
        else:  # [BLOCK_H, BLOCK_N]
            if FP8:
                qk = qk * sc_log2[None, :]
            else:
                qk = qk * qk_scale_log2
            if F16:
                qk = qk * qs[:, None]
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP8:
                p = p * sc[None, :]
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = (b * num_heads + heads) * num_splits + s
    if SWAP:
        o = acc * inv[None, :]
        tl.store(out_ptr + part[None, :] * L + offs_v[:, None], o, mask=hmask[None, :] & vmask[:, None])
    else:
        o = acc * inv[:, None]
        tl.store(out_ptr + part[:, None] * L + offs_v[None, :], o, mask=hmask[:, None] & vmask[None, :])
    if cb == 0:
        tl.store(lse_ptr + part, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, num_heads, num_splits,
                              L: tl.constexpr, BLOCK_L: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_l = tl.arange(0, BLOCK_L)
    lmask = offs_l < L
    base = (b * num_heads + h) * num_splits
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(lse_ptr + base + s + tl.zeros([1], dtype=tl.int32))
        o = tl.load(part_ptr + (base + s) * L + offs_l, mask=lmask, other=0.0)
        m_new = tl.maximum(m, lse)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - safe)
        w = tl.exp2(lse - safe)
        acc = acc * alpha + w * o
        den = den * alpha + w
        m = m_new
    out = acc / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + (b * num_heads + h) * L + offs_l, out.to(out_ptr.dtype.element_ty), mask=lmask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def choose_num_splits(batch: int, programs_per_split: int, max_seq_len: int, device: torch.device,
                      block_n: int = 64, ctas_per_sm: int = 1, min_chunk: int = 256, max_splits: int = 64) -> int:
    """Splits per request: enough programs for about two waves of ``ctas_per_sm`` per SM, the
    count (up to twice that) whose last wave is fullest, and no split shorter than
    ``min_chunk`` positions (rounded to ``block_n``) so the merge stays small against the reads.

    Args: batch: requests; programs_per_split: head blocks x column blocks; max_seq_len: the
    longest request (positions); device: where it runs (its SM count). Returns an int >= 1.
    """
    slots = _num_sms(device) * max(ctas_per_sm, 1)
    per = max(batch * programs_per_split, 1)
    cap = max(1, min(max_splits, -(-max_seq_len // max(min_chunk, block_n))))
    want = max(1, -(-2 * slots // per))
    if want >= cap:
        return cap
    best, best_eff = want, 0.0
    for s in range(want, min(cap, 2 * want) + 1):
        waves = per * s / slots
        eff = waves / -(-per * s // slots)
        if eff > best_eff + 1e-3:
            best, best_eff = s, eff
    return best


def mla_decode(q_full: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               kv_lora_rank: int, scale: float, max_seq_len: int, num_splits: int | None = None,
               block_h: int | None = None, block_n: int | None = None, fp8: bool = False,
               num_warps: int | None = None, config: MLADecodeConfig | None = None) -> torch.Tensor:
    """Absorbed MLA decode over paged latent rows.

    Args:
        q_full: ``[B, H, L + R]`` (absorbed query latent, then the RoPE'd part), float16 /
            bfloat16 / float32.
        cache: ``[1, num_blocks, block_size, 1, row]`` latent rows: ``row = L + R`` values of any
            float dtype (cast to the query's in registers), or with ``fp8`` uint8 rows of e4m3
            codes then an fp16 scale (``MLALatentFormat``).
        block_tables: ``[B, width]`` int32; seq_lens: ``[B]`` int32 (device).
        kv_lora_rank: L; scale: softmax scale; max_seq_len: bound on ``seq_lens`` (picks the
            split count).
        num_splits, block_h, block_n, num_warps, config: overrides of the table's tiles and the
            split count (tests, benchmarks).
    Returns ``o_lat [B, H, L]`` in the query's dtype.
    Raises ValueError: ``config.block_v`` not a power-of-two divisor of the padded ``L``.
    """
    b, h, w = q_full.shape
    lora = kv_lora_rank
    rope = w - lora
    q_full = q_full.contiguous()
    bs = cache.shape[2]
    block_l, block_r = triton.next_power_of_2(lora), max(triton.next_power_of_2(rope), 16)
    cfg = config or decode_config(h, fp8, q_full.device)
    block_h = block_h or cfg.block_h
    block_n = block_n or cfg.block_n
    block_v = min(cfg.block_v, block_l)
    if block_v < 16 or block_l % block_v:
        raise ValueError(f"MLA decode: block_v {cfg.block_v} must be a power of two >= 16 dividing {block_l}")
    hb, ncb = triton.cdiv(h, block_h), block_l // block_v
    if num_splits is None:
        num_splits = choose_num_splits(b, hb * ncb, max_seq_len, q_full.device, block_n, cfg.ctas_per_sm)
    part = torch.empty(b, h, num_splits, lora, dtype=torch.float32, device=q_full.device)
    lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q_full.device)
    out = torch.empty(b, h, lora, dtype=q_full.dtype, device=q_full.device)
    if b == 0:
        return out
    _mla_decode_split_kernel[(hb * ncb, num_splits, b)](
        q_full, cache, block_tables, seq_lens, part, lse, h, num_splits, block_tables.stride(0), bs,
        scale * _LOG2E, L=lora, R=rope, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_V=block_v, NUM_CB=ncb, ROW=cache.shape[-1], FP8=fp8, SWAP=cfg.swap,
        F16=fp8 and cfg.f16,
        DOT_PREC="ieee" if q_full.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg.num_warps, num_stages=cfg.num_stages)
    _mla_decode_reduce_kernel[(b, h)](part, lse, out, h, num_splits, L=lora, BLOCK_L=block_l, num_warps=4)
    return out
