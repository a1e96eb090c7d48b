"""DeepSeek-V3's multi-token-prediction (MTP) module, loaded from the checkpoint's extra layer.

DeepSeek-V3 (arXiv:2412.19437, section 2.2) trains, beside the main model, a module that
predicts one token further: for position ``i`` it combines the main model's representation
``h_i`` with the embedding of the next token ``t_{i+1}`` and predicts ``t_{i+2}``:

    x  = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))      [T, hidden]
    h' = block(x)                                                 one MLA + MoE decoder layer
    logits = shared_head.head(shared_head.norm(h'))

The embedding is the main model's (shared); at the sequence's position 0 it is zero (vLLM and
SGLang mask it there, "not needed by MTP"). ``h_i`` is the main model's final-normed hidden
state (what the model runner hands to proposers); ``h'`` (before ``shared_head.norm``) is fed
back as ``h`` to draft further tokens with the same layer (vLLM does the same). The
concatenation order (embedding first) is the released checkpoints' (vLLM, SGLang).

HF checkpoints keep the module as decoder layer ``num_hidden_layers`` (``num_nextn_predict_layers``
of them): ``model.layers.{L}.enorm.weight``, ``hnorm.weight``, ``eh_proj.weight``,
``shared_head.norm.weight``, ``shared_head.head.weight``, the block's usual names
(``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``; FP8 block
scales as in the main model) and a copy of the embedding (``embed_tokens.weight``, unused).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from kvserve.layers.linear import ParallelLMHead, parallel_logits
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.deepseek_v2 import DeepseekV2DecoderLayer, load_deepseek_weights


class _SharedHead(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype)


class DeepseekMTPLayer(DeepseekV2DecoderLayer):
    """One MTP layer: the decoder block of layer index ``layer_idx`` (MoE by DeepSeek's rule)
    plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``."""

    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_idx, rotary, dtype)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps).to(dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps).to(dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.shared_head = _SharedHead(cfg, dtype)


class DeepseekMTP(nn.Module):
    """The MTP module of a DeepSeek-V3 checkpoint as a draft head (``kvserve.spec_decode.deepseek_mtp``).

    Args:
        hf_config: the target's config (``num_hidden_layers`` L: the MTP layer is layer L).
        dtype: parameter dtype (the router stays float32).
        rotary: the target's rotary embedding (the same positions and YaRN scaling).

    Raises ValueError when the config has no MTP layer (``num_nextn_predict_layers`` < 1).
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__()
        n = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
        if n < 1:
            raise ValueError("deepseek_mtp needs a checkpoint with a multi-token-prediction layer "
                             "(config.json num_nextn_predict_layers >= 1); this one has none")
        self.config, self.dtype = hf_config, dtype
        self.layer_index = hf_config.num_hidden_layers
        self.layers = nn.ModuleList([DeepseekMTPLayer(hf_config, self.layer_index, rotary, dtype)])
        self.target: Optional[list[nn.Module]] = None
        # Rows of the next forward at the sequence's position 0 (their embedding is zeroed); set
        # by the proposer, which knows where each request's pairs start.
        self.first_position_rows: Optional[torch.Tensor] = None

    def share_target(self, target: nn.Module) -> None:
        """Use ``target``'s token embedding (``target.model.embed_tokens``)."""
        self.target = [target]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids (``t_{i+1}``), positions ``[T]`` int64; hidden ``[T, hidden_size]`` (the
        target's final-normed ``h_i``, or this module's previous output) -> ``h'`` ``[T,
        hidden_size]`` before ``shared_head.norm``. Runs inside a ``forward_context`` with the
        metadata of the MTP layer's own latent KV cache."""
        layer = self.layers[0]
        emb = self.target[0].model.embed_tokens(input_ids)
        if self.first_position_rows is not None and self.first_position_rows.numel():
            emb = emb.index_fill(0, self.first_position_rows, 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1))
        x, residual = DeepseekV2DecoderLayer.forward(layer, positions, x, None)
        return x + residual

    def compute_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """``h'`` ``[N, hidden_size]`` -> logits ``[N, vocab]`` float32."""
        head = self.layers[0].shared_head
        return parallel_logits(head.norm(feats), head.head)

    def greedy_tokens(self, feats: torch.Tensor) -> torch.Tensor:
        """``h'`` ``[N, hidden_size]`` -> drafted token ids ``[N]`` int64."""
        return self.compute_logits(feats).argmax(dim=-1)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load layer ``num_hidden_layers`` of HF-named ``(name, tensor)`` pairs; other names
        are ignored (a later MTP layer too: drafts reuse the first one). Raises ValueError when
        the checkpoint has no such layer, or on an unknown name / shape mismatch / missing weight."""
        prefix = f"model.layers.{self.layer_index}."
        found = 0

        def mine() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal found
            for name, tensor in weights:
                if not name.startswith(prefix):
                    continue
                found += 1
                rest = name[len(prefix):]
                if rest == "embed_tokens.weight" or rest.endswith("rotary_emb.inv_freq"):
                    continue  # the target's embedding is shared
                yield "layers.0." + rest, tensor

        try:
            load_deepseek_weights(self, mine(), self.dtype)
        except ValueError as e:
            if not found:
                raise ValueError(f"the checkpoint has no multi-token-prediction layer ({prefix}*) although "
                                 f"num_nextn_predict_layers is {self.config.num_nextn_predict_layers}") from None
            raise ValueError(f"multi-token-prediction layer: {e}") from None


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def iterate_layer_weights(model_dir: str, layer_index: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, CPU tensor)`` of decoder layer ``layer_index`` only, read from the
    checkpoint's safetensors shards (the other tensors are not read; with a
    ``model.safetensors.index.json``, only the shards holding the layer are opened)."""
    from safetensors import safe_open

    from kvserve.model_loader.hf_loader import safetensors_files

    files = safetensors_files(model_dir)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        wanted = {os.path.join(model_dir, shard) for name, shard in weight_map.items()
                  if (m := _LAYER_KEY.match(name)) and int(m.group(1)) == layer_index}
        files = [p for p in files if p in wanted]
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _LAYER_KEY.match(name)
                if m and int(m.group(1)) == layer_index:
                    yield name, f.get_tensor(name)
