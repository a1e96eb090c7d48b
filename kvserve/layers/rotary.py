"""Rotary position embedding (neox / rotate_half style, as HF Llama) on flat q/k."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def get_rope_params(config: Any) -> dict:
    """Rope settings of an HF config as one dict with ``rope_theta`` and ``rope_type``.

    Reads transformers-5 ``config.rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def compute_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 for rope types default, linear and llama3.

    Raises ValueError for any other rope type.
    """
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Applies rope to flat ``q [T, Hq*D]`` and ``k [T, Hk*D]`` given ``positions [T]`` int64.

    cos/sin are precomputed in float32 for positions ``< max_position`` and cast to the
    input dtype on use, matching HF numerics.
    """

    def __init__(self, head_dim: int, max_position: int, rope_params: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_params = dict(rope_params)
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
        inv_freq = compute_inv_freq(self.rope_params, self.head_dim)
        # Same op order as HF (position * inv_freq in float32) so cos/sin match bit for bit.
        pos = torch.arange(self.max_position, dtype=torch.int64, device="cpu").float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos().to(device)
        self.sin_cache = emb.sin().to(device)

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
