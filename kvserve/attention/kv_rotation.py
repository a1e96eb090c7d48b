"""Orthogonal rotation of the head dimension for the int4 / int2 KV cache formats (QuaRot).

Per-token min/max quantization of keys loses most of its precision to a few outlier
channels (KIVI, Liu et al., arXiv:2402.02750). Rotating the head dimension by an orthogonal
matrix ``R`` (``R R^T = I``) spreads each outlier over all channels first (QuaRot, Ashkboos
et al., arXiv:2404.00456), so the per-token scale of ``k R`` is set by the row's norm, not by
its largest channel. Attention is unchanged in exact arithmetic:

- scores: ``(q R) . (k R) = q R R^T k^T = q . k``;
- output: ``softmax(s) (v R) R^T = softmax(s) v``.

So ``Attention.forward`` (``kvserve/layers/attention.py``) hands the backend ``q R``,
``k R``, ``v R`` (after RoPE, which the models apply before calling it) and multiplies its
output by ``R^T`` -- unless the backend rotates inside its own kernels
(``AttentionBackend.fuses_kv_rotation``: Triton's store and decode kernels build ``H_D`` in
registers, ``triton/kv_load.hadamard_rotate``), which then gets ``kv_rotation=R`` and the
unrotated tensors. The cache layout does not know.
Every stored row stays per token (a block never changes after it is written: prefix
sharing, copy-on-write and the tiers work unchanged); the cache content is in the rotated
basis, which the disk tier's key version and the P2P ``kv_layout`` (field ``kv_rotation``)
name, so a rotated cache is never mixed with an unrotated one.

Which formats rotate: those with ``KVFormat.rotated`` (int4, int2). Unquantized, fp8 and
int8 caches are untouched (no matrix is bound, the forward is bit-identical).

The matrix (``rotation_matrix``), for head size ``D``:

- ``D`` a power of two: the normalized Sylvester Hadamard matrix ``H_D / sqrt(D)``
  (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``); entries are exactly ``+-1/sqrt(D)``
  and it is symmetric.
- otherwise (e.g. 80, 96): a fixed-seed random orthogonal matrix, the Q factor of the QR
  decomposition of a float64 standard normal ``D x D`` matrix drawn on the CPU from
  ``torch.Generator().manual_seed(SEED)``, columns' signs fixed so ``diag(R_qr) > 0``
  (Haar-distributed, unique). Unlike a block-diagonal Hadamard, it mixes every channel with
  every other. Its last bits may depend on the LAPACK build (~1e-16), far below any storage
  precision.

Numerics: the matrix is kept in float32; ``rotate`` computes ``x.float() @ R`` and casts
back to ``x``'s dtype (bfloat16 / float16 activations lose only the final rounding).
"""

from __future__ import annotations

import functools

import torch

#: seed of the random orthogonal matrix for head sizes that are not powers of two
SEED = 0
#: the P2P ``kv_layout`` value naming this rotation (bump when the matrix changes)
ROTATION_NAME = "hadamard-v1"


@functools.lru_cache(maxsize=None)
def _matrix_cpu(head_size: int) -> torch.Tensor:
    if head_size < 1:
        raise ValueError(f"head_size must be >= 1, got {head_size}")
    if head_size & (head_size - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_size:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / head_size ** 0.5
    else:
        g = torch.Generator().manual_seed(SEED)
        a = torch.randn(head_size, head_size, generator=g, dtype=torch.float64)
        q, rr = torch.linalg.qr(a)
        r = q * torch.sign(torch.diagonal(rr))[None, :]
    return r.to(torch.float32)


def rotation_matrix(head_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthogonal rotation ``R [head_size, head_size]`` float32 on ``device`` (module docstring).

    Raises ValueError when ``head_size < 1``.
    """
    return _matrix_cpu(head_size).to(device)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x [..., D] @ r [D, D]`` computed in float32, returned in ``x``'s dtype and shape."""
    return (x.float() @ r).to(x.dtype)


def kv_rotation_for(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor | None:
    """The matrix a layer bound to ``kv_cache`` (rows of ``head_size`` values) rotates by, on
    the cache's device, or None when its format does not rotate (``KVFormat.rotated``).

    Raises ValueError when the cache's dtype and row width match no format.
    """
    from kvserve.attention.kv_quant import cache_format

    if not cache_format(kv_cache, head_size).rotated:
        return None
    return rotation_matrix(head_size, kv_cache.device)
