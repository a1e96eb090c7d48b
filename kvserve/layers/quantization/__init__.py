"""Weight quantization (``--quantization``): which formats exist, where they run, and applying them.

``int4``: weight-only, group-wise asymmetric INT4 (group 128, or the largest of 64/32 dividing K),
int4pack (tinygemm) or the Triton W4A16 GEMM on CUDA; on the CPU int4pack with bfloat16 activations, a
per-call dequantization + dense matmul with float32 (``cpu_int4``). ``int8``: weight-only per-channel symmetric INT8.
``fp8``: per-channel FP8 e4m3 weights with per-token dynamic FP8 activations (W8A8: ``torch._scaled_mm``
above ``fp8_w8a8.W8A8_MIN_M`` rows, the norm before the GEMM emitting the FP8 input; the weight-only
Triton GEMV below; CUDA compute capability >= 8.9; refused on the CPU, where the op exists but is
~1000x slower, unless ``KVSERVE_FP8_EMULATE=1`` selects the float32 emulation). HF FP8 checkpoints
(``quant_method: fp8``, per-tensor / per-channel or 128 x 128 block scales) load as stored
(``model_loader.fp8_checkpoint``). ``gguf``: a GGUF's Q4_0/Q4_1 tensors repacked into the INT4
layout (exact) and Q8_0 into per-channel INT8, instead of dequantized (``gguf_quant``).
``gptq`` / ``awq`` (and vLLM's ``gptq_marlin`` / ``awq_marlin`` names): pre-quantized GPTQ / AutoAWQ
checkpoints (auto-detected from config.json), repacked into the Triton W4A16 GEMM's layout on CUDA
(``triton_w4a16``) and int4pack / ``cpu_int4`` on the CPU (``model_loader.gptq_awq``, ``group_quant``).
``compressed-tensors``: a pre-quantized HF checkpoint (llm-compressor / vLLM format; auto-detected
from config.json) loaded as stored: INT4 group-wise, INT8 and FP8 per channel
(``model_loader.compressed_tensors_quant``; its kernels are checked here as int4 / int8 / fp8).
The decoder's linear layers are quantized; embeddings, norms and the LM head stay in the model dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve.layers.quantization.fp8_w8a8 import Fp8BlockWeight, attach_fp8_norms, emulate_on_cpu
from kvserve.layers.quantization.kernels import Fp8Weight, Int4Weight
from kvserve.layers.quantization.linear import QuantizedLinear

QUANTIZATION_METHODS = ("int4", "int8", "fp8", "gguf", "compressed-tensors",
                        "gptq", "awq", "gptq_marlin", "awq_marlin")
# Decoder projections that are quantized (packed names of kvserve.models.llama).
QUANTIZED_LAYER_SUFFIXES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

__all__ = ["QUANTIZATION_METHODS", "QuantizedLinear", "check_quantization", "quantize_model"]


def check_quantization(method: Optional[str], device: str, dtype: str, load_format: str,
                       device_checks: bool = True) -> None:
    """Raise ValueError (at start-up) when ``method`` cannot run on ``device`` / with this model.

    ``device_checks=False`` skips the CUDA capability query (for the early check before config load).
    """
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    if method == "gguf" and load_format != "gguf":
        raise ValueError(f"--quantization gguf keeps a GGUF file's quantized weights; this model is {load_format}")
    if method == "compressed-tensors" and load_format != "safetensors":
        raise ValueError(f"--quantization compressed-tensors loads a pre-quantized HF safetensors checkpoint; "
                         f"this model is {load_format}")
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin") and load_format not in ("safetensors", "dummy"):
        raise ValueError(f"--quantization {method} loads a pre-quantized HF safetensors checkpoint; "
                         f"this model is {load_format}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"unsupported dtype {dtype!r} for quantized weights")
    if device == "cuda" and device_checks:
        if method in ("int4", "gguf") and dtype != "bfloat16":
            raise ValueError(f"--quantization {method} on CUDA needs --dtype bfloat16 (tinygemm int4 kernel)")
        if method == "fp8":
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (8, 9):
                raise ValueError(f"--quantization fp8 needs a GPU with FP8 tensor cores (compute capability "
                                 f">= 8.9); this one is {major}.{minor}")
    elif device != "cuda" and method == "fp8" and not emulate_on_cpu():
        # torch._scaled_mm runs on the CPU but ~1000x slower than bf16 (docs/benchmarks/weight-quant.md): refuse it.
        raise ValueError("--quantization fp8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); "
                         "on the CPU use int8, int4 or (GGUF models) gguf")


def quantized_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, attribute, linear)`` for each decoder projection that quantization replaces."""
    out = []
    for name, module in model.named_modules():
        for attr in QUANTIZED_LAYER_SUFFIXES:
            child = getattr(module, attr, None)
            if isinstance(child, nn.Linear):
                out.append((module, attr, child))
    return out


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, dtype: torch.dtype, group_size: int = 128) -> int:
    """Replace the decoder's ``nn.Linear`` projections by ``QuantizedLinear`` (dynamic quantization), and
    quantize MoE experts in place where the layer supports ``method`` (``FusedMoE.quantize_experts``:
    fp8, int8; other methods leave the experts dense).

    Returns the number of layers replaced or quantized. Raises ValueError for an unknown method.
    """
    n = 0
    for parent, attr, linear in quantized_linears(model):
        setattr(parent, attr, QuantizedLinear.from_dense(linear, method, dtype, group_size))
        n += 1
    for module in list(model.modules()):
        quantize_experts = getattr(module, "quantize_experts", None)  # MoE layers (kvserve.layers.moe)
        if callable(quantize_experts) and quantize_experts(method):
            n += 1
    attach_fp8_norms(model)
    return n


# Packed projection -> its HF shards, in packing order (kvserve.models.llama).
PACKED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _cat_shards(shards: list, dev: torch.device, dtype: torch.dtype, bias) -> Optional[QuantizedLinear]:
    """One ``QuantizedLinear`` from same-format shards (rows concatenated), or None if the formats differ."""
    if all(isinstance(s, Int4Weight) for s in shards):
        if len({s.group_size for s in shards}) != 1:
            return None
        w = Int4Weight(torch.cat([s.q for s in shards]), torch.cat([s.scale for s in shards]),
                       torch.cat([s.min for s in shards]), shards[0].group_size)
        return QuantizedLinear.from_int4(w, bias, dev, dtype)
    if all(isinstance(s, Fp8Weight) for s in shards):
        w = Fp8Weight(torch.cat([s.q for s in shards]), torch.cat([s.scale for s in shards]))
        return QuantizedLinear.from_fp8(w, bias, dev, dtype)
    if all(isinstance(s, Fp8BlockWeight) for s in shards):
        w = Fp8BlockWeight(torch.cat([s.q for s in shards]), torch.cat([s.scale for s in shards]))
        return QuantizedLinear.from_fp8_block(w, bias, dev, dtype)
    if all(isinstance(s, tuple) for s in shards):  # INT8: (q int8 [N, K], scale float32 [N])
        return QuantizedLinear.from_int8(torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards]),
                                         bias, dev, dtype)
    return None


@torch.no_grad()
def apply_prequantized(model: nn.Module, quant: dict, dtype: torch.dtype) -> int:
    """Swap each decoder projection whose HF shards are all pre-quantized in one format for a ``QuantizedLinear``.

    ``quant``: HF weight name (``model.layers.0.self_attn.q_proj.weight``) -> ``Int4Weight``,
    ``Fp8Weight``, ``Fp8BlockWeight`` or INT8 ``(q, scale)``. q/k/v and gate/up shards are concatenated along the
    output rows, as the dense packing does. Projections with a missing shard or mixed formats keep
    their dense weight. Returns the number of layers swapped.
    """
    names = {id(m): n for n, m in model.named_modules()}
    n_done = 0
    for parent, attr, linear in quantized_linears(model):
        prefix = names[id(parent)]
        shards = [quant.get(f"{prefix}.{s}.weight") for s in PACKED_SHARDS.get(attr, (attr,))]
        if any(s is None for s in shards):
            continue
        bias = linear.bias.detach() if linear.bias is not None else None
        new = _cat_shards(shards, linear.weight.device, dtype, bias)
        if new is not None:
            setattr(parent, attr, new)
            n_done += 1
    attach_fp8_norms(model)
    return n_done


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and quantized weight buffers (what a decode step reads, roughly)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [b for n, b in model.named_buffers() if "qweight" in n]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
