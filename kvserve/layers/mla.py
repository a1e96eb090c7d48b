"""The multi-head latent attention layer: an ``Attention`` whose cache is MLA's latent rows.

``MLAAttention`` is bound like every attention layer (``bind_attention`` / ``bind_kv_cache``),
but describes its own cache: ``kv_cache_spec`` returns an ``MLAAttentionSpec`` (one row of
``kv_lora_rank + qk_rope_head_dim`` values per token, format ``mla_<dtype>``), so the model
runner allocates, binds, copies and plans it like any other spec. Its forward takes the
query heads and the new latent rows and runs ``kvserve.attention.mla.MLAAttentionImpl``
(expanded prefill, absorbed decode; the Triton decode kernel when the layer's backend is
``triton``). KV features that cannot apply to the latent are refused here, at start-up:
bounded KV (StreamingLLM / H2O keep per-head attention mass), the per-head quantized KV
dtypes (int8 / int4 / int2 / fp8_e5m2; fp8 stores ``mla_fp8_e4m3`` rows) and tree drafts
(``speculative_eagle_topk > 1``: the tree attention mask lives in full attention's prefill
paths; the latent paths attend causally).

Tensor parallelism: the query heads (and ``kv_b_proj``, ``o_proj``) split over the ranks;
the latent row is computed and cached whole on every rank (replicated: the cache costs each
rank the full ``kv_lora_rank + qk_rope_head_dim`` per token, the start-up line says so).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from kvserve.attention.forward_context import get_forward_context
from kvserve.attention.mla import MLAAttentionImpl
from kvserve.core.kv_cache_spec import MLAAttentionSpec, latent_format_name
from kvserve.layers.attention import Attention


class MLAAttention(Attention):
    """Paged MLA for one layer.

    Args:
        num_heads: this rank's query heads; total_heads: all of them.
        kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim: the config's dims.
        scale: softmax scale (``qk_head_dim ** -0.5`` times DeepSeek's YaRN ``mscale ** 2``).
        layer_idx: the model's attention-layer index.
        kv_b_proj: the layer's ``kv_b_proj`` (held by reference for the absorbed decode).
        tp_size: tensor-parallel ranks (the latent is replicated on each).
    """

    def __init__(self, num_heads: int, total_heads: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 qk_nope_head_dim: int, v_head_dim: int, scale: float, layer_idx: int, kv_b_proj: nn.Linear,
                 tp_size: int = 1) -> None:
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, 1, layer_idx)
        self.total_heads = total_heads
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.tp_size = tp_size
        self._kv_b = [kv_b_proj]  # a list: not a child module (the model owns it)
        self._impl_mla: Optional[MLAAttentionImpl] = None

    @property
    def out_width(self) -> int:
        """Columns of ``forward``'s output: ``max(H * v_head_dim, H * qk_head_dim)`` (the
        piecewise CUDA graph runner gives attention outputs the query's width); the first
        ``H * v_head_dim`` hold the result."""
        return self.num_heads * max(self.v_head_dim, self.qk_nope_head_dim + self.qk_rope_head_dim)

    def kv_cache_spec(self, block_size: int, config: Any) -> MLAAttentionSpec:
        """This layer's cache spec for an ``EngineConfig``. Raises ValueError for a KV feature
        the latent cannot serve (bounded KV, per-head quantized KV dtypes) and for tree drafts
        (``speculative_eagle_topk > 1``: the MLA path has no tree attention mask)."""
        cc = config.cache_config
        sc = config.speculative_config
        if sc is not None and sc.speculative_eagle_topk > 1:
            raise ValueError(f"speculative_eagle_topk {sc.speculative_eagle_topk} (tree drafts): layer "
                             f"{self.layer_idx} is multi-head latent attention (MLA), whose latent attention does "
                             f"not apply the tree attention mask (only full attention's prefill paths do); use "
                             f"speculative_eagle_topk 1 (chain drafts)")
        if cc.kv_eviction_policy != "none":
            raise ValueError(f"--kv-eviction-policy {cc.kv_eviction_policy}: bounded KV keeps per-head attention "
                             f"mass and windows of K/V heads; a multi-head latent attention (MLA) cache has no heads "
                             f"to bound (use the default full cache)")
        return MLAAttentionSpec(block_size, 1, self.head_size, latent_format_name(cc.kv_cache_dtype),
                                config.model_config.dtype, kv_lora_rank=self.kv_lora_rank,
                                qk_rope_head_dim=self.qk_rope_head_dim, num_heads=self.total_heads,
                                qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim,
                                tp_size=self.tp_size)

    def _mla_impl(self) -> MLAAttentionImpl:
        if self._impl_mla is None:
            triton = self.impl is not None and self.impl.name == "triton" and self.kv is not None \
                and self.kv.cache.is_cuda
            self._impl_mla = MLAAttentionImpl(use_triton_decode=triton)
        return self._impl_mla

    def forward(self, q: torch.Tensor, rows: torch.Tensor, v: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q ``[T, H * (qk_nope + qk_rope)]`` (RoPE applied to each head's last ``qk_rope``),
        rows ``[T, kv_lora_rank + qk_rope]`` -> ``[T, out_width]`` (first ``H * v_head_dim``
        columns: the heads' outputs, for ``o_proj``)."""
        if self.split_hook is not None:
            return self.split_hook(self, q, rows, rows)
        meta = get_forward_context().attn_metadata[self.kv_cache_group_id]
        if meta.bounded is not None:
            raise ValueError("bounded KV metadata reached an MLA layer (refused at start-up)")
        t = q.shape[0]
        nope = self.qk_nope_head_dim
        qh = q.view(t, self.num_heads, nope + self.qk_rope_head_dim)
        out = q.new_zeros(t, self.out_width)  # padding rows stay finite (o_proj, MoE routing read them)
        return self._mla_impl().forward(qh[..., :nope], qh[..., nope:], rows, self._kv_b[0].weight, self.kv, meta,
                                        self.scale, self.v_head_dim, out)
