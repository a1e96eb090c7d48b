"""Reference attention over the paged KV cache: gather the blocks, then SDPA.

Runs on any device torch runs on. It is the oracle for the Triton kernels and for the
CPU backend (``kvserve.attention.cpu_backend``, which reuses its store and prefill).
Decodes (query length 1) are batched into one SDPA call with the query heads of a KV
group laid along the query axis, so GQA needs no repeat of K/V; prefill chunks run one
request at a time with a causal mask offset by the cached prefix. A layer's learned attention
sinks (``kv.sinks``, gpt-oss) switch both to an explicit float32 softmax with the sink logit
appended (``sdpa``), as transformers' eager gpt-oss attention computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import KVCacheView
from kvserve.attention.kv_residual import exact_rows, store_residual


def store_kv(key: torch.Tensor, value: torch.Tensor, kv: KVCacheView, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into their slots of
    ``kv.cache``, quantized to its format (``KVCacheFormat.store``).

    ``slot_mapping``: ``[num_tokens]`` int64 flat slot ids; negative ids are skipped (padding).
    """
    kv.format.store(key, value, kv.cache, slot_mapping)


def window_block_tables(block_tables: torch.Tensor, seq_lens: list[int], first_pos: list[int],
                        block_size: int) -> tuple[torch.Tensor, list[int], int]:
    """Per row, the block-table columns from the block holding ``first_pos[i]`` (the first key
    any of its queries sees) up to its last token: blocks below a sliding window are never read.

    Returns ``(tables [R, nb], first block index per row, nb)``; columns past a row's last
    block repeat its table's last column (masked by position).
    """
    lo = [max(p, 0) // block_size for p in first_pos]
    nb = max(-(-n // block_size) - b for n, b in zip(seq_lens, lo))
    nb = max(nb, 1)
    if not any(lo):
        return block_tables[:, :nb], lo, nb
    dev = block_tables.device
    cols = torch.tensor(lo, dtype=torch.int64, device=dev).unsqueeze(1) + torch.arange(nb, device=dev)
    cols.clamp_(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, cols), lo, nb


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
         sinks: torch.Tensor | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a boolean ``mask``, plus learned attention sinks.

    ``sinks`` (broadcastable to the scores ``[..., n, 1]``, one logit per query head) joins each
    row's softmax as an extra logit with no value, as transformers' gpt-oss eager attention
    (scores, softmax and the weighted sum in float32, the result in ``q``'s dtype). With GQA
    (``enable_gqa``) K/V ``[..., Hkv, L, d]`` serve ``H / Hkv`` consecutive query heads each.
    """
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v.float()).to(q.dtype)


def tree_visible(bits: torch.Tensor, tree_start: int, kpos: torch.Tensor) -> torch.Tensor:
    """Bool ``[n, L]``: key positions ``kpos`` ``[1, L]`` each query row may see under its
    ancestor bits ``bits`` int64 ``[n]`` (``AttentionMetadata.tree_mask``): keys below
    ``tree_start`` or past bit 63 always, key ``tree_start + j`` where bit ``j`` is set."""
    rel = kpos - tree_start
    bit = (bits.to(kpos.device).unsqueeze(1) >> rel.clamp(0, 63)) & 1
    return (rel < 0) | (rel > 63) | (bit != 0)


def uses_residual(kv: KVCacheView, meta: AttentionMetadata) -> bool:
    """Whether this layer reads its own block exactly this step (``kv_residual.py``)."""
    return kv.residual is not None and meta.residual is not None


def prefill_attention(
    query: torch.Tensor,
    kv: KVCacheView,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> None:
    """Attend the non-decode requests (``meta.num_decodes`` onward), one at a time.

    Each request's query rows attend causally to its cached prefix and its new tokens;
    K/V must already be stored. Writes those rows of ``out`` (``[num_tokens, num_heads,
    head_size]``, the query's dtype); decode rows are left untouched. When the layer keeps
    its filling block exact (``uses_residual``; the step's new ``key`` / ``value`` rows
    given), each query reads its own block exactly (``kvserve/attention/kv_residual.py``).
    The view's learned attention sinks (``kv.sinks``), if any, join every row's softmax.
    """
    nd = meta.num_decodes
    if meta.num_reqs == nd:
        return
    kv_cache, fmt = kv.cache, kv.format
    kv_residual = kv.residual if uses_residual(kv, meta) else None
    block_size = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    sinks = None if kv.sinks is None else kv.sinks.view(-1, 1, 1)  # [h, 1, 1]
    qsl = meta.query_start_loc.tolist()
    for i in range(nd, meta.num_reqs):
        start, end = qsl[i], qsl[i + 1]
        n = end - start
        seq_len = meta.seq_lens_cpu[i]
        ctx = seq_len - n
        lo = 0
        if sliding_window is not None:  # keys below the first query's window are never read
            lo = max(ctx - sliding_window + 1, 0) // block_size
        nb = -(-seq_len // block_size) - lo
        k, v = fmt.gather(kv_cache, meta.block_tables[i : i + 1, lo:], nb)
        k0 = lo * block_size
        k = fmt.dequantize(k[0, : seq_len - k0], query.dtype).transpose(0, 1)  # [hkv, L, d]
        v = fmt.dequantize(v[0, : seq_len - k0], query.dtype).transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [h, n, d]
        qpos = torch.arange(ctx, seq_len, device=query.device).unsqueeze(1)
        kpos = torch.arange(k0, seq_len, device=query.device).unsqueeze(0)
        mask = kpos <= qpos  # [n, L]
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        if meta.tree_mask is not None:  # tree verification: keys from tree_start on by ancestor bits
            mask &= tree_visible(meta.tree_mask[start:end], int(meta.tree_start[i]), kpos)
        if kv_residual is not None:
            out[start:end] = _attend_with_exact_block(
                q, k, v, qpos, kpos, mask, kv_residual, meta, i, ctx, key[start:end], value[start:end],
                block_size, scale, sliding_window, sinks).transpose(0, 1)
            continue
        o = sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale, sinks, enable_gqa=group > 1)
        out[start:end] = o[0].transpose(0, 1)


def _attend_with_exact_block(q, k, v, qpos, kpos, mask, kv_residual, meta, i, ctx, new_key, new_value,
                             block_size, scale, sliding_window, sinks=None):
    """One request's prefill rows with their own block exact: scores against the dequantized
    keys outside the query's block and against the exact rows inside it, one softmax over
    both (float32; ``sinks [h, 1, 1]`` joins it). q ``[h, n, d]``, k / v ``[hkv, L, d]``;
    returns ``[h, n, d]``."""
    h, hkv = q.shape[0], k.shape[0]
    seq_len = ctx + q.shape[1]
    start = ctx // block_size * block_size
    ke, ve = exact_rows(kv_residual, meta.residual.slots_cpu[i], start, ctx, new_key, new_value)
    own_start = qpos // block_size * block_size  # [n, 1]
    epos = torch.arange(start, seq_len, device=q.device).unsqueeze(0)
    emask = (epos >= own_start) & (epos <= qpos)
    if sliding_window is not None:
        emask &= epos > qpos - sliding_window
    mask = mask & (kpos < own_start)
    g = h // hkv
    qf = q.float()
    kk = torch.cat([k, ke.transpose(0, 1).to(k.dtype)], 1).float().repeat_interleave(g, 0)  # [h, L + Le, d]
    vv = torch.cat([v, ve.transpose(0, 1).to(v.dtype)], 1).float().repeat_interleave(g, 0)
    s = torch.matmul(qf, kk.transpose(1, 2)) * scale
    s = s.masked_fill(~torch.cat([mask, emask], 1), float("-inf"))
    if sinks is not None:
        return torch.matmul(torch.softmax(torch.cat([s, sinks.float().expand(*s.shape[:-1], 1)], -1), -1)[..., :-1],
                            vv).to(q.dtype)
    return torch.matmul(torch.softmax(s, -1), vv).to(q.dtype)


def substitute_exact_block(k: torch.Tensor, v: torch.Tensor, kv_residual: torch.Tensor, slots: list[int],
                           seq_lens: list[int], first_pos: list[int], new_key: torch.Tensor,
                           new_value: torch.Tensor) -> None:
    """Decode rows: overwrite, in gathered and dequantized K / V ``[R, L, Hkv, D]`` (row ``r``'s
    position 0 is ``first_pos[r]``), each row's own block with its exact rows: residual rows,
    then its new row (``new_key[r]``, query length 1). Positions past the sequence stay masked."""
    bs = kv_residual.shape[3]
    r = len(slots)
    dev = k.device
    last = torch.tensor([n - 1 for n in seq_lens], device=dev)
    start = last // bs * bs
    res = kv_residual[:, torch.tensor(slots, device=dev), (last // bs) % 2]  # [2, R, B, Hkv, D]
    res = res.to(k.dtype).clone()
    rows = torch.arange(r, device=dev)
    res[0, rows, last % bs] = new_key[:r].to(k.dtype)
    res[1, rows, last % bs] = new_value[:r].to(v.dtype)
    cols = (start - torch.tensor(first_pos, device=dev)).unsqueeze(1) + torch.arange(bs, device=dev)
    cols = cols.clamp_(max=k.shape[1] - 1)  # only past-the-end slots clamp: masked anyway
    k[rows.unsqueeze(1), cols] = res[0]
    v[rows.unsqueeze(1), cols] = res[1]


class TorchRefBackend(AttentionBackend):
    """Gather the blocks, dequantize, SDPA: the reference every backend is tested against."""

    name = "torch_ref"
    supports_attention_sinks = True

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv: KVCacheView,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``AttentionBackend.attend``; a layer that keeps its filling block exact
        (``uses_residual``) reads its own block from the residual, whose new rows are then written."""
        store_kv(key, value, kv, meta.slot_mapping)
        kv_cache, fmt = kv.cache, kv.format
        kv_residual = kv.residual if uses_residual(kv, meta) else None
        block_size = kv_cache.shape[2]
        hkv = kv_cache.shape[3]
        num_tokens, num_heads, d = query.shape
        group = num_heads // hkv
        out = torch.empty_like(query)
        nd = meta.num_decodes

        if nd > 0:
            lens = meta.seq_lens_cpu[:nd]
            if sliding_window is not None:  # only the blocks of each row's window
                tables, lo, nb = window_block_tables(meta.block_tables[:nd], lens,
                                                     [n - sliding_window for n in lens], block_size)
            else:
                tables, lo, nb = meta.block_tables[:nd], [0] * nd, -(-max(lens) // block_size)
            k, v = fmt.gather(kv_cache, tables, nb)  # [nd, L, hkv, row]
            k = fmt.dequantize(k, query.dtype)  # [nd, L, hkv, d]
            v = fmt.dequantize(v, query.dtype)
            if kv_residual is not None:
                substitute_exact_block(k, v, kv_residual, meta.residual.slots_cpu[:nd], lens,
                                       [b * block_size for b in lo], key, value)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [nd, hkv, L, d]
            q = query[:nd].view(nd, hkv, group, d)  # a KV group's heads as query rows
            pos = torch.arange(nb * block_size, device=query.device).unsqueeze(0)
            if any(lo):
                pos = pos + torch.tensor(lo, device=query.device).unsqueeze(1) * block_size
            seq_lens = meta.seq_lens[:nd].to(query.device).unsqueeze(1)
            mask = pos < seq_lens  # [nd, L]
            if sliding_window is not None:
                mask &= pos > seq_lens - 1 - sliding_window
            sinks = None if kv.sinks is None else kv.sinks.view(1, hkv, group, 1)
            o = sdpa(q, k, v, mask[:, None, None, :], scale, sinks)
            out[:nd] = o.reshape(nd, num_heads, d)

        prefill_attention(query, kv, meta, scale, sliding_window, out, key, value)
        if kv_residual is not None:
            store_residual(key, value, kv_residual, meta.residual.slot_mapping)
        return out
