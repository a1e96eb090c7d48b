"""Cascade attention for decode steps whose requests share prefix blocks.

Hydragen (Juravsky et al., arXiv:2402.05099) and FlashInfer's cascade attention: when several
running requests start with the same KV blocks (the radix-tree prefix cache makes a shared
prompt literally the same physical blocks), a decode step reads those blocks once for the whole
group instead of once per request, then merges that partial softmax state with each request's
own suffix.

Plan (host, ``plan_cascade``, numpy over the step's block table): decode requests whose first
``min_shared_blocks`` block ids are equal form a group (``np.unique`` over those columns); a
group of >= 2 requests shares its longest common run of full blocks, never the block that holds
a request's newest token (that block stays in the suffix, so an exact filling block,
``kv_residual``, is never shared). The plan lists the groups' members in items of at most
``rows_per_item`` requests, each request's shared length (``prefix_lens``, tokens; 0: none)
and its suffix: the block table shifted left by its shared blocks (``suffix_block_tables``) and
``seq_len - prefix_len`` (``suffix_seq_lens``), so the suffix is an ordinary decode over a
shorter sequence. No groups: no plan, the step takes the plain decode path.

Kernels, for the decode rows of one layer (``cascade_decode_attention``):

1. ``_cascade_prefix_kernel``, grid ``(items, num_kv_heads, P)``: the queries of an item's
   requests for one KV head, ``rows_per_item x (num_heads / num_kv_heads)`` rows (a real matrix,
   so the dots use tensor cores), attend over split ``p`` of the shared keys, read once through
   the first member's block table; each row's normalised output and log-sum-exp (base 2) go to
   ``prefix parts [R, H, P, D]`` / ``[R, H, P]``.
2. The decode kernel (``decode.py``) over the suffix tables with ``partials``: its ``S`` splits'
   states go to ``suffix parts [R, H, S, D]``; every KV format, the in-kernel rotation and
   the exact filling block work there unchanged (the shift is a whole number of blocks).
3. ``_cascade_merge_kernel``, grid ``(R, H)``: ``o = sum_i 2^(l_i - m) o_i / sum_i 2^(l_i - m)``
   over the ``P + S`` states (prefix states only where ``prefix_lens > 0``), plus a learned
   sink logit (gpt-oss) in the denominator.

Every KV format the decode kernel reads works here (same loaders, ``kv_load.py``). Sliding
window layers never use a plan (``TritonBackend`` falls back). Nothing reads device values
back, so a step can be captured in a CUDA graph: ``CascadeMetadataBuilder`` keeps the plan in
static buffers padded to ``max_items`` items (empty items do no work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from kvserve.attention.forward_context import AttentionMetadata, to_device
from kvserve.attention.kv_format import KVCacheFormat
from kvserve.attention.kv_rotation import rotate as rotate_rows
from kvserve.attention.metadata import AttentionMetadataBuilder
from kvserve.attention.triton.decode import _num_sms, choose_num_splits, decode_attention
from kvserve.attention.triton.kv_load import (cache_strides, kernel_cache_args, kv_row_offsets, kv_scale_index,
                                               load_k_tile, load_scales, load_v_tile, online_softmax, prepare_query,
                                               pv_update, scaled_scores, use_fast_cvt)
from kvserve.core.kv_cache_spec import KVCacheGroup

_LOG2E = 1.4426950408889634

#: a group must share at least this many tokens (whole blocks) to be read once for all; below,
#: the extra launches cost more than re-reading the blocks
MIN_SHARED_TOKENS = 256
#: at most this many groups per step (the largest savings; the rest decode per request); it
#: bounds the padded item count of captured CUDA graphs
MAX_GROUPS = 8
#: query rows per prefix-kernel program (requests x query heads per KV head)
ROWS_PER_PROGRAM = 64
#: decode graphs of fewer requests are captured without cascade (a step of the graph's size
#: without groups pays the empty prefix launch and the merge: not worth it for small batches)
GRAPH_MIN_BATCH = 16


@dataclass
class CascadePlan:
    """One step's cascade plan for the decode rows of one KV cache group (device tensors int32).

    Attributes:
        prefix_lens: ``[num_decodes]`` shared tokens of each decode request (0: not in a group).
        suffix_block_tables: ``[num_decodes, width]`` each request's block table shifted left
            by its shared blocks (the freed columns 0).
        suffix_seq_lens: ``[num_decodes]`` ``seq_len - prefix_len``.
        members: ``[>= 1]`` request indices, item by item.
        item_first / item_count: ``[max_items]`` each item's first entry in ``members`` and its
            number of requests (0: padding, no work).
        rows_per_item: requests per item (host).
        max_prefix_len / max_suffix_len: host bounds of ``prefix_lens`` / ``suffix_seq_lens``
            (they pick the split counts).
    """

    prefix_lens: torch.Tensor
    suffix_block_tables: torch.Tensor
    suffix_seq_lens: torch.Tensor
    members: torch.Tensor
    item_first: torch.Tensor
    item_count: torch.Tensor
    rows_per_item: int
    max_prefix_len: int
    max_suffix_len: int

    @property
    def max_items(self) -> int:
        return self.item_first.shape[0]


@dataclass
class CascadeAttentionMetadata(AttentionMetadata):
    """``AttentionMetadata`` with the step's ``CascadePlan`` (None: plain decode)."""

    cascade: Optional[CascadePlan] = field(default=None, repr=False, compare=False)


def rows_per_item(num_heads: int, num_kv_heads: int) -> int:
    """Requests per prefix-kernel program: ``ROWS_PER_PROGRAM`` query rows in all."""
    return max(1, ROWS_PER_PROGRAM // max(1, num_heads // num_kv_heads))


def max_items(num_reqs: int, per_item: int, max_groups: int = MAX_GROUPS) -> int:
    """An upper bound of the items of a plan over ``num_reqs`` decode requests."""
    return min(num_reqs // 2, max_groups) + -(-num_reqs // per_item)


def plan_cascade(block_table: np.ndarray, seq_lens: np.ndarray, num_decodes: int, block_size: int,
                 per_item: int, min_shared_blocks: int | None = None,
                 max_groups: int = MAX_GROUPS) -> dict | None:
    """The host arrays of a ``CascadePlan`` for the first ``num_decodes`` rows, or None when no
    group of >= 2 requests shares ``min_shared_blocks`` full blocks (default from
    ``MIN_SHARED_TOKENS``, at least 1).

    Args:
        block_table: ``[R, width]`` int block ids (a shared prefix: the same ids).
        seq_lens: ``[R]`` tokens after this step (the newest included).
    Returns a dict of int32 numpy arrays (``prefix_lens``, ``suffix_block_tables``,
    ``suffix_seq_lens``, ``members``, ``item_first``, ``item_count``) and host ints
    (``num_groups``, ``max_prefix_len``, ``max_suffix_len``)."""
    if min_shared_blocks is None:
        min_shared_blocks = max(1, MIN_SHARED_TOKENS // block_size)
    nd = num_decodes
    if nd < 2 or min_shared_blocks > block_table.shape[1]:
        return None
    bt = block_table[:nd]
    sl = np.asarray(seq_lens[:nd], dtype=np.int64)
    # full blocks below the newest token's block: the only ones a group may share
    n_full = np.minimum((sl - 1) // block_size, bt.shape[1])
    cand = np.nonzero(n_full >= min_shared_blocks)[0]
    if len(cand) < 2:
        return None
    _, inv, counts = np.unique(bt[cand, :min_shared_blocks], axis=0, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    big = np.nonzero(counts >= 2)[0]
    if not len(big):
        return None
    groups = []
    for g in big[np.argsort(-counts[big], kind="stable")][: 4 * max_groups]:
        mem = cand[inv == g]
        n = int(n_full[mem].min())
        same = (bt[mem, :n] == bt[mem[0], :n]).all(axis=0)
        shared = n if same.all() else int(np.argmin(same))
        groups.append(((len(mem) - 1) * shared, shared, mem))
    groups.sort(key=lambda x: -x[0])
    groups = groups[:max_groups]
    prefix = np.zeros(nd, dtype=np.int64)
    members, first, count = [], [], []
    at = 0
    for _, shared, mem in groups:
        prefix[mem] = shared * block_size
        members.append(mem)
        for i in range(0, len(mem), per_item):
            first.append(at + i)
            count.append(min(per_item, len(mem) - i))
        at += len(mem)
    width = bt.shape[1]
    cols = np.arange(width)[None, :] + (prefix // block_size)[:, None]
    suffix_bt = np.where(cols < width, np.take_along_axis(bt, np.minimum(cols, width - 1), axis=1), 0)
    suffix_sl = sl - prefix
    i32 = np.int32
    return dict(prefix_lens=prefix.astype(i32), suffix_block_tables=suffix_bt.astype(i32),
                suffix_seq_lens=suffix_sl.astype(i32), members=np.concatenate(members).astype(i32),
                item_first=np.asarray(first, dtype=i32), item_count=np.asarray(count, dtype=i32),
                num_groups=len(groups), max_prefix_len=int(prefix.max()), max_suffix_len=int(suffix_sl.max()))


def plan_to_device(host: dict, per_item: int, device: torch.device) -> CascadePlan:
    """A ``CascadePlan`` from ``plan_cascade``'s arrays (eager steps: exactly its items)."""
    return CascadePlan(
        prefix_lens=to_device(host["prefix_lens"], device),
        suffix_block_tables=to_device(host["suffix_block_tables"], device),
        suffix_seq_lens=to_device(host["suffix_seq_lens"], device), members=to_device(host["members"], device),
        item_first=to_device(host["item_first"], device), item_count=to_device(host["item_count"], device),
        rows_per_item=per_item, max_prefix_len=host["max_prefix_len"], max_suffix_len=host["max_suffix_len"])


# ---- kernels -----------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _cascade_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, prefix_lens_ptr,
    members_ptr, item_first_ptr, item_count_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bt,
    GROUP: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr,
    KV_FMT: tl.constexpr = 0, FP16_DOT: tl.constexpr = False, FAST_CVT: tl.constexpr = False,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    count = tl.load(item_count_ptr + item)
    first = tl.load(item_first_ptr + item)
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    r_loc = offs_m // GROUP
    valid = (r_loc < count) & (offs_m < ROWS * GROUP)
    req = tl.load(members_ptr + first + r_loc, mask=valid, other=0)
    lead = tl.load(members_ptr + first)  # every member holds the shared blocks: read them via the first
    plen = tl.where(count > 0, tl.load(prefix_lens_ptr + lead), 0)
    heads = kvh * GROUP + offs_m % GROUP
    q_row = tl.load(query_start_loc_ptr + req, mask=valid, other=0).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=valid[:, None], other=0.0)
    in_dtype: tl.constexpr = tl.float16 if FP16_DOT else q_ptr.dtype.element_ty
    q, q_scale, q_sum = prepare_query(q, qk_scale, KV_FMT, in_dtype)
    op_dtype: tl.constexpr = tl.float32 if WIDEN else in_dtype
    q = q.to(op_dtype)
    CODE_SCALE: tl.constexpr = 256.0 if (KV_FMT == 1 and FAST_CVT) else 1.0
    q_scale = q_scale * CODE_SCALE

    split_len = tl.cdiv(tl.cdiv(plen, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, plen)
    bt_row = block_tables_ptr + lead.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_ch
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        row_off = kv_row_offsets(bt_row, pos, n_mask, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, True)
        k = load_k_tile(k_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM, True, WIDEN, in_dtype, KV_FMT, FAST_CVT)
        if KV_FMT > 0:
            sc_idx = kv_scale_index(bt_row, n0, end, kv_head_off, stride_cb, stride_co, BLOCK_SIZE, BLOCK_N,
                                    HEAD_DIM, KV_FMT, True)
            ks, kz = load_scales(k_cache_ptr, sc_idx, n_mask, KV_FMT, BLOCK_N)
            vs, vz = load_scales(v_cache_ptr, sc_idx, n_mask, KV_FMT, BLOCK_N)
        else:
            ks, kz, vs, vz = qk_scale, qk_scale, qk_scale, qk_scale
        qk = scaled_scores(q, k, q_scale, q_sum, ks, kz, DOT_PREC, KV_FMT)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        p, alpha, m_new, l_i = online_softmax(qk, m_i, l_i)
        v = load_v_tile(v_cache_ptr, row_off, n_mask, stride_cd, HEAD_DIM, True, WIDEN, in_dtype, KV_FMT, FAST_CVT)
        acc = pv_update(acc * alpha[:, None], p, v, vs, vz, DOT_PREC, KV_FMT, in_dtype)
        m_i = m_new
    empty = l_i == 0.0
    o = acc * (CODE_SCALE / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    prow = (req.to(tl.int64) * num_heads + heads) * num_splits + split
    tl.store(part_out_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=valid[:, None])
    tl.store(part_lse_ptr + prow, lse, mask=valid)


@triton.jit(do_not_specialize=["num_prefix", "num_suffix"])
def _cascade_merge_kernel(
    pre_out_ptr, pre_lse_ptr, suf_out_ptr, suf_lse_ptr, prefix_lens_ptr, out_ptr, query_start_loc_ptr,
    num_prefix, num_suffix, stride_ot, stride_oh, stride_od, sinks_ptr,
    HEAD_DIM: tl.constexpr, P_PAD: tl.constexpr, S_PAD: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    shared = tl.load(prefix_lens_ptr + req) > 0
    offs_p = tl.arange(0, P_PAD)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    row = req.to(tl.int64) * num_heads + head
    p_mask = (offs_p < num_prefix) & shared
    s_mask = offs_s < num_suffix
    lse_p = tl.load(pre_lse_ptr + row * num_prefix + offs_p, mask=p_mask, other=float("-inf"))
    lse_s = tl.load(suf_lse_ptr + row * num_suffix + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.maximum(tl.max(lse_p, 0), tl.max(lse_s, 0))
    if HAS_SINKS:  # the head's sink logit (log2 units) joins the denominator once
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_p = tl.exp2(lse_p - m)
    w_s = tl.exp2(lse_s - m)
    o_p = tl.load(pre_out_ptr + (row * num_prefix + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=p_mask[:, None], other=0.0)
    o_s = tl.load(suf_out_ptr + (row * num_suffix + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    denom = tl.sum(w_p, 0) + tl.sum(w_s, 0)
    if HAS_SINKS:
        denom = denom + tl.exp2(sink - m)
    res = (tl.sum(o_p * w_p[:, None], 0) + tl.sum(o_s * w_s[:, None], 0)) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d * stride_od, res.to(out_ptr.dtype.element_ty))


def _prefix_config(dtype: torch.dtype, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the prefix kernel."""
    if interpret:
        return 16, 1, 1
    if dtype == torch.float32:
        return 32, 4, 2
    return 64, 4, 2


def cascade_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: CascadePlan,
    query_start_loc: torch.Tensor,
    num_decodes: int,
    scale: float,
    out: torch.Tensor,
    kv_format: KVCacheFormat | None = None,
    rotate: bool = False,
    kv_rotation: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    prefix_splits: int | None = None,
    suffix_splits: int | None = None,
    **residual,
) -> torch.Tensor:
    """Decode attention for the first ``num_decodes`` requests through ``plan``.

    Args:
        query: ``[num_tokens, num_heads, D]`` fp32/bf16/fp16 (request ``i``'s row at
            ``query_start_loc[i]``); kv_cache ``[2, num_blocks, block_size, num_kv_heads, row]``
            in ``kv_format``; block_tables ``[num_reqs, width]`` int32 (the step's; the prefix
            kernel reads the shared blocks through them); out ``[num_tokens, num_heads, D]``,
            written at the decode rows.
        plan: the step's ``CascadePlan``; scale: the softmax scale.
        rotate / kv_rotation: the cache holds ``K R``, ``V R`` and the kernels rotate (as
            ``decode_attention``): the prefix kernel gets ``q R`` and its states are rotated
            back (``R`` symmetric, ``[D, D]``).
        sinks: ``[num_heads]`` learned attention sinks, added in the merge.
        prefix_splits / suffix_splits: override the split counts (tests).
        residual: the exact filling block's arguments of ``decode_attention`` (the suffix
            holds every request's own block).
    Returns ``out``. No host synchronisation.
    """
    nd = num_decodes
    _, num_heads, d = query.shape
    hkv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // hkv
    dev = query.device
    interpret = dev.type != "cuda"
    sms = _num_sms(dev)
    block_n, warps, stages = _prefix_config(query.dtype, interpret)
    n_items = plan.max_items
    p = prefix_splits or choose_num_splits(n_items, hkv, max(1, plan.max_prefix_len), sms, block_n)
    pre_out = torch.empty((nd, num_heads, p, d), dtype=torch.float32, device=dev)
    pre_lse = torch.empty((nd, num_heads, p), dtype=torch.float32, device=dev)
    cache_b, kv_fmt = kernel_cache_args(kv_cache, kv_format)
    k_cache, v_cache = cache_b[0], cache_b[1]
    q_pre = rotate_rows(query, kv_rotation) if rotate else query
    rows = plan.rows_per_item
    _cascade_prefix_kernel[(n_items, hkv, p)](
        q_pre, k_cache, v_cache, block_tables, query_start_loc,
        plan.prefix_lens, plan.members, plan.item_first, plan.item_count, pre_out, pre_lse,
        scale * _LOG2E, p,
        q_pre.stride(0), q_pre.stride(1), q_pre.stride(2),
        *cache_strides(k_cache, d, kv_fmt),
        block_tables.stride(0),
        GROUP=group, ROWS=rows, M=max(16, triton.next_power_of_2(rows * group)), HEAD_DIM=d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN=query.dtype == torch.bfloat16 and interpret, KV_FMT=kv_fmt,
        FP16_DOT=kv_fmt > 0 and query.dtype != torch.float32, FAST_CVT=use_fast_cvt(kv_fmt),
        num_warps=warps, num_stages=stages,
    )
    if rotate:  # linear: each normalised state may be rotated back before the merge
        pre_out = rotate_rows(pre_out, kv_rotation.T)
    s = suffix_splits or choose_num_splits(nd, hkv, max(1, plan.max_suffix_len), sms)
    suf_out = torch.empty((nd, num_heads, s, d), dtype=torch.float32, device=dev)
    suf_lse = torch.empty((nd, num_heads, s), dtype=torch.float32, device=dev)
    decode_attention(query, kv_cache, plan.suffix_block_tables, plan.suffix_seq_lens, query_start_loc, nd,
                     max(1, plan.max_suffix_len), scale, out=out, rotate=rotate, kv_format=kv_format,
                     partials=(suf_out, suf_lse), **residual)
    _cascade_merge_kernel[(nd, num_heads)](
        pre_out, pre_lse, suf_out, suf_lse, plan.prefix_lens, out, query_start_loc, p, s,
        out.stride(0), out.stride(1), out.stride(2), query if sinks is None else sinks,
        HEAD_DIM=d, P_PAD=max(2, triton.next_power_of_2(p)), S_PAD=max(2, triton.next_power_of_2(s)),
        HAS_SINKS=sinks is not None, num_warps=4 if d >= 128 else 2,
    )
    return out


# ---- the metadata builder ------------------------------------------------------------------
class CascadeMetadataBuilder(AttentionMetadataBuilder):
    """The Triton backend's builder: the base metadata plus, per eligible KV cache group, the
    step's ``CascadePlan`` (``plan_cascade`` over the group's block table; None: plain decode).

    A group is eligible when the backend has cascade attention on (``TritonBackend``'s
    ``enable_cascade_attention``) and it is a full-attention group (not bounded, not a sliding
    window, not MLA). CUDA graphs: decode graphs (``q = 1``) of at least ``GRAPH_MIN_BATCH``
    requests are captured with a plan in static buffers padded to ``max_items(batch)`` items and
    replayed with each step's plan (a step without groups replays it with no items: every
    request decodes its whole sequence as a suffix, an empty launch and a merge launch more per
    layer than the plain graph); smaller decode graphs never use cascade.
    """

    metadata_cls = CascadeAttentionMetadata

    def __init__(self, layers: list, groups: list[KVCacheGroup], input_batch, model, device: torch.device,
                 dtype: torch.dtype, max_num_seqs: int) -> None:
        super().__init__(layers, groups, input_batch, model, device, dtype, max_num_seqs)
        backend = layers[0].impl if layers else None
        enabled = backend is not None and getattr(backend, "cascade_enabled", lambda _d: False)(device)
        #: group id -> requests per prefix-kernel item, for the groups that plan
        self.cascade_per_item: dict[int, int] = {}
        if enabled:
            for gi, g in enumerate(groups):
                spec = g.spec
                if (self.bounded_specs[gi] is not None or getattr(spec, "sliding_window", None)
                        or spec.format.latent):
                    continue
                ls = [layer for layer in layers if layer.kv_cache_group_id == gi]
                if ls:
                    self.cascade_per_item[gi] = min(rows_per_item(layer.num_heads, layer.num_kv_heads) for layer in ls)

    def build(self, inp, pad_to: int | None = None) -> list[AttentionMetadata]:
        metas = super().build(inp, pad_to)
        for gi, per_item in self.cascade_per_item.items():
            host = plan_cascade(inp.block_tables[gi], inp.seq_lens, inp.num_decodes, self.block_size, per_item)
            if host is not None:
                metas[gi].cascade = plan_to_device(host, per_item, self.device)
        return metas

    def prepare_for_capture(self, max_num_seqs: int, query_lens: list[int], max_blocks_per_group: list[int],
                            max_model_len: int) -> None:
        """The base buffers, and per planning group the plan's: ``prefix_lens``,
        ``suffix_seq_lens``, ``members [N]``, ``suffix_block_tables [N, width]`` and the items
        ``[max_items(N)]``."""
        super().prepare_for_capture(max_num_seqs, query_lens, max_blocks_per_group, max_model_len)
        n, dev = max_num_seqs, self.device
        self._cascade_static = {}
        for gi, per_item in self.cascade_per_item.items():
            i32 = dict(dtype=torch.int32, device=dev)
            m = max_items(n, per_item)
            self._cascade_static[gi] = dict(
                prefix_lens=torch.zeros(n, **i32), suffix_seq_lens=torch.ones(n, **i32),
                suffix_block_tables=torch.zeros((n, max_blocks_per_group[gi]), **i32),
                members=torch.zeros(n, **i32), item_first=torch.zeros(m, **i32), item_count=torch.zeros(m, **i32))

    def capture_metadata(self, bs: int, q: int, seq_lens_cpu: list[int] | None = None) -> list[AttentionMetadata]:
        metas = super().capture_metadata(bs, q, seq_lens_cpu)
        if q != 1 or bs < GRAPH_MIN_BATCH:
            return metas
        length = self._static["max_model_len"]
        for gi, per_item in self.cascade_per_item.items():
            st = self._cascade_static[gi]
            m = max_items(bs, per_item)
            metas[gi].cascade = CascadePlan(
                prefix_lens=st["prefix_lens"][:bs], suffix_block_tables=st["suffix_block_tables"][:bs],
                suffix_seq_lens=st["suffix_seq_lens"][:bs], members=st["members"][:bs],
                item_first=st["item_first"][:m], item_count=st["item_count"][:m], rows_per_item=per_item,
                max_prefix_len=length, max_suffix_len=length)
        return metas

    def prepare_for_replay(self, inp, bs: int, q: int, dst: np.ndarray) -> list[tuple[torch.Tensor, np.ndarray]]:
        pairs = super().prepare_for_replay(inp, bs, q, dst)
        if q != 1 or bs < GRAPH_MIN_BATCH:
            return pairs
        r = len(inp.query_lens)
        for gi, per_item in self.cascade_per_item.items():
            st = self._cascade_static[gi]
            bt = inp.block_tables[gi]
            w = bt.shape[1]
            m = max_items(bs, per_item)
            host = plan_cascade(bt, inp.seq_lens, r, self.block_size, per_item)
            prefix = np.zeros(bs, dtype=np.int64)
            seq = np.full(bs, q, dtype=np.int64)  # padding rows: as the base metadata's
            table = np.zeros((bs, w), dtype=np.int64)
            first = np.zeros(m, dtype=np.int64)
            count = np.zeros(m, dtype=np.int64)
            if host is None:
                seq[:r] = inp.seq_lens
                table[:r] = bt
                members = np.zeros(1, dtype=np.int64)
            else:
                prefix[:r] = host["prefix_lens"]
                seq[:r] = host["suffix_seq_lens"]
                table[:r] = host["suffix_block_tables"]
                k = len(host["item_first"])
                first[:k], count[:k] = host["item_first"], host["item_count"]
                members = host["members"].astype(np.int64)
            pairs += [(st["prefix_lens"][:bs], prefix), (st["suffix_seq_lens"][:bs], seq),
                      (st["suffix_block_tables"][:bs, :w], table), (st["members"][:len(members)], members),
                      (st["item_first"][:m], first), (st["item_count"][:m], count)]
        return pairs
