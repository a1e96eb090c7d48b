"""Rotary position embedding (neox / rotate_half style, as HF Llama) on flat q/k; scaling types
in ``kvserve.layers.rope_scaling``."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from kvserve.layers.rope_scaling import layer_rope_dicts, rope_inv_freq


def get_rope_params(config: Any, layer_type: str | None = None) -> dict:
    """Rope settings of an HF config as one dict with ``rope_theta`` and ``rope_type``.

    Reads transformers-5 ``config.rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``.
    ``layer_type`` picks one dict on models with a rope per layer type (Gemma 3:
    ``full_attention`` / ``sliding_attention``). Raises KeyError for a layer type the config lacks.
    """
    dicts = layer_rope_dicts(config)
    if layer_type is None or "default" in dicts:
        return dicts.get("default") or dicts["full_attention"]
    return dicts[layer_type]


class RotaryEmbedding(nn.Module):
    """Applies rope to flat ``q [T, Hq*D]`` and ``k [T, Hk*D]`` given ``positions [T]`` int64.

    cos/sin are precomputed in float32 for positions ``< max(max_position, max_model_len)``
    (times the scaling type's attention factor: yarn, longrope) and cast to the input dtype
    on use, matching HF numerics.

    Args:
        head_dim: rotary dim; max_position: the config's ``max_position_embeddings``.
        rope_params: one rope dict (``rope_theta``, ``rope_type``, the type's keys).
        max_model_len: the engine's context length (sizes the cache; picks dynamic's /
            longrope's setting), None = ``max_position``.

    Raises ValueError for an unsupported rope type or missing keys.
    """

    def __init__(self, head_dim: int, max_position: int, rope_params: dict,
                 max_model_len: Optional[int] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.config_max_position = max_position
        self.max_model_len = max_model_len
        self.max_position = max(max_position, max_model_len or 0)
        self.rope_params = dict(rope_params)
        # Validate now (ValueError at model build, not at the first forward).
        self.inv_freq, self.attention_factor = rope_inv_freq(self.rope_params, head_dim, max_position, max_model_len)
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.build_cache()

    @torch.no_grad()
    def build_cache(self) -> None:
        """(Re)compute the float32 cos/sin caches ``[max_position, head_dim]`` on the caches' device.

        Call after ``to_empty`` (meta-device construction leaves them uninitialized).
        """
        device = self.cos_cache.device
        if device.type == "meta":
            shape = (self.max_position, self.head_dim)
            self.cos_cache = torch.empty(shape, device=device)
            self.sin_cache = torch.empty(shape, device=device)
            return
        inv_freq = self.inv_freq
        # Same op order as HF (position * inv_freq in float32) so cos/sin match bit for bit.
        pos = torch.arange(self.max_position, dtype=torch.int64, device="cpu").float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos_cache = cos.to(device)
        self.sin_cache = sin.to(device)

    @torch.no_grad()
    def extend(self, max_position: int) -> None:
        """Grow the cos/sin caches to ``max_position`` positions (bounded KV: requests run past
        ``max_model_len`` and the trained length; rotary depends only on relative distance, and
        a bounded request's distances stay within its kept keys)."""
        if max_position > self.max_position:
            self.max_position = max_position
            self.build_cache()

    def _apply(self, fn, recurse=True):
        # Keep the caches float32 when the module is cast with .to(dtype)/.half().
        out = super()._apply(fn, recurse)
        if self.cos_cache.dtype != torch.float32 and self.cos_cache.device.type != "meta":
            self.build_cache()
        return out

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        xh = x.view(t, -1, self.head_dim)
        half = self.head_dim // 2
        rot = torch.cat((-xh[..., half:], xh[..., :half]), dim=-1)
        return (xh * cos + rot * sin).reshape(t, -1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns rotated ``(q, k)`` with the input shapes and dtypes (on CUDA: rotated in
        place by one Triton kernel, when head_dim / 2 is a power of two)."""
        half = self.head_dim // 2
        if q.is_cuda and half & (half - 1) == 0 and q.stride(-1) == 1 and k.stride(-1) == 1:
            from kvserve.layers import fused

            if fused.ENABLED:
                return fused.rotary_inplace(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim)
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
