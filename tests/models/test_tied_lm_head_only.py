"""A tied checkpoint that stores only ``lm_head.weight`` loads (the embedding is filled from it)."""

from __future__ import annotations

import torch


def test_tied_checkpoint_with_only_lm_head():
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from kvserve.models.registry import get_model_class

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    sd = HFLlama(cfg).state_dict()
    emb = sd.pop("model.embed_tokens.weight").clone()
    sd["lm_head.weight"] = emb.clone()
    model = get_model_class(cfg)(cfg, torch.float32)
    model.load_weights(iter(sd.items()))
    assert torch.equal(model.model.embed_tokens.weight, emb)
