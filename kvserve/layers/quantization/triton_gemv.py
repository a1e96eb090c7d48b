"""Triton weight-only GEMV / skinny GEMM for decode (small M): quantized weights dequantized in registers.

``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` with bf16/fp16 activations (no activation quantization)
and W read once per M block of 16..64 rows (decode: M = tokens in the step). Formats (``FMT``):

* 0 — FP8 e4m3 ``[N, Kp]`` (passed as uint8 bytes), float32 per-output-channel scale ``[N]``.
* 1 — INT8 ``[N, Kp]`` symmetric, per-output-channel scale ``[N]`` (any float dtype).
* 2 — INT4 group-wise asymmetric (``w = scale * q + min``, ``q`` in [0, 15], group ``g`` along K).
  Packing (``pack_int4``): ``[N, Kq // 2]`` uint8; within each group, byte ``j`` holds ``q[j]`` in its
  low nibble and ``q[j + g/2]`` in its high nibble, so one ``[BLOCK_N, g/2]`` byte tile (16-byte
  vectors when g >= 32) unpacks into two contiguous halves of the *same* group with one scale and
  one minimum per row. Scales and minima are stored transposed, ``[Kq / g, N]``, so each group's
  ``[BLOCK_N]`` vector is one coalesced load; their dtype is float16 when that is exact (GGUF
  Q4_0/Q4_1 scales are float16) else the activation dtype (tinygemm's rounding).

Parallelism: one program per ``BLOCK_N`` output channels x M block x K split. Small N / large K
(o_proj, down_proj at M=1) would leave the 132 SMs with ~1 program each, too few loads in flight
to reach HBM bandwidth, so K is split: each split writes float32 partials ``[S, M, N]`` and a
second tiny kernel sums them, adds the bias and casts. A second launch (deterministic, no
memset of an atomic accumulator, which would also be a launch) is captured by CUDA graphs like
the first. Tiles: M == 1 accumulates elementwise products in a ``[BLOCK_N, BLOCK_K]`` float32
register tile, reduced once at the end; M > 1 pads M to 16/32/64 and uses ``tl.dot``.
Configurations come from a small static table (``gemv_config``): no per-call host work beyond
computing the grid.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FMT_FP8, FMT_INT8, FMT_INT4 = 0, 1, 2
#: largest M the kernel serves; above it QuantizedLinear uses the existing matmul / dequant + cuBLAS
MAX_M = 64
_TARGET_PROGRAMS = 132 * 3  # H100 SMs x programs wanted in flight for bandwidth (K is split below it)


@triton.jit
def _nibble_f32(q):
    """int32 in [0, 2^23) -> float32, exactly: OR into the mantissa of 2^23 and subtract it. Two full-rate
    ops instead of an int-to-float conversion (quarter rate on sm_90, the int4 kernel's bottleneck)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _wgemv_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  n_iters, iters_per_split,
                  FMT: tl.constexpr, GROUP: tl.constexpr, GPI: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  WIDEN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    in_dtype = x_ptr.dtype.element_ty
    dot_dtype = tl.float32 if WIDEN else in_dtype  # WIDEN: interpreter only (its numpy dot has no bf16)
    it0 = pid_k * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, n_iters)
    HALF: tl.constexpr = GROUP // 2
    KT: tl.constexpr = BLOCK_K if FMT != 2 else HALF  # K extent of one register tile
    acc2 = tl.zeros([BLOCK_N, KT], dtype=tl.float32)  # M == 1 path
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # tl.dot path
    for it in range(it0, it1):
        if FMT != 2:
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            raw = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                          mask=n_mask[:, None] & k_mask[None, :], other=0)
            if FMT == 0:
                w = raw.to(tl.float8e4nv, bitcast=True)
            else:  # int8 -> float32 exactly without the quarter-rate conversion (see _nibble_f32)
                w = _nibble_f32(raw.to(tl.int32) + 128) - 128.0
            if BLOCK_M == 1:
                x = tl.load(x_ptr + offs_k, mask=k_mask, other=0).to(tl.float32)
                acc2 += w.to(tl.float32) * x[None, :]
            else:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0).to(dot_dtype)
                acc += tl.dot(x, tl.trans(w.to(dot_dtype)))
        else:
            offs_j = tl.arange(0, HALF)
            for gi in tl.static_range(GPI):
                grp = it * GPI + gi
                k_lo = grp * GROUP + offs_j
                g_ok = k_lo < K  # groups past the logical K (padding, or the last iteration) read as 0
                raw = tl.load(w_ptr + offs_n[:, None] * stride_wn + grp * HALF + offs_j[None, :],
                              mask=n_mask[:, None] & g_ok[None, :], other=0).to(tl.int32)
                sc = tl.load(s_ptr + grp * N + offs_n, mask=n_mask & (grp * GROUP < K), other=0).to(tl.float32)
                mn = tl.load(mn_ptr + grp * N + offs_n, mask=n_mask & (grp * GROUP < K), other=0).to(tl.float32)
                w_lo = _nibble_f32(raw & 15) * sc[:, None] + mn[:, None]
                w_hi = _nibble_f32(raw >> 4) * sc[:, None] + mn[:, None]
                k_hi = k_lo + HALF
                if BLOCK_M == 1:
                    x_lo = tl.load(x_ptr + k_lo, mask=g_ok, other=0).to(tl.float32)
                    x_hi = tl.load(x_ptr + k_hi, mask=k_hi < K, other=0).to(tl.float32)
                    acc2 += w_lo * x_lo[None, :] + w_hi * x_hi[None, :]
                else:
                    xp = x_ptr + offs_m[:, None] * stride_xm
                    x_lo = tl.load(xp + k_lo[None, :], mask=m_mask[:, None] & g_ok[None, :], other=0)
                    x_hi = tl.load(xp + k_hi[None, :], mask=m_mask[:, None] & (k_hi < K)[None, :], other=0)
                    acc += tl.dot(x_lo.to(dot_dtype), tl.trans(w_lo.to(in_dtype).to(dot_dtype)))
                    acc += tl.dot(x_hi.to(dot_dtype), tl.trans(w_hi.to(in_dtype).to(dot_dtype)))
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    if FMT != 2:  # per-channel scale: linear, so applying it before the split-K sum is exact algebra
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        ptrs = y_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]  # float32 partials [S, M, N]
        tl.store(ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, MN, N, S, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_dequant_kernel(w_ptr, s_ptr, mn_ptr, out_ptr, N, K, stride_wn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    grp = tl.program_id(1)
    HALF: tl.constexpr = GROUP // 2
    offs_j = tl.arange(0, HALF)
    n_mask = offs_n < N
    raw = tl.load(w_ptr + offs_n[:, None] * stride_wn + grp * HALF + offs_j[None, :], mask=n_mask[:, None],
                  other=0).to(tl.int32)
    sc = tl.load(s_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
    mn = tl.load(mn_ptr + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
    base = out_ptr + offs_n[:, None] * K + grp * GROUP + offs_j[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(base, (_nibble_f32(raw & 15) * sc + mn).to(dt), mask=n_mask[:, None])
    tl.store(base + HALF, (_nibble_f32(raw >> 4) * sc + mn).to(dt), mask=n_mask[:, None])


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q`` uint8 ``[N, Kq]`` in [0, 15] (``Kq % group_size == 0``) -> packed uint8 ``[N, Kq // 2]`` (module doc)."""
    n, kq = q.shape
    if kq % group_size or group_size % 2:
        raise ValueError(f"int4 pack: K {kq} must be a multiple of the (even) group size {group_size}")
    g = q.reshape(n, kq // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, kq // 2).contiguous()


@functools.lru_cache(maxsize=None)
def gemv_config(fmt: int, m: int, n: int, k: int, group_size: int = 0) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, GPI, split, num_warps)`` for one shape (static table, H100-minded).

    M == 1: elementwise tiles of ~8-16 KiB of weight bytes per iteration; M > 1: ``tl.dot`` with
    BLOCK_M = 16/32/64. ``split`` (K splits) brings the program count near 3 per SM (INT4: 4).
    ``BLOCK_K`` is in K elements per iteration (int4: ``GPI`` groups of ``group_size``).
    """
    block_m = 1 if m == 1 else (16 if m <= 16 else (32 if m <= 32 else 64))
    # H100 sweep (benchmarks/gpu_weight_quant.py --sweep): 8-row tiles of 512-1024 bytes for M = 1, 32 x 128
    # for the tl.dot path; INT4 (more ALU per byte: unpacking, dequantization) wants more programs.
    target = _TARGET_PROGRAMS
    if fmt == FMT_INT4:
        g = group_size
        target = 4 * 132
        if block_m == 1:
            block_n, gpi = 32, max(1, 256 // g)
        else:
            block_n, gpi = (32 if n <= 8192 else 64), max(1, 128 // g)
        block_k = g * gpi
    else:
        if block_m == 1:
            block_n, block_k = 8, (1024 if n <= 4096 else 512)
        else:
            block_n, block_k = 32, 128
    num_warps = 4
    n_iters = triton.cdiv(k, block_k)
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    if programs < target:
        split = max(1, min(triton.cdiv(target, programs), n_iters // 4))
    return block_m, block_n, block_k, (block_k // group_size if fmt == FMT_INT4 else 1), split, num_warps


def wgemv(x: torch.Tensor, fmt: int, w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, n: int,
          group_size: int = 0, bias: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (bf16/fp16/fp32, last dim contiguous) -> ``[M, n]`` in x's dtype.

    ``w``: FP8 as uint8 ``[>=n, Kp]`` / INT8 ``[>=n, Kp]`` (``Kp >= K``, zero padded) with ``scale`` ``[>=n]``;
    INT4 packed by ``pack_int4`` ``[n, Kq // 2]`` with ``scale`` / ``mins`` ``[Kq // group_size, n]``.
    ``bias`` ``[n]`` or None. ``config`` overrides ``gemv_config`` (benchmarks, tests).
    Raises ValueError for M > MAX_M or an unknown format.
    """
    m, k = x.shape
    if m > MAX_M or m < 1:
        raise ValueError(f"wgemv serves 1 <= M <= {MAX_M}, got {m}")
    if fmt not in (FMT_FP8, FMT_INT8, FMT_INT4):
        raise ValueError(f"unknown wgemv format {fmt}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    bm, bn, bk, gpi, split, warps = config or gemv_config(fmt, m, n, k, group_size)
    n_iters = triton.cdiv(k, bk)
    ips = triton.cdiv(n_iters, split)
    split = triton.cdiv(n_iters, ips)  # no empty splits
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    widen = x.device.type != "cuda" and x.dtype != torch.float32
    _wgemv_kernel[grid](x, w, scale, mins if mins is not None else scale, bias if bias is not None else scale,
                        out, m, n, k, x.stride(0), w.stride(0), y.stride(0), n_iters, ips,
                        FMT=fmt, GROUP=group_size if fmt == FMT_INT4 else 2, GPI=gpi, BLOCK_M=bm, BLOCK_N=bn,
                        BLOCK_K=bk, SPLIT=split > 1, HAS_BIAS=bias is not None, WIDEN=widen, num_warps=warps)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](out, bias if bias is not None else out, y, m * n, n,
                                                            split, HAS_BIAS=bias is not None, BLOCK=block)
    return y


def int4_dequantize(w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, n: int, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Packed INT4 (``pack_int4`` layout) -> dense ``[n, Kq]`` in ``dtype`` (the large-M path: then cuBLAS)."""
    kq = w.shape[1] * 2
    out = torch.empty(n, kq, device=w.device, dtype=dtype)
    _int4_dequant_kernel[(triton.cdiv(n, 32), kq // group_size)](w, scale, mins, out, n, kq, w.stride(0),
                                                                 GROUP=group_size, BLOCK_N=32)
    return out
