"""``TritonBackend``: paged attention with Triton kernels (name ``"triton"``).

One forward is: the store kernel (new K/V -> cache slots), then the split-KV decode kernel
for the first ``num_decodes`` requests (query length 1) and the FlashAttention-2 style
prefill/extend kernel for the rest. Grid sizes come only from tensor shapes and the host
ints ``max_query_len`` / ``max_seq_len`` / ``num_decodes`` of the metadata; nothing in
``forward`` reads device values back (no ``.item()`` / ``.tolist()``), so it can be
captured in a CUDA graph for fixed host ints.
"""

from __future__ import annotations

import logging

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import KVCacheFormat, KVCacheView
from kvserve.attention.kv_quant import aligned_for_vector_loads
from kvserve.attention.kv_residual import residual_shape, store_residual
from kvserve.attention.kv_rotation import rotate as rotate_rows
from kvserve.attention.triton.cascade import CascadeMetadataBuilder, cascade_decode_attention
from kvserve.attention.triton.decode import decode_attention
from kvserve.attention.triton.decode_configs import decode_warmup_configs
from kvserve.attention.triton.kv_store import store_kv
from kvserve.attention.triton.prefill import prefill_attention
from kvserve.core.kv_cache_spec import KVCacheSpec

logger = logging.getLogger(__name__)
_WARNED: set = set()


def _rotates_inside(num_heads: int, num_kv_heads: int) -> bool:
    """Whether the store / decode kernels rotate int4/int2 K, V, q in their own tiles: their
    rotation dots have ``max(16, query heads per KV head)`` / ``max(16, KV heads)`` rows, and
    above 32 rows Triton takes the sm_90 wgmma path, which miscomputed the rotation in the
    prefill kernel (``benchmarks/rotation_probe.py``); then the backend rotates around them."""
    return max(num_heads // num_kv_heads, num_kv_heads) <= 32


class TritonBackend(AttentionBackend):
    """Store, then decode (split-KV) + prefill kernels; see ``AttentionBackend.forward``.

    Shapes: query ``[T, H, D]``; key/value ``[T, Hkv, D]``; kv_cache
    ``[2, num_blocks, block_size, Hkv, D]`` (any float dtype; loaded then cast to the query
    dtype). Returns ``[T, H, D]`` in the query dtype; rows not owned by any request
    (padding) are left unwritten. The kernels' feature switches come from the layer's view:
    ``KV_FMT`` from its format, ``ROTATE`` from its rotation, ``HAS_RESIDUAL`` (each query
    reads its own block exactly, ``kv_exact``) from its exact filling block, ``HAS_SINKS`` from
    its learned attention sinks (``kv.sinks``, gpt-oss).
    """

    name = "triton"
    cuda_graph_safe = True
    supports_attention_sinks = True  # HAS_SINKS in the decode, reduce and prefill kernels
    fuses_kv_rotation = True  # every head size it runs is a power of two: R = H_D / sqrt(D)
    #: plans cascade attention for decode requests sharing prefix blocks (``cascade.py``)
    metadata_builder_cls = CascadeMetadataBuilder

    def __init__(self, decode_num_splits: int | None = None,
                 enable_cascade_attention: bool | None = None) -> None:
        self.decode_num_splits = decode_num_splits
        #: None: on with CUDA, off on the CPU (``AttentionConfig.enable_cascade_attention``)
        self.enable_cascade_attention = enable_cascade_attention

    def configure(self, attention_config) -> None:
        """Take ``enable_cascade_attention`` from the engine's ``AttentionConfig``."""
        self.enable_cascade_attention = getattr(attention_config, "enable_cascade_attention", None)

    def cascade_enabled(self, device: torch.device) -> bool:
        """Whether the metadata builder plans cascade attention on ``device``."""
        on = self.enable_cascade_attention
        return device.type == "cuda" if on is None else bool(on)

    def validate_spec(self, spec: KVCacheSpec) -> None:
        """As the base class; also warns (once per shape) when a quantized cache's code rows
        cannot be 16-byte aligned (``kv_quant.aligned_for_vector_loads``): still correct, but
        the kernels then load codes in narrower pieces."""
        super().validate_spec(spec)
        fmt = spec.format
        key = (fmt.name, spec.head_size, spec.block_size, spec.num_kv_heads)
        if key not in _WARNED and not aligned_for_vector_loads(fmt, spec.head_size, spec.block_size,
                                                               spec.num_kv_heads):
            _WARNED.add(key)
            logger.warning(
                "%s KV cache with head_size %d, block_size %d, %d KV heads: code rows of %d bytes / pages of %d "
                "bytes are not multiples of 16, so the Triton kernels cannot use 16-byte loads (slower, still "
                "correct); head_size * bits / 8 and block_size * kv_heads * row must be multiples of 16",
                fmt.name, spec.head_size, spec.block_size, spec.num_kv_heads, spec.head_size * fmt.bits // 8,
                spec.page_size_bytes // 2)

    def warmup(self, kv: KVCacheView, num_heads: int, dtype: torch.dtype,
               sliding_windows: set[int | None]) -> None:
        """Compile, at start-up, every kernel variant a step can need: the decode kernels for
        each split-count class (1 split takes a direct path; the reduce kernel is specialized
        on the padded split count) and the prefill kernel, per sliding-window setting, so
        no request waits for a compile mid-serving. The view says the rest: its format, its
        rotation (with ``values_rotated`` the store kernel rotates q, decode does not) and its
        exact filling block (the residual variants are compiled instead of the plain ones).
        Reads only the null block; stores nothing.
        """
        kv_cache, fmt = kv.cache, kv.format
        if fmt.desc.latent:  # MLA layers: kvserve/attention/triton/mla_decode.py compiles on first use
            return
        hkv, d = kv_cache.shape[3], fmt.head_size  # the last dim is a packed row for quantized formats
        dev = kv_cache.device
        q = torch.zeros(1, num_heads, d, dtype=dtype, device=dev)
        new = torch.zeros(1, hkv, d, dtype=dtype, device=dev)
        bt = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        lens = torch.ones(1, dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        rotate = kv.rotation is not None and _rotates_inside(num_heads, hkv)
        slot = torch.full((1,), -1, dtype=torch.long, device=dev)
        res = {}
        k_out = v_out = None
        if kv.residual is not None:  # a one-slot residual; a step of length 1 reads only its new row
            bs = kv_cache.shape[2]
            res = dict(kv_residual=torch.zeros(residual_shape(1, bs, hkv, d), dtype=dtype, device=dev),
                       residual_slots=torch.zeros(1, dtype=torch.int32, device=dev), new_key=new, new_value=new)
            k_out = v_out = torch.empty_like(new) if rotate else None
        if rotate and kv.values_rotated:
            store_kv(new, new, kv_cache, slot, rotate=True, rotate_value=False, query=q, key_out=k_out,
                     kv_format=fmt)
            rotate = False
        else:
            store_kv(new, new, kv_cache, slot, rotate=rotate, key_out=k_out, value_out=v_out, kv_format=fmt)
        configs = decode_warmup_configs(q, kv_cache, fmt)
        for window in sliding_windows:
            for cfg, split_counts in configs:  # each config the batch sizes can pick (DECODE_CONFIGS)
                for splits in split_counts:  # the direct path, each S_PAD of the reduce kernel
                    decode_attention(q, kv_cache, bt, lens, qsl, 1, 1, 1.0, window, num_splits=splits, rotate=rotate,
                                     kv_format=fmt, sinks=kv.sinks, block_n=cfg.block_n, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, page_tile=cfg.page_tile,
                                     fuse_reduce=cfg.fuse_reduce, fp8_keys_rows=cfg.fp8_keys_rows,
                                     fp8_pv=cfg.fp8_pv, v_bytes=cfg.v_bytes, **res)
            chunk = {}  # the variant that reads the chunk's own K/V (the one _attend runs)
            if not res and kv.rotation is None and (fmt.kernel_code or kv_cache.dtype == dtype):
                chunk = dict(new_key=new, new_value=new)
            prefill_attention(q, kv_cache, bt, lens, qsl, 0, 1, 1, 1.0, window, kv_format=fmt, sinks=kv.sinks,
                              **res, **chunk)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv: KVCacheView,
                 slot_mapping: torch.Tensor) -> None:
        """The Triton store kernel (bounded-KV groups store with it, then attend with the
        reference ``AttentionBackend.forward_bounded``)."""
        store_kv(key, value, kv.cache, slot_mapping, kv_format=kv.format)

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
        """``AttentionBackend.attend``; with a rotation (the view's int4/int2 matrix ``R``) the
        cache holds ``k R`` and ``v R``, rotated in the store kernel.

        - ``kv.values_rotated`` (the layer's weights hold ``R``: ``value`` arrives as ``v R`` and
          the output leaves rotated, ``kv_rotation.bind_value_rotation``): the store kernel
          also writes ``query R``, and the decode and prefill kernels run as for any format.
        - otherwise the decode kernel rotates q on entry and its output back (no extra
          launches in decode steps), and prefill/extend rows are rotated around their kernel
          in torch: on sm_90 (Triton 3.6) the in-kernel rotation miscomputes (64 rows) or
          faults (128 rows) in that kernel's wgmma tiles (``benchmarks/rotation_probe.py``).

        query, key and (unless ``values_rotated``) value and the output are in the model's basis.

        With an exact filling block (the view's ``residual``, ``meta.residual``) each query
        reads its own block exactly (``kvserve/attention/kv_residual.py``), in the kernels
        (``kv_exact``); the new rows, in the cache's basis (rotated by the store kernel when it
        rotates), are then written to it.
        """
        kv_residual = kv.residual if meta.residual is not None else None
        r, folded = kv.rotation, kv.values_rotated
        if r is not None and not _rotates_inside(query.shape[1], key.shape[1]):
            q, k = rotate_rows(query, r), rotate_rows(key, r)
            v = value if folded else rotate_rows(value, r)
            out = self._attend(q, k, v, kv.cache, kv.format, meta, scale, sliding_window, None, False, kv_residual,
                               kv.sinks, chunk_kv=False)
            return out if folded else rotate_rows(out, r.T)
        return self._attend(query, key, value, kv.cache, kv.format, meta, scale, sliding_window, r, folded,
                            kv_residual, kv.sinks)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                fmt: KVCacheFormat, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                kv_rotation: torch.Tensor | None, values_rotated: bool,
                kv_residual: torch.Tensor | None, sinks: torch.Tensor | None = None,
                chunk_kv: bool = True) -> torch.Tensor:
        rotate = kv_rotation is not None
        res, k_out, v_out, early = {}, None, None, {}
        if kv_residual is not None:  # the new rows as the cache holds them: the store kernel's if it rotates
            if rotate:
                k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
                v_out = None if values_rotated else torch.empty(value.shape, dtype=value.dtype, device=value.device)
            res = dict(kv_residual=kv_residual, residual_slots=meta.residual.slots,
                       new_key=key if k_out is None else k_out, new_value=value if v_out is None else v_out)
            if meta.residual.written_early:
                early = dict(kv_residual=kv_residual, residual_slot_mapping=meta.residual.slot_mapping)
        if rotate and values_rotated:
            query = store_kv(key, value, kv_cache, meta.slot_mapping, rotate=True, rotate_value=False, query=query,
                             key_out=k_out, kv_format=fmt, **early)
            rotate = False  # q R against k R: no kernel below rotates
        else:
            store_kv(key, value, kv_cache, meta.slot_mapping, rotate=rotate, key_out=k_out, value_out=v_out,
                     kv_format=fmt, **early)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_reqs = meta.seq_lens.shape[0]
        nd = meta.num_decodes
        plan = getattr(meta, "cascade", None)
        if nd > 0 and plan is not None and sliding_window is None:  # shared prefixes read once per group
            cascade_decode_attention(query, kv_cache, meta.block_tables, plan, meta.query_start_loc, nd, scale, out,
                                     kv_format=fmt, rotate=rotate, kv_rotation=kv_rotation, sinks=sinks, **res)
        elif nd > 0:
            decode_attention(
                query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                nd, meta.max_seq_len, scale, sliding_window, out=out,
                num_splits=self.decode_num_splits, rotate=rotate, kv_format=fmt, sinks=sinks, **res,
            )
        if num_reqs > nd:
            q_p, out_p = (rotate_rows(query, kv_rotation), torch.empty_like(out)) if rotate else (query, out)
            if (chunk_kv and not res and kv_rotation is None and key.dtype == value.dtype == query.dtype
                    and (fmt.kernel_code or kv_cache.dtype == query.dtype)):
                res = dict(new_key=key, new_value=value)  # the chunk's own keys from its K/V rows (prefill.py)
            prefill_attention(
                q_p, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                nd, num_reqs - nd, meta.max_query_len, scale, sliding_window, out=out_p, kv_format=fmt, sinks=sinks,
                tree_mask=meta.tree_mask, tree_start=meta.tree_start, **res,
            )
            if rotate:  # the prefill rows follow the decodes' (one row each)
                out[nd:] = rotate_rows(out_p[nd:], kv_rotation.T)
        if kv_residual is not None and not early:  # after both kernels read the rows it overwrites
            store_residual(res["new_key"], res["new_value"], kv_residual, meta.residual.slot_mapping)
        return out
