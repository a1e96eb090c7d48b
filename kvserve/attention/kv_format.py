"""The KV format object: one per KV cache spec, carried from allocation to the kernels.

``kvserve.core.kv_cache_spec.KVFormat`` is the pure-Python description of a
``--kv-cache-dtype`` (bits, scale bytes, flags; the scheduler reads it). ``KVCacheFormat`` is
its torch side for one head size: the storage dtype, the page layout of codes and scales
(``kv_quant.py``), the store and load routines every torch path uses, whether the format
rotates the head dimension (``kv_rotation.py``) or keeps the filling block exact
(``kv_residual.py``), and the Triton kernel variant it selects (``kernel_code``).

``KVCacheView`` binds one attention layer's cache tensor to its format, with the layer's
rotation matrix and exact-filling-block residual; ``Attention`` hands it to the backend on
every forward, so nothing below re-derives the format from a tensor's dtype or row width.

A new format (say MLA's latent: one row per token, no heads) is a ``KVCacheSpec`` whose
``format`` names a ``KVFormat``, a ``KVCacheFormat`` with its own store / load, and a backend
that reads it; the model runner and the scheduler only see specs and views.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.attention import kv_quant
from kvserve.core.kv_cache_spec import KVCacheSpec, KVFormat, get_kv_format

#: the Triton kernels' ``KV_FMT`` constexpr per format name (0: plain values, read and cast)
KERNEL_CODES = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3, "int4": 4, "int2": 5,
                "mla_fp8_e4m3": 1}  # e4m3 codes too (read by triton/mla_decode.py's FP8 variant)


@dataclass(frozen=True)
class KVCacheFormat:
    """A KV storage format for rows of ``head_size`` values (the torch side of ``KVFormat``).

    A layer's cache is ``[2, num_blocks, block_size, num_kv_heads, row_elems]`` in
    ``storage_dtype``; index 0 holds K, 1 holds V. Quantized pages hold codes then scales
    (``kv_quant.py``).
    """

    desc: KVFormat
    head_size: int

    # ---- what it is -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.desc.name

    @property
    def quantized(self) -> bool:
        return self.desc.quantized

    @property
    def rotated(self) -> bool:
        """K and V are stored (and attended) rotated by ``kv_rotation.rotation_matrix``."""
        return self.desc.rotated

    @property
    def residual(self) -> bool:
        """Each request's filling block is also kept exact (``kv_residual.py``)."""
        return self.desc.residual

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(torch, self.desc.torch_dtype)

    @property
    def row_elems(self) -> int:
        return self.desc.row_elems(self.head_size)

    @property
    def kernel_code(self) -> int:
        """The Triton kernels' ``KV_FMT`` (``triton/kv_load.py``): 0 reads plain values."""
        return KERNEL_CODES.get(self.name, 0)

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, self.row_elems)

    def rotation(self, device: torch.device | str = "cpu") -> Optional[torch.Tensor]:
        """``R [head_size, head_size]`` float32 on ``device`` for a rotated format, else None."""
        if not self.rotated:
            return None
        from kvserve.attention.kv_rotation import rotation_matrix

        return rotation_matrix(self.head_size, device)

    # ---- rows and pages ---------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Values ``[..., head_size]`` -> rows ``[..., row_elems]`` in the storage dtype."""
        return kv_quant.quantize(x, self.desc)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[..., row_elems]`` (codes then scale bytes) -> values ``[..., head_size]``."""
        return kv_quant.dequantize(rows, self.head_size, dtype, self.desc)

    def dequantize_pages(self, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pages ``[..., block_size, Hkv, row_elems]`` -> values ``[..., block_size, Hkv, head_size]``."""
        return kv_quant.dequantize_pages(pages, self.head_size, dtype, self.desc)

    def pages_to_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages -> per-row form (a copy; plain formats: unchanged)."""
        return kv_quant.pages_to_rows(pages, self.head_size, self.desc) if self.quantized else pages

    def page_views(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided ``(codes, scales)`` views of quantized pages (``kv_quant.page_views``)."""
        return kv_quant.page_views(pages, self.head_size, self.desc)

    def bytes_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` as bytes when its elements are one byte (torch has no float8
        ``index_select`` / ``index_copy_``), else unchanged."""
        return cache.view(torch.uint8) if cache.element_size() == 1 else cache

    # ---- store and load (the torch reference; kernels mirror it) -------------------------
    def store(self, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[T, Hkv, head_size]`` (any float dtype) quantized into
        their flat slots of ``cache``; ``slot_mapping [T]`` int64, negative ids skipped."""
        _, num_blocks, block_size, hkv, row = cache.shape
        key, value = self.quantize(key), self.quantize(value)
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        if self.quantized:  # codes and scales go to their places in the block's page
            kv_quant.scatter_rows(cache, self.head_size, slot_mapping, key, value, self.desc)
            return
        k_flat = cache[0].view(num_blocks * block_size, hkv, row)
        v_flat = cache[1].view(num_blocks * block_size, hkv, row)
        if cache.element_size() == 1:
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            key, value = key.view(torch.uint8), value.view(torch.uint8)
        k_flat.index_copy_(0, slot_mapping, key)
        v_flat.index_copy_(0, slot_mapping, value)

    def gather(self, cache: torch.Tensor, block_tables: torch.Tensor,
               num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows ``[R, num_blocks * block_size, Hkv, row_elems]`` (storage dtype, per-row
        form: ``dequantize`` turns them into values) of the first ``num_blocks`` blocks of each
        row of ``block_tables [R, >= num_blocks]``."""
        r = block_tables.shape[0]
        _, _, bs, hkv, row = cache.shape
        idx = block_tables[:, :num_blocks].reshape(-1).long()
        b = self.bytes_view(cache)
        out = []
        for half in (b[0], b[1]):
            # index_select copies whole pages; several times faster than advanced indexing on the CPU.
            pages = half.index_select(0, idx)
            if self.quantized:
                pages = kv_quant.pages_to_rows(pages, self.head_size, self.desc)
            out.append(pages.view(r, num_blocks * bs, hkv, row).view(cache.dtype))
        return out[0], out[1]

    def load_blocks(self, cache: torch.Tensor, half: int, block_ids: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """Values ``[len(block_ids), block_size, Hkv, head_size]`` in ``dtype`` of K (``half``
        0) or V (1) of the pages ``block_ids`` (int64, device)."""
        pages = self.bytes_view(cache)[half].index_select(0, block_ids).view(cache.dtype)
        return self.dequantize_pages(pages, dtype)

    def copy_slots(self, cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy-on-write: K and V of flat slots ``src_slots`` into ``dst_slots`` (codes and scales)."""
        kv_quant.copy_slots(cache, self.head_size, src_slots, dst_slots, self.desc)


@dataclass(frozen=True)
class MLALatentFormat(KVCacheFormat):
    """Multi-head latent attention's cache rows (``KVFormat.latent``; DeepSeek-V2,
    arXiv:2405.04434): per token one row ``[kv_lora_rank + qk_rope_head_dim]`` -- the
    normalized KV latent, then the RoPE'd shared key -- and nothing else. ``mla_fp8_e4m3``
    stores the row as e4m3 codes with one fp16 scale per token (``encode`` / ``decode``).

    The cache is ``[1, num_blocks, block_size, 1, head_size]`` in the storage dtype: the
    leading and head axes of the K/V layout stay (size 1) so that block copies, tiers and
    views that index ``cache[:, block_ids]`` work unchanged; there is no V half. ``store``
    takes the rows as ``key`` ``[T, 1, head_size]`` and ignores ``value``; ``gather`` and
    ``load_blocks`` return the rows (``value`` None).
    """

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        if num_kv_heads != 1:
            raise ValueError(f"an MLA latent cache has one row per token, got num_kv_heads={num_kv_heads}")
        return (1, num_blocks, block_size, 1, self.row_elems)

    #: fp8 e4m3's largest finite value (codes = x / scale with scale = amax / FP8_MAX)
    FP8_MAX = 448.0

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Values ``[..., head_size]`` -> storage rows ``[..., row_elems]``: cast, or (fp8) e4m3
        codes of ``x / scale`` then the row's fp16 ``scale = amax / 448`` (zero padding after)."""
        if not self.quantized:
            return rows.to(self.storage_dtype)
        x = rows.float()
        scale = (x.abs().amax(dim=-1, keepdim=True) / self.FP8_MAX).clamp(min=1e-6).half()
        codes = (x / scale.float()).clamp(-self.FP8_MAX, self.FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        out = torch.zeros(*rows.shape[:-1], self.row_elems, dtype=torch.uint8, device=rows.device)
        out[..., : self.head_size] = codes
        out[..., self.head_size:self.head_size + 2] = scale.view(torch.uint8)
        return out

    def decode(self, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Storage rows ``[..., row_elems]`` -> values ``[..., head_size]`` in ``dtype``."""
        if not self.quantized:
            return raw.to(dtype)
        codes = raw[..., : self.head_size].contiguous().view(torch.float8_e4m3fn).float()
        scale = raw[..., self.head_size:self.head_size + 2].contiguous().view(torch.float16).float()
        return (codes * scale).to(dtype)

    def copy_slots(self, cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy-on-write: whole rows (codes and scale together) of ``src_slots`` into ``dst_slots``."""
        flat = cache[0].view(-1, self.row_elems)
        flat.index_copy_(0, dst_slots, flat.index_select(0, src_slots))

    def store(self, key: torch.Tensor, value: Optional[torch.Tensor], cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write latent rows ``key [T, 1, head_size]`` (or ``[T, head_size]``) at their slots
        (``slot_mapping [T]`` int64, negative ids skipped), encoded in the storage format."""
        rows = self.encode(key.reshape(key.shape[0], 1, self.head_size))
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, rows = slot_mapping[keep], rows[keep]
        flat = cache[0].view(-1, 1, self.row_elems)
        flat.index_copy_(0, slot_mapping, rows)

    def gather(self, cache: torch.Tensor, block_tables: torch.Tensor,
               num_blocks: int) -> tuple[torch.Tensor, None]:
        """Rows ``[R, num_blocks * block_size, 1, head_size]`` of the first ``num_blocks`` blocks
        of each row of ``block_tables``, and None (no V)."""
        r = block_tables.shape[0]
        idx = block_tables[:, :num_blocks].reshape(-1).long()
        pages = cache[0].index_select(0, idx)
        return pages.view(r, num_blocks * cache.shape[2], 1, self.row_elems), None

    def load_blocks(self, cache: torch.Tensor, half: int, block_ids: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[len(block_ids), block_size, 1, head_size]`` in ``dtype`` (``half`` must be 0)."""
        if half != 0:
            raise ValueError("an MLA latent cache has no V half")
        return self.decode(cache[0].index_select(0, block_ids), dtype)


#: ``KVFormat.name`` -> the ``KVCacheFormat`` subclass serving it (default: ``KVCacheFormat``).
#: A format with its own page layout or routines (MLA's latent, head-less cache) registers
#: its class here; the model runner and the scheduler stay as they are.
FORMAT_CLASSES: dict[str, type[KVCacheFormat]] = {
    "mla_float32": MLALatentFormat, "mla_bfloat16": MLALatentFormat, "mla_float16": MLALatentFormat,
    "mla_fp8_e4m3": MLALatentFormat,
}


@functools.lru_cache(maxsize=None)
def kv_format_for(name: str, head_size: int) -> KVCacheFormat:
    """The format object of ``--kv-cache-dtype name`` for rows of ``head_size`` values.

    Raises ValueError for an unknown name."""
    desc = get_kv_format(name)
    return FORMAT_CLASSES.get(desc.name, KVCacheFormat)(desc, head_size)


def format_of_spec(spec: KVCacheSpec) -> KVCacheFormat:
    """The format object of a layer's ``KVCacheSpec``."""
    return kv_format_for(spec.dtype, spec.head_size)


def plain_format(dtype: torch.dtype, head_size: int) -> KVCacheFormat:
    """An unquantized format storing values in ``dtype`` (any float dtype, e.g. a float64
    oracle in tests). Raises ValueError for one-byte or non-float dtypes."""
    if not dtype.is_floating_point or torch.empty((), dtype=dtype).element_size() < 2:
        raise ValueError(f"{dtype} is not a plain KV storage dtype; name the format (kv_format_for)")
    name = str(dtype).removeprefix("torch.")
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    return KVCacheFormat(KVFormat(name, bits, name), head_size)


@dataclass
class KVCacheView:
    """One attention layer's KV cache as the backend sees it (bound by ``bind_kv_cache``).

    Attributes:
        cache: ``[2, num_blocks, block_size, num_kv_heads, row_elems]`` in the format's dtype.
        format: its ``KVCacheFormat``.
        rotation: ``[head_size, head_size]`` float32 on the cache's device when the layer
            stores and attends in a rotated basis (``format.rotated``), else None.
        values_rotated: the layer's value and output projections hold ``rotation``
            (``kv_rotation.bind_value_rotation``): v arrives as ``v R`` and the output leaves
            rotated.
        residual: ``[2, slots + 1, 2, block_size, num_kv_heads, head_size]`` in the compute
            dtype when the layer keeps each request's filling block exact (``kv_residual.py``;
            bound by the metadata builder), else None.
        sinks: ``[num_heads]`` float32, the layer's learned attention sinks (gpt-oss: one extra
            logit per query head in the softmax denominator, with no value), else None. Set from
            the layer (``Attention.sinks``) when the view is bound.
    """

    cache: torch.Tensor
    format: KVCacheFormat
    rotation: Optional[torch.Tensor] = None
    values_rotated: bool = False
    residual: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None

    @classmethod
    def bind(cls, cache: torch.Tensor, fmt: KVCacheFormat) -> "KVCacheView":
        """A view of ``cache`` in format ``fmt``, with its rotation on the cache's device.
        Raises ValueError when the tensor's dtype or row width is not the format's."""
        if cache.dtype != fmt.storage_dtype or cache.shape[-1] != fmt.row_elems:
            raise ValueError(f"a {fmt.name} cache of head_size {fmt.head_size} is {fmt.storage_dtype} rows of "
                             f"{fmt.row_elems}, got {cache.dtype} rows of {cache.shape[-1]}")
        return cls(cache, fmt, fmt.rotation(cache.device))

    @property
    def block_size(self) -> int:
        return self.cache.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.cache.shape[3]


def view_of(cache: torch.Tensor, fmt: KVCacheFormat | str | None = None, head_size: int | None = None,
            residual: Optional[torch.Tensor] = None, rotate: bool = False) -> KVCacheView:
    """A ``KVCacheView`` of ``cache`` for tests and benchmarks that drive a backend directly:
    ``fmt`` a format object, a ``--kv-cache-dtype`` name (with ``head_size``, default the
    rows' width), or None for a plain cache of the tensor's own float dtype. ``rotate``: bind
    the format's rotation (int4 / int2) as ``bind_kv_cache`` does; by default none, so q/k/v
    are attended in the basis given. ``residual``: the exact filling block, if any."""
    if fmt is None:
        fmt = plain_format(cache.dtype, cache.shape[-1])
    elif isinstance(fmt, str):
        fmt = kv_format_for(fmt, head_size if head_size is not None else cache.shape[-1])
    view = KVCacheView.bind(cache, fmt)
    if not rotate:
        view.rotation = None
    view.residual = residual
    return view
