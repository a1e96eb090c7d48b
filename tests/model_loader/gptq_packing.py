"""GPTQ / AWQ checkpoint writers for the tests: min/max round-to-nearest quantization and the packing.

The values need not be calibrated (the tests check the storage format, not the quantizer); the packing
is exactly what the reference tools write:

* GPTQ (AutoGPTQ ``QuantLinear.pack`` / GPTQModel): ``qweight`` int32 ``[K / p, N]`` with ``p = 32 / bits``
  values per word packed along K from the low bits up (field ``j`` of row ``i`` = input feature
  ``p*i + j``); ``qzeros`` int32 ``[G, N / p]`` packed along N the same way, holding ``z - 1`` (the v1
  convention) or ``z`` (``checkpoint_format: gptq_v2``); ``scales`` float16 ``[G, N]``; ``g_idx`` int32
  ``[K]``, the group of each input feature. With ``desc_act`` the groups are formed in a permuted
  (activation) order, so ``g_idx`` is not sorted, while ``qweight`` stays in the original feature order.
  Symmetric (``sym: true``): ``z = 2^(bits-1)`` everywhere (stored as ``2^(bits-1) - 1`` in v1).
* AWQ (AutoAWQ ``WQLinear_GEMM.from_linear``, version "gemm"): ``qweight`` int32 ``[K, N / 8]`` and
  ``qzeros`` int32 ``[G, N / 8]`` packed along N in the interleaved order ``(0, 2, 4, 6, 1, 3, 5, 7)``
  (field ``i`` of word ``c`` = column ``8c + order[i]``), ``scales`` float16 ``[G, N]``.

Both dequantize as ``w = scales * (q - z)`` (``dequant``: the tests' reference).
"""

from __future__ import annotations

import json
import os

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_rtn(w: torch.Tensor, q: dict, perm: torch.Tensor | None = None):
    """Min/max RTN per group -> (q uint8 [N, K] in feature order, scales fp16 [G, N], zeros int [G, N], g_idx [K]).

    ``w``: float ``[N, K]``; ``q``: the ``quantization_config``. ``perm``: the activation order (GPTQ's
    ``desc_act`` sorts by the Hessian diagonal of the layer's input, so projections reading the same
    input -- q/k/v, gate/up -- share it); ignored without ``desc_act``, required with it.
    """
    n, k = w.shape
    bits = q["bits"]
    maxq = (1 << bits) - 1
    g = k if q["group_size"] == -1 else q["group_size"]
    act_order = bool(q.get("desc_act"))
    assert perm is not None or not act_order, "desc_act needs the activation order"
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)  # the i-th column in activation order -> group i // g
    else:
        g_idx = (torch.arange(k) // g).to(torch.int32)
    wp = (w[:, perm] if act_order else w).reshape(n, k // g, g)
    if q.get("sym", False):
        scale = (wp.abs().amax(-1) / ((maxq + 1) // 2 - 1)).half().float()
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        lo, hi = wp.amin(-1), wp.amax(-1)
        scale = ((hi - lo) / maxq).half().float()
        # v1 stores z - 1, so z = 0 would wrap (AutoGPTQ's known overflow): keep z >= 1 there
        zmin = 1 if q["quant_method"] == "gptq" and q.get("checkpoint_format", "gptq") == "gptq" else 0
        zero = (-lo / scale).round().clamp(zmin, maxq)
    qp = ((wp / scale[..., None]).round() + zero[..., None]).clamp(0, maxq).reshape(n, k)
    qv = qp
    if act_order:
        qv = torch.empty_like(qp)
        qv[:, perm] = qp
    return qv.to(torch.uint8), scale.t().half().contiguous(), zero.t().to(torch.int64).contiguous(), g_idx


def dequant(qv, scales, zeros, g_idx) -> torch.Tensor:
    """The reference: ``w[n, k] = scales[g_idx[k], n] * (q[n, k] - zeros[g_idx[k], n])`` in float32."""
    gi = g_idx.long()
    return scales.float().t()[:, gi] * (qv.float() - zeros.float().t()[:, gi])  # [N, K], contiguous


def pack_words(v: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack int ``v`` along ``dim`` into int32 words, field j from the low bits (``order``: AWQ's field->column)."""
    p = 32 // bits
    v = v.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // p, p)
    if order is not None:
        v = v[..., list(order)]  # field i holds column order[i]
    word = ((v & ((1 << bits) - 1)) << (bits * torch.arange(p))).sum(-1)  # one pass: the real model has 210 layers
    word = (word - ((word >> 31) << 32)).to(torch.int32)  # [2^31, 2^32) -> negative: the same 32 bits
    return word.movedim(-1, dim).contiguous()


def pack_layer(tensors: dict, layer: str, w: torch.Tensor, q: dict, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``w [N, K]`` and store ``layer``'s tensors in ``q``'s format into ``tensors``.

    Returns the dequantized weight (float32 ``[N, K]``), what a loader must reproduce exactly.
    """
    qv, sc, z, gi = quantize_rtn(w.float(), q, perm)
    bits = q["bits"]
    if q["quant_method"] == "gptq":
        stored = z - 1 if q.get("checkpoint_format", "gptq") == "gptq" else z  # v1: z - 1
        tensors[f"{layer}.qweight"] = pack_words(qv.t(), bits, 0)
        tensors[f"{layer}.qzeros"] = pack_words(stored, bits, 1)
        tensors[f"{layer}.g_idx"] = gi
    else:
        tensors[f"{layer}.qweight"] = pack_words(qv.t(), bits, 1, AWQ_ORDER)
        tensors[f"{layer}.qzeros"] = pack_words(z, bits, 1, AWQ_ORDER)
    tensors[f"{layer}.scales"] = sc
    return dequant(qv, sc, z, gi)


def add_quantization_config(path: str, q: dict) -> None:
    """Set ``quantization_config`` to ``q`` in ``path``/config.json (as the quantizers' ``save_pretrained`` do)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = q
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
