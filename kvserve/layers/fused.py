"""Triton kernels fusing a decoder layer's small elementwise steps (used on CUDA).

At small batch a decode step's GPU time is mostly kernel launches, not bytes: RMSNorm as
torch ops is ~7 kernels, the residual add one more, rotary ~12 for q and k, SiLU-and-mul
3. Each of these runs here as one kernel. They round to the model dtype exactly where the
torch op sequence (and Hugging Face's) rounds, so results match the unfused path up to the
fp32 summation order of the norm's mean and the last bit of ``rsqrt``/``exp``.

Imported lazily by the layers, on CUDA only: on the CPU, outside tests run under
``TRITON_INTERPRET=1``, the torch path is used. ``KVSERVE_FUSED_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("KVSERVE_FUSED_KERNELS", "1") != "0"


@triton.jit
def _round(x, dt: tl.constexpr):
    """Round float32 ``x`` to ``dt`` precision, staying float32: what a torch op in ``dt``
    does to its result. Done on the bits for bfloat16 (round to nearest even) so that the
    compiler cannot fold a cast pair away."""
    if dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_inner, stride_xo, stride_xi, stride_ro, stride_ri, n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
):
    # Row r is (r // n_inner, r % n_inner): a [T, H, D] view with any T and H strides.
    r = tl.program_id(0).to(tl.int64)
    xo = (r // n_inner) * stride_xo + (r % n_inner) * stride_xi
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + xo + cols, mask=mask, other=0.0)
    if HAS_RES:
        ro = (r // n_inner) * stride_ro + (r % n_inner) * stride_ri
        res = tl.load(res_ptr + ro + cols, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + res.to(tl.float32), DT)  # rounded like torch's add
        tl.store(res_out_ptr + r * n_cols + cols, x.to(DT), mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = _round(xf * tl.rsqrt(var + eps), DT)  # HF casts before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + r * n_cols + cols, _round(w.to(tl.float32) * y, DT).to(DT), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim in one kernel, optionally after ``x + residual``.

    Args:
        x: ``[T, D]`` or ``[T, H, D]`` (last dim contiguous; other strides free), fp32/bf16/fp16.
        weight: ``[D]`` in x's dtype. eps: variance epsilon.
        residual: same shape as x, or None.
    Returns the normed ``x`` (contiguous, x's shape and dtype), or ``(normed, x + residual)``.
    """
    d = x.shape[-1]
    assert x.stride(-1) == 1 and x.dim() in (2, 3)
    n_inner = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * n_inner
    sx = (x.stride(0), x.stride(1) if x.dim() == 3 else 0)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        sr = (residual.stride(0), residual.stride(1) if x.dim() == 3 else 0)
    else:
        residual, res_out, sr = x, out, sx  # unused (HAS_RES=False)
    if rows:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows,)](
            x, residual, weight, out, res_out, n_inner, sx[0], sx[1], sr[0], sr[1], d, eps,
            HAS_RES=res_out is not out, BLOCK=block, DT=_TL_DTYPES[x.dtype], num_warps=max(1, min(16, block // 256)),
        )
    return out if res_out is out else (out, res_out)


@triton.jit
def _rope_heads(ptr, stride, nh, t, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr, DT: tl.constexpr):
    d = tl.arange(0, HALF)
    h = tl.arange(0, BLOCK_H)
    offs = t * stride + h[:, None] * (2 * HALF) + d[None, :]
    mask = h[:, None] < nh
    x1 = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded to dt, then the sum (as torch).
    o1 = _round(_round(x1 * c, DT) + _round(-x2 * s, DT), DT)
    o2 = _round(_round(x2 * c, DT) + _round(x1 * s, DT), DT)
    tl.store(ptr + offs, o1.to(DT), mask=mask)
    tl.store(ptr + offs + HALF, o2.to(DT), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_kt, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, DT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    # cos/sin caches are float32 [max_pos, 2*HALF] with equal halves; torch casts them to DT.
    c = _round(tl.load(cos_ptr + pos * 2 * HALF + d), DT)[None, :]
    s = _round(tl.load(sin_ptr + pos * 2 * HALF + d), DT)[None, :]
    _rope_heads(q_ptr, stride_qt, num_q_heads, t, c, s, HALF, BLOCK_H, DT)
    _rope_heads(k_ptr, stride_kt, num_k_heads, t, c, s, HALF, BLOCK_H, DT)


def rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                   sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on q ``[T, Hq*D]`` and k ``[T, Hk*D]`` in place (rows may be strided,
    heads contiguous); positions ``[T]`` int; caches float32 ``[max_pos, D]``. Returns (q, k)."""
    t = q.shape[0]
    half = head_dim // 2
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0 and half & (half - 1) == 0
    hq, hk = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    if t:
        _rope_kernel[(t,)](
            q, k, positions, cos_cache, sin_cache, q.stride(0), k.stride(0), hq, hk,
            HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(max(hq, hk)), DT=_TL_DTYPES[q.dtype], num_warps=4,
        )
    return q, k


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, BLOCK: tl.constexpr, DT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + r * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), DT)  # silu rounded, then the product
    tl.store(out_ptr + r * n + cols, _round(s * u, DT).to(DT), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` (last dim contiguous) -> ``[T, I]``."""
    t, two_i = x.shape
    n = two_i // 2
    assert x.stride(-1) == 1
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, x.stride(0), BLOCK=block,
                                                     DT=_TL_DTYPES[x.dtype], num_warps=4)
    return out
