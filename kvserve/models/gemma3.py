"""Gemma 3 text decoder (``Gemma3ForCausalLM``) over the paged attention layer.

What differs from Llama (Gemma Team, "Gemma 3 Technical Report", arXiv 2503.19786):

- local/global layers: ``layer_types`` (or every ``sliding_window_pattern``-th layer global);
  local layers attend to the last ``sliding_window`` tokens and use their own rope theta
  (``rope_parameters["sliding_attention"]``, 10k) while global layers use
  ``rope_parameters["full_attention"]`` (1M, possibly scaled). Each ``Attention`` layer carries
  its ``sliding_window`` (int or None) for the KV cache spec.
- per-head q/k RMSNorm before rope; sandwich norms (after attention and after the MLP too);
  Gemma's zero-centred RMSNorm ``(1 + w)``;
- embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model dtype, as transformers);
- GELU-tanh gated MLP; softmax scale ``query_pre_attn_scalar ** -0.5``; tied embeddings;
- optional ``final_logit_softcapping``. Logits are computed only for the rows the runner asks
  for (the 262k vocabulary makes full-sequence logits expensive).

GGUF files (llama.cpp) store norm weights with the ``+1`` baked in; ``iterate_gguf`` removes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.distributed import get_tp_size, kv_head_range
from kvserve.layers.activation import GeluAndMul
from kvserve.layers.linear import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                                   VocabParallelEmbedding)
from kvserve.layers.attention import Attention
from kvserve.layers.norm import GemmaRMSNorm
from kvserve.layers.rotary import RotaryEmbedding, get_rope_params
from kvserve.models.llama import LlamaForCausalLM

SLIDING = "sliding_attention"
FULL = "full_attention"


def gemma3_layer_types(cfg: Any) -> list[str]:
    """Per-layer ``sliding_attention`` / ``full_attention`` of a Gemma 3 text config.

    Raises ValueError for an unknown layer type or a list of the wrong length.
    """
    types = getattr(cfg, "layer_types", None)
    if types is None:
        pattern = getattr(cfg, "sliding_window_pattern", None) or getattr(cfg, "_sliding_window_pattern", 6)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(cfg.num_hidden_layers)]
    types = list(types)
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad:
        raise ValueError(f"unsupported Gemma 3 layer types {bad}; supported: {SLIDING}, {FULL}")
    return types


def _check_config(cfg: Any, types: list[str]) -> None:
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ValueError("Gemma 3 attn_logit_softcapping is not supported (the released Gemma 3 models set None)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("bidirectional Gemma 3 (embedding) models are not supported; kvserve serves causal LMs")
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
        raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}")
    if SLIDING in types:
        window = getattr(cfg, "sliding_window", None)
        max_pos = getattr(cfg, "max_position_embeddings", None)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"Gemma 3 sliding_window must be a positive integer, got {window!r}")
        if max_pos is not None and window > max_pos:
            raise ValueError(
                f"sliding_window {window} is larger than the model's context ({max_pos} tokens): a broken config")


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, layer_type: str, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp_size()
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv, bias, dtype)
        self.num_heads = total_heads // tp  # this rank's heads
        self.num_kv_heads = kv_head_range(total_kv, tp, 0)[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = [rotary]  # shared; a list keeps it out of this module's children
        scalar = getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim
        window = cfg.sliding_window if layer_type == SLIDING else None
        self.attn = Attention(self.num_heads, self.head_dim, scalar**-0.5, self.num_kv_heads, layer_idx, window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q, k = self.rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False, dtype=dtype)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        self.act = GeluAndMul("none" if act == "gelu" else "tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, layer_type: str, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(cfg, layer_idx, layer_type, rotary, dtype)
        self.mlp = Gemma3MLP(cfg, dtype)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        x = x + h
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + h


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, max_model_len: int | None = None) -> None:
        super().__init__()
        types = gemma3_layer_types(cfg)
        _check_config(cfg, types)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        # transformers multiplies by a float32 scalar tensor cast to the weight dtype.
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, device="cpu").to(dtype))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        max_pos = getattr(cfg, "max_position_embeddings", None) or 2048
        self.rotary_global = RotaryEmbedding(head_dim, max_pos, get_rope_params(cfg, FULL), max_model_len)
        self.rotary_local = RotaryEmbedding(head_dim, max_pos, get_rope_params(cfg, SLIDING), max_model_len)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, t, self.rotary_local if t == SLIDING else self.rotary_global, dtype)
            for i, t in enumerate(types)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Causal LM for Gemma 3 text configs (``model_type`` ``gemma3_text``).

    Weight loading (q/k/v and gate/up packed; HF names) is Llama's ``load_weights``.

    Args:
        hf_config: a ``Gemma3TextConfig``.
        dtype: parameter dtype (norm math and rope caches stay float32).
        max_model_len: the engine's context length (rope cache size).

    Raises ValueError for configs kvserve cannot run exactly (attention logit softcapping,
    bidirectional attention, unknown activation or layer type, a window larger than the
    context, an unsupported rope type).
    """

    supports_pipeline_parallel = False  # its own forward / weight names: no layer-range hook yet

    def __init__(self, hf_config: Any, dtype: torch.dtype, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.model = Gemma3Model(hf_config, dtype, max_model_len)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden]`` -> logits ``[N, vocab]`` float32 (soft-capped when configured)."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
