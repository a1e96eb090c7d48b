"""compressed-tensors checkpoints kept quantized (``--quantization compressed-tensors``, auto-detected).

The format llm-compressor writes and vLLM reads: config.json's ``quantization_config`` has
``quant_method: compressed-tensors`` and ``config_groups`` of schemes (``targets``, ``weights``,
``input_activations``, ``format``); ``ignore`` lists layers left dense. Supported, mapped onto our
kernels without requantizing:

- ``pack-quantized`` INT4 weight-only, ``strategy: group`` (32/64/128/256), symmetric or not:
  ``weight_packed`` (int32, 8 values a word; stored q is signed, q + 8 in the word) ->
  ``Int4Weight`` with ``q + 8`` and ``min = -(8 + zero_point) * scale`` (the library dequantizes
  ``(q - zero_point) * scale``; ``weight_zero_point`` is packed along the output rows).
- INT8 weight-only, ``strategy: channel``, symmetric (``pack-quantized`` 8-bit, ``int-quantized``
  or ``naive-quantized``) -> per-channel INT8.
- FP8 ``float-quantized`` weights, ``strategy: channel`` or ``tensor`` -> per-channel FP8 with our
  per-token dynamic FP8 activations (a static ``input_scale`` is ignored, with a warning).

Anything else (other bit widths or group sizes, ``actorder: group`` / ``g_idx``, sparsity,
transforms, activation-quantized INT, a KV-cache scheme) is a ValueError at start-up. The
``compressed-tensors`` package is imported only here, when such a checkpoint is loaded.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from kvserve.layers.quantization import PACKED_SHARDS, quantized_linears
from kvserve.layers.quantization.kernels import INT4_GROUP_SIZES, Fp8Weight, Int4Weight

logger = logging.getLogger(__name__)

CT_METHOD = "compressed-tensors"
SUPPORTED = ("pack-quantized INT4 weight-only with strategy group (group size 32/64/128/256, symmetric or "
             "asymmetric); INT8 weight-only, strategy channel, symmetric (pack-/int-/naive-quantized); FP8 "
             "float-quantized weights, strategy channel or tensor (activations: none, or FP8 - run dynamic per token)")
# Tensors a quantized layer may store besides its bias (the loader takes them; the dense load does not).
_QUANT_TENSORS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                  "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale", "output_scale")


def quantization_config_of(hf_config: Any) -> Optional[dict]:
    """config.json's ``quantization_config`` as a dict (None if absent)."""
    q = getattr(hf_config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return q


def is_compressed_tensors(hf_config: Any) -> bool:
    """True when config.json says ``quantization_config.quant_method == "compressed-tensors"``."""
    q = quantization_config_of(hf_config)
    return bool(q) and q.get("quant_method") == CT_METHOD


@dataclass(frozen=True)
class LayerScheme:
    """How one layer is stored: ``kind`` int4 | int8 | fp8 (our kernel), the checkpoint ``format``, args."""

    kind: str
    format: str
    group_size: Optional[int] = None
    symmetric: bool = True
    strategy: str = "channel"
    static_input: bool = False


def _describe(w: Any, fmt: str) -> str:
    return (f"format {fmt}, {w.type}{w.num_bits} weights, strategy {w.strategy}"
            + (f", group_size {w.group_size}" if w.group_size else "") + (", symmetric" if w.symmetric else ""))


def _classify(group: str, scheme: Any, fmt: Optional[str]) -> LayerScheme:
    """One config group -> ``LayerScheme``; ValueError naming what is unsupported and what is."""
    w, a = scheme.weights, scheme.input_activations
    fmt = scheme.format or fmt or ""

    def bad(reason: str) -> ValueError:
        what = _describe(w, fmt) if w is not None else f"format {fmt}"
        return ValueError(f"compressed-tensors config group {group!r} ({what}) is not supported: {reason}. "
                          f"Supported: {SUPPORTED}")

    if w is None:
        raise bad("no weight quantization (activation-only schemes)")
    if scheme.output_activations is not None:
        raise bad("output activation quantization")
    if w.type == "int":
        if a is not None:
            raise bad(f"INT activation quantization ({a.type}{a.num_bits}); only weight-only INT runs here")
        if w.actorder == "group":
            raise bad("actorder group (g_idx): activation-ordered groups")
        if w.num_bits == 4:
            if fmt != "pack-quantized":
                raise bad("INT4 must be pack-quantized")
            if w.strategy != "group" or w.group_size not in INT4_GROUP_SIZES:
                raise bad(f"INT4 needs strategy group with a group size in {INT4_GROUP_SIZES} (the int4 kernels)")
            return LayerScheme("int4", fmt, w.group_size, bool(w.symmetric), "group")
        if w.num_bits == 8:
            if w.strategy != "channel" or not w.symmetric:
                raise bad("INT8 needs strategy channel and symmetric weights (the per-channel int8 kernel)")
            if fmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
                raise bad(f"INT8 storage {fmt!r}")
            return LayerScheme("int8", fmt)
        raise bad(f"{w.num_bits}-bit INT weights")
    if w.type == "float" and w.num_bits == 8:
        if fmt not in ("float-quantized", "naive-quantized"):
            raise bad(f"FP8 storage {fmt!r}")
        if w.strategy not in ("channel", "tensor") or not w.symmetric:
            raise bad("FP8 weights need strategy channel or tensor, symmetric")
        if a is not None and not (a.type == "float" and a.num_bits == 8):
            raise bad(f"{a.type}{a.num_bits} activations with FP8 weights")
        return LayerScheme("fp8", fmt, strategy=w.strategy, static_input=a is not None and not a.dynamic)
    raise bad(f"{w.type}{w.num_bits} weights")


class CompressedTensorsPlan:
    """The parsed ``quantization_config``: which layer has which ``LayerScheme``.

    Raises ValueError (at start-up) for anything outside ``SUPPORTED``.
    """

    def __init__(self, hf_config: Any) -> None:
        from compressed_tensors.quantization import QuantizationConfig

        raw = quantization_config_of(hf_config) or {}
        for name, group in (raw.get("config_groups") or {}).items():  # the library itself rejects it now
            if isinstance(group, dict) and (group.get("weights") or {}).get("actorder") == "group":
                raise ValueError(f"compressed-tensors config group {name!r}: actorder group (g_idx, activation-"
                                 f"ordered groups) is not supported. Supported: {SUPPORTED}")
        try:
            cfg = QuantizationConfig.model_validate(raw)
        except Exception as e:  # pydantic ValidationError: a malformed quantization_config
            raise ValueError(f"malformed compressed-tensors quantization_config: {e}") from None
        if raw.get("sparsity_config"):
            raise ValueError(f"compressed-tensors sparsity ({raw['sparsity_config'].get('format', '?')}, e.g. 2:4) "
                             f"is not supported. Supported: {SUPPORTED}")
        if raw.get("transform_config"):
            raise ValueError("compressed-tensors transforms (transform_config) are not supported")
        if cfg.kv_cache_scheme is not None:
            raise ValueError("a compressed-tensors kv_cache_scheme (static KV-cache quantization) is not supported; "
                             "use --kv-cache-dtype")
        self.ignore = list(cfg.ignore or [])
        self.groups = [(list(s.targets), _classify(name, s, cfg.format)) for name, s in cfg.config_groups.items()]
        self.methods = sorted({ls.kind for _, ls in self.groups})

    @staticmethod
    def _matches(name: str, targets: list[str]) -> bool:
        from compressed_tensors.utils.match import match_name

        return any(t == "Linear" or match_name(name, t) for t in targets)

    def scheme_for(self, layer: str) -> Optional[LayerScheme]:
        """The scheme of the linear layer ``layer`` (HF module name), or None if it stays dense."""
        if self._matches(layer, [t for t in self.ignore if t != "Linear"]):
            return None
        for targets, ls in self.groups:
            if self._matches(layer, targets):
                return ls
        return None


def projection_schemes(model: nn.Module, plan: CompressedTensorsPlan) -> dict[str, LayerScheme]:
    """HF layer name -> scheme for the decoder projections that are quantized.

    Raises ValueError when shards fused into one projection (q/k/v, gate/up) are quantized differently.
    """
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, LayerScheme] = {}
    for parent, attr, _ in quantized_linears(model):
        layers = [f"{names[id(parent)]}.{s}" for s in PACKED_SHARDS.get(attr, (attr,))]
        schemes = [plan.scheme_for(n) for n in layers]
        kinds = {(s.kind, s.group_size) if s else None for s in schemes}
        if len(kinds) > 1:
            raise ValueError(f"{', '.join(layers)} are fused into one {attr}: they must be quantized alike "
                             f"(or all ignored); got {[s.kind if s else 'dense' for s in schemes]}")
        out.update({n: s for n, s in zip(layers, schemes) if s is not None})
    return out


def _need(t: dict, layer: str, key: str) -> torch.Tensor:
    if key not in t:
        raise ValueError(f"malformed compressed-tensors checkpoint: tensor {layer}.{key} is missing")
    return t[key]


def _check_shape(x: torch.Tensor, shape: tuple, layer: str, key: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"malformed compressed-tensors checkpoint: {layer}.{key} has shape {tuple(x.shape)}, "
                         f"expected {tuple(shape)}")


def _channel_scale(scale: torch.Tensor, n: int, layer: str, per_tensor: bool = False) -> torch.Tensor:
    """``weight_scale`` ``[N, 1]`` / ``[N]`` (or one value, per tensor) -> float32 ``[N]``."""
    s = scale.float().reshape(-1)
    if per_tensor and s.numel() == 1:
        return s.expand(n).contiguous()
    _check_shape(s, (n,), layer, "weight_scale (flattened)")
    return s.contiguous()


def decode_layer(layer: str, ls: LayerScheme, t: dict[str, torch.Tensor]):
    """One layer's checkpoint tensors (``weight_packed``, ``weight_scale``, ...) -> our weight.

    Returns ``Int4Weight``, INT8 ``(q int8 [N, K], scale float32 [N])`` or ``Fp8Weight``. Raises
    ValueError naming a missing or mis-shaped tensor.
    """
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if "weight_g_idx" in t:
        raise ValueError(f"{layer}.weight_g_idx: activation-ordered groups (g_idx) are not supported")
    scale = _need(t, layer, "weight_scale")
    if ls.format == "pack-quantized":
        bits = 4 if ls.kind == "int4" else 8
        shape = _need(t, layer, "weight_shape")
        if shape.numel() != 2:
            raise ValueError(f"malformed compressed-tensors checkpoint: {layer}.weight_shape is {shape.tolist()}")
        n, k = (int(v) for v in shape.tolist())
        packed = _need(t, layer, "weight_packed")
        _check_shape(packed, (n, math.ceil(k * bits / 32)), layer, "weight_packed")
        if packed.dtype != torch.int32:
            raise ValueError(f"malformed compressed-tensors checkpoint: {layer}.weight_packed is {packed.dtype}, "
                             "expected int32")
        q = unpack_from_int32(packed, bits, torch.Size((n, k)))  # int8, signed
    else:
        q = _need(t, layer, "weight")
        n, k = q.shape if q.dim() == 2 else (-1, -1)
    if ls.kind == "int4":
        g = ls.group_size
        if k % g:
            raise ValueError(f"{layer}: in_features {k} is not a multiple of the group size {g}")
        _check_shape(scale, (n, k // g), layer, "weight_scale")
        scale = scale.float()
        if ls.symmetric:
            zp = torch.zeros_like(scale)
        else:
            zpp = _need(t, layer, "weight_zero_point")
            _check_shape(zpp, (math.ceil(n * 4 / 32), k // g), layer, "weight_zero_point")
            zp = unpack_from_int32(zpp, 4, torch.Size((n, k // g)), packed_dim=0).float()
        return Int4Weight((q.to(torch.int16) + 8).to(torch.uint8), scale, -(8.0 + zp) * scale, g)
    if ls.kind == "int8":
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"malformed compressed-tensors checkpoint: {layer}.weight is {q.dtype} "
                             f"{tuple(q.shape)}, expected int8 [out, in]")
        return q.contiguous(), _channel_scale(scale, n, layer)
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(f"malformed compressed-tensors checkpoint: {layer}.weight is {q.dtype} {tuple(q.shape)}, "
                         "expected float8_e4m3fn [out, in]")
    return Fp8Weight(q.contiguous(), _channel_scale(scale, n, layer, per_tensor=ls.strategy == "tensor"))


class CompressedTensorsLoader:
    """Splits a checkpoint's tensors: quantized layers' go to ``decode_layer``, the rest to the dense load.

    ``filter(weights)`` yields the dense ``(name, tensor)`` pairs plus, at the end, a zero-stride
    placeholder ``{layer}.weight`` per quantized layer (so the dense load checks its shape against the
    model and counts it loaded; ``apply_prequantized`` then replaces the layer). ``weights`` holds
    ``{layer}.weight -> quantized weight`` afterwards.
    """

    def __init__(self, model: nn.Module, plan: CompressedTensorsPlan) -> None:
        self.schemes = projection_schemes(model, plan)
        self.weights: dict[str, Any] = {}

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        collected: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.schemes}
        for name, tensor in weights:
            layer, _, key = name.rpartition(".")
            if key in _QUANT_TENSORS and layer in collected:
                collected[layer][key] = tensor
            elif key in _QUANT_TENSORS[1:]:
                raise ValueError(f"compressed-tensors: {name} is a quantized tensor of a layer that is not a "
                                 "quantized decoder projection (q/k/v/o, gate/up/down) under the checkpoint's "
                                 "quantization_config; only those are loaded quantized (list others in ignore)")
            else:
                yield name, tensor
        warned = False
        for layer, ls in self.schemes.items():
            t = collected[layer]
            if ("input_scale" in t or ls.static_input) and not warned:
                logger.warning("compressed-tensors: static FP8 input_scale ignored; activations are quantized "
                               "dynamically per token")
                warned = True
            w = decode_layer(layer, ls, t)
            self.weights[f"{layer}.weight"] = w
            n, k = (w.q if not isinstance(w, tuple) else w[0]).shape
            yield f"{layer}.weight", torch.zeros((), dtype=torch.float32).expand(n, k)


def resolve_checkpoint_quantization(requested: Optional[str], hf_config: Any, load_format: str,
                                    path: str = "", device: Optional[str] = None) -> tuple[Optional[str], list[str]]:
    """The ``--quantization`` to use and the kernels it needs (for ``check_quantization``).

    A compressed-tensors checkpoint gives ``compressed-tensors`` (auto-detected) and its kernels
    (int4 / int8 / fp8). Raises ValueError for another explicit ``--quantization`` on it, for
    ``--quantization compressed-tensors`` on another checkpoint, for another pre-quantized format,
    and (via ``CompressedTensorsPlan``) for unsupported schemes.
    """
    q = quantization_config_of(hf_config) if load_format == "safetensors" else None
    qm = (q or {}).get("quant_method")
    if qm == CT_METHOD:
        if requested not in (None, CT_METHOD):
            raise ValueError(f"{path or 'the model'} is a compressed-tensors (pre-quantized) checkpoint; "
                             f"--quantization {requested} cannot apply to it: leave --quantization unset or pass "
                             f"{CT_METHOD}")
        return CT_METHOD, CompressedTensorsPlan(hf_config).methods
    if requested == CT_METHOD:
        raise ValueError(f"--quantization {CT_METHOD} needs a checkpoint whose config.json has "
                         f"quantization_config.quant_method {CT_METHOD!r}; {path or 'this model'} has "
                         f"{qm or 'none'}")
    if qm == "mxfp4" and getattr(hf_config, "model_type", None) == "gpt_oss":
        return requested, [requested] if requested else []  # experts dequantized at load (model_loader.mxfp4)
    if qm == "fp8":  # HF FP8 checkpoint (per tensor / channel, or 128 x 128 blocks): model_loader.fp8_checkpoint
        from kvserve.model_loader.fp8_checkpoint import fp8_checkpoint_config, resolve_fp8_checkpoint

        fp8_checkpoint_config(hf_config)  # validates
        method = resolve_fp8_checkpoint(requested, hf_config, device, path)
        return method, [method] if method else []
    from kvserve.model_loader.gptq_awq import resolve_gptq_awq

    ga = resolve_gptq_awq(requested, hf_config, load_format, path)
    if ga is not None:
        return ga, [ga]
    if qm:
        raise ValueError(f"{path or 'the model'} is pre-quantized with quant_method {qm!r}, which kvserve cannot "
                         f"load; supported pre-quantized formats: {CT_METHOD} ({SUPPORTED}), gptq, awq, fp8, GGUF")
    return requested, [requested] if requested else []
