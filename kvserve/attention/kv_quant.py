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
  rows never change after they are written, so prefix sharing, tiers and transfers move
  pages unchanged. KIVI's other half, recent tokens in full precision, is kept: each
  request's filling block is also held exact in the compute dtype and a query reads its
  own block from there (``KVFormat.residual``, ``kvserve/attention/kv_residual.py``); this
  module's pages are written for every token all the same. The outlier channels of K
  that make per-token keys lossy are spread first: the
  attention layer stores (and attends with) ``k R`` and ``v R``, ``R`` an orthogonal
  Hadamard rotation of the head dimension (QuaRot, Ashkboos et al., arXiv:2404.00456;
  ``kvserve/attention/kv_rotation.py``, ``KVFormat.rotated``), so the rows this module
  quantizes are already rotated; it never sees ``R``. The accuracy cost is measured by
  ``kvserve bench accuracy`` (SmolLM2-135M: int4 +10.8% perplexity without the rotation).

Layout (this module owns it; ``kvserve/attention/triton/kv_load.py`` and ``kv_store.py`` are
its Triton mirror). One layer's cache is allocated as ``[2, num_blocks, block_size,
num_kv_heads, row]`` in the format's storage dtype (one byte per element), ``row = C + S``
with ``C = D * bits / 8`` code bytes and ``S`` scale bytes (2: one float16 scale; 4: float16
scale then float16 minimum, int4/int2). For quantized formats that shape only sizes the
page: the bytes of one block of K (likewise V), a *page* of ``P = block_size * num_kv_heads
* row`` bytes, hold first the codes of every (slot, kv_head) row, then all their scales,
head-major::

    page[0 : block_size*Hkv*C]            codes  [block_size, Hkv, C]   uint8
    page[block_size*Hkv*C : P]            scales [Hkv, block_size, S/2] float16

so byte ``k`` of the codes of slot ``t``, KV head ``h`` is at ``(t * Hkv + h) * C + k`` and
its scale (and minimum) at ``block_size * Hkv * C + (h * block_size + t) * S`` (+2). Pages are
whole blocks, so anything that moves whole blocks (CPU / disk / remote tiers) moves scales
with them. ``page_views`` gives strided ``(codes, scales)`` views of any tensor of pages;
``pages_to_rows`` / ``rows_to_pages`` convert to and from the per-row form ``[..., row]``
(codes then scale bytes) that ``quantize`` / ``dequantize`` work on; ``quantize_pages`` /
``dequantize_pages`` go straight between values and pages; ``scatter_rows`` (the torch
store) and ``copy_slots`` (copy-on-write of some slots of a block) write both regions.
Why: the kernels load a tile of codes as 16-byte vectors; that needs ``C`` and the page
size to be multiples of 16 (``aligned_for_vector_loads``: D*bits/8 % 16 == 0, i.e. D >= 16
for 8-bit, >= 32 for int4, >= 64 for int2, and block_size * Hkv * row % 16 == 0, true for
any block_size >= 8 since row is even). The scales are head-major so that the scales of
consecutive slots of one KV head are contiguous: a kernel reading a tile of keys of one
head loads them as vectors (``block_size * S`` bytes per page). Other shapes are still read correctly (the Triton
compiler then emits narrower loads; a start-up warning says so). Scales are float16 and at
least ``MIN_SCALE`` (the smallest normal float16), so a constant row never divides by zero.
Rounding is ``floor(y + 0.5)`` (the Triton store kernel does the same). The disk tier's
content key carries the layout version (``kv_connector/block_hash.py``: v4, head-major
scales and rotated int4 / int2 content) and the P2P handshake's ``kv_layout`` both
(``kv_scales``, ``kv_rotation``).
"""

from __future__ import annotations

import torch

from kvserve.core.kv_cache_spec import KVFormat

#: largest code magnitude of the symmetric formats
QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}
#: smallest stored scale (float16's smallest normal)
MIN_SCALE = 2.0 ** -14

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


def dequantize(rows: torch.Tensor, head_size: int, dtype: torch.dtype, fmt: KVFormat) -> torch.Tensor:
    """Cache rows ``[..., row]`` of format ``fmt`` (codes then scale bytes) -> values
    ``[..., head_size]`` in ``dtype``."""
    if not fmt.quantized:
        return rows.to(dtype)
    b = rows.view(torch.uint8)
    nc = code_bytes(fmt, head_size)
    scales = b[..., nc:nc + scale_bytes(fmt)].contiguous().view(torch.float16)
    return _dequantize_parts(b[..., :nc], scales, head_size, dtype, fmt)


def _dequantize_parts(codes: torch.Tensor, scales: torch.Tensor, head_size: int, dtype: torch.dtype,
                      fmt: KVFormat) -> torch.Tensor:
    """Code bytes ``[..., C]`` (uint8) and float16 scales ``[..., n_scale]`` -> ``[..., head_size]``."""
    sz = scales.float()
    if fmt.asymmetric:
        scale, zero = sz[..., :1], sz[..., 1:2]
        per_byte = 8 // fmt.bits
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * fmt.bits
        q = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << fmt.bits) - 1)
        q = q.reshape(*codes.shape[:-1], head_size)
        return (q.float() * scale + zero).to(dtype)
    scale = sz[..., :1]
    if fmt.name == "int8":
        vals = codes.view(torch.int8).float()
    else:
        vals = codes.contiguous().view(getattr(torch, fmt.torch_dtype)).float()
    return (vals * scale).to(dtype)


# ---- page layout ---------------------------------------------------------------------------

def code_bytes(fmt: KVFormat, head_size: int) -> int:
    """``C``: code bytes of one (token, KV head) row."""
    return head_size * fmt.bits // 8


def scale_bytes(fmt: KVFormat) -> int:
    """``S``: scale bytes of one (token, KV head) row of K or of V (2, or 4 with a minimum)."""
    return fmt.scale_bytes_per_token_head // 2


def aligned_for_vector_loads(fmt: KVFormat, head_size: int, block_size: int, num_kv_heads: int) -> bool:
    """True if every row's codes start on a 16-byte boundary (``C`` and the page size are
    multiples of 16), so the kernels can load codes as 16-byte vectors. Unquantized: True."""
    if not fmt.quantized:
        return True
    c = code_bytes(fmt, head_size)
    return c % 16 == 0 and (block_size * num_kv_heads * (c + scale_bytes(fmt))) % 16 == 0


def _page_bytes(pages: torch.Tensor, head_size: int, fmt: KVFormat):
    if not fmt.quantized:
        raise ValueError(f"{fmt.name} caches have no page layout (rows are plain values)")
    *lead, bs, hkv, row = pages.shape
    b = pages.view(torch.uint8)
    if b.stride()[-3:] != (hkv * row, row, 1):
        raise ValueError("the last three dims of a tensor of pages must be contiguous (one page each)")
    c = code_bytes(fmt, head_size)
    if row != c + scale_bytes(fmt):
        raise ValueError(f"rows of {row} bytes do not hold {fmt.name} codes of head_size {head_size}")
    flat = b.flatten(-3)  # a view: the page dims are contiguous
    return fmt, flat, bs, hkv, c


def page_views(pages: torch.Tensor, head_size: int, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided views ``(codes, scales)`` of quantized pages ``[..., block_size, Hkv, row]``
    (e.g. a whole cache ``[2, num_blocks, ...]`` or gathered blocks): codes
    ``[..., block_size, Hkv, C]`` uint8 and scales ``[..., block_size, Hkv, n_scale]``
    float16 (n_scale 1, or 2 = scale, minimum; stored head-major, so this view is transposed).
    Writing them writes the pages."""
    fmt, flat, bs, hkv, c = _page_bytes(pages, head_size, fmt)
    n = bs * hkv * c
    codes = flat[..., :n].unflatten(-1, (bs, hkv, c))
    # stored head-major [Hkv, block_size, n_scale]; viewed slot-major like the codes
    scales = flat[..., n:].unflatten(-1, (hkv, bs, scale_bytes(fmt))).view(torch.float16).transpose(-3, -2)
    return codes, scales


def pages_to_rows(pages: torch.Tensor, head_size: int, fmt: KVFormat) -> torch.Tensor:
    """Pages ``[..., block_size, Hkv, row]`` -> per-row form (same shape and dtype, each row
    its codes then its scale bytes), as ``quantize`` writes and ``dequantize`` reads. A copy."""
    codes, scales = page_views(pages, head_size, fmt)
    return torch.cat([codes, scales.view(torch.uint8)], -1).view(pages.dtype)


def rows_to_pages(rows: torch.Tensor, head_size: int, fmt: KVFormat) -> torch.Tensor:
    """The inverse of ``pages_to_rows``: rows ``[..., block_size, Hkv, row]`` -> pages (a new tensor)."""
    out = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    codes, scales = page_views(out, head_size, fmt)
    b = rows.view(torch.uint8)
    c = codes.shape[-1]
    codes.copy_(b[..., :c])
    scales.view(torch.uint8).copy_(b[..., c:])
    return out


def quantize_pages(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Values ``[..., block_size, Hkv, D]`` -> a cache (pages) ``[..., block_size, Hkv, row]``
    in the storage dtype (unquantized formats: just the cast)."""
    rows = quantize(x, fmt)
    return rows_to_pages(rows, x.shape[-1], fmt) if fmt.quantized else rows


def dequantize_pages(pages: torch.Tensor, head_size: int, dtype: torch.dtype, fmt: KVFormat) -> torch.Tensor:
    """Pages ``[..., block_size, Hkv, row]`` of format ``fmt`` -> values ``[..., block_size, Hkv, head_size]``."""
    if not fmt.quantized:
        return pages.to(dtype)
    codes, scales = page_views(pages, head_size, fmt)
    return _dequantize_parts(codes, scales, head_size, dtype, fmt)


def copy_slots(cache: torch.Tensor, head_size: int, src_slots: torch.Tensor, dst_slots: torch.Tensor,
               fmt: KVFormat) -> None:
    """Copy the K and V of flat slots ``src_slots`` into ``dst_slots`` (in place) of a cache
    ``[2, num_blocks, block_size, Hkv, row]`` of format ``fmt``, codes and scales when quantized."""
    bs = cache.shape[2]
    if not fmt.quantized:
        flat = (cache.view(torch.uint8) if cache.element_size() == 1 else cache).flatten(1, 2)
        flat.index_copy_(1, dst_slots, flat.index_select(1, src_slots))
        return
    sb, so = src_slots // bs, src_slots % bs
    db, do = dst_slots // bs, dst_slots % bs
    for part in page_views(cache, head_size, fmt):
        part[:, db, do] = part[:, sb, so]


def scatter_rows(cache: torch.Tensor, head_size: int, slots: torch.Tensor, k_rows: torch.Tensor,
                 v_rows: torch.Tensor, fmt: KVFormat) -> None:
    """Write per-row K/V ``[num_tokens, Hkv, row]`` (``quantize``'s output) at flat ``slots``
    (all >= 0) of a quantized cache ``[2, num_blocks, block_size, Hkv, row]``."""
    bs = cache.shape[2]
    blk, off = slots // bs, slots % bs
    codes, scales = page_views(cache, head_size, fmt)
    c = codes.shape[-1]
    for i, rows in enumerate((k_rows, v_rows)):
        b = rows.view(torch.uint8)
        codes[i].index_put_((blk, off), b[..., :c])
        scales[i].index_put_((blk, off), b[..., c:].contiguous().view(torch.float16))
