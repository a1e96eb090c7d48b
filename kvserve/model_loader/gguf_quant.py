"""GGUF kept quantized (``--quantization gguf``): Q4_0 / Q4_1 / Q8_0 blocks repacked for our kernels.

Q4_1 (llama.cpp, per 32 weights: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; ``w = d * q + m``) is
exactly our canonical group-wise INT4 with group 32 (``scale = d``, ``min = m``); Q4_0 (``w = d * (q - 8)``)
is the same with ``min = -8 d``. Q8_0 (``w = d * q``, int8, per 32) has no per-group INT8 kernel in
PyTorch: it is dequantized and requantized per output channel (``quantize_int8``; not exact, the
error is at most half an INT8 step of the row's absmax). Block layouts: ggml-common.h (llama.cpp).
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from kvserve.layers.quantization import apply_prequantized
from kvserve.layers.quantization.kernels import Int4Weight, quantize_int8
from kvserve.model_loader.gguf_dequant import QK, decode_q4, decode_q8_0
from kvserve.model_loader.gguf_loader import gguf_architecture, gguf_to_hf_name, open_gguf, reverse_permute

Int8Weight = tuple  # (q int8 [N, K], scale float32 [N])


def q8_0_to_int8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> per-channel INT8: dequantize, then ``quantize_int8`` (the one requantization)."""
    return quantize_int8(q.float() * d.repeat_interleave(QK, 1))


def _permute(w: Union[Int4Weight, tuple], n_heads: int) -> Union[Int4Weight, tuple]:
    if isinstance(w, Int4Weight):  # rows carry q, scale and min alike
        return Int4Weight(reverse_permute(w.q, n_heads), reverse_permute(w.scale, n_heads),
                          reverse_permute(w.min, n_heads), w.group_size)
    return tuple(reverse_permute(t, n_heads) for t in w)


def read_gguf_quantized(path: str, hf_config: Any) -> dict[str, Union[Int4Weight, tuple]]:
    """HF weight name -> ``Int4Weight`` (Q4_0/Q4_1) or ``(q int8, scale [N])`` (Q8_0), for 2-D tensors.

    Q/K rows are un-permuted for ``llama`` files as ``iterate_gguf`` does. Other types are left out
    (they load dequantized). Raises ValueError on a corrupt file.
    """
    reader = open_gguf(path)
    permute = gguf_architecture(reader) == "llama"
    n_heads = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    out: dict[str, Union[Int4Weight, tuple]] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0") or len(t.shape) != 2:
            continue
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = decode_q4(t.data, kind) if kind != "Q8_0" else q8_0_to_int8(*decode_q8_0(t.data))
        if permute and ".self_attn.q_proj." in name:
            w = _permute(w, n_heads)
        elif permute and ".self_attn.k_proj." in name:
            w = _permute(w, n_kv)
        out[name] = w
    return out


def apply_gguf_quantization(model: nn.Module, quant: dict, dtype: torch.dtype) -> int:
    """Swap each decoder projection whose GGUF shards are all Q4 (or all Q8_0) for a ``QuantizedLinear``.

    ``quant`` from ``read_gguf_quantized``. Others keep their dequantized dense weight. Returns the count.
    """
    return apply_prequantized(model, quant, dtype)
