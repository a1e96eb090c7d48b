"""Triton kernel that writes the new tokens' K/V rows into the paged KV cache.

PagedAttention (Kwon et al., arXiv:2309.06180) keeps each layer's KV cache in fixed-size
blocks; a token's flat slot is ``block_id * block_size + offset``. This kernel scatters
``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into
``kv_cache[0|1][block_id, offset]`` at the slots of ``slot_mapping``; a negative slot
(padding, e.g. for CUDA-graph batches) is skipped. The values are cast to the cache dtype
on store (fp32/bf16/fp16 -> any cache dtype, the hook for an FP8 KV cache).

Grid: ``(num_tokens,)``; each program moves one token's ``[num_kv_heads, head_size]`` tile
for K and for V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    blk = safe_slot // BLOCK_SIZE
    off = safe_slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & valid
    dst = blk * stride_cb + off * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask, other=0.0)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into the paged cache (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, any float dtype, any strides.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``; the K and V halves
            must share strides (true for any slice of a contiguous tensor).
        slot_mapping: ``[num_tokens]`` int64 (int32 works too) flat slot ids; ``< 0`` = skip.
    """
    num_tokens, hkv, d = key.shape
    assert value.shape == key.shape and slot_mapping.shape[0] >= num_tokens
    assert kv_cache.shape[3] == hkv and kv_cache.shape[4] == d
    assert d >= 16 and d & (d - 1) == 0, "head_size must be a power of two >= 16"
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        NUM_KV_HEADS=hkv, BLOCK_H=triton.next_power_of_2(hkv), HEAD_DIM=d, BLOCK_SIZE=block_size,
        num_warps=4 if hkv * d >= 1024 else 2,
    )
