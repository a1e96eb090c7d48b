"""Triton kernel that writes the new tokens' K/V rows into the paged KV cache.

PagedAttention (Kwon et al., arXiv:2309.06180) keeps each layer's KV cache in fixed-size
blocks; a token's flat slot is ``block_id * block_size + offset``. This kernel scatters
``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into
``kv_cache[0|1][block_id, offset]`` at the slots of ``slot_mapping``; a negative slot
(padding, e.g. for CUDA-graph batches) is skipped. The values are cast to the cache dtype
on store (fp32/bf16/fp16 -> any cache dtype), or quantized for the quantized formats
(``KV_FMT`` > 0): per (token, head) row, the scale (and minimum) is computed in registers;
the codes go to the row's place in its block's codes region and the scales to the page's
scales region, as ``kvserve/attention/kv_quant.py`` describes (the same arithmetic, so the
cache holds the bytes the torch reference would write).

Grid: ``(num_tokens,)``; each program moves one token's ``[num_kv_heads, head_size]`` tile
for K and for V. With ``query`` (int4/int2 layers whose value rotation is folded into
their weights) it also writes the token's query rotated by the same ``R``, so the decode and
prefill kernels attend with ``q R`` and rotate nothing themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.kv_format import KVCacheFormat
from kvserve.attention.kv_quant import MIN_SCALE, QMAX
from kvserve.attention.triton.kv_load import cache_strides, hadamard_rotate, kernel_cache_args

_QMAX_BY_CODE = {1: QMAX["fp8_e4m3"], 2: QMAX["fp8_e5m2"], 3: QMAX["int8"], 4: 15.0, 5: 3.0}


@triton.jit
def _quant_store(x, cache_ptr, row, scale_row, mask, HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr,
                 QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Quantize rows ``x [BLOCK_H, HEAD_DIM]``; write the codes at byte offsets ``row`` and the
    float16 scale (and minimum) at byte offsets ``scale_row`` (both ``[BLOCK_H]``)."""
    xf = x.to(tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    m2 = mask[:, None] & (offs_d[None, :] >= 0)
    if KV_FMT >= 4:
        BITS: tl.constexpr = 4 if KV_FMT == 4 else 2
        PER: tl.constexpr = 8 // BITS
        mn = tl.min(xf, 1)
        mx = tl.max(xf, 1)
        scale = tl.maximum((mx - mn) / QMAX, MIN_SCALE).to(tl.float16)
        zero = mn.to(tl.float16)
        y = (xf - zero.to(tl.float32)[:, None]) / scale.to(tl.float32)[:, None]
        q = tl.minimum(tl.maximum(tl.floor(y + 0.5), 0.0), QMAX).to(tl.int32)
        q3 = tl.reshape(q, [x.shape[0], HEAD_DIM // PER, PER])
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(q3 << shifts[None, None, :], 2).to(tl.uint8)
        offs_c = tl.arange(0, HEAD_DIM // PER)
        tl.store(cache_ptr + row[:, None] + offs_c[None, :], packed, mask=mask[:, None] & (offs_c[None, :] >= 0))
        sp = (cache_ptr + scale_row).to(tl.pointer_type(tl.float16))
        tl.store(sp, scale, mask=mask)
        tl.store(sp + 1, zero, mask=mask)
    else:
        amax = tl.max(tl.abs(xf), 1)
        scale = tl.maximum(amax / QMAX, MIN_SCALE).to(tl.float16)
        y = xf / scale.to(tl.float32)[:, None]
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if KV_FMT <= 2:
            # Round to the fp8 grid in fp32 first (half away from zero): the conversion is then
            # exact, so the interpreter's fp8 cast (wrong when rounding carries into the
            # exponent) and the GPU's agree.
            MANT: tl.constexpr = 3 if KV_FMT == 1 else 2
            MIN_EXP: tl.constexpr = -6 if KV_FMT == 1 else -14
            e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(y), 1e-30))), MIN_EXP)
            ulp = tl.exp2(e - MANT)
            a = tl.floor(tl.abs(y) / ulp + 0.5) * ulp
            y = tl.minimum(tl.where(y < 0, -a, a), QMAX)
            y = tl.maximum(y, -QMAX)
            if KV_FMT == 1:
                codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                codes = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            codes = tl.floor(y + 0.5).to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(cache_ptr + row[:, None] + offs_d[None, :], codes, mask=m2)
        sp = (cache_ptr + scale_row).to(tl.pointer_type(tl.float16))
        tl.store(sp, scale, mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    res_k_ptr, res_v_ptr, res_map_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_qt, stride_qh, stride_qd,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FMT: tl.constexpr = 0, QMAX: tl.constexpr = 1.0,
    MIN_SCALE: tl.constexpr = 1.0, ROTATE: tl.constexpr = False, DOT_PREC: tl.constexpr = "ieee",
    WIDEN: tl.constexpr = False, ROTATE_V: tl.constexpr = True, NUM_HEADS: tl.constexpr = 0,
    Q_ROWS: tl.constexpr = 16, K_OUT: tl.constexpr = False, V_OUT: tl.constexpr = False,
    RES_OUT: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    if NUM_HEADS > 0:  # q R for the attention kernels, whatever the slot (padding rows too)
        q_dtype: tl.constexpr = tl.float32 if WIDEN else q_ptr.dtype.element_ty
        offs_q = tl.arange(0, Q_ROWS)
        for c in tl.static_range(0, NUM_HEADS, Q_ROWS):  # dots of <= 32 rows (see backend)
            qm = ((c + offs_q)[:, None] < NUM_HEADS) & (offs_d[None, :] >= 0)
            x = tl.load(q_ptr + t * stride_qt + (c + offs_q)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                        mask=qm, other=0.0)
            x = hadamard_rotate(x, HEAD_DIM, DOT_PREC, q_dtype)
            tl.store(q_out_ptr + (t * NUM_HEADS + c + offs_q)[:, None] * HEAD_DIM + offs_d[None, :],
                     x.to(q_out_ptr.dtype.element_ty), mask=qm)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    blk = safe_slot // BLOCK_SIZE
    off = safe_slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & valid
    ld_mask = mask
    if K_OUT or RES_OUT:  # the rows go out whatever the slot (the residual's rows for unstored tokens too)
        ld_mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] >= 0)
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=ld_mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=ld_mask, other=0.0)
    if ROTATE:  # int4/int2: store K R and V R (kv_rotation.py), quantized from float32
        rot_dtype: tl.constexpr = tl.float32 if WIDEN else key_ptr.dtype.element_ty
        k = hadamard_rotate(k, HEAD_DIM, DOT_PREC, rot_dtype)
        if ROTATE_V:  # else v arrives as v R (the rotation is folded into the weights)
            v = hadamard_rotate(v, HEAD_DIM, DOT_PREC, rot_dtype)
    if K_OUT:  # the cache-basis rows in the compute dtype, [T, NUM_KV_HEADS, HEAD_DIM] contiguous
        out_off = (t * NUM_KV_HEADS + offs_h)[:, None] * HEAD_DIM + offs_d[None, :]
        out_mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] >= 0)
        tl.store(k_out_ptr + out_off, k.to(k_out_ptr.dtype.element_ty), mask=out_mask)
        if V_OUT:
            tl.store(v_out_ptr + out_off, v.to(v_out_ptr.dtype.element_ty), mask=out_mask)
    if RES_OUT:  # the exact filling block's row (kv_residual; its own map, the scratch row for the rest)
        res_row = tl.load(res_map_ptr + t).to(tl.int64)
        res_off = (res_row * NUM_KV_HEADS + offs_h)[:, None] * HEAD_DIM + offs_d[None, :]
        res_mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] >= 0)
        tl.store(res_k_ptr + res_off, k.to(res_k_ptr.dtype.element_ty), mask=res_mask)
        tl.store(res_v_ptr + res_off, v.to(res_v_ptr.dtype.element_ty), mask=res_mask)
    if KV_FMT > 0:
        # Page layout (kv_quant): codes [BLOCK_SIZE, NUM_KV_HEADS, C] then scales head-major
        # [NUM_KV_HEADS, BLOCK_SIZE, SB]; stride_co / stride_ch are the code strides.
        SB: tl.constexpr = 4 if KV_FMT >= 4 else 2
        page = blk * stride_cb
        row = page + off * stride_co + offs_h * stride_ch
        scale_row = page + BLOCK_SIZE * stride_co + (offs_h * BLOCK_SIZE + off) * SB
        hmask = (offs_h < NUM_KV_HEADS) & valid
        _quant_store(k, k_cache_ptr, row, scale_row, hmask, HEAD_DIM, KV_FMT, QMAX, MIN_SCALE)
        _quant_store(v, v_cache_ptr, row, scale_row, hmask, HEAD_DIM, KV_FMT, QMAX, MIN_SCALE)
    else:
        dst = blk * stride_cb + off * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    rotate: bool = False, rotate_value: bool = True, query: torch.Tensor | None = None,
    key_out: torch.Tensor | None = None, value_out: torch.Tensor | None = None,
    kv_residual: torch.Tensor | None = None, residual_slot_mapping: torch.Tensor | None = None,
    kv_format: KVCacheFormat | None = None,
) -> torch.Tensor | None:
    """Scatter new K/V rows into the paged cache (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, any float dtype, any strides.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, row]`` (``row``: see
            ``KVFormat.row_elems``; quantized on store into the page layout of
            ``kvserve/attention/kv_quant.py``); the K and V halves
            must share strides (true for any slice of a contiguous tensor).
        slot_mapping: ``[num_tokens]`` int64 (int32 works too) flat slot ids; ``< 0`` = skip.
        rotate: store ``key R`` / ``value R`` (``R = H_D / sqrt(D)``, the int4/int2 rotation of
            ``kvserve/attention/kv_rotation.py``), rotated in the kernel in float32.
        rotate_value: with ``rotate``, whether to rotate ``value`` (False: it is already ``v R``).
        query: with ``rotate``, ``[num_tokens, num_heads, head_size]`` to rotate as well.
        key_out / value_out: contiguous ``[num_tokens, num_kv_heads, head_size]`` (e.g. the
            compute dtype) to receive the rows as the cache holds them before quantization
            (``key R`` / ``value R`` when rotated): the exact residual's new rows
            (``kvserve/attention/kv_residual.py``), written for every token, whatever its slot.
            ``value_out`` needs ``key_out``.
        kv_residual / residual_slot_mapping: also write those rows into the exact filling
            blocks (contiguous ``[2, slots + 1, 2, block_size, num_kv_heads, head_size]``) at
            ``residual_slot_mapping`` (``[num_tokens]`` int64 flat rows), as
            ``kv_residual.store_residual`` does; only where no query of the step reads a row
            this overwrites (``TritonBackend``: decode and verify steps).

        kv_format: the cache's format (``KVCacheFormat``; selects ``KV_FMT``); None: plain
            values of the cache's own float dtype.

    Returns:
        ``query R`` (new contiguous tensor, ``query``'s dtype) when ``query`` is given, else None.
    """
    num_tokens, hkv, d = key.shape
    assert value.shape == key.shape and slot_mapping.shape[0] >= num_tokens
    assert kv_cache.shape[3] == hkv
    assert d >= 16 and d & (d - 1) == 0, "head_size must be a power of two >= 16"
    q_out = None
    if query is not None:
        assert rotate and query.shape[0] == num_tokens and query.shape[2] == d
        q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    q_in = query if query is not None else key  # a placeholder pointer when there is no query
    num_heads = query.shape[1] if query is not None else 0
    assert value_out is None or key_out is not None
    for o in (key_out, value_out):
        assert o is None or (o.shape == key.shape and o.is_contiguous())
    res_out = kv_residual is not None
    if res_out:
        assert kv_residual.is_contiguous() and kv_residual.shape[-2:] == (hkv, d)
        assert residual_slot_mapping.shape[0] >= num_tokens
    kv_cache, kv_fmt = kernel_cache_args(kv_cache, kv_format)
    block_size = kv_cache.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, q_in, q_out if q_out is not None else key,
        key_out if key_out is not None else key, value_out if value_out is not None else key,
        kv_residual[0] if res_out else key, kv_residual[1] if res_out else key,
        residual_slot_mapping if res_out else slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        *cache_strides(k_cache, d, kv_fmt),
        q_in.stride(0), q_in.stride(1), q_in.stride(2),
        NUM_KV_HEADS=hkv, BLOCK_H=max(16 if rotate else 1, triton.next_power_of_2(hkv)), HEAD_DIM=d,
        BLOCK_SIZE=block_size, KV_FMT=kv_fmt, QMAX=_QMAX_BY_CODE.get(kv_fmt, 1.0), MIN_SCALE=MIN_SCALE,
        ROTATE=rotate, DOT_PREC="ieee" if key.dtype == torch.float32 else "tf32",
        WIDEN=key.dtype == torch.bfloat16 and key.device.type != "cuda",
        ROTATE_V=rotate_value, NUM_HEADS=num_heads,
        Q_ROWS=min(32, max(16, triton.next_power_of_2(max(num_heads, 1)))),
        K_OUT=key_out is not None, V_OUT=value_out is not None, RES_OUT=res_out,
        num_warps=4 if hkv * d >= 1024 else 2,
    )
    return q_out
