"""EAGLE draft heads for Llama-family targets, and the loader of their published checkpoints.

EAGLE-1/2 (Li et al., arXiv:2401.15077): ``fc(concat(embed(token), feature))`` -> one Llama
decoder layer whose first input RMSNorm is absent -> the next feature; the target's (shared)
lm_head turns a feature into logits. The feature is the target's last hidden state *after*
its final norm (what the EAGLE repo's data generation stores: ``hidden_states[-1]``).

EAGLE-3 (Li et al., arXiv:2503.01840): ``fc`` maps the concatenation of three of the target's
residual-stream states (low / mid / high layers, ``3 * hidden``) to ``hidden``; the decoder
layer's attention reads ``concat(input_layernorm(embed(token)), hidden_norm(h))`` (``2 *
hidden`` wide); ``norm`` + the head's own ``lm_head`` score a reduced draft vocabulary whose
index ``i`` is the target token ``i + d2t[i]``. Later draft steps feed the layer's own output
back (no ``fc``).

Published layout (``pytorch_model.bin`` or ``*.safetensors`` + an HF ``config.json``):
``fc.weight`` [``fc.bias``], ``layers.0.*`` (EAGLE-1/2) or ``midlayer.*`` (EAGLE-3) with HF
projection names (``self_attn.q_proj.weight`` ...), EAGLE-3 ``norm.weight``,
``lm_head.weight``, ``d2t`` [, ``t2d``]; an ``embed_tokens.weight`` copy is optional (the
target's embedding is used). A leading ``model.`` is accepted.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Iterable

import torch
from torch import nn

from kvserve.layers import materialize
from kvserve.layers.attention import Attention
from kvserve.layers.linear import ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, get_rope_params
from kvserve.models.llama import LlamaMLP, _head_dim

_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_PACKED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class EagleAttention(nn.Module):
    """Llama attention whose q/k/v read ``in_size`` features (``2 * hidden`` for EAGLE-3)."""

    def __init__(self, cfg: Any, in_size: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = _head_dim(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(in_size, self.head_dim, heads, kv, bias, dtype)
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size, bias=False, dtype=dtype)
        self.q_size, self.kv_size = heads * self.head_dim, kv * self.head_dim
        self.rotary = [rotary]
        self.attn = Attention(heads, self.head_dim, self.head_dim**-0.5, kv, 0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class EagleDecoderLayer(nn.Module):
    """The head's one decoder layer; returns the new feature (residual stream, not normed)."""

    def __init__(self, cfg: Any, eagle3: bool, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.eagle3 = eagle3
        self.self_attn = EagleAttention(cfg, 2 * h if eagle3 else h, rotary, dtype)
        self.mlp = LlamaMLP(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps).to(dtype)
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps).to(dtype)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps).to(dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        residual = x
        if self.eagle3:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class EagleHead(nn.Module):
    """An EAGLE-1/2 (``eagle3=False``) or EAGLE-3 head over a target of the same hidden size.

    Args:
        hf_config: the head's config (a ``LlamaConfig``: hidden size, heads, rope, eps;
            ``draft_vocab_size`` for EAGLE-3).
        dtype: parameter dtype; eagle3: which head; max_model_len: sizes the rope cache.
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, eagle3: bool = False,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        h = hf_config.hidden_size
        self.config, self.eagle3, self.dtype = hf_config, eagle3, dtype
        max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
        self.rotary_emb = RotaryEmbedding(_head_dim(hf_config), max_pos, get_rope_params(hf_config), max_model_len)
        # The published EAGLE-1/2 fc has a bias, EAGLE-3's has none: a missing bias loads as zeros.
        self.fc = nn.Linear((3 if eagle3 else 2) * h, h, bias=True, dtype=dtype)
        self.layers = nn.ModuleList([EagleDecoderLayer(hf_config, eagle3, self.rotary_emb, dtype)])
        if eagle3:
            dv = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
            self.norm = RMSNorm(h, hf_config.rms_norm_eps).to(dtype)
            self.lm_head = ParallelLMHead(dv, h, dtype=dtype)
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
        self.target = None  # [the target model]: its embedding (and EAGLE-1 lm_head) are shared
        self.draft_vocab: int | None = None  # EAGLE-1/2: draft only token ids < this (None: all)

    def share_target(self, target: nn.Module) -> None:
        """Use ``target``'s embedding (and for EAGLE-1/2 its lm_head)."""
        self.target = [target]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids/positions ``[T]`` int64, hidden ``[T, hidden]`` (EAGLE-1 target features or
        previous head outputs; EAGLE-3: ``[T, 3*hidden]`` target states or ``[T, hidden]`` head
        outputs) -> the next features ``[T, hidden]`` in the head dtype. Runs inside a
        ``forward_context`` with the head's own KV metadata."""
        emb = self.target[0].model.embed_tokens(input_ids)
        if self.eagle3:
            if hidden.shape[-1] != self.config.hidden_size:
                hidden = self.fc(hidden)
            return self.layers[0](positions, hidden, emb)
        return self.layers[0](positions, self.fc(torch.cat([emb, hidden], dim=-1)), None)

    def limit_draft_vocab(self, n: int | None) -> None:
        """EAGLE-1/2: score only token ids ``< n`` when drafting (BPE vocabularies are ordered
        by merge rank, roughly frequency); cuts the shared lm_head's cost by ``vocab / n``.
        Drafts are proposals, so outputs stay exact. Raises ValueError for ``n < 1``."""
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"draft_vocab_size must be a positive integer, got {n!r}")
        self.draft_vocab = None if n is None or n >= self.config.vocab_size or self.eagle3 else n

    def compute_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """features ``[N, hidden]`` -> float32 logits ``[N, vocab]`` (EAGLE-3: ``[N, draft_vocab]``;
        EAGLE-1/2 with ``limit_draft_vocab(n)``: ``[N, n]``)."""
        if self.eagle3:
            return torch.nn.functional.linear(self.norm(feats), self.lm_head.weight).float()
        target = self.target[0]
        if self.draft_vocab is not None:
            w = (target.model.embed_tokens if target.lm_head is None else target.lm_head).weight
            return torch.nn.functional.linear(feats, w[:self.draft_vocab]).float()
        return target.compute_logits(feats)

    def greedy_tokens(self, feats: torch.Tensor) -> torch.Tensor:
        """features ``[N, hidden]`` -> the drafted target token ids ``[N]`` int64."""
        idx = self.compute_logits(feats).argmax(dim=-1)
        return idx + self.d2t[idx] if self.eagle3 else idx

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy published-layout tensors in (see the module doc). Raises ValueError on an
        unknown name, a shape mismatch or a missing weight."""
        params = dict(self.named_parameters())
        params.update({n: b for n, b in self.named_buffers() if n == "d2t"})
        owners = {f"{mn}.{pn}" if mn else pn: m for mn, m in self.named_modules()
                  for pn, _ in m.named_parameters(recurse=False)}
        seen: dict[str, set] = {}
        for name, t in weights:
            name = name[len("model."):] if name.startswith("model.") else name
            name = "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name
            if name in ("t2d", "embed_tokens.weight") or name.endswith("rotary_emb.inv_freq"):
                continue  # t2d is implied by d2t; the target's embedding is shared
            m = _PACKED_RE.match(name)
            target, shard = (f"{m.group(1)}.{_PACKED[m.group(2)][0]}.{m.group(3)}", _PACKED[m.group(2)][1]) \
                if m else (name, 0)
            if target not in params:
                raise ValueError(f"unknown EAGLE head weight {name!r}")
            p = params[target]
            load = getattr(owners.get(target), "weight_loader", None)
            try:
                if load is not None:
                    load(p, t, shard)
                elif tuple(p.shape) != tuple(t.shape):
                    raise ValueError(f"shape mismatch: checkpoint {tuple(t.shape)}, head {tuple(p.shape)}")
                else:
                    p.copy_(t)
            except ValueError as e:
                raise ValueError(f"EAGLE head weight {name!r}: {e}") from None
            seen.setdefault(target, set()).add(shard)
        need = {n: (3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1) for n in params}
        if "fc.bias" not in seen:
            self.fc.bias.zero_()
            need.pop("fc.bias")
        missing = [n for n, k in need.items() if len(seen.get(n, ())) < k]
        if missing:
            raise ValueError(f"EAGLE head checkpoint is missing weights: {missing}")


def published_state_dict(head_state: dict[str, torch.Tensor], eagle3: bool = False) -> dict[str, torch.Tensor]:
    """HF-named tensors (``layers.0.self_attn.q_proj.weight`` ...) of the published layout from
    a state dict that already uses those names (``kvserve/spec_decode/train_eagle.py``): renames
    ``layers.0.`` to ``midlayer.`` for EAGLE-3 and makes tensors contiguous."""
    out = {}
    for n, t in head_state.items():
        if eagle3 and n.startswith("layers.0."):
            n = "midlayer." + n[len("layers.0."):]
        out[n] = t.detach().contiguous()
    return out


def read_eagle_checkpoint(path: str) -> tuple[dict, Iterable[tuple[str, torch.Tensor]]]:
    """``(config dict, (name, tensor) pairs)`` of an EAGLE head directory holding
    ``config.json`` and ``*.safetensors`` or ``pytorch_model.bin``.

    Raises FileNotFoundError when either is missing."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"EAGLE head {path!r} has no config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file

        tensors = [kv for p in files for kv in load_file(p).items()]
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        tensors = list(torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu",
                                  weights_only=True).items())
    else:
        raise FileNotFoundError(f"EAGLE head {path!r} has neither *.safetensors nor pytorch_model.bin")
    return cfg, tensors


def eagle_hf_config(cfg: dict, target_hf_config: Any, path: str = "") -> Any:
    """The head's ``LlamaConfig`` from its config dict, checked against the target's.

    Raises ValueError when its hidden size or vocabulary size differ from the target's."""
    from transformers import LlamaConfig

    d = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "auto_map")}
    hc = LlamaConfig(**d)
    for key in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(hc, key, None), getattr(target_hf_config, key, None)
        if mine != theirs:
            raise ValueError(f"EAGLE head {path!r} has {key} {mine}, the target has {theirs}: "
                             "the head must be trained for this target")
    return hc


def load_eagle_head(path: str, target_hf_config: Any, dtype: torch.dtype, device: str | torch.device,
                    eagle3: bool = False, max_model_len: int | None = None) -> EagleHead:
    """Build and load the EAGLE head at ``path`` for a target with ``target_hf_config``.

    Raises ValueError (hidden / vocab size mismatch, bad weights) or FileNotFoundError.
    """
    cfg, tensors = read_eagle_checkpoint(path)
    hc = eagle_hf_config(cfg, target_hf_config, path)
    if eagle3 != any(n.startswith(("midlayer.", "model.midlayer.")) or n == "d2t" for n, _ in tensors):
        raise ValueError(f"EAGLE head {path!r} is {'not ' if eagle3 else ''}an EAGLE-3 checkpoint; use method "
                         f"{'eagle' if eagle3 else 'eagle3'}")
    with torch.device("meta"):
        head = EagleHead(hc, dtype, eagle3, max_model_len)
    head = materialize(head, device)
    head.rotary_emb.build_cache()
    head.load_weights(tensors)
    return head.eval()


def save_random_eagle_head(path: str, target_hf_config: Any, eagle3: bool = False,
                           draft_vocab_size: int | None = None, seed: int = 0, std: float = 0.02,
                           fmt: str = "safetensors") -> dict[str, torch.Tensor]:
    """Write a randomly initialized head for ``target_hf_config`` in the published layout to
    ``path`` (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin`` with ``fmt="bin"``);
    returns its tensors. For tests and plumbing: losslessness must not depend on head quality."""
    c = target_hf_config
    h, hd = c.hidden_size, _head_dim(c)
    nh, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    i, v = c.intermediate_size, c.vocab_size
    g = torch.Generator().manual_seed(seed)
    inp = 2 * h if eagle3 else h
    lay = "midlayer." if eagle3 else "layers.0."
    shapes = {"fc.weight": (h, (3 if eagle3 else 2) * h), lay + "self_attn.q_proj.weight": (nh * hd, inp),
              lay + "self_attn.k_proj.weight": (kv * hd, inp), lay + "self_attn.v_proj.weight": (kv * hd, inp),
              lay + "self_attn.o_proj.weight": (h, nh * hd), lay + "mlp.gate_proj.weight": (i, h),
              lay + "mlp.up_proj.weight": (i, h), lay + "mlp.down_proj.weight": (h, i)}
    t = {n: torch.randn(s, generator=g) * std for n, s in shapes.items()}
    t[lay + "post_attention_layernorm.weight"] = torch.ones(h)
    if eagle3:
        dv = draft_vocab_size or v
        t.update({lay + "input_layernorm.weight": torch.ones(h), lay + "hidden_norm.weight": torch.ones(h),
                  "norm.weight": torch.ones(h), "lm_head.weight": torch.randn(dv, h, generator=g) * std})
        keep = torch.sort(torch.randperm(v, generator=g)[:dv]).values  # draft index -> target token
        t["d2t"] = keep - torch.arange(dv)
        t["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, keep, True)
    else:
        t["fc.bias"] = torch.zeros(h)
    os.makedirs(path, exist_ok=True)
    cfg = {k: val for k, val in c.to_dict().items() if isinstance(val, (int, float, str, bool, list, dict, type(None)))}
    cfg.update(num_hidden_layers=1, model_type="llama",
               architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"])
    if eagle3:
        cfg["draft_vocab_size"] = draft_vocab_size or v
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if fmt == "bin":
        torch.save(t, os.path.join(path, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file

        save_file({n: x.contiguous() for n, x in t.items()}, os.path.join(path, "model.safetensors"))
    return t
