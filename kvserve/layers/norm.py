"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in float32 like HF.

    Args:
        hidden_size: size of the normalized (last) dim.
        eps: variance epsilon.
    """

    #: set by ``fp8_w8a8.attach_fp8_norms`` when every linear reading this norm's output takes FP8
    #: activations: for more than this many rows ``forward`` returns an ``Fp8Act`` (norm + per-token FP8
    #: quantization fused) in place of the normed tensor. None: never.
    fp8_out_min_m: int | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        # HF casts back to the input dtype before scaling by the weight.
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x ``[..., hidden]``.

        Without ``residual`` returns the normed ``x``. With ``residual`` (same shape) returns
        ``(norm(x + residual), x + residual)``: the sum is the new residual stream.
        On CUDA this is one Triton kernel (``kvserve.layers.fused``). With ``fp8_out_min_m`` set and more
        rows than it, the normed output is an ``Fp8Act`` (``[T, hidden]`` FP8 codes + per-token scales).
        """
        if self.fp8_out_min_m is not None and x.dim() == 2 and x.shape[0] > self.fp8_out_min_m:
            return self._forward_fp8(x, residual)
        if x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1:
            from kvserve.layers import fused

            if fused.ENABLED:
                return fused.rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None):
        from kvserve.layers.quantization.fp8_w8a8 import Fp8Act, quantize_act_ref

        if x.is_cuda and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
            from kvserve.layers.quantization.triton_fp8 import rms_norm_quant_fp8

            q, s, res = rms_norm_quant_fp8(x, self.weight, self.variance_epsilon, residual)
        else:  # the same numerics unfused (CPU)
            res = None if residual is None else x + residual
            q, s = quantize_act_ref(self._norm(x if res is None else res))
        act = Fp8Act(q, s, x.dtype)
        return act if residual is None else (act, res)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32, then cast.

    The weight is zero-centred (HF checkpoints store ``w``; GGUF files store ``1 + w``, which the
    loader undoes). Unlike Llama's norm the scale multiplies before the cast back to the input
    dtype (as transformers' Gemma 3).

    Args:
        hidden_size: size of the normalized (last) dim; eps: variance epsilon.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden]`` -> normed, same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
