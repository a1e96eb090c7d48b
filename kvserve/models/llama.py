"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged attention layer.

One implementation covers the four: Qwen2 adds q/k/v bias, Qwen3 adds per-head q/k
RMSNorm before rope, Mistral may set a sliding window. Projections are packed
(``qkv_proj``, ``gate_up_proj``); ``load_weights`` packs HF checkpoint tensors into them.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed import get_tp_size, kv_head_range, tp_all_reduce_add_rms_norm
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import Attention
from kvserve.layers.linear import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                                   VocabParallelEmbedding, parallel_logits)
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, get_rope_params


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _layer_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    window = _sliding_window_in_use(cfg, layer_idx)
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if window is not None and max_pos is not None and window > max_pos:
        raise ValueError(f"sliding_window {window} is larger than the model's context ({max_pos} tokens): "
                         "a broken config")
    return window


def _sliding_window_in_use(cfg: Any, layer_idx: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:  # Qwen2/3: only layers marked sliding use the window
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype,
                 qkv_bias: bool | None = None, qk_norm: bool | None = None) -> None:
        super().__init__()
        tp = get_tp_size()
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = _head_dim(cfg)
        bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        bias = bias if qkv_bias is None else qkv_bias  # other families (MoE) say it themselves
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv, bias, dtype)
        # This rank's heads (all of them with one rank).
        self.num_heads = total_heads // tp
        self.num_kv_heads = kv_head_range(total_kv, tp, 0)[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=False, dtype=dtype)
        self.qk_norm = cfg.model_type == "qwen3" if qk_norm is None else qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps).to(dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps).to(dtype)
        self.rotary = [rotary]  # shared; a list keeps it out of this module's children
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx,
            _layer_sliding_window(cfg, layer_idx),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, x))

    def attend(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention up to (not including) ``o_proj``: ``[T, hidden]`` -> ``[T, heads/tp * head_dim]``."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        if self.qk_norm:
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q, k = self.rotary[0](positions, q, k)
        return self.attn(q, k, v.contiguous())


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    #: module -> the linears reading its output: with FP8 W8A8 weights it emits their FP8 input
    #: (``kvserve.layers.quantization.fp8_w8a8.attach_fp8_norms``)
    fp8_input_producers = {"input_layernorm": ("self_attn.qkv_proj",),
                           "post_attention_layernorm": ("mlp.gate_up_proj",), "mlp.act": ("mlp.down_proj",)}

    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, dtype)
        self.mlp = LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        partial = None
        if get_tp_size() > 1 and type(self.self_attn).forward is LlamaAttention.forward:
            # o_proj's all-reduce, the residual add and the norm in one pass (custom all-reduce).
            a = self.self_attn.attend(positions, h)
            partial = _row_parallel_partial(self.self_attn.o_proj, a)
            if partial is None:
                h = self.self_attn.o_proj(a)
        else:
            h = self.self_attn(positions, h)
        if partial is not None:
            h, residual = tp_all_reduce_add_rms_norm(partial, residual, self.post_attention_layernorm)
        else:
            h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_fused(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor,
                      next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its normed input ``h`` to the next layer's normed input: both
        row-parallel all-reduces run fused with the residual add and RMSNorm after them
        (``next_norm``: the next layer's ``input_layernorm`` or the final norm); one kernel each
        with the custom all-reduce. Used under tensor parallelism; returns ``(normed, residual)``."""
        a = self.self_attn.attend(positions, h)
        partial = _row_parallel_partial(self.self_attn.o_proj, a)
        if partial is None:
            h, residual = self.post_attention_layernorm(self.self_attn.o_proj(a), residual)
        else:
            h, residual = tp_all_reduce_add_rms_norm(partial, residual, self.post_attention_layernorm)
        partial = None
        if type(self.mlp).forward is LlamaMLP.forward:
            partial = _row_parallel_partial(self.mlp.down_proj, self.mlp.act(self.mlp.gate_up_proj(h)))
        if partial is None:
            return next_norm(self.mlp(h), residual)
        return tp_all_reduce_add_rms_norm(partial, residual, next_norm)


def _row_parallel_partial(linear: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """This rank's un-reduced product of a bias-free row-parallel ``linear`` (plain or weight-
    quantized), for a fused all-reduce; None for any other layer (LoRA wrappers, biases), which
    then runs as itself."""
    if type(linear).forward is RowParallelLinear.forward and linear.bias is None:
        return F.linear(x, linear.weight)
    from kvserve.layers.quantization.linear import QuantizedLinear

    if (type(linear).forward is QuantizedLinear.forward and linear.tp_reduce and linear.bias is None
            and x.dim() == 2):
        return linear.packed.matmul(x)
    return None


class LlamaModel(nn.Module):
    #: Layers whose input (the residual stream entering them) is kept in
    #: ``aux_hidden_states[layer]`` on each forward (EAGLE-3 heads read three); empty: none.
    aux_hidden_state_layers: tuple[int, ...] = ()
    #: Whether the next forwards keep them: the model runner turns it off for steps after which
    #: nothing drafts (dynamic speculation off), so those run the plain forward.
    keep_aux_hidden_states: bool = True

    def __init__(self, cfg: Any, dtype: torch.dtype, max_model_len: int | None = None) -> None:
        super().__init__()
        self.aux_hidden_states: dict[int, torch.Tensor] = {}
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        max_pos = getattr(cfg, "max_position_embeddings", None) or 2048
        self.rotary_emb = RotaryEmbedding(_head_dim(cfg), max_pos, get_rope_params(cfg), max_model_len)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary_emb, dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    #: The layers this pipeline stage runs (``kvserve.models.pipeline``; all of them by default).
    start_layer: int = 0
    end_layer: int | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """-> final-normed hidden ``[T, hidden]``; a pipeline stage before the last returns
        ``(hidden, residual)`` instead, and a stage after the first starts from the previous
        stage's ``intermediate`` pair (zeros when none is given: the memory profile)."""
        if intermediate is not None:
            x, residual = intermediate
        elif self.embed_tokens is None:  # a later stage profiled on its own
            x = torch.zeros(input_ids.shape[0], self.layers[self.start_layer].input_layernorm.weight.shape[0],
                            dtype=self.layers[self.start_layer].input_layernorm.weight.dtype, device=input_ids.device)
            residual = torch.zeros_like(x)
        else:
            x = self.embed_tokens(input_ids)
            residual = None
        aux = self.aux_hidden_state_layers if self.keep_aux_hidden_states else ()
        if self.aux_hidden_state_layers:
            self.aux_hidden_states = {}  # none kept from an earlier step
        if (not aux and intermediate is None and self.start_layer == 0 and self.end_layer is None
                and self._fuse_all_reduce()):
            residual, h = x, self.layers[0].input_layernorm(x)
            norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
            for layer, next_norm in zip(self.layers, norms):
                h, residual = layer.forward_fused(positions, h, residual, next_norm)
            return h
        end = len(self.layers) if self.end_layer is None else self.end_layer
        for i in range(self.start_layer, end):
            if aux and i in aux:
                self.aux_hidden_states[i] = x if residual is None else x + residual
            x, residual = self.layers[i](positions, x, residual)
        if self.norm is None:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def _fuse_all_reduce(self) -> bool:
        """Layers chain through ``forward_fused`` (all-reduces fused with the norms) under tensor
        parallelism when every layer is a plain Llama layer. Without the custom all-reduce
        (CPU, NCCL) the same path runs all-reduce, then the fused add + norm: the same ops.
        Decided at the first forward (after any layer wrapping), then kept."""
        fuse = self.__dict__.get("_fused_chain")
        if fuse is None:
            fuse = self._fused_chain = (
                get_tp_size() > 1 and len(self.layers) > 0
                and all(type(layer).forward is LlamaDecoderLayer.forward
                        and type(layer.self_attn).forward is LlamaAttention.forward for layer in self.layers))
        return fuse


def _check_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


# HF checkpoint name suffix -> (our packed param, shard index within it).
_PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_PACKED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """Causal LM for Llama / Mistral / Qwen2 / Qwen3 HF configs.

    Args:
        hf_config: a transformers config of one of those model types.
        dtype: parameter dtype (the rotary cos/sin cache stays float32).
        max_model_len: the engine's context length (rope cache size, dynamic/longrope choice).
    """

    supports_tensor_parallel = True  # parallel linear layers, vocab-parallel embedding and head
    supports_pipeline_parallel = True  # LlamaModel's layer range (kvserve.models.pipeline)

    def __init__(self, hf_config: Any, dtype: torch.dtype, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, dtype, max_model_len)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None) -> torch.Tensor:
        """input_ids, positions: ``[T]`` int64 -> final-normed hidden ``[T, hidden]`` in the model dtype.

        Must run inside ``kvserve.attention.forward_context.forward_context(...)``. Pipeline
        stages: ``intermediate`` and the return value as ``LlamaModel.forward``.
        """
        if intermediate is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden]`` -> logits ``[N, vocab]`` float32."""
        return parallel_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (e.g. ``model.layers.0.self_attn.q_proj.weight``) into the model.

        q/k/v and gate/up are packed into ``qkv_proj`` / ``gate_up_proj``; under tensor
        parallelism each layer's ``weight_loader`` keeps this rank's slice of the full tensor.
        ``rotary_emb.inv_freq`` is ignored; with tied embeddings ``lm_head.weight`` fills the
        embedding when the checkpoint stores only that copy.

        Raises ValueError on an unknown name, a shape mismatch, or a parameter left unloaded.
        """
        from kvserve.models.pipeline import skip_other_stages

        weights = skip_other_stages(self, weights)  # a pipeline stage loads its own layers only
        params = dict(self.named_parameters())
        owners = {f"{mn}.{pn}" if mn else pn: m for mn, m in self.named_modules()
                  for pn, _ in m.named_parameters(recurse=False)}
        # Each packed param must receive all of its shards; count them.
        expected: dict[str, int] = {}
        for name in params:
            for packed, n in (("qkv_proj", 3), ("gate_up_proj", 2)):
                if f".{packed}." in name:
                    expected[name] = n
        seen: dict[str, set] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                # Tied: the same matrix. Checkpoints that store only lm_head.weight fill the
                # embedding from it; when both are stored the embedding's own copy wins.
                if "model.embed_tokens.weight" in seen:
                    continue
                name = "model.embed_tokens.weight"
            m = _PACKED_RE.match(name)
            if m:
                packed, shard = _PACKED[m.group(2)]
                target = f"{m.group(1)}.{packed}.{m.group(3)}"
                if target not in params:
                    raise ValueError(f"unknown weight {name!r} for {type(self).__name__}")
            else:
                target, shard = name, 0
                if target not in params:
                    raise ValueError(f"unknown weight {name!r} for {type(self).__name__}")
            load = getattr(owners[target], "weight_loader", None)
            try:
                if load is not None:
                    load(params[target], tensor, shard)
                else:
                    _check_copy(params[target], tensor)
            except ValueError as e:
                raise ValueError(f"{name!r}: {e}") from None
            seen.setdefault(target, set()).add(shard)
        missing = [n for n in params if len(seen.get(n, ())) < expected.get(n, 1)]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
