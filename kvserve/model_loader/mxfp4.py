"""MXFP4 weights (OCP Microscaling Formats v1.0: FP4 E2M1 values in blocks of 32 sharing one E8M0
scale; Rouhani et al., arXiv 2310.10537), as the published gpt-oss checkpoints store their experts.

Layout (transformers' ``integrations/mxfp4.py``): a ``[..., rows, cols]`` weight is stored as
``*_blocks [..., rows, cols / 32, 16]`` uint8, two 4-bit codes per byte (element ``2j`` in the
low nibble, ``2j + 1`` in the high one), and ``*_scales [..., rows, cols / 32]`` uint8, the
block's exponent biased by 127: value = ``FP4[code] * 2 ** (scale - 127)``. A code is sign (bit
3) plus E2M1 magnitude: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

#: values per block (one shared scale)
MXFP4_BLOCK = 32
#: FP4 E2M1 code -> value
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> values ``[..., G * 32]`` in ``dtype``.

    Computed in float32 (exact: every value is a 3-bit mantissa times a power of two) and cast.
    Raises ValueError when the shapes do not pair up.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
                         f"(expected [..., G, {MXFP4_BLOCK // 2}] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8).long()
    vals = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(vals, exp.unsqueeze(-1).float())
    return out.flatten(-2).to(dtype)
