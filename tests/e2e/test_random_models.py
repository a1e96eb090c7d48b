"""Greedy equality with transformers on small random-weight Llama and Qwen3 models (float32)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
        architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
    )


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_theta=1e6, architectures=["Qwen3ForCausalLM"], bos_token_id=1, eos_token_id=2,
    )


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    cfg = _llama_config() if request.param == "llama" else _qwen3_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger weights than the default init so greedy choices are not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    return str(d), model.eval()


def _hf_greedy(model, prompts, n):
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def test_greedy_equals_transformers(model_dir):
    path, hf = model_dir
    g = torch.Generator().manual_seed(1)
    lens = [1, 5, 16, 17, 40, 63, 100]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]
    ref = _hf_greedy(hf, prompts, 24)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", block_size=16, kv_cache_memory="16MiB",
              max_num_batched_tokens=64, disable_log_stats=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.outputs[0].text == "" for o in outs)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
