"""DeepSeek-V2 / V3 decoders: multi-head latent attention and DeepSeekMoE, HF checkpoint names.

- Attention: MLA (DeepSeek-V2, arXiv:2405.04434). Queries from ``q_proj`` (V2-Lite, no query
  LoRA) or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; the latent and the shared RoPE key
  from ``kv_a_proj_with_mqa`` (``kv_a_layernorm`` on the latent); ``kv_b_proj`` expands the latent
  per head (prefill) or is absorbed into the query and the output (decode); the cache holds
  the latent row only (``kvserve.layers.mla``). RoPE acts on ``qk_rope_head_dim`` of each head,
  in DeepSeek's interleaved-pair layout (V2; V3 with ``rope_interleave``), YaRN with
  ``mscale`` / ``mscale_all_dim``: cos/sin scaled by ``mscale(factor, mscale) / mscale(factor,
  mscale_all_dim)`` and the softmax scale by ``mscale(factor, mscale_all_dim) ** 2``.
- MLP: ``first_k_dense_replace`` dense layers, then (every ``moe_layer_freq``-th layer)
  DeepSeekMoE (arXiv:2401.06066): routed experts (``kvserve.layers.moe.FusedMoE``) plus
  ``n_shared_experts`` shared ones as one MLP. V2 routes with softmax (``greedy`` or
  ``group_limited_greedy``); V3 with sigmoid scores and ``e_score_correction_bias`` over
  ``n_group`` groups (``noaux_tc``, DeepSeek-V3 arXiv:2412.19437), weights renormalized
  (``norm_topk_prob``) then scaled by ``routed_scaling_factor``.
- Weights: published HF names (``model.layers.N.self_attn.kv_a_proj_with_mqa.weight``,
  ``mlp.experts.E.gate_proj.weight``, ``mlp.gate.e_score_correction_bias``, ...). FP8
  block-quantized checkpoints (``weight_scale_inv``, 128 x 128 blocks, DeepSeek-V3's release)
  are dequantized to the model dtype at load. Multi-token-prediction layers (layer index
  ``num_hidden_layers`` and up) are skipped here (``kvserve.models.deepseek_mtp`` loads them).
- Tensor parallelism: query heads, ``kv_b_proj``, ``o_proj``, the dense and shared MLPs and the
  experts split over the ranks; ``kv_a_proj_with_mqa`` and the latent are replicated.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed import get_tp_size
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                   parallel_logits)
from kvserve.layers.mla import MLAAttention
from kvserve.layers.moe import FusedMoE
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, get_rope_params

logger = logging.getLogger("kvserve")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude scale ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg: Any) -> float:
    """``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under a scaled rope."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = get_rope_params(cfg)
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on ``x [T, n, R]`` with ``cos``/``sin`` ``[T, R]`` (``cat(freqs, freqs)`` layout, float32).

    ``interleave``: DeepSeek's pairs ``(x0, x1), (x2, x3), ...`` rotated together, written
    out as ``[even results, odd results]`` (transformers' V3 layout; V2's complex form is the
    same values interleaved: a fixed permutation of q and k alike, so every score is equal).
    Else rotate-half. Computed in float32, returned in ``x``'s dtype."""
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        half = x.shape[-1] // 2
        c, s = c[..., :half], s[..., :half]
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        half = x.shape[-1] // 2
        rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        out = xf * c + rot * s
    return out.to(x.dtype)


class DeepseekV2MLAttention(nn.Module):
    """MLA projections around ``MLAAttention`` (shapes in the module docstring)."""

    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp_size()
        self.total_heads = cfg.num_attention_heads
        if self.total_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide num_attention_heads ({self.total_heads})")
        self.num_heads = self.total_heads // tp
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope, self.qk_rope, self.v_head = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if self.qk_rope % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope}")
        qk_head = self.qk_nope + self.qk_rope
        bias = bool(getattr(cfg, "attention_bias", False))
        eps = cfg.rms_norm_eps
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [self.total_heads * qk_head], False, dtype)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps).to(dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [self.total_heads * qk_head], False, dtype)
        # Replicated on every rank: the latent row is cached whole on each.
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_lora_rank + self.qk_rope, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps).to(dtype)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [self.total_heads * (self.qk_nope + self.v_head)],
                                              False, dtype)
        self.o_proj = RowParallelLinear(self.total_heads * self.v_head, cfg.hidden_size, bias=bias, dtype=dtype)
        self.interleave = cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))
        self.rotary = [rotary]
        self.attn = MLAAttention(self.num_heads, self.total_heads, self.kv_lora_rank, self.qk_rope, self.qk_nope,
                                 self.v_head, mla_softmax_scale(cfg), layer_idx, self.kv_b_proj, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.qk_nope + self.qk_rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        rot = self.rotary[0]
        cos, sin = rot.cos_cache[positions], rot.sin_cache[positions]
        q_pe = apply_rope(q[..., self.qk_nope:], cos, sin, self.interleave)
        k_pe = apply_rope(k_pe.reshape(t, 1, self.qk_rope), cos, sin, self.interleave).view(t, self.qk_rope)
        q = torch.cat([q[..., : self.qk_nope], q_pe], dim=-1).view(t, -1)
        rows = torch.cat([latent, k_pe], dim=-1)
        o = self.attn(q, rows, rows)
        return self.o_proj(o[:, : self.num_heads * self.v_head])


class DeepseekV2MLP(nn.Module):
    """SwiGLU MLP (dense layers, shared experts): packed ``gate_up_proj``, ``down_proj``."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def moe_routing(cfg: Any) -> dict:
    """FusedMoE routing kwargs of a DeepSeek config.

    V3 (``noaux_tc`` / sigmoid): sigmoid scores, selection on ``scores + e_score_correction_bias``
    within the best ``topk_group`` of ``n_group`` groups (group score: its top-2 sum), weights
    renormalized when ``norm_topk_prob``, then times ``routed_scaling_factor``. V2: softmax
    scores, ``greedy`` or ``group_limited_greedy`` (group score: its max); ``norm_topk_prob``
    renormalizes (DeepSeek's own code: then no scaling), else the weights are scaled by
    ``routed_scaling_factor`` (transformers' V2). Raises ValueError for an unknown method."""
    method = getattr(cfg, "topk_method", None)
    scoring = getattr(cfg, "scoring_func", None) or ("sigmoid" if cfg.model_type == "deepseek_v3" else "softmax")
    norm = bool(getattr(cfg, "norm_topk_prob", False))
    scale = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
    n_group, topk_group = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
    if cfg.model_type == "deepseek_v3" or method == "noaux_tc":
        return dict(scoring_func=scoring, use_correction_bias=True, num_expert_group=n_group, topk_group=topk_group,
                    renormalize=norm, routed_scaling_factor=scale)
    if method in (None, "greedy"):
        n_group = topk_group = None
    elif method != "group_limited_greedy":
        raise ValueError(f"unsupported topk_method {method!r}; supported: greedy, group_limited_greedy, noaux_tc")
    return dict(scoring_func=scoring, use_correction_bias=False, num_expert_group=n_group, topk_group=topk_group,
                renormalize=norm, routed_scaling_factor=1.0 if norm else scale)


class DeepseekV2MoE(nn.Module):
    """Router (``gate``, float32), routed ``experts`` and ``shared_experts``."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.gate = nn.Linear(cfg.hidden_size, e, bias=False, dtype=torch.float32)
        self.experts = FusedMoE(e, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype,
                                **moe_routing(cfg))
        n_shared = getattr(cfg, "n_shared_experts", None) or 0
        self.shared_experts = (DeepseekV2MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, dtype)
                               if n_shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        out = self.experts(x, logits)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def is_moe_layer(cfg: Any, layer_idx: int) -> bool:
    """DeepSeek's rule: MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
    if not getattr(cfg, "n_routed_experts", None):
        return False
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    return layer_idx >= (getattr(cfg, "first_k_dense_replace", 0) or 0) and layer_idx % freq == 0


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = DeepseekV2MLAttention(cfg, layer_idx, rotary, dtype)
        self.mlp = DeepseekV2MoE(cfg, dtype) if is_moe_layer(cfg, layer_idx) else \
            DeepseekV2MLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, max_model_len: Optional[int] = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        max_pos = getattr(cfg, "max_position_embeddings", None) or 2048
        self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, max_pos, get_rope_params(cfg), max_model_len)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(cfg, i, self.rotary_emb, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


_EXPERT_RE = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PACKED_RE = re.compile(r"^(.*)\.(gate_proj|up_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
FP8_BLOCK = 128


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                         block: int = FP8_BLOCK) -> torch.Tensor:
    """DeepSeek-V3's FP8 weights: ``weight [N, K]`` float8_e4m3fn times ``scale_inv
    [ceil(N / block), ceil(K / block)]`` float32 per 128 x 128 block -> ``[N, K]`` in ``dtype``.
    Raises ValueError when the scale grid does not cover the weight."""
    n, k = weight.shape
    want = (-(-n // block), -(-k // block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)}, expected {want} for a {n}x{k} weight "
                         f"in {block}x{block} blocks")
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (weight.float() * s.to(weight.device)).to(dtype)


@torch.no_grad()
def load_deepseek_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Copy HF-named tensors into ``module``'s parameters of the same names (a DeepSeek model,
    or the multi-token-prediction layer with its names rebased).

    Dense ``gate_proj`` / ``up_proj`` pack into ``gate_up_proj``; experts go through
    ``FusedMoE.weight_loader``; ``mlp.gate.e_score_correction_bias`` is the experts' bias;
    FP8 ``weight`` + ``weight_scale_inv`` pairs are dequantized to ``dtype``. Raises ValueError
    on an unknown name, a shape mismatch, or a parameter left unloaded.
    """
    params = dict(module.named_parameters())
    owners = {f"{mn}.{pn}" if mn else pn: m for mn, m in module.named_modules()
              for pn, _ in m.named_parameters(recurse=False)}
    seen: dict[str, set] = {}
    fp8: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype == torch.float8_e4m3fn:  # wait for its weight_scale_inv
            fp8.setdefault(name, {})["w"] = tensor
            if "s" in fp8[name]:
                load(name, dequantize_fp8_block(tensor, fp8.pop(name)["s"], dtype))
            return
        m = _EXPERT_RE.match(name)
        if m:
            moe = owners[f"{m.group(1)}.experts.w13"]
            param = moe.w2 if m.group(3) == "down_proj" else moe.w13
            shard = _SHARD[m.group(3)]
            moe.weight_loader(param, tensor.to(param.dtype), int(m.group(2)), shard)
            seen.setdefault(f"{m.group(1)}.experts.{'w2' if shard == 'w2' else 'w13'}", set()).add(
                (int(m.group(2)), shard))
            return
        shard = 0
        m = _PACKED_RE.match(name)
        if m:
            target, shard = f"{m.group(1)}.gate_up_proj.weight", (0 if m.group(2) == "gate_proj" else 1)
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            target = name.replace("mlp.gate.e_score_correction_bias", "mlp.experts.e_score_correction_bias")
        else:
            target = name
        if target not in params:
            raise ValueError(f"unknown weight {name!r} for {type(module).__name__}")
        loader = getattr(owners[target], "weight_loader", None)
        dst = params[target]
        tensor = tensor.to(dst.dtype)
        if loader is not None and not isinstance(owners[target], FusedMoE):
            loader(dst, tensor, shard)
        else:
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}")
            dst.copy_(tensor)
        seen.setdefault(target, set()).add(shard)

    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            wname = name[: -len("_scale_inv")]
            fp8.setdefault(wname, {})["s"] = tensor
            if "w" in fp8[wname]:
                pair = fp8.pop(wname)
                load(wname, dequantize_fp8_block(pair["w"], pair["s"], dtype))
            continue
        try:
            load(name, tensor)
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None
    if fp8:
        raise ValueError(f"FP8 weights without their weight_scale_inv (or scales without weights): "
                         f"{sorted(fp8)[:4]}")
    missing = []
    for pname in params:
        owner = owners[pname]
        if isinstance(owner, FusedMoE) and pname.endswith(("experts.w13", "experts.w2")):
            need = owner.num_experts * (2 if pname.endswith("w13") else 1)  # (expert, shard) pairs
        else:
            need = 2 if pname.endswith("gate_up_proj.weight") else 1
        if len(seen.get(pname, ())) < need:
            missing.append(pname)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


class DeepseekV2ForCausalLM(nn.Module):
    """Causal LM for DeepSeek-V2 / V2-Lite / V3 (/ R1) HF configs (``deepseek_v2``, ``deepseek_v3``).

    Args:
        hf_config: the transformers config.
        dtype: parameter dtype (the router stays float32).
        max_model_len: the engine's context length (rope cache size).

    Raises ValueError for a config the layers cannot build (heads not divisible by the
    tensor-parallel size, an unknown routing method, an odd ``qk_rope_head_dim``).
    """

    supports_tensor_parallel = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, max_model_len: Optional[int] = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = DeepseekV2Model(hf_config, dtype, max_model_len)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else \
            ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions ``[T]`` int64 -> final-normed hidden ``[T, hidden]`` (inside a forward context)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden]`` -> logits ``[N, vocab]`` float32."""
        return parallel_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (names in the module docstring; see
        ``load_deepseek_weights``). Multi-token-prediction layers (index ``num_hidden_layers``
        and up) are skipped: ``kvserve.models.deepseek_mtp`` loads them for ``deepseek_mtp``
        speculation. Raises ValueError on an unknown name, a shape mismatch, or a parameter
        left unloaded."""
        n_layers = self.config.num_hidden_layers
        skipped_mtp = 0

        def kept() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped_mtp
            embed_seen = False
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                m = _LAYER_RE.match(name)
                if m and int(m.group(1)) >= n_layers:  # multi-token-prediction layers
                    skipped_mtp += 1
                    continue
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    if embed_seen:
                        continue
                    name = "model.embed_tokens.weight"
                embed_seen = embed_seen or name == "model.embed_tokens.weight"
                yield name, tensor

        load_deepseek_weights(self, kept(), self.dtype)
        if skipped_mtp:
            logger.info("skipped %d multi-token-prediction tensors (layers >= %d)", skipped_mtp, n_layers)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (query LoRA, sigmoid ``noaux_tc`` routing with the score-correction
    bias, YaRN with mscale); the same implementation as ``DeepseekV2ForCausalLM``."""
