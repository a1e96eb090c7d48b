"""GGUF block types decoded (llama.cpp's Q4_0 / Q4_1 / Q8_0, F16, F32): the dequantizer.

Per 32 weights: Q4_0 is fp16 ``d`` and 16 bytes of nibbles, ``w = d * (q - 8)``; Q4_1 adds an fp16
``m``, ``w = d * q + m``; Q8_0 is fp16 ``d`` and 32 int8, ``w = d * q``. Block layouts:
ggml-common.h (llama.cpp). ``decode_q4`` / ``decode_q8_0`` keep the codes (for
``--quantization gguf``, ``gguf_quant``); ``dequantize_tensor`` gives float32 values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvserve.layers.quantization.kernels import Int4Weight

QK = 32  # weights per block in Q4_0 / Q4_1 / Q8_0


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
