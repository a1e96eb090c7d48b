"""The attention backend interface: capabilities, KV cache allocation, metadata, forward."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.attention.bounded import bounded_attention
from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import KVCacheView, format_of_spec
from kvserve.attention.kv_rotation import rotate
from kvserve.attention.metadata import AttentionMetadataBuilder
from kvserve.core.kv_cache_spec import KVCacheSpec


class AttentionBackend(ABC):
    """Computes attention for a flat varlen batch over a paged KV cache.

    A backend declares which KV storage formats it reads (``supported_kv_dtypes``), and
    allocates a layer's cache from its ``KVCacheSpec``. The layout (per layer) is the format
    object's (``kvserve/attention/kv_format.py``): ``[2, num_blocks, block_size, num_kv_heads,
    row]`` in the format's torch dtype; index 0 holds K, 1 holds V; ``row`` is ``head_size``
    for unquantized formats and the codes plus their scales for quantized ones; for those the
    shape only sizes each block's page, laid out as codes then scales
    (``kvserve/attention/kv_quant.py``). The cache dtype may differ from the compute dtype.

    Every layer calls ``forward`` with its ``KVCacheView`` (cache, format, rotation, exact
    filling block); the step's ``AttentionMetadata`` comes from the backend's metadata builder
    (``metadata_builder_cls``, ``kvserve/attention/metadata.py``).
    """

    name: str = "abstract"
    # True if forward never reads device values back, so a CUDA graph can capture it.
    cuda_graph_safe: bool = False
    #: True if ``attend`` rotates inside its kernels for a view with a ``rotation`` (int4/int2,
    #: ``kvserve/attention/kv_rotation.py``; q, K, V in, the output back); else ``forward``
    #: rotates around ``attend``.
    fuses_kv_rotation: bool = False
    #: ``--kv-cache-dtype`` values this backend reads natively.
    supported_kv_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8",
                                            "int4", "int2")
    #: True if ``attend`` honours a view's learned attention sinks (``kv.sinks``, gpt-oss);
    #: ``bind_attention`` refuses a model with sinks on a backend without them.
    supports_attention_sinks: bool = False
    #: builds the step's metadata per KV cache group, with CUDA-graph capture / replay hooks
    metadata_builder_cls: type[AttentionMetadataBuilder] = AttentionMetadataBuilder

    def configure(self, attention_config) -> None:
        """Take the engine's ``AttentionConfig`` options (before the metadata builder is made).
        Default: nothing to take."""

    def validate_spec(self, spec: KVCacheSpec) -> None:
        """Raise ValueError (listing the choices) if this backend cannot serve ``spec``. A latent
        (MLA) spec is served by ``kvserve/attention/mla.py`` beside any backend."""
        if spec.format.latent:
            return
        if spec.dtype not in self.supported_kv_dtypes:
            raise ValueError(f"attention backend {self.name!r} cannot read a {spec.dtype!r} KV cache; "
                             f"it supports {list(self.supported_kv_dtypes)}")

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        return format_of_spec(spec).cache_shape(num_blocks, spec.block_size, spec.num_kv_heads)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
        """A zeroed cache tensor for one layer (zeros: masked slots never hold NaN)."""
        self.validate_spec(spec)
        return torch.zeros(self.kv_cache_shape(spec, num_blocks), dtype=format_of_spec(spec).storage_dtype,
                           device=device)

    def warmup(self, kv: KVCacheView, num_heads: int, dtype: torch.dtype,
               sliding_windows: set[int | None]) -> None:
        """Compile, at start-up, every kernel variant a step can need for layers like the one
        of ``kv`` (``num_heads`` query heads, compute ``dtype``, these windows). Default: nothing."""

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv: KVCacheView,
                 slot_mapping: torch.Tensor) -> None:
        """Write new K/V ``[T, Hkv, d]`` into their slots (``slot_mapping [T]`` int64, < 0 skipped)."""
        kv.format.store(key, value, kv.cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv: KVCacheView,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store the new K/V into their slots, then attend.

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: ``[num_tokens, num_kv_heads, head_size]`` for the new tokens (value
                already ``v R`` when ``kv.values_rotated``).
            kv: this layer's cache view, written in place.
            meta: the batch description (its group's).
            scale: softmax scale (usually ``head_size ** -0.5``).
            sliding_window: if set, a query at position p sees keys in ``(p - window, p]``.

        Returns:
            ``[num_tokens, num_heads, head_size]`` in the query's dtype (rotated when
            ``kv.values_rotated``, as ``o_proj`` expects).

        A bounded-KV step (``meta.bounded``) goes to ``forward_bounded``; a rotated view
        (``kv.rotation``) is attended in the rotated basis (scores unchanged), by ``attend``
        itself when the backend ``fuses_kv_rotation``, else around it.
        """
        if meta.bounded is not None:
            return self.forward_bounded(query, key, value, kv, meta, scale)
        r = kv.rotation
        if r is None or self.fuses_kv_rotation:
            return self.attend(query, key, value, kv, meta, scale, sliding_window)
        folded = kv.values_rotated
        out = self.attend(rotate(query, r), rotate(key, r), value if folded else rotate(value, r), kv, meta,
                          scale, sliding_window)
        return out if folded else rotate(out, r.T)

    def forward_bounded(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: KVCacheView,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store, then attend over a bounded KV cache (``meta.bounded``: StreamingLLM sinks +
        window or H2O's kept blocks; ``kvserve.attention.bounded``). The default is the reference
        implementation for every backend; shapes as ``forward``. With a rotation, q/k/v are
        rotated first (the sink queries' rotary shift is then applied in the unrotated basis)."""
        if kv.sinks is not None:  # bind_kv_cache refuses this at start-up; never attend without them
            raise ValueError("bounded KV does not implement learned attention sinks")
        r = kv.rotation
        folded = kv.values_rotated
        if r is not None:
            query, key = rotate(query, r), rotate(key, r)
            value = value if folded else rotate(value, r)
        self.store_kv(key, value, kv, meta.slot_mapping)
        out = bounded_attention(query, kv.cache, kv.format, meta.bounded, scale, r)
        return out if r is None or folded else rotate(out, r.T)

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv: KVCacheView,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``forward`` for a step without bounded KV: store, then attend. q/k/v are in the
        cache's basis unless the backend ``fuses_kv_rotation`` (then it rotates by
        ``kv.rotation``). A view with a ``residual`` and metadata with ``residual`` read each
        query's own block exactly (``kvserve/attention/kv_residual.py``)."""
