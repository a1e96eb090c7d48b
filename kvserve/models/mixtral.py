"""Mixtral (Mixtral-8x7B, 8x22B): the Llama decoder with every feed-forward a mixture of experts.

Each layer's ``block_sparse_moe`` has a router (``gate``, ``[num_local_experts, H]``) and
``num_local_experts`` SwiGLU experts (``w1`` gate, ``w3`` up, ``w2`` down, each of
``intermediate_size``); a token's top ``num_experts_per_tok`` experts are weighted by their
softmax probabilities renormalized to sum to 1 (Jiang et al., arXiv:2401.04088). Built on
``qwen_moe.MoeForCausalLM``; ``router_jitter_noise`` is training-only and ignored.
"""

from __future__ import annotations

from typing import Any

from kvserve.models.qwen_moe import MoeForCausalLM, MoeSpec


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: no attention bias or q/k norm, every layer sparse, top-k renormalized."""

    hf_mlp_name = "block_sparse_moe"
    hf_expert_names = {"w1": "w1", "w3": "w3", "w2": "w2"}

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoeSpec:
        e = int(cfg.num_local_experts)
        return MoeSpec(e, int(cfg.num_experts_per_tok), int(cfg.intermediate_size), True, None,
                       (e > 0,) * cfg.num_hidden_layers, qkv_bias=False, qk_norm=False)
