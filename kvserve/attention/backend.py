"""The attention backend interface: capabilities, KV cache allocation, forward."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.attention.forward_context import AttentionMetadata
from kvserve.core.kv_cache_spec import KVCacheSpec


class AttentionBackend(ABC):
    """Computes attention for a flat varlen batch over a paged KV cache.

    A backend declares which KV storage formats it reads (``supported_kv_dtypes``), and
    allocates and interprets a layer's cache from its ``KVCacheSpec``. The default layout
    (per layer) is ``[2, num_blocks, block_size, num_kv_heads, row]`` in the format's
    torch dtype; index 0 holds K, 1 holds V; ``row`` is ``head_size`` for unquantized formats
    and the codes plus their scales for quantized ones (``KVFormat.row_elems``); for those the
    shape only sizes each block's page, laid out as codes then scales
    (``kvserve/attention/kv_quant.py``). The cache dtype may differ from the compute dtype.
    """

    name: str = "abstract"
    # True if forward never reads device values back, so a CUDA graph can capture it.
    cuda_graph_safe: bool = False
    #: True if ``forward`` takes ``kv_rotation=R`` (int4/int2, ``kvserve/attention/kv_rotation.py``)
    #: and rotates inside its kernels (q, K, V in; the output back); else ``Attention.forward``
    #: rotates around the call.
    fuses_kv_rotation: bool = False
    #: ``--kv-cache-dtype`` values this backend reads natively.
    supported_kv_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8",
                                            "int4", "int2")

    def validate_spec(self, spec: KVCacheSpec) -> None:
        """Raise ValueError (listing the choices) if this backend cannot serve ``spec``."""
        if spec.dtype not in self.supported_kv_dtypes:
            raise ValueError(f"attention backend {self.name!r} cannot read a {spec.dtype!r} KV cache; "
                             f"it supports {list(self.supported_kv_dtypes)}")

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.format.row_elems(spec.head_size))

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
        """A zeroed cache tensor for one layer (zeros: masked slots never hold NaN)."""
        self.validate_spec(spec)
        dtype = getattr(torch, spec.format.torch_dtype)
        return torch.zeros(self.kv_cache_shape(spec, num_blocks), dtype=dtype, device=device)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write new K/V ``[T, Hkv, d]`` into their slots (``slot_mapping [T]`` int64, < 0 skipped)."""
        from kvserve.attention.torch_ref import store_kv

        store_kv(key, value, kv_cache, slot_mapping)

    def forward_bounded(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        kv_rotation: torch.Tensor | None = None) -> torch.Tensor:
        """Store, then attend over a bounded KV cache (``meta.bounded``: StreamingLLM sinks +
        window or H2O's kept blocks; ``kvserve.attention.bounded``). The default is the reference
        implementation for every backend; shapes as ``forward``. ``kv_rotation`` (``[d, d]``
        float32): q/k/v come in this rotated basis (``kvserve/attention/kv_rotation.py``); the
        sink queries' rotary shift is then applied in the unrotated basis."""
        from kvserve.attention.bounded import bounded_attention

        self.store_kv(key, value, kv_cache, meta.slot_mapping)
        qsl = meta.backend_cache.get("qsl_list")
        if qsl is None:
            qsl = meta.backend_cache["qsl_list"] = meta.query_start_loc.tolist()
        return bounded_attention(query, kv_cache, meta.bounded, qsl, scale, kv_rotation)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store the new K/V into their slots, then attend.

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]`` for the new tokens.
            kv_cache: this layer's cache, written in place.
            meta: the batch description.
            scale: softmax scale (usually ``head_size ** -0.5``).
            sliding_window: if set, a query at position p sees keys in ``(p - window, p]``.

        Returns:
            ``[num_tokens, num_heads, head_size]`` in the query's dtype.
        """
