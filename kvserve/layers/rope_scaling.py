"""RoPE scaling for long context: inverse frequencies and the cos/sin attention factor per type.

Rope types (HF ``rope_type`` names; the older ``type`` key is read too):

- ``default``: ``inv_freq[i] = theta ** (-2i / d)`` (RoFormer, arXiv 2104.09864).
- ``linear``: position interpolation, ``inv_freq / factor`` (Chen et al., arXiv 2306.15595).
- ``dynamic``: NTK-aware scaling of the base, ``theta' = theta * (factor * L / L0 - (factor - 1))
  ** (d / (d - 2))`` for a context of ``L > L0`` tokens (bloc97 / emozilla; as in transformers).
  transformers re-derives ``L`` from each forward's longest sequence; a paged engine cannot
  (cached keys were rotated with the old base), so kvserve fixes ``L = max_model_len`` once: with
  ``max_model_len <= L0`` this is the plain rope, i.e. identical to transformers on every
  sequence that fits the native context.
- ``yarn``: per-frequency blend of interpolation and extrapolation over a linear ramp between
  the ``beta_fast`` / ``beta_slow`` rotation counts, and cos/sin scaled by
  ``0.1 * mscale * ln(factor) + 1`` (Peng et al., YaRN, arXiv 2309.00071).
- ``longrope``: per-frequency rescale factors, ``short_factor`` within the original context and
  ``long_factor`` beyond it, cos/sin scaled by ``sqrt(1 + ln(s) / ln(L0))`` (Ding et al.,
  LongRoPE, arXiv 2402.13753). transformers switches per forward on the longest sequence;
  kvserve picks once: ``long_factor`` when ``max_model_len > original_max_position_embeddings``.
- ``llama3``: Llama 3.1's piecewise wavelength scaling.

``rope_inv_freq`` gives ``(inv_freq [d/2] float32, attention_factor)``; ``validate_rope_params``
raises ValueError for an unknown type or a missing/invalid key; ``apply_rope_overrides``
applies ``--rope-scaling`` / ``--rope-theta`` to an HF config; ``native_context_length`` is the
longest context a config's rope was trained or scaled for.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Keys each type needs beyond rope_theta / rope_type.
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def normalize_rope_params(params: dict) -> dict:
    """A copy with ``rope_type`` set (from ``type``; ``su``/``mrope`` style aliases are not accepted)."""
    out = dict(params)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    out.pop("type", None)
    return out


def validate_rope_params(params: dict, head_dim: int) -> None:
    """Check one rope parameter dict (after ``normalize_rope_params``).

    Raises ValueError naming the offending key: unknown ``rope_type`` (listing the supported
    ones), a missing required key, ``factor < 1``, a non-positive theta, or longrope factor
    lists whose length is not ``head_dim // 2``.
    """
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    theta = params.get("rope_theta")
    if theta is None or not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
    missing = [k for k in _REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} (got keys {sorted(params)})")
    factor = params.get("factor")
    if factor is not None and (not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1):
        raise ValueError(f"rope scaling factor must be a number >= 1, got {factor!r}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != head_dim // 2:
                raise ValueError(f"longrope {key} has {len(params[key])} entries, expected head_dim/2 = {head_dim // 2}")


def _base_exponents(head_dim: int) -> torch.Tensor:
    # 2i / d in float32, the way transformers builds it (int64 arange, then float).
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    orig = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / orig
    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all else _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_for_rotations(n: float) -> float:
        # The dimension whose wavelength fits ``n`` full turns into the original context.
        return head_dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** _base_exponents(head_dim)
    extrapolate = 1.0 / pos_freqs
    interpolate = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: high-frequency dims kept as trained (extrapolated)
    return interpolate * (1 - keep) + extrapolate * keep, float(attn)


def _llama3(params: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(
    params: dict, head_dim: int, max_position_embeddings: int, max_model_len: Optional[int] = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 (CPU) and the cos/sin attention factor.

    Args:
        params: one rope dict (``rope_theta``, ``rope_type`` and that type's keys).
        head_dim: rotary dimension.
        max_position_embeddings: the config's context length (``L0`` of ``dynamic``; the
            denominator of longrope's default factor).
        max_model_len: the engine's context length; picks ``dynamic``'s ``L`` and longrope's
            long/short factors (None: the config's length).

    Raises ValueError (``validate_rope_params``) for an unsupported type or missing keys.
    """
    params = normalize_rope_params(params)
    validate_rope_params(params, head_dim)
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exps = _base_exponents(head_dim)
    if rope_type == "dynamic":
        factor = params["factor"]
        seq_len = max(max_model_len or max_position_embeddings, max_position_embeddings)
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base**exps), 1.0
    if rope_type == "yarn":
        return _yarn(params, head_dim, max_position_embeddings)
    if rope_type == "longrope":
        orig = params.get("original_max_position_embeddings") or max_position_embeddings
        factor = params.get("factor") or max_position_embeddings / orig
        attn = params.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        long = (max_model_len or max_position_embeddings) > orig
        ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        return 1.0 / (ext * base**exps), float(attn)
    inv_freq = 1.0 / (base**exps)
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(params, inv_freq), 1.0
    return inv_freq, 1.0


def scaled_context_length(params: dict, max_position_embeddings: int) -> int:
    """The longest context this rope setting is meant for, in tokens.

    linear / dynamic / yarn stretch the original context (``original_max_position_embeddings``
    when given, else the config's length) by ``factor``; llama3 and longrope configs already
    state the extended length in ``max_position_embeddings``.
    """
    params = normalize_rope_params(params)
    rope_type = params["rope_type"]
    if rope_type in ("linear", "dynamic", "yarn"):
        orig = params.get("original_max_position_embeddings") or max_position_embeddings
        return max(int(orig * float(params["factor"])), max_position_embeddings)
    return max_position_embeddings


def layer_rope_dicts(hf_config: Any) -> dict[str, dict]:
    """The config's rope parameter dicts by layer type (``{"default": ...}`` for one shared rope).

    Reads transformers-5 ``rope_parameters`` (flat, or nested by layer type as Gemma 3) or the
    older ``rope_theta`` + ``rope_scaling`` (+ Gemma 3's ``rope_local_base_freq``).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return {k: normalize_rope_params(v) for k, v in params.items()}
    if isinstance(params, dict) and "rope_theta" in params:
        return {"default": normalize_rope_params(params)}
    out = dict(getattr(hf_config, "rope_scaling", None) or {})
    out["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    out = normalize_rope_params(out)
    local = getattr(hf_config, "rope_local_base_freq", None)
    if local is not None:
        return {"full_attention": out, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return {"default": out}


def apply_rope_overrides(hf_config: Any, rope_scaling: Optional[dict], rope_theta: Optional[float]) -> None:
    """Apply ``--rope-scaling`` (a rope dict without theta) and ``--rope-theta`` to ``hf_config``.

    The result is written as transformers-5 ``rope_parameters``. On models with per-layer-type
    ropes (Gemma 3) the overrides apply to the full-attention (global) layers only, as the
    released long-context Gemma 3 configs scale only those. Raises ValueError for an invalid
    result (unknown type, missing keys).
    """
    if rope_scaling is None and rope_theta is None:
        return
    dicts = layer_rope_dicts(hf_config)
    key = "full_attention" if "full_attention" in dicts else "default"
    target = dicts[key]
    if rope_scaling is not None:
        theta = target["rope_theta"]
        target = normalize_rope_params({**rope_scaling, "rope_theta": rope_scaling.get("rope_theta", theta)})
    if rope_theta is not None:
        target["rope_theta"] = float(rope_theta)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if target["rope_type"] in ("yarn", "longrope") and target.get("original_max_position_embeddings") is None:
        target["original_max_position_embeddings"] = hf_config.max_position_embeddings
    validate_rope_params(target, head_dim)
    dicts[key] = target
    hf_config.rope_parameters = dicts["default"] if key == "default" else dicts
