"""Plain-torch reference for bounded-KV attention (StreamingLLM / H2O) on a HF Llama model.

A whole-sequence forward (no cache) of a ``transformers`` Llama with its own attention: row
``p`` attends to the keys ``vis[p]`` allows, scoring keys of the sink blocks with the query
rotated at position ``p - shift[p]`` and every other key with the query at ``p`` (keys always
at their own positions). Greedy generation recomputes the whole sequence per token, so each
token's logits depend only on the masks, never on the engine's caching or batching.
"""

from __future__ import annotations

import math

import torch


def _rot(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    ang = pos.double()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.inference_mode()
def ref_logits(hf, ids: list[int], vis: torch.Tensor, shift: torch.Tensor, sink_keys: int) -> torch.Tensor:
    """Logits ``[T, V]`` of ``ids`` under ``vis [T, T]`` bool, ``shift [T]`` int and the first
    ``sink_keys`` keys scored with the shifted query."""
    cfg = hf.config
    H, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    T = len(ids)
    pos = torch.arange(T)
    x = hf.model.embed_tokens(torch.tensor(ids))
    sink = torch.arange(T) < sink_keys
    for layer in hf.model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(T, H, d)
        k = a.k_proj(h).view(T, Hk, d)
        v = a.v_proj(h).view(T, Hk, d)
        qr, kr, qs = _rot(q, pos, inv), _rot(k, pos, inv), _rot(q, pos - shift, inv)
        kr = kr.repeat_interleave(H // Hk, dim=1)
        v = v.repeat_interleave(H // Hk, dim=1)
        s = torch.einsum("thd,shd->hts", qr, kr)
        ss = torch.einsum("thd,shd->hts", qs, kr)
        s = torch.where(sink[None, None, :], ss, s) / math.sqrt(d)
        s = s.masked_fill(~vis[None], float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v).reshape(T, H * d)
        x = x + a.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hf.lm_head(hf.model.norm(x))


def streaming_masks(T: int, sinks: int, window: int, block_size: int):
    """``(vis, shift, sink_keys)`` of StreamingLLM at block granularity (kvserve's scheme)."""
    p = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    vis = (k <= p) & ((k < sinks) | (k > p - window))
    sb = -(-sinks // block_size)
    shift = block_size * torch.clamp((torch.arange(T) - window + 1) // block_size - sb, min=0)
    return vis, shift, sb * block_size


def streaming_greedy(hf, prompt: list[int], n: int, sinks: int, window: int, block_size: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        vis, shift, sk = streaming_masks(len(ids), sinks, window, block_size)
        ids.append(int(ref_logits(hf, ids, vis, shift, sk)[-1].argmax()))
    return ids[len(prompt):]
