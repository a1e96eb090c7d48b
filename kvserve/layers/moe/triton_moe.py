"""Triton fused mixture-of-experts: tokens sorted and padded by expert, one grouped GEMM per projection.

The block-sparse formulation of MegaBlocks (Gale et al., "MegaBlocks: Efficient Sparse Training
with Mixture-of-Experts", arXiv:2211.15841), written as Triton grouped GEMMs:

1. ``moe_align_block_size``: the ``T * top_k`` (token, slot) pairs, flattened as ``t * top_k + j``,
   are sorted by local expert (stable: by pair index within an expert) and each expert's run is
   padded to a multiple of ``BLOCK_M``; padded rows hold ``T * top_k`` (past the end). Every block
   of ``BLOCK_M`` sorted rows belongs to one expert (``expert_ids``). Pairs routed to experts this
   rank does not hold (expert parallelism) appear in no block.
2. ``w13`` GEMM: one program per (row block, ``BLOCK_N`` intermediate columns) computes the gate and
   the up columns of the same expert side by side and applies the activation in the epilogue
   (``silu(gate) * up`` or gpt-oss's clamped SwiGLU), writing ``[T * top_k, I]`` rows.
3. ``w2`` GEMM: the same blocks times ``w2[e]``, plus the bias, times the routing weight, into a
   ``[T * top_k, H]`` buffer (each pair's row written once: no atomics).
   Alignment: one program for decode-sized inputs (one launch); above ``ALIGN_ONE_PROGRAM_MAX_PAIRS``
   pairs, a parallel count (atomics) / offsets / scatter.
4. combine: ``out[t] = sum_j buf[t * top_k + j]`` over the slots routed to local experts, in slot
   order (deterministic).

CUDA-graph safe: every buffer is sized from ``T`` alone (the sorted rows for the worst case
``T * k + min(E, T * k) * (BLOCK_M - 1)``), the grids are fixed, and programs past the padded
total (read on the device) return at once; nothing syncs with the host.

Routing: ``topk_softmax`` is ``routing.select_experts`` for plain softmax scoring in one launch (decode
runs ~6 torch ops per layer otherwise).

Weights: the activation dtype, or weight-only FP8 e4m3 / INT8 with float32 per-expert
per-output-channel scales (``w13_scale [E, 2I]``, ``w2_scale [E, H]``): each ``[BLOCK_K,
BLOCK_N]`` tile is converted to the activation dtype in the K loop and the (linear) channel scale
is applied once to the accumulator.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

ACT_SILU, ACT_SWIGLUOAI = 0, 1
WFMT_DENSE, WFMT_FP8, WFMT_INT8 = 0, 1, 2
#: pairs (T * top_k) up to which the alignment runs as one Triton program (one launch, stable order);
#: above it three parallel launches (counts with atomics, offsets, scatter) and a memset
ALIGN_ONE_PROGRAM_MAX_PAIRS = int(os.environ.get("KVSERVE_MOE_ALIGN_ONE_PROGRAM_MAX", "256"))
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _widen(device: torch.device, dtype: torch.dtype) -> bool:
    """The interpreter's numpy dot has no bf16/fp16: compute the tiles in float32 there."""
    return device.type != "cuda" and dtype != torch.float32


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case sorted rows: every non-empty expert wastes up to ``block_m - 1`` rows, rounded to blocks."""
    n = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(n, block_m) * block_m


# ----------------------------------------------------------------------------- alignment


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr, numel, expert_start, num_experts,
                  max_padded, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """One program: histogram, padded offsets, block -> expert, padding rows, then the stable scatter."""
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < num_experts
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        local = tl.where(offs < numel, ids - expert_start, -1)
        hit = (local[:, None] == offs_e[None, :]) & e_ok[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    filled = starts + counts  # rows [filled, end) of each expert are padding
    total = tl.sum(padded, axis=0)
    tl.store(post_pad_ptr, total)
    for b0 in range(0, max_blocks, CHUNK):
        offs_b = b0 + tl.arange(0, CHUNK)
        row0 = offs_b * BLOCK_M
        e_of_b = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + offs_b, tl.where(row0 < total, e_of_b, -1), mask=offs_b < max_blocks)
    # Padding rows only (disjoint from the scatter below, so no ordering between the two is needed).
    for p0 in range(0, max_padded, CHUNK):
        offs_p = p0 + tl.arange(0, CHUNK)
        in_pad = (offs_p[:, None] >= filled[None, :]) & (offs_p[:, None] < ends[None, :])
        is_pad = (tl.sum(in_pad.to(tl.int32), axis=1) > 0) | (offs_p >= total)
        tl.store(sorted_ptr + offs_p, tl.zeros([CHUNK], dtype=tl.int32) + numel, mask=is_pad & (offs_p < max_padded))
    running = starts
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
        local = tl.where(offs < numel, ids - expert_start, -1)
        hit = ((local[:, None] == offs_e[None, :]) & e_ok[None, :]).to(tl.int32)
        incl = tl.cumsum(hit, axis=0)
        dest = tl.sum((incl - 1 + running[None, :]) * hit, axis=1)
        tl.store(sorted_ptr + dest, offs, mask=tl.sum(hit, axis=1) > 0)
        running += tl.sum(hit, axis=0)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_ptr, numel, expert_start, num_experts, max_padded,
                        BLOCK: tl.constexpr):
    """Many programs: padding value into every sorted row, and each pair's rank within its expert
    (``atomic_add`` on the expert's count; the order within an expert is then arbitrary, which no
    result depends on: every sorted row is computed independently of its position)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_ptr + offs, tl.zeros([BLOCK], dtype=tl.int32) + numel, mask=offs < max_padded)
    local = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32) - expert_start
    ok = (offs < numel) & (local >= 0) & (local < num_experts)
    rank = tl.atomic_add(counts_ptr + local, tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.store(rank_ptr + offs, rank, mask=ok)


@triton.jit
def _align_offsets_kernel(counts_ptr, starts_ptr, expert_ids_ptr, post_pad_ptr, num_experts, max_blocks,
                          BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """One program: padded offsets of the experts, the padded total and each block's expert."""
    offs_e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(starts_ptr + offs_e, ends - padded, mask=offs_e < num_experts)
    tl.store(post_pad_ptr, total)
    for b0 in range(0, max_blocks, CHUNK):
        offs_b = b0 + tl.arange(0, CHUNK)
        row0 = offs_b * BLOCK_M
        e_of_b = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + offs_b, tl.where(row0 < total, e_of_b, -1), mask=offs_b < max_blocks)


@triton.jit
def _align_scatter_kernel(ids_ptr, starts_ptr, rank_ptr, sorted_ptr, numel, expert_start, num_experts,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32) - expert_start
    ok = (offs < numel) & (local >= 0) & (local < num_experts)
    dest = tl.load(starts_ptr + local, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
    tl.store(sorted_ptr + dest, offs, mask=ok)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int, expert_start: int = 0,
                         one_program: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by local expert and pad each expert's run to ``block_m`` rows.

    Args:
        topk_ids: ``[T, k]`` integer global expert ids.
        block_m: rows per block (the grouped GEMM's BLOCK_M).
        num_experts: experts held locally (``E_local``); local id = global id - ``expert_start``.
        one_program: force the one-program kernel (True: pairs in pair order within an expert) or the
            parallel one (False: any order within an expert); default by size (``ALIGN_ONE_PROGRAM_MAX_PAIRS``).
    Returns:
        ``sorted_ids`` int32 ``[max_padded_rows]``: flat pair indices ``t * k + j`` grouped by expert,
        each expert's run padded to a multiple of ``block_m`` with ``T * k``;
        ``expert_ids`` int32 ``[max_padded_rows / block_m]``: each block's local expert, -1 past the end;
        ``num_tokens_post_pad`` int32 ``[1]``: the padded total (device tensor, never read on the host).
    """
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    max_padded = max_padded_rows(numel, num_experts, block_m)
    max_blocks = max_padded // block_m
    if one_program is None:
        one_program = numel <= ALIGN_ONE_PROGRAM_MAX_PAIRS
    dev = flat.device
    flat = flat.contiguous()
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    chunk = max(16, min(128, 8192 // e_pad))
    if one_program:
        _align_kernel[(1,)](flat, sorted_ids, expert_ids, post_pad, numel, expert_start, num_experts,
                            max_padded, max_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
        return sorted_ids, expert_ids, post_pad
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    rank = torch.empty(numel, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block = 1024
    _align_count_kernel[(triton.cdiv(max(numel, max_padded), block),)](
        flat, counts, rank, sorted_ids, numel, expert_start, num_experts, max_padded, BLOCK=block, num_warps=4)
    _align_offsets_kernel[(1,)](counts, starts, expert_ids, post_pad, num_experts, max_blocks, BLOCK_M=block_m,
                                E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    _align_scatter_kernel[(triton.cdiv(numel, block),)](flat, starts, rank, sorted_ids, numel, expert_start,
                                                        num_experts, BLOCK=block, num_warps=4)
    return sorted_ids, expert_ids, post_pad


# ----------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _load_w(ptrs, mask, WFMT: tl.constexpr, dt: tl.constexpr):
    """A weight tile in the compute dtype ``dt`` (FP8 is stored as uint8 bytes; INT8 as int8)."""
    raw = tl.load(ptrs, mask=mask, other=0)
    if WFMT == 1:
        return raw.to(tl.float8e4nv, bitcast=True).to(dt)
    return raw.to(dt)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr,
                     post_pad_ptr, N, K, numel, a_row_div, num_blocks_m,
                     stride_am, stride_we, stride_wn, stride_se, stride_be, stride_om, alpha, limit,
                     GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, WFMT: tl.constexpr, WIDEN: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """``out[r, n] = act(a[r // a_row_div] @ w[e]^T ...)`` for the sorted rows ``r`` of one block.

    GATED: ``w`` has ``2N`` rows (gate then up); the program computes columns ``n`` and ``N + n`` and
    writes ``act(gate, up)`` (``N`` = I). Otherwise ``w`` has ``N`` rows and MUL_WEIGHT scales each
    row by its routing weight.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)
    row_ok = rows < numel
    a_rows = (rows // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    cdt = tl.float32 if WIDEN else a_ptr.dtype.element_ty
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + e * stride_we
    b_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            b_mask = n_ok[None, :]
        else:
            k_ok = offs_k < K - k0
            a_mask = row_ok[:, None] & k_ok[None, :]
            b_mask = k_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0).to(cdt)
        acc += tl.dot(a, _load_w(b_ptrs, b_mask, WFMT, cdt), input_precision=PRECISION)
        if GATED:
            acc_up += tl.dot(a, _load_w(b_ptrs + N * stride_wn, b_mask, WFMT, cdt), input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if WFMT != 0:
        acc *= tl.load(scale_ptr + e * stride_se + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
        if GATED:
            acc_up *= tl.load(scale_ptr + e * stride_se + N + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
    if GATED:
        if ACT == 0:  # silu(gate) * up
            acc = acc * tl.sigmoid(acc) * acc_up
        else:  # gpt-oss: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate)
            if HAS_LIMIT:
                acc = tl.minimum(acc, limit)
                acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (acc_up + 1.0) * (acc * tl.sigmoid(acc * alpha))
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(buf_ptr, ids_ptr, out_ptr, T, H, expert_start, num_experts, TOPK: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t] = sum_j buf[t * TOPK + j]`` over the slots routed to local experts (float32, slot order)."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = offs_t < T
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        local = tl.load(ids_ptr + offs_t * TOPK + j, mask=t_ok, other=-1).to(tl.int32) - expert_start
        ok = t_ok & (local >= 0) & (local < num_experts)
        acc += tl.load(buf_ptr + (offs_t * TOPK + j)[:, None] * H + offs_h[None, :],
                       mask=ok[:, None] & h_ok[None, :], other=0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * H + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & h_ok[None, :])


# ----------------------------------------------------------------------------- routing


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_t, RENORM: tl.constexpr, TOPK: tl.constexpr,
                         K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr):
    """Softmax over the experts, the top ``TOPK`` (the lower id first among equal scores), renormalized."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    t_ok = offs_t < T
    x = tl.load(logits_ptr + offs_t[:, None] * stride_t + offs_e[None, :],
                mask=t_ok[:, None] & (offs_e < E)[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(t_ok[:, None], x, 0.0)  # rows past T: finite (no NaN), never stored
    x = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = x / tl.sum(x, axis=1)[:, None]
    p = tl.where((offs_e < E)[None, :], p, -1.0)
    w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        m = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == m[:, None], offs_e[None, :], E_PAD), axis=1)
        w = tl.where(offs_k[None, :] == j, m[:, None], w)
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
        p = tl.where(offs_e[None, :] == idx[:, None], -1.0, p)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    mask = t_ok[:, None] & (offs_k < TOPK)[None, :]
    tl.store(w_ptr + offs_t[:, None] * TOPK + offs_k[None, :], w, mask=mask)
    tl.store(ids_ptr + offs_t[:, None] * TOPK + offs_k[None, :], ids, mask=mask)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.select_experts`` for softmax scoring without groups or correction bias, in one launch.

    router_logits ``[T, E]`` (any float dtype; float32 math) -> (weights ``[T, top_k]`` float32, ids ``[T, top_k]``
    int32), weights in descending order. Equal scores: the lower expert id first (``torch.topk`` leaves the
    order of ties unspecified; they do not occur with real router logits).
    """
    t, e = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    w = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    e_pad = triton.next_power_of_2(max(e, 2))
    block_t = max(1, min(16, 4096 // e_pad))
    _topk_softmax_kernel[(triton.cdiv(t, block_t),)](router_logits, w, ids, t, e, router_logits.stride(0),
                                                      RENORM=renormalize, TOPK=top_k,
                                                      K_PAD=triton.next_power_of_2(max(top_k, 2)), BLOCK_T=block_t,
                                                      E_PAD=e_pad, num_warps=4)
    return w, ids


# ----------------------------------------------------------------------------- configuration

#: ``(max tokens, BLOCK_M, (w13 BLOCK_N, BLOCK_K, warps, stages), (w2 BLOCK_N, BLOCK_K, warps, stages), GROUP_M)``.
#: H100/H200-minded, after vLLM's tuned tables for E=128 (which are for an unfused w13 twice as wide: the fused
#: w13 here holds two [BLOCK_M, BLOCK_N] accumulators, so its BLOCK_N is half). Decode (few tokens per
#: expert) is weight-read bound: BLOCK_M = 16 and narrow N tiles for more programs in flight.
MOE_CONFIGS = (
    (32, 16, (32, 128, 4, 4), (64, 128, 4, 4), 1),
    (128, 16, (64, 128, 4, 3), (128, 128, 4, 3), 1),
    (512, 32, (64, 128, 4, 3), (128, 64, 4, 3), 8),
    (2048, 64, (64, 64, 4, 3), (128, 64, 4, 3), 8),
    (1 << 62, 128, (64, 64, 8, 3), (128, 64, 8, 3), 8),
)


def moe_config(num_tokens: int) -> tuple:
    """The table row (``MOE_CONFIGS``) for ``num_tokens`` tokens."""
    for row in MOE_CONFIGS:
        if num_tokens <= row[0]:
            return row
    return MOE_CONFIGS[-1]


def _fit(block: int, dim: int) -> int:
    """Shrink a block to the (power-of-two rounded) dimension, at least 16 (tl.dot's minimum)."""
    return max(16, min(block, triton.next_power_of_2(dim)))


def _wfmt(w: torch.Tensor, scale: Optional[torch.Tensor]) -> int:
    if scale is None:
        return WFMT_DENSE
    if w.dtype in (torch.float8_e4m3fn, torch.uint8):
        return WFMT_FP8
    if w.dtype == torch.int8:
        return WFMT_INT8
    raise ValueError(f"quantized expert weights must be float8_e4m3fn or int8, got {w.dtype}")


def fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, *, activation: str = "silu",
                         w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                         expert_start: int = 0, swiglu_alpha: float = 1.702, swiglu_limit: Optional[float] = 7.0,
                         w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                         config: Optional[tuple] = None) -> torch.Tensor:
    """The fused MoE (``layer.fused_experts_torch``'s contract) as Triton kernels.

    hidden ``[T, H]`` (bf16/fp16/fp32, CUDA or the interpreter); w13 ``[E_local, 2I, H]``; w2
    ``[E_local, H, I]`` in hidden's dtype, or FP8 e4m3 / INT8 with ``w13_scale [E_local, 2I]`` and
    ``w2_scale [E_local, H]`` (float32); biases ``[E_local, 2I]`` / ``[E_local, H]``; topk ``[T, k]``
    (weights float32, global ids). ``config`` overrides the table row (tests, benchmarks).
    Returns ``[T, H]`` in hidden's dtype. Raises ValueError for an unknown activation or weight format.
    """
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"unsupported MoE activation {activation!r}")
    t, h = hidden.shape
    e_local, two_i, _ = w13.shape
    i = two_i // 2
    k = topk_ids.shape[1]
    numel = t * k
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    _, bm, c13, c2, group_m = config or moe_config(t)
    sorted_ids, expert_ids, post_pad = moe_align_block_size(topk_ids, bm, e_local, expert_start)
    num_blocks = expert_ids.numel()
    widen = _widen(hidden.device, hidden.dtype)
    prec = "ieee" if hidden.dtype == torch.float32 else None  # float32 models: no TF32 rounding
    f13, f2 = _wfmt(w13, w13_scale), _wfmt(w2, w2_scale)
    w13k = w13.view(torch.uint8) if f13 == WFMT_FP8 else w13
    w2k = w2.view(torch.uint8) if f2 == WFMT_FP8 else w2
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty(numel, i, dtype=hidden.dtype, device=hidden.device)
    bn, bk, warps, stages = c13
    bn, bk = _fit(bn, i), _fit(bk, h)
    dummy = weights
    _moe_gemm_kernel[(num_blocks * triton.cdiv(i, bn),)](
        hidden, w13k, w13_scale if w13_scale is not None else dummy, w13_bias if w13_bias is not None else dummy,
        inter, dummy, sorted_ids, expert_ids, post_pad, i, h, numel, k, num_blocks,
        hidden.stride(0), w13k.stride(0), w13k.stride(1), w13_scale.stride(0) if w13_scale is not None else 0,
        w13_bias.stride(0) if w13_bias is not None else 0, inter.stride(0),
        float(swiglu_alpha), float(swiglu_limit if swiglu_limit is not None else 0.0),
        GATED=True, ACT=ACT_SILU if activation == "silu" else ACT_SWIGLUOAI, HAS_LIMIT=swiglu_limit is not None,
        MUL_WEIGHT=False, HAS_BIAS=w13_bias is not None, WFMT=f13, WIDEN=widen, EVEN_K=h % bk == 0, PRECISION=prec,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)
    buf = torch.empty(numel, h, dtype=hidden.dtype, device=hidden.device)
    bn, bk, warps, stages = c2
    bn, bk = _fit(bn, h), _fit(bk, i)
    _moe_gemm_kernel[(num_blocks * triton.cdiv(h, bn),)](
        inter, w2k, w2_scale if w2_scale is not None else dummy, w2_bias if w2_bias is not None else dummy,
        buf, weights, sorted_ids, expert_ids, post_pad, h, i, numel, 1, num_blocks,
        inter.stride(0), w2k.stride(0), w2k.stride(1), w2_scale.stride(0) if w2_scale is not None else 0,
        w2_bias.stride(0) if w2_bias is not None else 0, buf.stride(0), 0.0, 0.0,
        GATED=False, ACT=ACT_SILU, HAS_LIMIT=False, MUL_WEIGHT=True, HAS_BIAS=w2_bias is not None, WFMT=f2,
        WIDEN=widen, EVEN_K=i % bk == 0, PRECISION=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
        num_warps=warps, num_stages=stages)
    out = torch.empty_like(hidden)
    block_t, block_h = min(8, triton.next_power_of_2(t)), min(512, triton.next_power_of_2(h))
    _combine_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
        buf, topk_ids.contiguous(), out, t, h, expert_start, e_local, TOPK=k, BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4)
    return out
