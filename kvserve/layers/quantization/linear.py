"""``QuantizedLinear``: an ``nn.Linear`` replacement holding packed low-bit weights."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed import tp_all_reduce
from kvserve.layers.quantization.fp8_w8a8 import Fp8Act, Fp8BlockWeight, PackedFp8Block
from kvserve.layers.quantization.kernels import (
    Fp8Weight,
    Int4Weight,
    PackedFp8,
    PackedInt4,
    PackedInt8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)


def int4_group_size(in_features: int, preferred: int = 128) -> int:
    """The largest group size <= ``preferred`` among 128/64/32 that divides ``in_features`` (32 if none)."""
    for g in (128, 64, 32):
        if g <= preferred and in_features % g == 0:
            return g
    return 32


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored as ``method`` (int4 | int8 | fp8).

    Build with ``from_dense`` (quantize at load time) or ``from_int4`` / ``from_int8`` / ``from_fp8``
    (pre-quantized: GGUF, compressed-tensors).
    ``forward``: ``x`` ``[..., in_features]`` in the model dtype -> ``[..., out_features]``, or (FP8 weights
    per channel) an ``Fp8Act`` ``[M, in_features]`` already quantized per token -> ``[M, out_features]``.
    """

    def __init__(self, method: str, packed, in_features: int, out_features: int,
                 bias: Optional[torch.Tensor], tp_reduce: bool = False) -> None:
        super().__init__()
        self.method = method
        self.tp_reduce = tp_reduce  # a row-parallel shard: partial products summed over the ranks before the bias
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed
        for i, t in enumerate(packed.tensors()):  # visible to named_buffers / memory accounting
            self.register_buffer(f"qweight_{i}", t, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, method: str, dtype: torch.dtype,
                   group_size: int = 128) -> "QuantizedLinear":
        """Quantize ``linear.weight`` (dynamic, at load): int4 group-wise asymmetric, int8 / fp8 per channel."""
        w = linear.weight.detach()
        dev = w.device
        n, k = w.shape
        if method == "int4":
            g = int4_group_size(k, group_size)
            wp = F.pad(w.float(), (0, (-k) % g))
            packed = PackedInt4(quantize_int4(wp, g), dev, dtype, in_features=k)
        elif method == "int8":
            packed = PackedInt8(*quantize_int8(w), dev, dtype)
        elif method == "fp8":
            packed = PackedFp8(*quantize_fp8(w), dev, dtype)
        else:
            raise ValueError(f"unknown weight quantization {method!r}; choose int4, int8 or fp8")
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(method, packed, k, n, bias)

    @classmethod
    def from_int4(cls, w: Int4Weight, bias: Optional[torch.Tensor], device: torch.device,
                  dtype: torch.dtype) -> "QuantizedLinear":
        n, k = w.q.shape
        return cls("int4", PackedInt4(w, device, dtype), k, n, bias)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], device: torch.device,
                  dtype: torch.dtype) -> "QuantizedLinear":
        n, k = q.shape
        return cls("int8", PackedInt8(q, scale, device, dtype), k, n, bias)

    @classmethod
    def from_fp8(cls, w: Fp8Weight, bias: Optional[torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> "QuantizedLinear":
        n, k = w.q.shape
        return cls("fp8", PackedFp8(w.q, w.scale, device, dtype), k, n, bias)

    @classmethod
    def from_fp8_block(cls, w: Fp8BlockWeight, bias: Optional[torch.Tensor], device: torch.device,
                       dtype: torch.dtype) -> "QuantizedLinear":
        n, k = w.q.shape
        return cls("fp8_block", PackedFp8Block(w.q, w.scale, device, dtype), k, n, bias)

    @property
    def accepts_fp8_input(self) -> bool:
        """True when ``forward`` takes an ``Fp8Act`` (per-token FP8 activations): channel-scaled FP8 weights."""
        return isinstance(self.packed, PackedFp8)

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, Fp8Act):  # quantized by the norm before this layer (fp8_w8a8.attach_fp8_norms)
            y = self.packed.matmul_fp8(x.q, x.scale, x.dtype)
            if self.tp_reduce:
                y = tp_all_reduce(y)
            return y + self.bias if self.bias is not None else y
        shape = x.shape
        y = self.packed.matmul(x.reshape(-1, shape[-1]))
        if self.tp_reduce:
            y = tp_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.method}, in_features={self.in_features}, out_features={self.out_features}"
