"""Hugging Face FP8 checkpoints (``quantization_config.quant_method: "fp8"``) loaded as stored.

Two layouts, as transformers' ``FineGrainedFP8`` / DeepSeek-V3 and vLLM's ``fp8`` method write them;
each quantized ``{layer}.weight`` is float8_e4m3fn ``[N, K]`` and ``w = weight * scale``:

* per tensor / per channel: ``{layer}.weight_scale`` float32, a scalar (``[]`` or ``[1]``) or ``[N]`` /
  ``[N, 1]``; ``activation_scheme: "static"`` checkpoints also store ``input_scale``, which is ignored
  (activations are quantized dynamically per token, logged once).
* block-scaled, ``weight_block_size: [bn, bk]`` (DeepSeek-V3: ``[128, 128]``): ``{layer}.weight_scale_inv``
  float32 ``[ceil(N / bn), ceil(K / bk)]``, one scale per block.

Kept FP8 (``--quantization fp8`` on CUDA, or the CPU emulation with ``KVSERVE_FP8_EMULATE=1``): the
decoder projections that quantization replaces (``QUANTIZED_LAYER_SUFFIXES``; q/k/v and gate/up shards
concatenated) become ``QuantizedLinear``: per-channel FP8 (per-tensor scales expanded to channels) with
W8A8 GEMMs, or block-scaled FP8 with the Triton block GEMM (``fp8_w8a8.PackedFp8Block``). Every other
FP8 tensor (MLA projections, MoE experts) is dequantized to the model dtype at load. On the CPU without
the emulation the whole checkpoint is dequantized (logged): same weights, float arithmetic.
Malformed input (a non-e4m3 weight, a scale grid that does not cover its weight, a weight without its
scale) is a start-up ValueError naming the tensor and the expected shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from kvserve.layers.quantization import PACKED_SHARDS, apply_prequantized, quantized_linears
from kvserve.layers.quantization.fp8_w8a8 import BLOCK, Fp8BlockWeight, emulate_on_cpu, expand_block_scale
from kvserve.layers.quantization.kernels import Fp8Weight

logger = logging.getLogger(__name__)

FP8_METHOD = "fp8"


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """The parsed ``quantization_config`` of an FP8 checkpoint; ``block`` is None for per-tensor/channel."""

    block: Optional[tuple[int, int]]
    static_activations: bool

    @classmethod
    def from_dict(cls, q: dict) -> "Fp8CheckpointConfig":
        """Raises ValueError naming the field for anything unsupported."""
        if q.get("quant_method") != FP8_METHOD:
            raise ValueError(f"quant_method {q.get('quant_method')!r} is not {FP8_METHOD!r}")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"FP8 quantization_config.activation_scheme={scheme!r} is not supported (dynamic, static)")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 quantization_config.fmt={fmt!r} is not supported (e4m3)")
        block = q.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or min(block) <= 0:
                raise ValueError(f"FP8 quantization_config.weight_block_size={block!r}: expected [rows, columns]")
            block = (int(block[0]), int(block[1]))
        return cls(block, scheme == "static")


def fp8_checkpoint_config(hf_config: Any) -> Optional[Fp8CheckpointConfig]:
    """The ``Fp8CheckpointConfig`` when config.json says ``quant_method: fp8``, else None."""
    from kvserve.model_loader.gptq_awq import quantization_config_of

    q = quantization_config_of(hf_config)
    if not q or q.get("quant_method") != FP8_METHOD:
        return None
    return Fp8CheckpointConfig.from_dict(q)


def resolve_fp8_checkpoint(requested: Optional[str], hf_config: Any, device: Optional[str], path: str = ""
                           ) -> Optional[str]:
    """For an FP8 checkpoint: ``"fp8"`` where it is kept FP8 (CUDA, or the CPU emulation), ``None`` on the CPU
    (dequantized at load). Raises ValueError for another explicit ``--quantization``."""
    if requested not in (None, FP8_METHOD):
        raise ValueError(f"{path or 'the model'} is an FP8 checkpoint (quant_method fp8); --quantization "
                         f"{requested} cannot apply to it: leave --quantization unset or pass fp8")
    if requested is None and device == "cpu" and not emulate_on_cpu():
        logger.info("%s: FP8 checkpoint on the CPU: weights dequantized to the model dtype at load "
                    "(KVSERVE_FP8_EMULATE=1 keeps them FP8, emulated)", path or "model")
        return None
    return FP8_METHOD


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]],
               dtype: torch.dtype) -> torch.Tensor:
    """``weight`` float8_e4m3fn ``[N, K]`` times its scale (scalar, per channel, or a block grid) -> ``dtype``."""
    n, k = weight.shape
    s = scale.float()
    if block is not None:
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) != want:
            raise ValueError(f"weight_scale_inv shape {tuple(s.shape)}, expected {want} for a {n}x{k} weight in "
                             f"{bn}x{bk} blocks")
        s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        s = _channel_scale(s, n)[:, None]
    return (weight.float() * s.to(weight.device)).to(dtype)


def _channel_scale(s: torch.Tensor, n: int) -> torch.Tensor:
    if s.numel() == 1:
        return s.reshape(1).expand(n).contiguous()
    if s.numel() == n and s.dim() <= 2 and s.shape[0] == n:
        return s.reshape(n)
    raise ValueError(f"weight_scale shape {tuple(s.shape)}, expected [], [1], [{n}] or [{n}, 1]")


class Fp8CheckpointLoader:
    """Streams an FP8 checkpoint into a model: ``filter`` the tensors into ``model.load_weights``, then
    ``apply`` (module doc). ``keep``: keep the decoder projections FP8 (else everything is dequantized)."""

    def __init__(self, model: nn.Module, cfg: Fp8CheckpointConfig, dtype: torch.dtype, keep: bool) -> None:
        self.cfg, self.dtype, self.keep = cfg, dtype, keep
        names = {id(m): n for n, m in model.named_modules()}
        self.targets = {f"{names[id(p)]}.{s}.weight" for p, attr, _ in quantized_linears(model)
                        for s in PACKED_SHARDS.get(attr, (attr,))}
        self.weights: dict[str, Any] = {}
        self.n_dequantized = 0

    def _pair(self, name: str, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: FP8 checkpoint weight has dtype {w.dtype}, expected float8_e4m3fn")
        if w.dim() != 2:
            raise ValueError(f"{name}: FP8 weight has shape {tuple(w.shape)}, expected [out_features, in_features]")
        n, k = w.shape
        block = self.cfg.block
        if self.keep and name in self.targets:
            if block is None:
                self.weights[name] = Fp8Weight(w, _channel_scale(s.float(), n))
            elif block[1] == BLOCK:
                try:
                    self.weights[name] = Fp8BlockWeight(w, expand_block_scale(s, n, k, block))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
            else:  # the block GEMM steps K by 128
                self.n_dequantized += 1
        else:
            self.n_dequantized += 1
        try:  # the dense load gets the exact dequantized values (a projection apply cannot swap stays correct)
            return dequantize(w, s, block, self.dtype)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with FP8 weights dequantized and scales consumed. Raises ValueError for a
        weight without its scale or a scale without its weight."""
        scale_suffix = ".weight_scale_inv" if self.cfg.block is not None else ".weight_scale"
        pending: dict[str, dict[str, torch.Tensor]] = {}
        ignored_input_scales = 0
        for name, t in weights:
            if name.endswith(".input_scale"):
                ignored_input_scales += 1
                continue
            if name.endswith(scale_suffix):
                wname, key = name[: -len(scale_suffix)] + ".weight", "s"
            elif t.dtype == torch.float8_e4m3fn or (t.dtype.is_floating_point and t.element_size() == 1):
                wname, key = name, "w"
            else:
                yield name, t
                continue
            pair = pending.setdefault(wname, {})
            pair[key] = t
            if len(pair) == 2:
                del pending[wname]
                yield wname, self._pair(wname, pair["w"], pair["s"])
        if pending:
            name, pair = next(iter(pending.items()))
            missing = scale_suffix[1:] if "w" in pair else "weight"
            raise ValueError(f"FP8 checkpoint: {name} has no {missing} ({len(pending)} tensors unpaired; "
                             f"weight_block_size={list(self.cfg.block) if self.cfg.block else None})")
        if ignored_input_scales:
            logger.info("FP8 checkpoint: %d input_scale tensors ignored (activations are quantized dynamically "
                        "per token)", ignored_input_scales)

    def apply(self, model: nn.Module) -> int:
        """Swap the projections whose shards were all kept FP8 for ``QuantizedLinear``; returns the count."""
        n = apply_prequantized(model, self.weights, self.dtype) if self.keep else 0
        logger.info("FP8 checkpoint: %d projections kept FP8 (%s), %d FP8 tensors dequantized to %s", n,
                    f"{self.cfg.block[0]}x{self.cfg.block[1]} blocks" if self.cfg.block else "per channel",
                    self.n_dequantized, str(self.dtype).replace("torch.", ""))
        self.weights.clear()
        return n
