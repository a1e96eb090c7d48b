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
from kvserve.attention.kv_residual import residual_shape, store_residual
from kvserve.attention.kv_quant import aligned_for_vector_loads
from kvserve.attention.kv_rotation import kv_rotation_for
from kvserve.attention.kv_rotation import rotate as rotate_rows
from kvserve.attention.triton.decode import decode_attention
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


def _residual_written_early(meta: AttentionMetadata, block_size: int) -> bool:
    """Whether the store kernel may write the step's exact rows (``kv_residual``) before attention:
    a request's writes then overwrite no row its queries read (those below ``ctx``, in the
    parity of ``ctx``'s block) as long as its tokens stay within ``ctx``'s block and the next
    one (decode and verify steps, every CUDA-graph step). Host lists only; cached per step."""
    early = meta.backend_cache.get("residual_early")
    if early is None:
        early = meta.backend_cache["residual_early"] = all(
            s - 1 < (s - q) // block_size * block_size + 2 * block_size
            for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu))
    return early


class TritonBackend(AttentionBackend):
    """Store, then decode (split-KV) + prefill kernels; see ``AttentionBackend.forward``.

    Shapes: query ``[T, H, D]``; key/value ``[T, Hkv, D]``; kv_cache
    ``[2, num_blocks, block_size, Hkv, D]`` (any float dtype; loaded then cast to the query
    dtype). Returns ``[T, H, D]`` in the query dtype; rows not owned by any request
    (padding) are left unwritten. With ``kv_residual`` the kernels read each query's own
    block exactly (``kv_exact``); without it they are the plain variants.
    """

    name = "triton"
    cuda_graph_safe = True
    fuses_kv_rotation = True  # every head size it runs is a power of two: R = H_D / sqrt(D)

    def __init__(self, decode_num_splits: int | None = None) -> None:
        self.decode_num_splits = decode_num_splits

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

    def warmup(self, kv_cache: torch.Tensor, num_heads: int, head_size: int, dtype: torch.dtype,
               sliding_windows: set[int | None], values_rotated: bool = False, residual: bool = False) -> None:
        """Compile, at start-up, every kernel variant a step can need: the decode kernels for
        each split-count class (1 split takes a direct path; the reduce kernel is specialized
        on the padded split count) and the prefill kernel, per sliding-window setting, so
        no request waits for a compile mid-serving. ``values_rotated``: the layers hold the
        int4/int2 value rotation in their weights (the store kernel rotates q, decode does not).
        ``residual``: the layers keep their own blocks exact (``forward``'s ``kv_residual``):
        the residual variants are compiled instead of the plain ones.
        Reads only the null block; stores nothing.
        """
        hkv, d = kv_cache.shape[3], head_size  # the last dim is a packed row for quantized formats
        dev = kv_cache.device
        q = torch.zeros(1, num_heads, d, dtype=dtype, device=dev)
        kv = torch.zeros(1, hkv, d, dtype=dtype, device=dev)
        bt = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        lens = torch.ones(1, dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        rotate = kv_rotation_for(kv_cache, head_size) is not None and _rotates_inside(num_heads, hkv)
        slot = torch.full((1,), -1, dtype=torch.long, device=dev)
        res = {}
        k_out = v_out = None
        if residual:  # a one-slot residual; a step of length 1 reads only its new row
            bs = kv_cache.shape[2]
            res = dict(kv_residual=torch.zeros(residual_shape(1, bs, hkv, d), dtype=dtype, device=dev),
                       residual_slots=torch.zeros(1, dtype=torch.int32, device=dev), new_key=kv, new_value=kv)
            k_out = v_out = torch.empty_like(kv) if rotate else None
        if rotate and values_rotated:
            store_kv(kv, kv, kv_cache, slot, rotate=True, rotate_value=False, query=q, key_out=k_out)
            rotate = False
        else:
            store_kv(kv, kv, kv_cache, slot, rotate=rotate, key_out=k_out, value_out=v_out)
        for window in sliding_windows:
            for splits in (1, 2, 3, 5, 9, 17):  # S_PAD 2, 4, 8, 16, 32 and the direct path
                decode_attention(q, kv_cache, bt, lens, qsl, 1, 1, 1.0, window, num_splits=splits, rotate=rotate,
                                 **res)
            prefill_attention(q, kv_cache, bt, lens, qsl, 0, 1, 1, 1.0, window, **res)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """The Triton store kernel (bounded-KV groups store with it, then attend with the
        reference ``AttentionBackend.forward_bounded``)."""
        store_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_rotation: torch.Tensor | None = None,
        values_rotated: bool = False,
        kv_residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``AttentionBackend.forward``; with ``kv_rotation`` (the int4/int2 matrix ``R``) the
        cache holds ``k R`` and ``v R``, rotated in the store kernel.

        - ``values_rotated`` (the layer's weights hold ``R``: ``value`` arrives as ``v R`` and
          the output leaves rotated, ``kv_rotation.bind_value_rotation``): the store kernel
          also writes ``query R``, and the decode and prefill kernels run as for any format.
        - otherwise the decode kernel rotates q on entry and its output back (no extra
          launches in decode steps), and prefill/extend rows are rotated around their kernel
          in torch: on sm_90 (Triton 3.6) the in-kernel rotation miscomputes (64 rows) or
          faults (128 rows) in that kernel's wgmma tiles (``benchmarks/rotation_probe.py``;
          ``benchmarks/results/issue12_h100_rotation/``).

        query, key and (unless ``values_rotated``) value and the output are in the model's basis.

        ``kv_residual`` (``[2, num_slots + 1, 2, block_size, Hkv, D]``, compute dtype; needs
        ``meta.residual_slots`` / ``meta.residual_slot_mapping``): each query reads its own block
        exactly (``kvserve/attention/kv_residual.py``), in the kernels (``kv_exact``); the new rows,
        in the cache's basis (rotated by the store kernel when it rotates), are then written to it.
        """
        rotate = kv_rotation is not None
        if rotate and not _rotates_inside(query.shape[1], key.shape[1]):
            q, k = rotate_rows(query, kv_rotation), rotate_rows(key, kv_rotation)
            v = value if values_rotated else rotate_rows(value, kv_rotation)
            out = self.forward(q, k, v, kv_cache, meta, scale, sliding_window, kv_residual=kv_residual)
            return out if values_rotated else rotate_rows(out, kv_rotation.T)
        res, k_out, v_out, early = {}, None, None, {}
        if kv_residual is not None:  # the new rows as the cache holds them: the store kernel's if it rotates
            if rotate:
                k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
                v_out = None if values_rotated else torch.empty(value.shape, dtype=value.dtype, device=value.device)
            res = dict(kv_residual=kv_residual, residual_slots=meta.residual_slots,
                       new_key=key if k_out is None else k_out, new_value=value if v_out is None else v_out)
            if _residual_written_early(meta, kv_cache.shape[2]):
                early = dict(kv_residual=kv_residual, residual_slot_mapping=meta.residual_slot_mapping)
        if rotate and values_rotated:
            query = store_kv(key, value, kv_cache, meta.slot_mapping, rotate=True, rotate_value=False, query=query,
                             key_out=k_out, **early)
            rotate = False  # q R against k R: no kernel below rotates
        else:
            store_kv(key, value, kv_cache, meta.slot_mapping, rotate=rotate, key_out=k_out, value_out=v_out, **early)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_reqs = meta.seq_lens.shape[0]
        nd = meta.num_decodes
        if nd > 0:
            decode_attention(
                query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                nd, meta.max_seq_len, scale, sliding_window, out=out,
                num_splits=self.decode_num_splits, rotate=rotate, **res,
            )
        if num_reqs > nd:
            q_p, out_p = (rotate_rows(query, kv_rotation), torch.empty_like(out)) if rotate else (query, out)
            prefill_attention(
                q_p, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                nd, num_reqs - nd, meta.max_query_len, scale, sliding_window, out=out_p, **res,
            )
            if rotate:  # the prefill rows follow the decodes' (one row each)
                out[nd:] = rotate_rows(out_p[nd:], kv_rotation.T)
        if kv_residual is not None and not early:  # after both kernels read the rows it overwrites
            store_residual(res["new_key"], res["new_value"], kv_residual, meta.residual_slot_mapping)
        return out
