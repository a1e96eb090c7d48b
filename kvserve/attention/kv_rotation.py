"""Orthogonal rotation of the head dimension for the int4 / int2 KV cache formats (QuaRot).

Per-token min/max quantization of keys loses most of its precision to a few outlier
channels (KIVI, Liu et al., arXiv:2402.02750). Rotating the head dimension by an orthogonal
matrix ``R`` (``R R^T = I``) spreads each outlier over all channels first (QuaRot, Ashkboos
et al., arXiv:2404.00456), so the per-token scale of ``k R`` is set by the row's norm, not by
its largest channel. Attention is unchanged in exact arithmetic:

- scores: ``(q R) . (k R) = q R R^T k^T = q . k``;
- output: ``softmax(s) (v R) R^T = softmax(s) v``.

So the layer's ``KVCacheView`` carries ``R`` (``kvserve/attention/kv_format.py``) and
``AttentionBackend.forward`` attends with ``q R``, ``k R``, ``v R`` (after RoPE, which the
models apply before attention) and multiplies the output by ``R^T`` -- unless the backend
rotates inside its own kernels (``AttentionBackend.fuses_kv_rotation``: Triton's store and
decode kernels build ``H_D`` in registers, ``triton/kv_load.hadamard_rotate``), which then
reads ``R`` from the view and gets the unrotated tensors. The cache layout does not know.
Every stored row stays per token (a block never changes after it is written: prefix
sharing, copy-on-write and the tiers work unchanged); the cache content is in the rotated
basis, which the disk tier's key version and the P2P ``kv_layout`` (field ``kv_rotation``)
name, so a rotated cache is never mixed with an unrotated one.

Which formats rotate: those with ``KVFormat.rotated`` (int4, int2; ``KVCacheFormat.rotation``). Unquantized, fp8 and
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


def _projections(model: torch.nn.Module) -> dict[int, tuple]:
    """``{id(attention layer): (qkv_proj, o_proj, q_size, kv_size)}`` for every attention
    module of ``model`` built as ``qkv_proj -> attn -> o_proj`` (the Llama / Gemma 3 layout)."""
    out = {}
    for m in model.modules():
        attn, qkv, o = getattr(m, "attn", None), getattr(m, "qkv_proj", None), getattr(m, "o_proj", None)
        if attn is not None and qkv is not None and o is not None and hasattr(m, "q_size"):
            out[id(attn)] = (qkv, o, m.q_size, m.kv_size)
    return out


def _dense(linear: torch.nn.Module) -> bool:
    w = getattr(linear, "weight", None)
    return isinstance(linear, torch.nn.Linear) and w is not None and w.is_floating_point() and not w.is_meta


@torch.no_grad()
def _apply(qkv: torch.nn.Linear, o: torch.nn.Linear, q_size: int, kv_size: int, r: torch.Tensor) -> None:
    """``W_v <- R^T W_v`` (and ``b_v <- b_v R``) per KV head, ``W_o <- W_o R`` per query head."""
    d = r.shape[0]
    r = r.to(qkv.weight.device)
    v = qkv.weight[q_size + kv_size: q_size + 2 * kv_size]  # [kv heads * d, hidden]
    hv = v.float().view(-1, d, v.shape[-1])
    v.copy_((r.T @ hv).view_as(v))
    if qkv.bias is not None:
        b = qkv.bias[q_size + kv_size: q_size + 2 * kv_size]
        b.copy_((b.float().view(-1, d) @ r).view_as(b))
    w = o.weight  # [hidden, heads * d]
    w.copy_((w.float().view(w.shape[0], -1, d) @ r.to(w.device)).view_as(w))


def bind_value_rotation(model: torch.nn.Module) -> None:
    """Fold the value half of each attention layer's KV rotation into its weights, where they
    are dense: ``v R`` comes straight out of ``qkv_proj`` (``W_v <- R^T W_v``, ``b_v <- b_v R``
    per KV head) and ``o_proj`` takes the rotated attention output (``W_o <- W_o R`` per query
    head), so attention never rotates values or outputs (QuaRot, arXiv:2404.00456, folds its
    rotations into weights the same way). Values carry no RoPE, so this is exact up to the
    weights' rounding, and the cache holds the same ``v R`` either way; only q and k (rotated
    after RoPE) still rotate at run time.

    Call after every ``Attention.kv_rotation`` is bound (``bind_kv_cache`` does). Sets each
    layer's ``Attention.values_rotated_by`` (the folded matrix, float32 on the CPU, or None).
    Idempotent: a layer folded with the same matrix is left alone; one folded with another
    matrix, or now unrotated, is unfolded first. Quantized (non-dense) projections are left
    as they are: the backend then rotates values and outputs itself.
    """
    proj = _projections(model)
    for attn in (m for m in model.modules() if hasattr(m, "values_rotated_by")):
        p = proj.get(id(attn))
        r = attn.kv_rotation.float().cpu() if attn.kv_rotation is not None else None
        old = attn.values_rotated_by
        if old is not None and (r is None or not torch.equal(old, r)):
            _apply(*p, old.T.contiguous())  # undo (R orthogonal: R^-1 = R^T)
            attn.values_rotated_by = old = None
        if r is not None and old is None and p is not None and _dense(p[0]) and _dense(p[1]):
            _apply(*p, r)
            attn.values_rotated_by = r
