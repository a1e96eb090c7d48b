"""Exact K/V of a request's own (filling) block, for the decode and prefill kernels.

With a per-request residual (``kvserve/attention/kv_residual.py``), a query at position ``p``
reads keys ``j`` in ``[p // B * B, p]`` in the compute dtype instead of the quantized cache:
from the residual when ``j < ctx`` (``ctx``: the request's cached tokens), else from the
step's new rows (``new_key`` / ``new_value`` row ``query_start + j - ctx``, in the cache's
basis). The residual ``[2, num_slots + 1, 2, B, Hkv, D]`` is contiguous, so slot ``s``'s
row for position ``j`` is ``s * 2B + j % 2B`` (parity and offset in one index).

These tiles are ordinary floats: no scales, no code scale; their scores use the query in
the compute dtype (not the quantized path's normalised float16 copy), so they cost what one
step of unquantized attention costs, on at most the own block's keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.kv_load import online_softmax


@triton.jit
def load_exact_tile(res_ptr, new_ptr, pos, mask, ctx, rslot, new_row0, kvh,
                    stride_rs, stride_rr, stride_rh, stride_nt, stride_nh,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TRANS: tl.constexpr,
                    out_dtype: tl.constexpr):
    """Exact rows of keys ``pos [N]`` of one request and KV head, ``[D, N]`` if ``TRANS`` (the K
    operand) else ``[N, D]``, in ``out_dtype``; keys outside ``mask`` are 0 (never loaded).
    ``rslot``: the request's residual slot (int64); ``new_row0``: its first new row (int64);
    the last dim of the residual and of the new rows is contiguous."""
    offs_d = tl.arange(0, HEAD_DIM)
    in_res = pos < ctx
    r_off = rslot * stride_rs + (pos % (2 * BLOCK_SIZE)).to(tl.int64) * stride_rr + kvh * stride_rh
    n_off = (new_row0 + (pos - ctx)).to(tl.int64) * stride_nt + kvh * stride_nh
    if TRANS:
        a = tl.load(res_ptr + r_off[None, :] + offs_d[:, None], mask=(mask & in_res)[None, :], other=0.0)
        b = tl.load(new_ptr + n_off[None, :] + offs_d[:, None], mask=(mask & (pos >= ctx))[None, :], other=0.0)
        x = tl.where(in_res[None, :], a.to(out_dtype), b.to(out_dtype))
    else:
        a = tl.load(res_ptr + r_off[:, None] + offs_d[None, :], mask=(mask & in_res)[:, None], other=0.0)
        b = tl.load(new_ptr + n_off[:, None] + offs_d[None, :], mask=(mask & (pos >= ctx))[:, None], other=0.0)
        x = tl.where(in_res[:, None], a.to(out_dtype), b.to(out_dtype))
    return x


@triton.jit
def attend_exact(
    q, acc, m_i, l_i, n0, key_lo, key_hi, q_pos, window, ctx, rslot, new_row0, kvh,
    res_k_ptr, res_v_ptr, new_k_ptr, new_v_ptr,
    stride_rs, stride_rr, stride_rh, stride_nkt, stride_nkh, stride_nvt, stride_nvh, qk_scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr, INV_CODE_SCALE: tl.constexpr,
):
    """One online-softmax step over the exact keys ``[n0, n0 + BLOCK_N)`` of query rows
    ``q [M, D]`` (compute dtype, or float32; unscaled) at positions ``q_pos [M]``: key ``j`` counts
    for a row when ``key_lo <= j < key_hi``, ``j // B == q_pos // B``, ``j <= q_pos`` (and inside
    the window). ``qk_scale``: softmax scale * log2(e). The P V product is multiplied by
    ``INV_CODE_SCALE`` (the caller multiplies its accumulator by the code scale at the end)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    kmask = (pos >= key_lo) & (pos < key_hi)
    k = load_exact_tile(res_k_ptr, new_k_ptr, pos, kmask, ctx, rslot, new_row0, kvh, stride_rs, stride_rr,
                        stride_rh, stride_nkt, stride_nkh, BLOCK_SIZE, HEAD_DIM, True, q.dtype)
    qk = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
    valid = (kmask[None, :] & (pos[None, :] // BLOCK_SIZE == q_pos[:, None] // BLOCK_SIZE)
             & (pos[None, :] <= q_pos[:, None]))
    if USE_WINDOW:
        valid = valid & (pos[None, :] > q_pos[:, None] - window)
    qk = tl.where(valid, qk, float("-inf"))
    p, alpha, m_new, l_i = online_softmax(qk, m_i, l_i)
    v = load_exact_tile(res_v_ptr, new_v_ptr, pos, kmask, ctx, rslot, new_row0, kvh, stride_rs, stride_rr,
                        stride_rh, stride_nvt, stride_nvh, BLOCK_SIZE, HEAD_DIM, False, q.dtype)
    pv = tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    if INV_CODE_SCALE != 1.0:
        pv = pv * INV_CODE_SCALE
    return acc * alpha[:, None] + pv, m_new, l_i


def residual_args(kv_residual: torch.Tensor | None, residual_slots: torch.Tensor | None,
                  new_key: torch.Tensor | None, new_value: torch.Tensor | None, fallback: torch.Tensor):
    """The kernels' residual arguments: ``(res_k, res_v, new_k, new_v, slots)`` tensors and
    ``(stride_rs, stride_rr, stride_rh, stride_nkt, stride_nkh, stride_nvt, stride_nvh)``;
    without a residual, ``fallback`` (any tensor) stands for every pointer and the strides are 0."""
    if kv_residual is None:
        return (fallback,) * 5, (0,) * 7
    assert residual_slots is not None and new_key is not None and new_value is not None
    assert kv_residual.dim() == 6 and kv_residual.is_contiguous(), "kv_residual: [2, S + 1, 2, B, Hkv, D] contiguous"
    assert new_key.shape == new_value.shape and new_key.shape[1:] == kv_residual.shape[-2:]
    new_key = new_key if new_key.stride(-1) == 1 else new_key.contiguous()
    new_value = new_value if new_value.stride(-1) == 1 else new_value.contiguous()
    tensors = (kv_residual[0], kv_residual[1], new_key, new_value, residual_slots)
    strides = (kv_residual.stride(1), kv_residual.stride(3), kv_residual.stride(4),
               new_key.stride(0), new_key.stride(1), new_value.stride(0), new_value.stride(1))
    return tensors, strides
