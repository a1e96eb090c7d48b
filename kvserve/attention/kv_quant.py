"""Quantized KV cache rows: the torch reference of the scheme every backend reads.

Scheme (no calibration data needed; scales are computed from each token as it is stored):

- ``fp8_e4m3`` / ``fp8_e5m2`` / ``int8``: per-token-per-head symmetric scaling. For one
  token and one KV head, the row ``x[0:D]`` of K (and separately of V) is stored as
  ``code = round(x / s)`` with ``s = max(|x|) / QMAX`` (QMAX 448 / 57344 / 127), then the
  scale ``s`` as float16. Dequantized: ``x ~ code * s``.
- ``int4`` / ``int2``: per-token-per-head asymmetric (min-max) scaling:
  ``code = round((x - m) / s)`` in ``[0, 2^b - 1]`` with ``m = min(x)``,
  ``s = (max(x) - min(x)) / (2^b - 1)``; codes packed little-end first (element ``j`` in
  byte ``j // (8 / b)``, bits ``(j % (8 / b)) * b`` up), then ``s`` and ``m`` as float16.
  KIVI (Liu et al., arXiv:2402.02750) quantizes keys per channel instead; per-token
  keys were chosen here so that every token is final the moment it is stored: a block's
  rows never change after they are written, so prefix sharing and copy-on-write of a
  partial block work unchanged, and no block is kept in the compute dtype while it
  fills. The accuracy cost is measured by ``kvserve bench accuracy``.

Layout: one layer's cache is ``[2, num_blocks, block_size, num_kv_heads, row]`` in the
format's storage dtype (one byte per element), ``row = D * bits / 8 + scale bytes``; the
scales sit in the row right after the codes, so they move with the token. Scales are
float16 and at least ``MIN_SCALE`` (the smallest normal float16), so a constant row never
divides by zero. Rounding is ``floor(y + 0.5)`` (the Triton store kernel does the same).
"""

from __future__ import annotations

import torch

from kvserve.core.kv_cache_spec import KV_FORMATS, KVFormat

#: largest code magnitude of the symmetric formats
QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}
#: smallest stored scale (float16's smallest normal)
MIN_SCALE = 2.0 ** -14

_UNQUANTIZED = {getattr(torch, f.torch_dtype): f for f in KV_FORMATS.values() if not f.quantized}


def cache_format(cache: torch.Tensor, head_size: int) -> KVFormat:
    """The storage format of cache rows ``cache[..., row]`` holding ``head_size`` values each.

    Raises ValueError when dtype and row width match no format.
    """
    if cache.dtype in _UNQUANTIZED:
        return _UNQUANTIZED[cache.dtype]
    if cache.is_floating_point() and cache.element_size() > 1:  # e.g. a float64 oracle in tests
        return KVFormat(str(cache.dtype), 8 * cache.element_size(), str(cache.dtype).removeprefix("torch."))
    row = cache.shape[-1]
    for f in KV_FORMATS.values():
        if f.quantized and getattr(torch, f.torch_dtype) == cache.dtype and f.row_elems(head_size) == row:
            return f
    raise ValueError(f"no KV format stores head_size {head_size} in rows of {row} {cache.dtype}")


def quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows ``x [..., D]`` (any float dtype) -> ``[..., fmt.row_elems(D)]`` in the storage dtype."""
    store_dtype = getattr(torch, fmt.torch_dtype)
    if not fmt.quantized:
        return x.to(store_dtype)
    xf = x.float()
    if fmt.asymmetric:
        levels = (1 << fmt.bits) - 1
        mn, mx = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
        scale = ((mx - mn) / levels).clamp_min(MIN_SCALE).to(torch.float16)
        zero = mn.to(torch.float16)
        q = torch.floor((xf - zero.float()) / scale.float() + 0.5).clamp_(0, levels).to(torch.int32)
        per_byte = 8 // fmt.bits
        shifts = torch.arange(per_byte, device=x.device, dtype=torch.int32) * fmt.bits
        q = q.view(*q.shape[:-1], q.shape[-1] // per_byte, per_byte)
        codes = (q << shifts).sum(-1).to(torch.uint8)
        tail = torch.cat([scale, zero], -1).view(torch.uint8)
    else:
        qmax = QMAX[fmt.name]
        scale = (xf.abs().amax(-1, keepdim=True) / qmax).clamp_min(MIN_SCALE).to(torch.float16)
        y = xf / scale.float()
        if fmt.name == "int8":
            codes = torch.floor(y + 0.5).clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8)
        else:
            codes = y.clamp_(-qmax, qmax).to(store_dtype).view(torch.uint8)
        tail = scale.view(torch.uint8)
    return torch.cat([codes, tail], -1).view(store_dtype)


def dequantize(rows: torch.Tensor, head_size: int, dtype: torch.dtype, fmt: KVFormat | None = None) -> torch.Tensor:
    """Cache rows ``[..., row]`` -> values ``[..., head_size]`` in ``dtype``.

    The format is read from ``rows`` (``cache_format``) unless given.
    """
    fmt = fmt or cache_format(rows, head_size)
    if not fmt.quantized:
        return rows.to(dtype)
    b = rows.view(torch.uint8)
    nc = head_size * fmt.bits // 8
    codes = b[..., :nc]
    if fmt.asymmetric:
        sz = b[..., nc:nc + 4].contiguous().view(torch.float16).float()
        scale, zero = sz[..., :1], sz[..., 1:2]
        per_byte = 8 // fmt.bits
        shifts = torch.arange(per_byte, device=rows.device, dtype=torch.int32) * fmt.bits
        q = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << fmt.bits) - 1)
        q = q.reshape(*codes.shape[:-1], head_size)
        return (q.float() * scale + zero).to(dtype)
    scale = b[..., nc:nc + 2].contiguous().view(torch.float16).float()
    if fmt.name == "int8":
        vals = codes.view(torch.int8).float()
    else:
        vals = codes.contiguous().view(getattr(torch, fmt.torch_dtype)).float()
    return (vals * scale).to(dtype)
