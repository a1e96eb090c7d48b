"""Group-quantized weights with integer zero points (GPTQ / AWQ) and where they run.

``GroupQuantWeight`` is the loaders' canonical form (``model_loader.gptq_awq``): ``w = (q - z) * s`` per
group of input features, 4 or 8 bits. ``PackedGroupQuant`` places it for a device:

* CUDA, 4 bits in bfloat16: the kernel ``kernels.int4_kernel`` names (as ``--quantization int4``): tinygemm
  (``PackedInt4``) or the Triton W4A16/W8A16 GEMM (``triton_w4a16``), whichever measured faster; 8 bits and
  other dtypes: the Triton GEMM. It serves M <= 256, its dequantization + cuBLAS above;
* CPU, 4 bits: float32 activations: ``cpu_int4.CpuInt4`` (nibble-packed; each call dequantizes
  ``(q - z) * s``, bit for bit ``GroupQuantWeight.dequantize``, and runs a dense matmul); bfloat16 /
  float16: PyTorch's int4pack kernel (``PackedInt4``: ``w = q * s + m`` with ``m = -z * s``; per-channel
  scales repeated over groups of 128/64/32); 8 bits: ``_weight_int8pack_mm`` when symmetric per channel,
  else the dequantized weight (correct, not smaller).

Activation order (GPTQ ``desc_act``): the loader sorts K by group (``perm``) so groups are contiguous;
``matmul`` then reads ``x[:, perm]`` (one gather of the activations, exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.layers.quantization.cpu_int4 import CpuInt4
from kvserve.layers.quantization.kernels import Int4Weight, PackedInt4, PackedInt8, int4_kernel

#: group sizes the loaders accept (-1: one group per output channel)
GROUP_SIZES = (32, 64, 128, 256, -1)


@dataclass
class GroupQuantWeight:
    """``q`` uint8 ``[N, K]`` in ``[0, 2^bits)``; ``scale`` float32 ``[N, K // g]``; ``zero`` float32
    ``[N, K // g]`` holding integers (None: symmetric, ``z = 2^(bits-1)``); ``group_size`` ``g`` (K for
    per channel); ``perm`` int64 ``[K]`` or None: the layer computes ``x[:, perm] @ dequantize().T``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    bits: int
    group_size: int
    perm: Optional[torch.Tensor] = None

    def zeros(self) -> torch.Tensor:
        """The zero points, float32 ``[N, K // g]`` (filled in for the symmetric case)."""
        return self.zero if self.zero is not None else torch.full_like(self.scale, float(1 << (self.bits - 1)))

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]`` in the stored (``perm``-sorted) input order."""
        g = self.group_size
        return (self.q.float() - self.zeros().repeat_interleave(g, 1)) * self.scale.repeat_interleave(g, 1)

    def dequantize_unpermuted(self) -> torch.Tensor:
        """Float32 ``[N, K]`` in the model's input order (``perm`` undone)."""
        w = self.dequantize()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def quantize_groupwise(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False
                       ) -> GroupQuantWeight:
    """Round-to-nearest min/max group quantization of ``w`` ``[N, K]`` (dummy checkpoints, benchmarks).

    ``sym``: ``z = 2^(bits-1)`` and ``s = max|w| / (2^(bits-1) - 1)`` (GPTQ's symmetric grid); else
    ``s = (max - min) / (2^bits - 1)``, ``z = round(-min / s)``. Raises ValueError when ``group_size``
    does not divide K.
    """
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g:
        raise ValueError(f"group quantization: in_features {k} is not a multiple of the group size {g}")
    maxq = (1 << bits) - 1
    x = w.float().reshape(n, k // g, g)
    if sym:
        scale = (x.abs().amax(-1) / ((maxq + 1) // 2 - 1)).clamp_min(1e-8)
        zero = None
        q = (x / scale[..., None]).round() + (maxq + 1) // 2
    else:
        lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp_min(1e-8)
        zero = (-lo / scale).round().clamp(0, maxq)
        q = (x / scale[..., None]).round() + zero[..., None]
    q = q.clamp(0, maxq).to(torch.uint8).reshape(n, k)
    return GroupQuantWeight(q, scale, zero, bits, g)


class PackedGroupQuant:
    """A ``GroupQuantWeight`` in the kernel layout of ``device`` (module doc). ``dtype``: activation dtype."""

    def __init__(self, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> None:
        self.n, self.k = w.q.shape
        self.bits, self.dtype = w.bits, dtype
        self.perm = w.perm.to(device) if w.perm is not None else None
        self.cuda = device.type == "cuda"
        self.cuda_triton = False  # the Triton W4A16/W8A16 layout (else int4 / int8pack / dense)
        self.int4 = self.int8 = None
        self.dense = None
        tinygemm = w.bits == 4 and dtype == torch.bfloat16 and self.cuda and int4_kernel() == "tinygemm"
        if self.cuda and not tinygemm:
            self._init_triton(w, device, dtype)
            self.cuda_triton = True
        elif w.bits == 4 and not self.cuda and dtype == torch.float32:  # exactly ``w.dequantize`` per call
            self.int4 = CpuInt4(w.q, w.scale, w.zeros(), w.group_size, "zero_point", device=device)
        elif w.bits == 4:  # int4pack: w = q * s + m with m = -z * s; per channel over groups of 128/64/32
            g = w.group_size
            scale, zero, q = w.scale, w.zeros(), w.q
            if g not in (32, 64, 128, 256):
                q = F.pad(q, (0, (-self.k) % 32))
                g = next(c for c in (128, 64, 32) if q.shape[1] % c == 0)
                reps = q.shape[1] // g
                scale, zero = scale.expand(-1, reps).contiguous(), zero.expand(-1, reps).contiguous()
            self.int4 = PackedInt4(Int4Weight(q, scale.float(), -zero.float() * scale.float(), g), device, dtype,
                                   in_features=self.k)
        elif w.zero is None and w.group_size == self.k:  # symmetric per channel: exactly int8pack's form
            self.int8 = PackedInt8((w.q.to(torch.int16) - 128).to(torch.int8), w.scale[:, 0].float(), device, dtype)
        else:
            self.dense = w.dequantize().to(device, dtype)

    def _init_triton(self, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> None:
        from kvserve.layers.quantization import triton_w4a16 as tw

        kb = tw.block_rows(w.bits)
        kp = tw.padded_k(self.k, w.bits)
        g = kp if w.group_size == self.k and self.k % kb else w.group_size  # per channel: one group of Kp
        n_groups = -(-kp // g)
        pad = n_groups - w.scale.shape[1]
        scale = F.pad(w.scale.float(), (0, pad)).t().contiguous()
        sdt = torch.float16 if torch.equal(scale.half().float(), scale) else dtype
        self.qweight = tw.pack(w.q, w.bits).to(device)
        tw.workspace(device)  # split-K counters allocated now, not under CUDA-graph capture
        self.scales = scale.to(device, sdt)
        self.group_size = g
        if w.zero is None:
            self.zp, self.zeros = tw.ZP_SYM, None
        else:
            self.zp = tw.ZP_INT
            self.zeros = F.pad(w.zero, (0, pad)).t().contiguous().to(device, torch.uint8)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` -> ``x @ W.T`` ``[M, N]`` in x's dtype."""
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self.cuda_triton:
            from kvserve.layers.quantization import triton_w4a16 as tw

            if x.shape[0] <= tw.MAX_M:
                return tw.gemm(x, self.qweight, self.scales, self.zeros, self.n, self.group_size, self.bits, self.zp)
            wd = tw.dequantize(self.qweight, self.scales, self.zeros, self.n, self.k, self.group_size, self.bits,
                               self.zp, x.dtype)
            return F.linear(x, wd)
        if self.int4 is not None:
            return self.int4.matmul(x)
        if self.int8 is not None:
            return self.int8.matmul(x)
        return F.linear(x, self.dense)

    def tensors(self) -> list[torch.Tensor]:
        extra = [self.perm] if self.perm is not None else []
        if self.cuda_triton:
            return [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else []) + extra
        inner = self.int4 or self.int8
        return (inner.tensors() if inner is not None else [self.dense]) + extra
