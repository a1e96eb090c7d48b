"""OpenAI gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``) over the paged attention layer.

What differs from Llama (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv 2508.10925):

- attention: q/k/v/o biases; ``head_dim`` 64 independent of the hidden size; **learned attention
  sinks** (``self_attn.sinks [num_heads]``): one logit per head that joins the softmax
  denominator with no value, so a head may attend to "nothing". They are parameters of the
  layer, not StreamingLLM's sink tokens (the first tokens a bounded KV cache keeps,
  ``--attention-sinks``); the backends read them from the layer's ``KVCacheView``.
- ``layer_types``: sliding-window (``sliding_window``, 128 in the released models) and full
  attention layers alternate; each ``Attention`` carries its window for the hybrid KV cache.
- YaRN RoPE (``rope_parameters`` ``rope_type: yarn``, ``truncate: false``).
- every MLP is a mixture of experts: ``mlp.router`` (a linear layer with bias) picks the top-k
  experts by logit and softmaxes over the selected logits (= softmax, top-k, renormalize);
  experts carry biases and the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)``,
  ``g = clamp(gate, max=l)`` (``FusedMoE`` with ``activation="swigluoai"``).

Checkpoints: experts are stored stacked and transposed against ``nn.Linear``:
``mlp.experts.gate_up_proj [E, H, 2I]`` with gate and up interleaved along the last dim (gate
``[..., ::2]``, up ``[..., 1::2]``), ``gate_up_proj_bias [E, 2I]`` (interleaved alike),
``down_proj [E, I, H]``, ``down_proj_bias [E, H]``; the published checkpoints store the two
weights as MXFP4 (``*_blocks`` / ``*_scales``, ``kvserve.model_loader.mxfp4``), dequantized
here at load to the model dtype.

RMSNorm: transformers keeps gpt-oss's norm weights in float32 and scales before the cast to
the activation dtype; kvserve's ``RMSNorm`` (Llama's, fused on CUDA) casts first. Identical in
float32; in bfloat16 the two may differ by one rounding.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from kvserve.distributed import get_tp_rank, get_tp_size, kv_head_range
from kvserve.layers.attention import Attention
from kvserve.layers.linear import ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from kvserve.layers.moe import FusedMoE
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, get_rope_params
from kvserve.model_loader.mxfp4 import MXFP4_BLOCK, mxfp4_dequantize
from kvserve.models.llama import LlamaForCausalLM

SLIDING = "sliding_attention"
FULL = "full_attention"


def gpt_oss_layer_types(cfg: Any) -> list[str]:
    """Per-layer ``sliding_attention`` / ``full_attention`` (default: alternating, sliding first).

    Raises ValueError for an unknown type, a list of the wrong length or, with sliding layers,
    a ``sliding_window`` that is not a positive integer or exceeds the context.
    """
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = [SLIDING if i % 2 == 0 else FULL for i in range(cfg.num_hidden_layers)]
    types = list(types)
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad:
        raise ValueError(f"unsupported gpt-oss layer types {bad}; supported: {SLIDING}, {FULL}")
    if SLIDING in types:
        window = getattr(cfg, "sliding_window", None)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"gpt-oss sliding_window must be a positive integer, got {window!r}")
        max_pos = getattr(cfg, "max_position_embeddings", None)
        if max_pos is not None and window > max_pos:
            raise ValueError(f"sliding_window {window} is larger than the model's context ({max_pos} tokens): "
                             "a broken config")
    return types


class GptOssAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, layer_type: str, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp_size()
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        bias = bool(getattr(cfg, "attention_bias", True))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv, bias, dtype)
        self.num_heads = total_heads // tp  # this rank's heads
        self.num_kv_heads = kv_head_range(total_kv, tp, 0)[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=bias, dtype=dtype)
        self.rotary = [rotary]  # shared; a list keeps it out of this module's children
        window = cfg.sliding_window if layer_type == SLIDING else None
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx,
                              window, has_sinks=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class GptOssMLP(nn.Module):
    """Router (top-k by logit, softmax over the selected) and the routed experts."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        num_experts = cfg.num_local_experts
        self.router = nn.Linear(cfg.hidden_size, num_experts, bias=True, dtype=dtype)
        self.experts = FusedMoE(num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                                dtype=dtype, renormalize=True, scoring_func="softmax", activation="swigluoai",
                                swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
                                swiglu_limit=float(getattr(cfg, "swiglu_limit", 7.0)), has_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, layer_type: str, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = GptOssAttention(cfg, layer_idx, layer_type, rotary, dtype)
        self.mlp = GptOssMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class GptOssModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, max_model_len: int | None = None) -> None:
        super().__init__()
        types = gpt_oss_layer_types(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        max_pos = getattr(cfg, "max_position_embeddings", None) or 2048
        self.rotary_emb = RotaryEmbedding(head_dim, max_pos, get_rope_params(cfg), max_model_len)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, t, self.rotary_emb, dtype) for i, t in enumerate(types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_ATTN_RE = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(q_proj|k_proj|v_proj)\.(weight|bias)$")
_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\."
                         r"(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


class GptOssForCausalLM(LlamaForCausalLM):
    """Causal LM for gpt-oss configs (``GptOssConfig``).

    Args:
        hf_config: a ``GptOssConfig`` (its checkpoint dense or MXFP4).
        dtype: parameter dtype (attention sinks, norm math and rope caches stay float32).
        max_model_len: the engine's context length (rope cache size).

    Raises ValueError for configs kvserve cannot run exactly (unknown layer type, a bad
    window, an unsupported rope type, ``num_experts_per_tok`` above the experts).
    """

    supports_pipeline_parallel = False  # its own forward / weight names: no layer-range hook yet

    supports_tensor_parallel = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.model = GptOssModel(hf_config, dtype, max_model_len)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(hf_config.vocab_size,
                                                                            hf_config.hidden_size, dtype=dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named gpt-oss tensors into the model.

        q/k/v are packed into ``qkv_proj``; ``self_attn.sinks`` goes to the attention layer
        (this rank's heads); expert tensors (dense or MXFP4 ``*_blocks`` + ``*_scales``) are
        de-interleaved (gate ``::2``, up ``1::2``), transposed to ``FusedMoE``'s ``[E, 2I, H]`` /
        ``[E, H, I]`` layout and handed to its ``weight_loader`` one expert at a time.

        Raises ValueError naming the tensor on an unknown name, a shape mismatch (with the
        expected shape), an MXFP4 half without its partner, or a parameter left unloaded.
        """
        params = dict(self.named_parameters())
        seen: dict[str, set] = {}
        pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves waiting for their partner
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                if "model.embed_tokens.weight" in seen:
                    continue
                name = "model.embed_tokens.weight"
            m = _EXPERTS_RE.match(name)
            if m:
                prefix, proj, kind = m.group(1), m.group(2), m.group(3) or ""
                moe = self._experts(prefix, name)
                if kind in ("_blocks", "_scales"):
                    halves = pending.setdefault(f"{prefix}.{proj}", {})
                    halves[kind] = tensor
                    if len(halves) < 2:
                        continue
                    del pending[f"{prefix}.{proj}"]
                    self._load_mxfp4(moe, prefix, proj, halves["_blocks"], halves["_scales"])
                    kind = ""
                else:
                    self._load_dense(moe, name, proj, kind, tensor)
                target = f"{prefix}.{'w13' if proj == 'gate_up_proj' else 'w2'}{'_bias' if kind else ''}"
                seen.setdefault(target, set()).add(0)
                continue
            m = _ATTN_RE.match(name)
            if m:
                target, shard = f"{m.group(1)}.qkv_proj.{m.group(3)}", _QKV[m.group(2)]
            elif name.endswith(".self_attn.sinks"):
                target, shard = name[: -len("sinks")] + "attn.sinks", -1
            else:
                target, shard = name, 0
            if target not in params:
                raise ValueError(f"unknown weight {name!r} for {type(self).__name__}")
            try:
                self._copy(target, params[target], tensor, shard)
            except ValueError as e:
                raise ValueError(f"{name!r}: {e}") from None
            seen.setdefault(target, set()).add(shard)
        if pending:
            left = [f"{k}{'_scales' if '_blocks' in v else '_blocks'}" for k, v in pending.items()]
            raise ValueError(f"checkpoint has MXFP4 expert tensors without their partner: missing {left[:4]}")
        expected = {n: (3 if ".qkv_proj." in n else 1) for n in params}
        missing = [n for n in params if len(seen.get(n, ())) < expected[n]]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _experts(self, prefix: str, name: str) -> FusedMoE:
        try:
            moe = self.get_submodule(prefix)
        except AttributeError:
            moe = None
        if not isinstance(moe, FusedMoE):
            raise ValueError(f"unknown weight {name!r} for {type(self).__name__}")
        return moe

    def _copy(self, target: str, param: nn.Parameter, tensor: torch.Tensor, shard: int) -> None:
        owner = self.get_submodule(target.rsplit(".", 1)[0])
        if shard == -1:  # attention sinks: this rank's heads
            n = param.shape[0]
            if tensor.dim() != 1 or tensor.shape[0] != n * get_tp_size():
                raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, expected "
                                 f"({n * get_tp_size()},) (one sink per attention head)")
            param.copy_(tensor.narrow(0, get_tp_rank() * n, n))
            return
        load = getattr(owner, "weight_loader", None)
        if load is not None:
            load(param, tensor, shard)
        elif tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        else:
            param.copy_(tensor)

    @staticmethod
    def _load_dense(moe: FusedMoE, name: str, proj: str, kind: str, t: torch.Tensor) -> None:
        e, h, i = moe.num_experts, moe.hidden_size, moe.intermediate_size
        want = {("gate_up_proj", ""): (e, h, 2 * i), ("gate_up_proj", "_bias"): (e, 2 * i),
                ("down_proj", ""): (e, i, h), ("down_proj", "_bias"): (e, h)}[(proj, kind)]
        if tuple(t.shape) != want:
            raise ValueError(f"{name!r}: checkpoint shape {tuple(t.shape)}, expected {want} "
                             f"(experts {e}, hidden {h}, intermediate {i})")
        bias = kind == "_bias"
        param = getattr(moe, ("w13" if proj == "gate_up_proj" else "w2") + ("_bias" if bias else ""))
        for x in moe.local_experts:
            te = t[x]
            if proj == "gate_up_proj":  # interleaved columns: gate ::2, up 1::2
                gate, up = (te[::2], te[1::2]) if bias else (te[:, ::2].t(), te[:, 1::2].t())
                moe.weight_loader(param, gate, x, "w1")
                moe.weight_loader(param, up, x, "w3")
            else:
                moe.weight_loader(param, te if bias else te.t(), x, "w2")

    @staticmethod
    def _load_mxfp4(moe: FusedMoE, prefix: str, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        e, h, i = moe.num_experts, moe.hidden_size, moe.intermediate_size
        rows, cols = (2 * i, h) if proj == "gate_up_proj" else (h, i)
        g = cols // MXFP4_BLOCK
        for suffix, t, want in (("_blocks", blocks, (e, rows, g, MXFP4_BLOCK // 2)), ("_scales", scales, (e, rows, g))):
            if cols % MXFP4_BLOCK or tuple(t.shape) != want:
                raise ValueError(f"'{prefix}.{proj}{suffix}': checkpoint shape {tuple(t.shape)}, expected {want} "
                                 f"(MXFP4: {MXFP4_BLOCK}-value blocks of 4-bit codes, one E8M0 scale each)")
        param = moe.w13 if proj == "gate_up_proj" else moe.w2
        for x in moe.local_experts:  # one expert at a time: bounded float32 scratch
            w = mxfp4_dequantize(blocks[x], scales[x], param.dtype)  # [rows, cols], as nn.Linear
            if proj == "gate_up_proj":  # interleaved rows: gate ::2, up 1::2
                moe.weight_loader(param, w[::2], x, "w1")
                moe.weight_loader(param, w[1::2], x, "w3")
            else:
                moe.weight_loader(param, w, x, "w2")
