"""Mixture-of-experts decoders on the Llama skeleton: Qwen2-MoE and Qwen3-MoE (Mixtral: ``mixtral.py``).

Attention (packed q/k/v, Qwen3's per-head q/k RMSNorm, Qwen2's q/k/v bias), norms, rope and
the dense MLP are ``kvserve.models.llama``'s. What differs is the feed-forward block of the
sparse layers (``SparseMoeBlock``): a replicated router linear (``gate``, ``[E, H]``) gives
logits ``[T, E]``, ``FusedMoE`` keeps each token's top-k experts (softmax, renormalized when
the config says so) and sums their SwiGLU outputs weighted by the router probabilities.
Qwen2-MoE adds a shared expert (a dense SwiGLU MLP every token goes through) scaled by
``sigmoid(shared_expert_gate(x))``; its partial output (tensor parallel) is added to the routed
experts' partial output before the one all-reduce of the block.

Which layers are sparse (Qwen2/3-MoE): layer ``i`` is an MoE layer when ``i`` is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (and there are experts); the
others use the dense ``LlamaMLP`` of ``intermediate_size``.

Checkpoints: the published per-expert names (``mlp.experts.{e}.gate_proj/up_proj/down_proj
.weight``; Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``) and the stacked
``[E, ...]`` form (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``mlp.experts.down_proj``
``[E, H, I]``) go through ``FusedMoE.weight_loader``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed import get_tp_size, tp_all_reduce
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from kvserve.layers.moe import FusedMoE
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, get_rope_params
from kvserve.models.llama import (_PACKED, _PACKED_RE, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                  LlamaMLP, LlamaModel, _check_copy, _head_dim)

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class MoeSpec:
    """What a config asks of the MoE decoder (read once, checked by ``check_moe_config``).

    Attributes:
        num_experts: routed experts per sparse layer (E); top_k: experts per token.
        intermediate_size: each routed expert's intermediate size.
        renormalize: rescale the kept top-k probabilities to sum to 1.
        shared_intermediate_size: the shared expert's intermediate size (None: no shared expert).
        sparse_layers: per layer, whether its feed-forward is the MoE block.
        qkv_bias / qk_norm: attention with q/k/v bias / per-head q/k RMSNorm.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: Optional[int]
    sparse_layers: tuple[bool, ...]
    qkv_bias: bool
    qk_norm: bool


# Config fields of other MoE families that change inference and that these decoders do not
# implement: a config that sets one of them to something but its neutral value is refused.
_NEUTRAL = {
    "scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (None, 0, 1), "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1, 1.0), "n_shared_experts": (None, 0), "num_shared_experts": (None, 0),
    "first_k_dense_replace": (None, 0), "moe_layer_freq": (None, 1),
}
# Fields that are training-only (aux loss, jitter) or read by the decoders themselves.
_KNOWN_MOE_FIELDS = {"moe_intermediate_size"}


def check_moe_config(cfg: Any, spec: MoeSpec, arch: str, implemented: tuple[str, ...] = ()) -> None:
    """Refuse a config this decoder would run wrongly (ValueError naming the field).

    ``num_experts_per_tok`` above the experts (or below 1), a non-SwiGLU ``hidden_act``,
    ``decoder_sparse_step`` below 1, and MoE fields other families use that change inference
    (``_NEUTRAL`` at a non-neutral value, an unknown ``moe_*`` field). Training-only fields
    (``output_router_logits``, ``router_aux_loss_coef``, ``router_jitter_noise``) are ignored:
    they do not change inference. ``implemented``: fields of ``_NEUTRAL`` this family implements.
    """
    if spec.num_experts < 0:
        raise ValueError(f"{arch}: the number of experts must be >= 0, got {spec.num_experts}")
    if spec.num_experts and not 1 <= spec.top_k <= spec.num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok {spec.top_k} must be between 1 and the number of experts "
                         f"({spec.num_experts})")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (experts and MLPs are SwiGLU: 'silu')")
    step = getattr(cfg, "decoder_sparse_step", 1)
    if step is not None and step < 1:
        raise ValueError(f"{arch}: decoder_sparse_step must be >= 1, got {step}")
    for name, neutral in _NEUTRAL.items():
        if name in implemented or not hasattr(cfg, name):
            continue
        value = getattr(cfg, name)
        if value not in neutral:
            raise ValueError(f"{arch}: config field {name}={value!r} is not implemented by kvserve's {arch} "
                             f"(it would change the routing or the expert layout)")
    for name in vars(cfg):
        if name.startswith("moe_") and name not in _KNOWN_MOE_FIELDS and name not in _NEUTRAL:
            raise ValueError(f"{arch}: config field {name}={getattr(cfg, name)!r} is not implemented by kvserve")


class SharedExpertMLP(nn.Module):
    """A dense SwiGLU MLP whose output stays this rank's partial sum (the caller all-reduces).

    Input ``[T, H]`` -> ``[T, H]`` (a partial sum under tensor parallelism)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.gate_up_proj(x))
        if get_tp_size() == 1:  # also a quantized down_proj (quantization runs with one rank)
            return self.down_proj(h)
        packed = getattr(self.down_proj, "packed", None)  # a GPTQ / AWQ checkpoint's down_proj: unreduced product
        if packed is not None:
            return packed.matmul(h)
        return F.linear(h, self.down_proj.weight)


def _real_rows(x: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64: 1 for the step's real tokens, 0 for CUDA-graph padding and warm-up or
    capture runs (rows whose KV slot is -1: they store nothing). Stays on the device."""
    from kvserve.attention.forward_context import _CURRENT

    metas = getattr(_CURRENT, "attn_metadata", None)
    if metas:
        slots = getattr(metas[0], "slot_mapping", None)
        if slots is not None and slots.shape[0] == x.shape[0]:
            return (slots >= 0).to(torch.int64)
    return torch.ones(x.shape[0], dtype=torch.int64, device=x.device)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert). ``[T, H]`` -> ``[T, H]``.

    ``expert_counts`` (``[E]`` int64, on the model's device) accumulates the tokens routed to
    each expert (top-k choices of the step's real tokens; CUDA-graph padding and warm-up rows,
    whose KV slot is -1, count 0) while ``count_experts``
    is set; ``kvserve.models.moe_stats`` reads it.
    """

    def __init__(self, cfg: Any, spec: MoeSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.top_k = spec.top_k
        self.gate = nn.Linear(h, spec.num_experts, bias=False, dtype=dtype)  # replicated on every rank
        shared = spec.shared_intermediate_size
        self.experts = FusedMoE(spec.num_experts, spec.top_k, h, spec.intermediate_size, dtype=dtype,
                                renormalize=spec.renormalize, reduce_results=shared is None)
        if shared is not None:
            self.shared_expert = SharedExpertMLP(h, shared, dtype)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, dtype=dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.count_experts = True
        self.register_buffer("expert_counts", torch.zeros(spec.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.count_experts:
            # Softmax is monotonic: the top-k logits are the experts FusedMoE selects.
            ids = logits.topk(self.top_k, dim=-1).indices
            self.expert_counts.index_add_(0, ids.flatten(), _real_rows(x).repeat_interleave(self.top_k))
        out = self.experts(x, logits)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = tp_all_reduce(out)
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its forward) with the MoE block or the dense MLP as ``mlp``."""

    def __init__(self, cfg: Any, spec: MoeSpec, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, dtype, qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm)
        self.mlp = SparseMoeBlock(cfg, spec, dtype) if spec.sparse_layers[layer_idx] else LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)


class MoeModel(LlamaModel):
    """Llama's model (its forward) over ``MoeDecoderLayer``s."""

    def __init__(self, cfg: Any, spec: MoeSpec, dtype: torch.dtype, max_model_len: Optional[int] = None) -> None:
        nn.Module.__init__(self)
        self.aux_hidden_states = {}
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        max_pos = getattr(cfg, "max_position_embeddings", None) or 2048
        self.rotary_emb = RotaryEmbedding(_head_dim(cfg), max_pos, get_rope_params(cfg), max_model_len)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(cfg, spec, i, self.rotary_emb, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)


# Per-expert checkpoint tensors: (prefix, expert, projection); the projection -> FusedMoE shard.
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_STACKED_RE = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_SHARD = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}
_HF_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MoeForCausalLM(LlamaForCausalLM):
    """Causal LM over ``MoeModel``; subclasses say how their config reads (``moe_spec``).

    Args: as ``LlamaForCausalLM``. Raises ValueError (``check_moe_config``) for a config the
    model would run wrongly.
    """

    supports_pipeline_parallel = False  # its own forward / weight names: no layer-range hook yet
    supports_tensor_parallel = True  # attention and dense MLPs as Llama; experts split I (or, EP, whole)
    #: MoE fields of ``check_moe_config._NEUTRAL`` this family implements.
    implemented_fields: tuple[str, ...] = ()
    #: How the checkpoint names a layer's feed-forward module (Mixtral: ``block_sparse_moe``).
    hf_mlp_name = "mlp"
    #: How the checkpoint names an expert's projections: w1 (gate), w3 (up), w2 (down).
    hf_expert_names = _HF_PROJ

    def __init__(self, hf_config: Any, dtype: torch.dtype, max_model_len: Optional[int] = None) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.moe = self.moe_spec(hf_config)
        check_moe_config(hf_config, self.moe, type(self).__name__, self.implemented_fields)
        self.model = MoeModel(hf_config, self.moe, dtype, max_model_len)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(hf_config.vocab_size,
                                                                            hf_config.hidden_size, dtype=dtype)

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoeSpec:
        raise NotImplementedError

    @classmethod
    def check_parallel(cls, cfg: Any, tp: int, enable_expert_parallel: bool) -> None:
        """Raise ValueError when ``tp`` ranks cannot split the experts: the expert count under
        expert parallelism, else the expert (and shared expert) intermediate size."""
        spec = cls.moe_spec(cfg)
        if not spec.num_experts or tp == 1:
            return
        if enable_expert_parallel:
            if spec.num_experts % tp:
                raise ValueError(f"the {spec.num_experts} experts are not divisible by the expert-parallel size "
                                 f"{tp} (--enable-expert-parallel splits them over the tensor_parallel_size ranks)")
        elif spec.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the expert intermediate size "
                             f"{spec.intermediate_size} (or pass --enable-expert-parallel)")
        s = spec.shared_intermediate_size
        if s is not None and s % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide shared_expert_intermediate_size {s}")

    def _hf_expert_name(self, layer: str, expert: int, shard: str) -> str:
        return f"{layer}.{self.hf_mlp_name}.experts.{expert}.{self.hf_expert_names[shard]}.weight"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model.

        Dense tensors load as in ``LlamaForCausalLM.load_weights`` (q/k/v and gate/up packed);
        expert tensors (per expert or stacked ``[E, ...]``) go to the layer's
        ``FusedMoE.weight_loader``, which keeps this rank's experts / slices.

        Raises ValueError naming the tensor: an unknown name, a shape mismatch (with the
        expected shape), an expert index out of range, or an expert tensor (or any parameter)
        the checkpoint lacks.
        """
        params = dict(self.named_parameters())
        owners = {f"{mn}.{pn}" if mn else pn: m for mn, m in self.named_modules()
                  for pn, _ in m.named_parameters(recurse=False)}
        expected: dict[str, int] = {}
        for name in params:
            for packed, n in (("qkv_proj", 3), ("gate_up_proj", 2)):
                if f".{packed}." in name:
                    expected[name] = n
        seen: dict[str, set] = {}
        experts_seen: dict[str, set] = {}  # "model.layers.N.mlp.experts" -> {(expert, shard)}
        mlp = f".{self.hf_mlp_name}."
        for hf_name, tensor in weights:
            name = hf_name.replace(mlp, ".mlp.", 1) if mlp != ".mlp." else hf_name
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                if "model.embed_tokens.weight" in seen:
                    continue
                name = "model.embed_tokens.weight"
            m = _EXPERT_RE.match(name) or _STACKED_RE.match(name)
            if m:
                self._load_expert_tensor(hf_name, m, tensor, experts_seen)
                continue
            m = _PACKED_RE.match(name)
            if m:
                packed, shard = _PACKED[m.group(2)]
                target = f"{m.group(1)}.{packed}.{m.group(3)}"
            else:
                target, shard = name, 0
            if target not in params:
                raise ValueError(f"unknown weight {hf_name!r} for {type(self).__name__}")
            load = getattr(owners[target], "weight_loader", None)
            try:
                if load is not None:
                    load(params[target], tensor, shard)
                else:
                    _check_copy(params[target], tensor)
            except ValueError as e:
                raise ValueError(f"{hf_name!r}: {e}") from None
            seen.setdefault(target, set()).add(shard)
        self._check_experts_loaded(experts_seen)
        missing = [n for n in params if len(seen.get(n, ())) < expected.get(n, 1)
                   and ".experts.w13" not in n and ".experts.w2" not in n]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _fused(self, prefix: str, hf_name: str) -> FusedMoE:
        module = dict(self.named_modules()).get(prefix)
        if not isinstance(module, FusedMoE):
            raise ValueError(f"unknown weight {hf_name!r} for {type(self).__name__} (no MoE layer {prefix!r})")
        return module

    def _load_expert_tensor(self, hf_name: str, m: re.Match, tensor: torch.Tensor, experts_seen: dict) -> None:
        prefix = m.group(1)
        moe = self._fused(prefix, hf_name)
        done = experts_seen.setdefault(prefix, set())
        if m.re is _EXPERT_RE:
            expert, shard = int(m.group(2)), _SHARD[m.group(3)]
            parts = [(expert, shard, tensor)]
        else:  # stacked: gate_up_proj [E, 2I, H] (gate rows first), gate/up_proj [E, I, H], down_proj [E, H, I]
            e, i, h = moe.num_experts, moe.intermediate_size, moe.hidden_size
            proj = m.group(2)
            want = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}.get(proj, (e, i, h))
            if tuple(tensor.shape) != want:
                raise ValueError(f"{hf_name!r}: checkpoint shape {tuple(tensor.shape)}, expected {want}")
            if proj == "gate_up_proj":
                parts = [(x, s, tensor[x, j * i:(j + 1) * i]) for x in moe.local_experts
                         for j, s in enumerate(("w1", "w3"))]
            else:
                parts = [(x, _SHARD[proj], tensor[x]) for x in moe.local_experts]
        for expert, shard, t in parts:
            param = moe.w2 if shard == "w2" else moe.w13
            try:
                if moe.weight_loader(param, t, expert, shard):
                    done.add((expert, shard))
            except ValueError as e:
                raise ValueError(f"{hf_name!r}: {e}") from None

    def _check_experts_loaded(self, experts_seen: dict) -> None:
        for prefix, module in self.named_modules():
            if not isinstance(module, FusedMoE):
                continue
            done = experts_seen.get(prefix, set())
            layer = prefix.rsplit(".mlp.experts", 1)[0]
            for e in module.local_experts:
                for shard in ("w1", "w3", "w2"):
                    if (e, shard) not in done:
                        i, h = module.intermediate_size, module.hidden_size
                        shape = (h, i) if shard == "w2" else (i, h)
                        raise ValueError(f"checkpoint is missing expert weight {self._hf_expert_name(layer, e, shard)!r} "
                                         f"(expected shape {shape})")


def _sparse_layers(cfg: Any, num_experts: int) -> tuple[bool, ...]:
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple(i not in dense and num_experts > 0 and step >= 1 and (i + 1) % step == 0
                 for i in range(cfg.num_hidden_layers))


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, no bias, top-k over
    ``num_experts`` renormalized when ``norm_topk_prob``, no shared expert."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, max_model_len: Optional[int] = None) -> None:
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("Qwen3MoeForCausalLM: attention_bias=True (an o_proj bias) is not supported")
        super().__init__(hf_config, dtype, max_model_len)

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoeSpec:
        e = int(getattr(cfg, "num_experts", 0) or 0)
        return MoeSpec(e, int(cfg.num_experts_per_tok), int(cfg.moe_intermediate_size),
                       bool(getattr(cfg, "norm_topk_prob", False)), None, _sparse_layers(cfg, e),
                       qkv_bias=False, qk_norm=True)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v bias, top-k not renormalized by
    default (``norm_topk_prob``), a shared expert gated by ``sigmoid(shared_expert_gate(x))``."""

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoeSpec:
        e = int(getattr(cfg, "num_experts", 0) or 0)
        return MoeSpec(e, int(cfg.num_experts_per_tok), int(cfg.moe_intermediate_size),
                       bool(getattr(cfg, "norm_topk_prob", False)), int(cfg.shared_expert_intermediate_size),
                       _sparse_layers(cfg, e), qkv_bias=bool(getattr(cfg, "qkv_bias", True)), qk_norm=False)
