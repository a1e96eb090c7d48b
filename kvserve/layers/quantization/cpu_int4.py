"""INT4 weights on the CPU: nibble-packed storage, dequantized per call, then one dense matmul.

Used for float32 activations (``kernels.PackedInt4``, ``group_quant.PackedGroupQuant``): PyTorch's CPU
int4 kernel (``_weight_int4pack_mm_for_cpu``) has no fast float32 path (AVX2): at the default model's
projections it is tens of times a dense float32 matmul at M = 64 and no faster than unpacking + dense
at M = 1 (``benchmarks/cpu_int4.py``, ``benchmarks/results/weight_quant/cpu_int4.json``). bfloat16
activations keep int4pack, whose bf16 GEMV beats a dense bf16 matmul at M = 1 (docs/benchmarks/weight-quant.md).
Here the 4-bit values stay packed two per byte (half a byte per weight, as int4pack), and each call
unpacks them (vectorized shifts and masks), applies the group's affine map in float32 and runs ``F.linear``.

The float32 weight a call builds is bit for bit the reference dequantization of the source form:

* ``"affine"`` (``kernels.Int4Weight``, llama.cpp Q4_1 / compressed-tensors / ``--quantization int4``):
  ``w = q * scale + min``;
* ``"zero_point"`` (``group_quant.GroupQuantWeight``, GPTQ / AWQ): ``w = (q - zero) * scale``.

Packing (this module's own): byte ``j`` of a row holds column ``j`` in its low nibble and column
``j + Kp / 2`` in its high nibble (``Kp``: the row length padded to even), so unpacking is two
contiguous half-rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORMS = ("affine", "zero_point")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q`` uint8 ``[N, K]`` in [0, 15] -> uint8 ``[N, ceil(K / 2)]`` (module doc's layout)."""
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"int4 values must be uint8 [N, K], got {q.dtype} {list(q.shape)}")
    q = F.pad(q, (0, q.shape[1] % 2))
    h = q.shape[1] // 2
    return (q[:, :h] | (q[:, h:] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 ``[N, Kp / 2]`` -> uint8 ``[N, k]``."""
    q = torch.cat((packed & 15, packed >> 4), 1)
    return q if q.shape[1] == k else q[:, :k]


class CpuInt4:
    """Group-wise INT4 for the CPU (module doc).

    ``q`` uint8 ``[N, Kq]`` in [0, 15] with ``Kq = G * group_size``; ``scale`` and ``offset`` float32
    ``[N, G]``: ``offset`` is the minimum (``form="affine"``) or the zero point (``form="zero_point"``).
    ``in_features``: the logical K (<= Kq; the activations are zero-padded to Kq). Raises ValueError on
    shapes that do not agree.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                 form: str, in_features: int | None = None, device: torch.device | str = "cpu") -> None:
        if form not in FORMS:
            raise ValueError(f"int4 form must be one of {FORMS}, got {form!r}")
        n, kq = q.shape
        if group_size <= 0 or kq % group_size:
            raise ValueError(f"int4: {kq} input features are not a multiple of the group size {group_size}")
        groups = kq // group_size
        for name, t in (("scale", scale), ("offset", offset)):
            if tuple(t.shape) != (n, groups):
                raise ValueError(f"int4 {name} must be [{n}, {groups}] for q [{n}, {kq}] in groups of "
                                 f"{group_size}, got {list(t.shape)}")
        self.n, self.kq, self.group_size, self.form = n, kq, group_size, form
        self.k = in_features or kq
        self.packed = pack_nibbles(q).to(device)
        self.scale = scale.float().unsqueeze(-1).contiguous().to(device)  # [N, G, 1]: broadcast over a group
        self.offset = offset.float().unsqueeze(-1).contiguous().to(device)

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, Kq]``, equal to the source form's reference dequantization (module doc)."""
        w = unpack_nibbles(self.packed, self.kq).reshape(self.n, -1, self.group_size).float()
        if self.form == "affine":
            w.mul_(self.scale).add_(self.offset)
        else:
            w.sub_(self.offset).mul_(self.scale)
        return w.view(self.n, self.kq)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` -> ``x @ W.T`` ``[M, N]`` in x's dtype."""
        if x.shape[-1] != self.kq:
            x = F.pad(x, (0, self.kq - x.shape[-1]))
        w = self.dequantize()
        return F.linear(x, w if x.dtype == torch.float32 else w.to(x.dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale, self.offset]
