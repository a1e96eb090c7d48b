"""GGUF kept quantized (``--quantization gguf``): Q4_0 / Q4_1 / Q8_0 blocks repacked for our kernels.

Q4_1 (llama.cpp, per 32 weights: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; ``w = d * q + m``) is
exactly our canonical group-wise INT4 with group 32 (``scale = d``, ``min = m``); Q4_0 (``w = d * (q - 8)``)
is the same with ``min = -8 d``. Q8_0 (``w = d * q``, int8, per 32) has no per-group INT8 kernel in
PyTorch: it is dequantized and requantized per output channel (``quantize_int8``; not exact, the
error is at most half an INT8 step of the row's absmax). Block layouts: ggml-common.h (llama.cpp).
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch
from torch import nn

from kvserve.layers.quantization import apply_prequantized
from kvserve.layers.quantization.kernels import Int4Weight, quantize_int8
from kvserve.model_loader.gguf_loader import gguf_architecture, gguf_to_hf_name, open_gguf, reverse_permute

QK = 32  # weights per block in Q4_0 / Q4_1 / Q8_0
Int8Weight = tuple  # (q int8 [N, K], scale float32 [N])


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` uint8: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_q4(data: np.ndarray, kind: str) -> Int4Weight:
    """Raw ``Q4_0``/``Q4_1`` rows (uint8 ``[N, blocks * bytes_per_block]``) -> canonical ``Int4Weight`` (group 32)."""
    n = data.shape[0]
    bpb = 20 if kind == "Q4_1" else 18
    blocks = np.ascontiguousarray(data).reshape(n, -1, bpb)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        m = -8.0 * d
        qs = blocks[..., 2:]
    q = _nibbles(qs).reshape(n, -1)
    return Int4Weight(torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(m), QK)


def decode_q8_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw ``Q8_0`` rows -> (q int8 ``[N, K]``, d float32 ``[N, K // 32]``)."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
    return torch.from_numpy(q), torch.from_numpy(d)


def q8_0_to_int8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> per-channel INT8: dequantize, then ``quantize_int8`` (the one requantization)."""
    return quantize_int8(q.float() * d.repeat_interleave(QK, 1))


def dequantize_tensor(data: np.ndarray, tensor_type: Any) -> torch.Tensor:
    """A GGUF tensor's float32 values, bit-identical to ``gguf.quants.dequantize``.

    ``data``: ``ReaderTensor.data`` (float32/float16 ``[..., K]``, or uint8 ``[..., row bytes]`` for
    block types); ``tensor_type``: its ``GGMLQuantizationType``. Returns a new float32 CPU tensor
    ``[..., K]``. F32, F16, Q4_0, Q4_1 and Q8_0 are decoded from the blocks above, with gguf's own
    per-element float32 operations (``d * (q - 8)``, ``d * q + m``, ``q * d``) in one numpy pass per
    tensor (single-threaded: torch's threads only contend on a busy CPU); other types go through
    ``gguf.quants.dequantize``. Raises NotImplementedError for types gguf lacks.
    """
    kind = tensor_type.name
    if kind == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if kind == "F16":
        return torch.from_numpy(data.astype(np.float32))  # a copy: the memory map stays read-only
    if kind not in ("Q4_0", "Q4_1", "Q8_0"):
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(data, tensor_type).copy())
    rows = data.reshape(-1, data.shape[-1])
    if kind == "Q8_0":
        q, d = decode_q8_0(rows)
        w = q.numpy().reshape(q.shape[0], -1, QK).astype(np.float32)
        w *= d.numpy()[..., None]
    else:  # in place: the same float32 operations as gguf's, one buffer
        w4 = decode_q4(rows, kind)
        w = w4.q.numpy().reshape(w4.q.shape[0], -1, QK).astype(np.float32)
        if kind == "Q4_0":
            w -= 8
        w *= w4.scale.numpy()[..., None]
        if kind == "Q4_1":
            w += w4.min.numpy()[..., None]
    return torch.from_numpy(w.reshape(*data.shape[:-1], -1))


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
