"""A tiny random Llama (float32) saved once per session for the tier tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)  # larger than the default init: greedy picks are not near-ties
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d)
    return str(d)
