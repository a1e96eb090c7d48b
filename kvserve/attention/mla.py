"""Multi-head latent attention (MLA) over a paged latent cache: store, prefill, absorbed decode.

MLA (DeepSeek-V2, arXiv:2405.04434) caches per token one row ``[kv_lora_rank + qk_rope_head_dim]``:
the normalized KV latent ``c`` and the RoPE'd shared key ``k_pe`` (``MLALatentFormat``). Per
head ``h`` the keys and values are ``k_h = [W_UK_h c, k_pe]`` and ``v_h = W_UV_h c``, where
``kv_b_proj.weight`` viewed ``[H, qk_nope + v_head, L]`` holds ``W_UK`` (rows ``:qk_nope``) and
``W_UV`` (the rest).

- Prefill / extend (query length > 1; chunked prefill and prefix hits read the cached rows):
  each request's rows, cached and new, are gathered from their blocks and expanded through
  ``kv_b_proj`` into per-head ``k_nope`` and ``v``; ordinary causal attention follows.
- Decode (query length 1): the weights are absorbed (the paper's section 2.1.4): the query
  becomes ``q_lat_h = W_UK_h^T q_nope_h`` so that ``q_h . k_h = [q_lat_h, q_pe_h] . row``, an
  MQA over the rows themselves (one KV "head" of width ``L + R``, values the first ``L``
  columns), and the output ``o_lat_h`` (``[L]``) leaves through ``W_UV_h``. Per token only the
  row is read, never the expanded heads. On CUDA the attention over the rows is the Triton
  kernel of ``kvserve/attention/triton/mla_decode.py`` (split-K over the context); elsewhere
  the torch path here.
- Verify steps (speculative decoding: every request ``q = 1 + k`` tokens, ``q <= 16``): on
  CUDA each query row runs as its own absorbed decode over its causal prefix (block table
  row repeated, seq len ``seq_len - q + 1 + j``), device work only, so the target's verify
  graphs and the MTP layer's draft graphs can capture it (the expanded path reads host lengths).

``MLAAttentionImpl.forward`` is what ``kvserve.layers.mla.MLAAttention`` calls with its view
and its group's metadata.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import KVCacheView, MLALatentFormat


def absorbed_weights(kv_b_weight: torch.Tensor, num_heads: int, qk_nope: int,
                     v_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [H * (qk_nope + v_head), L]`` -> ``(W_UK [H, qk_nope, L], W_UV [H, v_head, L])`` (views).

    Raises ValueError when the weight's shape does not split into ``num_heads`` heads."""
    rows, lora = kv_b_weight.shape
    if rows != num_heads * (qk_nope + v_head):
        raise ValueError(f"kv_b_proj.weight has {rows} rows, expected num_heads {num_heads} x "
                         f"(qk_nope_head_dim {qk_nope} + v_head_dim {v_head})")
    w = kv_b_weight.view(num_heads, qk_nope + v_head, lora)
    return w[:, :qk_nope], w[:, qk_nope:]


def mla_decode_torch(q_full: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: list[int], kv_lora_rank: int, scale: float,
                     fmt: Optional[MLALatentFormat] = None) -> torch.Tensor:
    """Reference absorbed decode over paged latent rows.

    Args:
        q_full: ``[B, H, L + R]`` (absorbed query latent, then the RoPE'd query part).
        cache: ``[1, num_blocks, block_size, 1, row]`` latent rows (``fmt``'s storage rows;
            None: plain values, ``row = L + R``).
        block_tables: ``[>= B, width]`` int32 block ids per request.
        seq_lens: tokens per request (its new row already stored).
        kv_lora_rank: L; scale: softmax scale.
    Returns ``o_lat [B, H, L]`` float32.
    """
    b = q_full.shape[0]
    bs = cache.shape[2]
    nblk = -(-max(seq_lens) // bs)
    rows = cache[0].index_select(0, block_tables[:b, :nblk].reshape(-1).long())
    rows = rows.view(b, nblk * bs, -1)
    rows = fmt.decode(rows, torch.float32) if fmt is not None else rows.float()  # [B, S, L + R]
    scores = torch.einsum("bhd,bsd->bhs", q_full.float(), rows) * scale
    pos = torch.arange(nblk * bs, device=q_full.device)
    lens = torch.tensor(seq_lens, device=q_full.device)
    scores = scores.masked_fill((pos[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    p = scores.softmax(dim=-1)
    return torch.einsum("bhs,bsl->bhl", p, rows[..., :kv_lora_rank])


#: Longest query per request that verify steps run as per-token absorbed decodes (1 + k drafts).
MAX_UNIFORM_QUERY_LEN = 16


def uniform_query_len(meta: AttentionMetadata, num_tokens: int) -> int | None:
    """``q`` when every request of ``meta`` has query length ``q`` (``1 < q <=
    MAX_UNIFORM_QUERY_LEN``) over ``num_tokens = R * q`` rows, as in verify steps and the
    (padded) decode graphs captured for them; None otherwise (host lists only, no sync)."""
    q = meta.max_query_len
    if meta.num_decodes or not 1 < q <= MAX_UNIFORM_QUERY_LEN or num_tokens != q * len(meta.query_lens_cpu):
        return None
    return q if all(x == q for x in meta.query_lens_cpu) else None


def per_token_decode_inputs(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables ``[R, W]`` and seq lens ``[R]`` of ``R`` requests of ``q`` query tokens
    -> per token ``[R * q, W]`` and ``[R * q]`` int32: token ``j`` of request ``i`` sees
    ``seq_lens[i] - q + 1 + j`` keys (causal). Device ops only (CUDA-graph safe)."""
    tables = block_tables.repeat_interleave(q, dim=0)
    offs = torch.arange(q - 1, -1, -1, device=seq_lens.device, dtype=seq_lens.dtype).repeat(seq_lens.shape[0])
    return tables, (seq_lens.repeat_interleave(q) - offs).clamp_min(1).to(torch.int32)


class MLAAttentionImpl:
    """The attention of one MLA layer over its latent cache (see the module docstring).

    Args:
        use_triton_decode: run decode rows through the Triton kernel (CUDA; the torch path
            otherwise).
    """

    def __init__(self, use_triton_decode: bool = False) -> None:
        self.use_triton_decode = use_triton_decode

    @staticmethod
    def store(rows: torch.Tensor, kv: KVCacheView, slot_mapping: torch.Tensor) -> None:
        """Write latent rows ``[T, L + R]`` at ``slot_mapping [T]`` (negative: not stored). On
        CUDA without a host read: padding rows go to slot 0 of the null block, which no
        request reads below its length."""
        if rows.is_cuda:
            slots = torch.where(slot_mapping >= 0, slot_mapping, torch.zeros_like(slot_mapping))
            flat = kv.cache[0].view(-1, kv.cache.shape[-1])
            flat.index_copy_(0, slots[: rows.shape[0]], kv.format.encode(rows))
            return
        kv.format.store(rows, None, kv.cache, slot_mapping[: rows.shape[0]])

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, kv_b_weight: torch.Tensor,
                kv: KVCacheView, meta: AttentionMetadata, scale: float, v_head_dim: int,
                out: torch.Tensor) -> torch.Tensor:
        """Store the new rows, attend, write ``[T, H * v_head_dim]`` into ``out`` (rows no
        request owns are left as they are) and return it.

        Args:
            q_nope: ``[T, H, qk_nope]``; q_pe: ``[T, H, R]`` (RoPE applied).
            rows: ``[T, L + R]`` new latent rows (normalized latent, RoPE'd ``k_pe``).
            kv_b_weight: ``[H * (qk_nope + v_head_dim), L]`` (this rank's heads).
            kv: the layer's latent cache view; meta: its group's metadata.
            scale: softmax scale (with DeepSeek's YaRN mscale); out: ``[>= T, >= H * v_head_dim]``.
        """
        h, nope = q_nope.shape[1], q_nope.shape[2]
        lora = rows.shape[-1] - q_pe.shape[-1]
        self.store(rows, kv, meta.slot_mapping)
        w_uk, w_uv = absorbed_weights(kv_b_weight, h, nope, v_head_dim)
        nd = meta.num_decodes
        qsl = meta.query_lens_cpu
        seq_lens, tables = meta.seq_lens, meta.block_tables
        uq = uniform_query_len(meta, q_nope.shape[0]) if self.use_triton_decode else None
        if uq is not None:
            # Verify steps (1 + k tokens per request, CUDA graphs): every query row is an
            # absorbed decode over its own causal prefix; nothing read from the host.
            tables, seq_lens = per_token_decode_inputs(meta.block_tables, meta.seq_lens, uq)
            nd, qsl = q_nope.shape[0], []
        if nd:
            # Absorbed decode: q_lat = W_UK^T q_nope, attention over the rows, out = W_UV o_lat.
            q_lat = torch.bmm(q_nope[:nd].transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [B, H, L]
            q_full = torch.cat([q_lat, q_pe[:nd]], dim=-1)
            if self.use_triton_decode:
                from kvserve.attention.triton.mla_decode import mla_decode

                o_lat = mla_decode(q_full, kv.cache, tables[:nd], seq_lens[:nd], lora, scale,
                                   max_seq_len=meta.max_seq_len, fp8=kv.format.quantized)
            else:
                o_lat = mla_decode_torch(q_full, kv.cache, meta.block_tables, meta.seq_lens_cpu[:nd], lora, scale,
                                         kv.format)
            o = torch.bmm(o_lat.to(q_nope.dtype).transpose(0, 1), w_uv.transpose(1, 2).to(q_nope.dtype))
            out[:nd, : h * v_head_dim] = o.transpose(0, 1).reshape(nd, h * v_head_dim)
        start = nd
        bs = kv.cache.shape[2]
        for i in range(nd, len(qsl)):
            q_len, s_len = qsl[i], meta.seq_lens_cpu[i]
            if q_len == 0:
                continue
            nblk = -(-s_len // bs)
            ctx = kv.cache[0].index_select(0, meta.block_tables[i, :nblk].long()).view(nblk * bs, -1)[:s_len]
            ctx = kv.format.decode(ctx, q_nope.dtype)
            kvx = F.linear(ctx[:, :lora], kv_b_weight.to(q_nope.dtype)).view(s_len, h, nope + v_head_dim)
            k_pe = ctx[:, lora:]
            k = torch.cat([kvx[..., :nope], k_pe[:, None, :].expand(s_len, h, k_pe.shape[-1])], dim=-1)
            v = kvx[..., nope:]
            q = torch.cat([q_nope[start:start + q_len], q_pe[start:start + q_len]], dim=-1)
            # Causal with the cached prefix in front: query j sits at s_len - q_len + j.
            pos_q = torch.arange(s_len - q_len, s_len, device=q.device)
            mask = torch.arange(s_len, device=q.device)[None, :] <= pos_q[:, None]
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=scale)
            out[start:start + q_len, : h * v_head_dim] = o.transpose(0, 1).reshape(q_len, h * v_head_dim)
            start += q_len
        return out
