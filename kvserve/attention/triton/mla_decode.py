"""Triton: MLA decode over paged latent rows, split-K over the context (Flash-Decoding).

The absorbed decode of ``kvserve/attention/mla.py``: every query head ``h`` of a request
attends to the request's latent rows ``row = [c (L values), k_pe (R values)]`` with the query
``[q_lat_h, q_pe_h]`` (an MQA of one KV "head" of width ``L + R``) and averages ``c``. So one
program owns ``BLOCK_H`` heads of one request and one slice of its context, and reads each
row once for all of them -- the memory-bound quantity is the latent read.

Stage 1, ``_mla_decode_split_kernel``, grid ``(cdiv(H, BLOCK_H), B, num_splits)``: keys
``BLOCK_N`` at a time (each position's page from the block table), scores
``q_lat . c + q_pe . k_pe`` via two ``tl.dot`` (heads padded to ``BLOCK_H >= 16``), online
softmax in float32 (base 2, the scale folded into log2 e), ``acc += p c``; writes the split's
normalized ``[BLOCK_H, L]`` and its log-sum-exp. Split ``s`` of a request of ``n`` tokens
covers ``[s * chunk, (s + 1) * chunk)``, ``chunk = ceil(n / num_splits)`` rounded up to
``BLOCK_N``; splits past the end write ``lse = -inf``.

Stage 2, ``_mla_decode_reduce_kernel``, grid ``(B, H)``: ``out = sum_s 2^(lse_s - m) o_s /
sum_s 2^(lse_s - m)``.

Split count: ``num_splits`` (runtime, not specialized) from ``max_seq_len`` and the number of
(head block, request) programs, so ~2 waves fill the SMs; under a CUDA graph it is fixed by
the captured ``max_seq_len`` (every replay uses the captured launch), and keys past each
request's ``seq_len`` are never read.

Algorithm: Flash-Decoding (Dao et al., 2023) with the FlashAttention-2 online softmax
(arXiv:2307.08691) over PagedAttention blocks (arXiv:2309.06180), for MLA's absorbed form
(DeepSeek-V2, arXiv:2405.04434).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_NUM_SMS: dict[int, int] = {}


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _mla_decode_split_kernel(
    q_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
    num_heads, num_splits, stride_bt, block_size, qk_scale_log2,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, ROW: tl.constexpr, FP8: tl.constexpr, DOT_PREC: tl.constexpr,
):
    hb = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    row_w = L + R  # the query's row
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lmask = offs_l < L
    rmask = offs_r < R
    q_row = q_ptr + (b * num_heads + heads) * row_w
    q_lat = tl.load(q_row[:, None] + offs_l[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_pe = tl.load(q_row[:, None] + L + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)

    seq_len = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = s * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        nmask = pos < hi
        page = tl.load(bt_ptr + b * stride_bt + pos // block_size, mask=nmask, other=0).to(tl.int64)
        row = cache_ptr + (page * block_size + pos % block_size) * ROW
        c = tl.load(row[:, None] + offs_l[None, :], mask=nmask[:, None] & lmask[None, :], other=0)
        kpe = tl.load(row[:, None] + L + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0)
        if FP8:  # e4m3 codes, then the row's fp16 scale (two bytes, little-endian)
            b0 = tl.load(row + L + R, mask=nmask, other=0).to(tl.int32)
            b1 = tl.load(row + L + R + 1, mask=nmask, other=0).to(tl.int32)
            sc = (b0 | (b1 << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            c = (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(q_lat.dtype)
            kpe = (kpe.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(q_pe.dtype)
        else:
            c = c.to(q_lat.dtype)
            kpe = kpe.to(q_pe.dtype)
        qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PREC)
        qk = tl.dot(q_pe, tl.trans(kpe), qk, input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N] fp32
        qk = qk * qk_scale_log2
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = (b * num_heads + heads) * num_splits + s
    tl.store(out_ptr + part[:, None] * L + offs_l[None, :], o, mask=hmask[:, None] & lmask[None, :])
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


def choose_num_splits(batch: int, head_blocks: int, max_seq_len: int, device: torch.device,
                      block_n: int = 32) -> int:
    """Splits per request so that about two waves of programs fill the SMs (1 on the CPU
    interpreter path's tiny shapes when ``max_seq_len`` is short)."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _NUM_SMS:
            _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        sms = _NUM_SMS[idx]
    else:
        sms = 4
    want = -(-2 * sms // max(batch * head_blocks, 1))
    return int(max(1, min(want, -(-max_seq_len // (4 * block_n)), 64)))


def mla_decode(q_full: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               kv_lora_rank: int, scale: float, max_seq_len: int, num_splits: int | None = None,
               block_h: int | None = None, block_n: int | None = None, fp8: bool = False,
               num_warps: int | None = None) -> torch.Tensor:
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
        num_splits, block_h, block_n, num_warps: overrides (tests, benchmarks).
    Returns ``o_lat [B, H, L]`` in the query's dtype.
    """
    b, h, w = q_full.shape
    lora = kv_lora_rank
    rope = w - lora
    q_full = q_full.contiguous()
    bs = cache.shape[2]
    block_l, block_r = triton.next_power_of_2(lora), max(triton.next_power_of_2(rope), 16)
    # Defaults from the H200 tile sweep (benchmarks/gpu_mla.py, b64 x 8K): the largest tiles were
    # fastest for 128 heads (64 x 64: 4.5x the 32 x 16 tile) and 16 heads (16 x 64).
    if block_h is None:
        block_h = min(max(16, triton.next_power_of_2(h)), 64)
    if block_n is None:
        block_n = 64 if q_full.is_cuda else 16
    hb = triton.cdiv(h, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(b, hb, max_seq_len, q_full.device, block_n)
    part = torch.empty(b, h, num_splits, lora, dtype=torch.float32, device=q_full.device)
    lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q_full.device)
    out = torch.empty(b, h, lora, dtype=q_full.dtype, device=q_full.device)
    if b == 0:
        return out
    _mla_decode_split_kernel[(hb, b, num_splits)](
        q_full, cache, block_tables, seq_lens, part, lse, h, num_splits, block_tables.stride(0), bs,
        scale * _LOG2E, L=lora, R=rope, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_N=block_n,
        ROW=cache.shape[-1], FP8=fp8, DOT_PREC="ieee" if q_full.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (8 if block_l >= 256 else 4))
    _mla_decode_reduce_kernel[(b, h)](part, lse, out, h, num_splits, L=lora, BLOCK_L=block_l, num_warps=4)
    return out
