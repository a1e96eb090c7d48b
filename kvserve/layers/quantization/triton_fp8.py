"""Triton kernels for FP8 W8A8: activation quantization, RMSNorm fused with it, the block-scaled GEMM.

* ``quant_fp8`` — dynamic FP8 e4m3 quantization of activations ``x [M, K]``: one scale per row
  (``group = K``, per token) or per row and ``group`` columns (per token per 128-group, DeepSeek-V3's
  activation scheme, arXiv:2412.19437 §3.3). ``scale = max(amax, 1e-12) / 448``, ``q = x / scale``
  rounded to e4m3 (nearest even): exactly what ``fp8_w8a8.quantize_act_ref`` computes in torch.
* ``rms_norm_quant_fp8`` — ``RMSNorm(x [+ residual])`` then the per-token quantization in one pass over
  the row: the norm's output is rounded to the model dtype where ``RMSNorm`` (and HF) round it, so the
  FP8 codes equal quantizing the unfused norm's output (up to the fp32 summation order of the mean).
* ``silu_mul_quant_fp8`` — ``SiluAndMul`` then the per-token quantization (the input of ``down_proj``).
* ``block_gemm`` — ``y = (x_q * x_s) @ (w_q * w_s)^T`` with per-token-per-128-group activation scales
  ``x_s [M, K/128]`` and per-row-per-128-column weight scales ``w_s [N, K/128]`` (a 128 x 128 block
  checkpoint's ``weight_scale_inv`` expanded along N, so q/k/v shards concatenate at any row count).
  Each 128-wide K step is one ``tl.dot`` of FP8 tiles into a float32 partial, scaled and accumulated:
  the per-block scheme of DeepSeek-V3's inference kernels.

Under ``TRITON_INTERPRET=1`` (CPU tests) the dots run widened to float32 (the interpreter's numpy dot
has no FP8); compiled on CUDA they are FP8 tensor-core dots with float32 accumulation.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvserve.layers.fused import _TL_DTYPES, _round

FP8_MAX = 448.0
BLOCK_K_SCALE = 128  # the K extent of one block scale (weights and activations)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _to_e4m3(v, ROUND: tl.constexpr):
    """float32 in [-448, 448] -> float8e4nv, nearest even. ``ROUND``: round in float32 first (the Triton
    interpreter's own conversion drops the carry into the exponent, 127.4 -> 64)."""
    if ROUND:
        b = v.to(tl.uint32, bitcast=True)
        normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
        sub = (v + 24576.0) - 24576.0  # multiples of 2^-9: e4m3's subnormal spacing
        v = tl.where(tl.abs(v) < 0.015625, sub, normal)
    return v.to(tl.float8e4nv)


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, n_groups,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + cols, _to_e4m3(q, ROUND).to(tl.uint8, bitcast=True), mask=mask)
    tl.store(s_ptr + row * n_groups + g, s)


def quant_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 e4m3 quantization of ``x [M, K]`` (last dim contiguous; bf16/fp16/fp32).

    ``group``: None — one scale per row; else scales per row per ``group`` columns (the last group
    may be partial). Returns ``(q float8_e4m3fn [M, K], scale float32 [M, ceil(K / group)])``.
    """
    m, k = x.shape
    assert x.stride(-1) == 1
    group = group or k
    n_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        _quant_fp8_kernel[(m, n_groups)](x, q.view(torch.uint8), s, k, x.stride(0), k, n_groups, GROUP=group,
                                         BLOCK=block, ROUND=_interpret(), num_warps=max(1, min(16, block // 256)))
    return q, s


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, n_cols, stride_x, stride_r, eps,
                           HAS_RES: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
                           ROUND: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + r * stride_r + cols, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + res.to(tl.float32), DT)  # rounded like torch's add
        tl.store(res_out_ptr + r * n_cols + cols, x.to(DT), mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = _round(xf * tl.rsqrt(var + eps), DT)  # HF casts before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _round(w.to(tl.float32) * y, DT)  # the unfused norm's output, in float32
    s = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(y / s, -448.0), 448.0)
    tl.store(q_ptr + r * n_cols + cols, _to_e4m3(q, ROUND).to(tl.uint8, bitcast=True), mask=mask)
    tl.store(s_ptr + r, s)


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``RMSNorm(x [+ residual])`` quantized per token to FP8 e4m3, in one kernel.

    ``x``, ``residual``: ``[T, D]`` (last dim contiguous), fp32/bf16/fp16; ``weight`` ``[D]``.
    Returns ``(q float8_e4m3fn [T, D], scale float32 [T, 1], x + residual or None)``.
    """
    t, d = x.shape
    assert x.stride(-1) == 1
    q = torch.empty((t, d), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if t:
        block = triton.next_power_of_2(d)
        _rms_norm_quant_kernel[(t,)](
            x, residual if residual is not None else x, weight, q.view(torch.uint8), s,
            res_out if res_out is not None else x, d,
            x.stride(0), residual.stride(0) if residual is not None else 0, eps,
            HAS_RES=residual is not None, BLOCK=block, DT=_TL_DTYPES[x.dtype], ROUND=_interpret(),
            num_warps=max(1, min(16, block // 256)))
    return q, s, res_out


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, n, stride_x, BLOCK: tl.constexpr, DT: tl.constexpr,
                           ROUND: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + r * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(_round(g / (1.0 + tl.exp(-g)), DT) * u, DT)  # the unfused SiluAndMul's output, in float32
    s = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(y / s, -448.0), 448.0)
    tl.store(q_ptr + r * n + cols, _to_e4m3(q, ROUND).to(tl.uint8, bitcast=True), mask=mask)
    tl.store(s_ptr + r, s)


def silu_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(x[:, :I]) * x[:, I:]`` quantized per token to FP8 e4m3, in one kernel.

    ``x`` ``[T, 2I]`` (last dim contiguous), fp32/bf16/fp16. Returns ``(q float8_e4m3fn [T, I], scale
    float32 [T, 1])``; the product is rounded to x's dtype first, as ``SiluAndMul`` rounds it.
    """
    t, two_i = x.shape
    n = two_i // 2
    assert x.stride(-1) == 1
    q = torch.empty((t, n), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        block = triton.next_power_of_2(n)
        _silu_mul_quant_kernel[(t,)](x, q.view(torch.uint8), s, n, x.stride(0), BLOCK=block, DT=_TL_DTYPES[x.dtype],
                                     ROUND=_interpret(), num_warps=max(1, min(16, block // 256)))
    return q, s


@triton.jit
def _block_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, y_ptr, M, N, K, n_kb, stride_am, stride_bn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row blocks share each weight column block while it is in L2
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, n_kb):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0).to(tl.float8e4nv, bitcast=True)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                    other=0).to(tl.float8e4nv, bitcast=True)
        if WIDEN:  # interpreter only
            part = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            part = tl.dot(a, b)
        a_s = tl.load(as_ptr + offs_m * n_kb + kb, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptr + offs_n * n_kb + kb, mask=n_mask, other=0.0)
        acc += part * a_s[:, None] * b_s[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def block_config(m: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for ``m`` rows (static table; K steps are 128)."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def block_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
               config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Block-scaled FP8 GEMM: ``y [M, N] = (xq * xs) @ (wq * ws)^T`` in ``out_dtype``.

    ``xq`` float8_e4m3fn ``[M, K]``; ``xs`` float32 ``[M, ceil(K / 128)]``; ``wq`` float8_e4m3fn
    ``[N, K]`` row-major; ``ws`` float32 ``[N, ceil(K / 128)]``. ``config`` overrides ``block_config``.
    """
    m, k = xq.shape
    n = wq.shape[0]
    n_kb = triton.cdiv(k, BLOCK_K_SCALE)
    assert xs.shape == (m, n_kb) and ws.shape == (n, n_kb) and wq.shape[1] == k
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    bm, bn, warps, stages = config or block_config(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _block_gemm_kernel[grid](xq.view(torch.uint8), xs.contiguous(), wq.view(torch.uint8), ws.contiguous(), y,
                             m, n, k, n_kb, xq.stride(0), wq.stride(0), y.stride(0),
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K_SCALE, GROUP_M=8, WIDEN=_interpret(),
                             num_warps=warps, num_stages=stages)
    return y
