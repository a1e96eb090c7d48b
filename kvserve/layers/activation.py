"""Gated activations over packed projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[T, 2*I]`` -> ``[T, I]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:  # one Triton kernel
            from kvserve.layers import fused

            if fused.ENABLED:
                return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` for ``x = [gate | up]`` of shape ``[T, 2*I]`` -> ``[T, I]``.

    Args:
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU).
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
